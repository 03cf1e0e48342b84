"""Expert-cache lookup and miss copy on the device: no host round trip per layer.

State on the device (`gpu_cache.DeviceExpertCache` owns it):
- table  int32 [L*E + 1]: slot of expert row (layer*E + e), -1 if absent; last entry = dump.
- owner  int32 [S + 1]: expert row held by each slot, -1 if free; last entry = dump.
- victims int32 [V]: slots this layer may take, best first (from the host policy, one step
  behind); V >= the number of distinct experts the call can ask for.

`expert_lookup` marks the slots this layer hits, gives the k-th missing expert (in expert
order) the k-th victim that is not a hit, updates table and owner in place, and returns the
slot of every (token, k) plus a compacted load list (row, slot), -1 padded; `copy_rows` then
copies each listed store row into its slot (zero-copy from registered host memory). The
`*_ref` versions are fixed-size torch ops (capturable, no host sync): the CPU path.
"""

from __future__ import annotations

import functools
import math

import torch

from tinyserve.kernels.moe import host_rows
from tinyserve.kernels.moe.fused import ExpertSlots

FIELDS = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")


def cpu_share(a: float, b: float, misses: int) -> int:
    """c = clamp(floor(a * misses - b + 0.5), 0, misses): how many of a layer's distinct misses
    a split (a, b) leaves to the CPU (`offload.hybrid`); the lookups compute the same."""
    return min(max(math.floor(a * misses - b + 0.5), 0), misses)


def expert_lookup_ref(topk_ids: torch.Tensor, layer: int, table: torch.Tensor,
                      owner: torch.Tensor, victims: torch.Tensor, num_experts: int, *,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      split: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve the slots of `topk_ids` [N, k] of `layer`, assigning victims to misses.

    Mutates `table` and `owner`. Returns (slot_ids [N, k] int32, load_rows [K] int32,
    load_slots [K] int32) with K = len(victims); unused load entries are -1. `out`: two
    int32 [K] tensors to write the load lists into (returned as they are).

    `split` (fp32 [2] on the device: a, b): of the layer's m distinct misses, the last
    `cpu_share(a, b, m)` in expert order get no slot (slot id -1, table unchanged, not
    loaded): they are computed on the CPU (`offload.hybrid`).
    """
    dev, E = table.device, num_experts
    S, K = owner.numel() - 1, victims.numel()
    base = layer * E
    ids = topk_ids.reshape(-1).to(torch.int64)
    needed = torch.zeros(E, dtype=torch.bool, device=dev).index_fill_(0, ids, True)
    tab = table[base:base + E]  # [E] view
    hit = needed & (tab >= 0)
    miss = needed & (tab < 0)
    if split is not None:
        m = miss.sum()
        c = torch.floor(split[0] * m - split[1] + 0.5).clamp(min=0).to(m.dtype)
        miss = miss & (torch.cumsum(miss, 0) - 1 < m - torch.minimum(c, m))
    # Slots hit by this layer may not be taken.
    marked = torch.zeros(S + 1, dtype=torch.int32, device=dev)
    marked.index_add_(0, torch.where(hit, tab, S).long(), hit.int())
    vic = victims.long()
    avail = marked[vic] == 0  # [K]
    arank = torch.cumsum(avail, 0) - 1
    cand = torch.full((K + 1,), -1, dtype=torch.int32, device=dev)
    cand.scatter_(0, torch.where(avail, arank, K), victims.int())
    mrank = torch.cumsum(miss, 0) - 1  # [E]
    new_slot = cand[torch.where(miss, mrank, K)]  # [E], -1 where no miss
    rows = torch.arange(base, base + E, dtype=torch.int32, device=dev)
    # Evict the victims' old experts, then take the slots.
    old = owner[torch.where(miss, new_slot, S).long()]
    table.scatter_(0, torch.where(miss & (old >= 0), old, table.numel() - 1).long(),
                   torch.full_like(old, -1))
    owner.scatter_(0, torch.where(miss, new_slot, S).long(), rows)
    owner[S] = -1
    table[base:base + E] = torch.where(miss, new_slot, tab)
    table[-1] = -1
    slot_ids = table[base:base + E][ids].view(topk_ids.shape)
    pos = torch.where(miss, mrank, K)
    load_rows = torch.full((K + 1,), -1, dtype=torch.int32, device=dev)
    load_slots = torch.full((K + 1,), -1, dtype=torch.int32, device=dev)
    load_rows.scatter_(0, pos, rows)
    load_slots.scatter_(0, pos, new_slot)
    if out is None:
        return slot_ids, load_rows[:K], load_slots[:K]
    out[0].copy_(load_rows[:K])
    out[1].copy_(load_slots[:K])
    return slot_ids, out[0], out[1]


def copy_rows_ref(src: ExpertSlots, dst: ExpertSlots, rows: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """dst.field[slots[i]] = src.field[rows[i]] for every i with rows[i] >= 0 (host sync)."""
    keep = rows >= 0
    r, s = rows[keep].long().cpu(), slots[keep].long()
    for name in FIELDS:
        a, b = getattr(src, name), getattr(dst, name)
        if a is None:
            continue
        b.index_copy_(0, s.to(b.device), a.index_select(0, r.to(a.device)).to(b.device))


# Triton


@functools.cache
def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def expert_lookup_kernel(ids_ptr, M, table_ptr, owner_ptr, victims_ptr, K, marked_ptr,
                             cand_ptr, slot_ids_ptr, load_rows_ptr, load_slots_ptr, base, E, S,
                             split_ptr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_K: tl.constexpr, HAS_SPLIT: tl.constexpr):
        # One program; scratch `marked` [S+1] and `cand` [K+1] hold nothing between calls.
        offs_e = tl.arange(0, BLOCK_E)
        emask = offs_e < E
        offs_k = tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        # needed[e]: whether the call routes to e (a register bitmap over the ids)
        needed = tl.zeros([BLOCK_E], dtype=tl.int32)
        for m0 in range(0, M, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            ids = tl.load(ids_ptr + offs_m, mask=offs_m < M, other=-1)
            match = (ids[:, None] == offs_e[None, :]).to(tl.int32)
            needed = tl.maximum(needed, tl.max(match, axis=0))
        tab = tl.load(table_ptr + base + offs_e, mask=emask, other=-1)
        hit = (needed > 0) & (tab >= 0) & emask
        miss = (needed > 0) & (tab < 0) & emask
        if HAS_SPLIT:  # the last c misses stay unloaded (computed on the CPU)
            m = tl.sum(miss.to(tl.int32), axis=0)
            a = tl.load(split_ptr)
            b = tl.load(split_ptr + 1)
            c = tl.floor(a * m.to(tl.float32) - b + 0.5)
            c = tl.minimum(tl.maximum(c, 0.0), m.to(tl.float32)).to(tl.int32)
            rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
            miss = miss & (rank < m - c)
        for s0 in range(0, S + 1, BLOCK_K):
            offs_s = s0 + tl.arange(0, BLOCK_K)
            tl.store(marked_ptr + offs_s, tl.zeros([BLOCK_K], dtype=tl.int32),
                     mask=offs_s < S + 1)
        tl.debug_barrier()
        tl.store(marked_ptr + tab, tl.full([BLOCK_E], 1, tl.int32), mask=hit)
        tl.debug_barrier()
        vic = tl.load(victims_ptr + offs_k, mask=kmask, other=0)
        avail = (tl.load(marked_ptr + vic, mask=kmask, other=1) == 0) & kmask
        arank = tl.cumsum(avail.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=kmask)
        tl.debug_barrier()
        tl.store(cand_ptr + arank, vic, mask=avail)
        tl.debug_barrier()
        mrank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        new_slot = tl.load(cand_ptr + mrank, mask=miss, other=-1)
        old = tl.load(owner_ptr + new_slot, mask=miss, other=-1)
        tl.store(table_ptr + old, tl.full([BLOCK_E], -1, tl.int32), mask=miss & (old >= 0))
        tl.debug_barrier()
        rows = base + offs_e
        tl.store(owner_ptr + new_slot, rows, mask=miss)
        tl.store(table_ptr + rows, new_slot, mask=miss)
        tl.store(load_rows_ptr + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=kmask)
        tl.store(load_slots_ptr + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=kmask)
        tl.debug_barrier()
        tl.store(load_rows_ptr + mrank, rows, mask=miss)
        tl.store(load_slots_ptr + mrank, new_slot, mask=miss)
        tl.debug_barrier()
        for m0 in range(0, M, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            ids = tl.load(ids_ptr + offs_m, mask=offs_m < M, other=0)
            slot = tl.load(table_ptr + base + ids, mask=offs_m < M, other=-1)
            tl.store(slot_ids_ptr + offs_m, slot, mask=offs_m < M)

    return triton, expert_lookup_kernel


def expert_lookup(topk_ids: torch.Tensor, layer: int, table: torch.Tensor,
                  owner: torch.Tensor, victims: torch.Tensor, num_experts: int, *,
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  split: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of `expert_lookup_ref` (same contract, one launch, no host sync);
    `out` (contiguous int32 [K] each) receives the load lists directly."""
    if split is not None and (split.dtype != torch.float32 or split.numel() != 2):
        raise TypeError(f"split must be float32 [2], got {split.dtype} {tuple(split.shape)}")
    triton, kernel = _triton_kernels()
    for t, name in ((table, "table"), (owner, "owner"), (victims, "victims")):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise TypeError(f"{name} must be contiguous int32, got {t.dtype}")
    dev, S, K = table.device, owner.numel() - 1, victims.numel()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    M = ids.numel()
    if scratch is None:
        scratch = (torch.empty(S + 1, dtype=torch.int32, device=dev),
                   torch.empty(K + 1, dtype=torch.int32, device=dev))
    slot_ids = torch.empty(M, dtype=torch.int32, device=dev)
    if out is None:
        out = (torch.empty(K, dtype=torch.int32, device=dev),
               torch.empty(K, dtype=torch.int32, device=dev))
    load_rows, load_slots = out
    for t in out:
        if t.dtype != torch.int32 or not t.is_contiguous() or t.numel() != K:
            raise TypeError(f"load lists must be contiguous int32 [{K}], got {t.dtype} "
                            f"{tuple(t.shape)}")
    kernel[(1,)](ids, M, table, owner, victims, K, scratch[0], scratch[1], slot_ids,
                 load_rows, load_slots, layer * num_experts, num_experts, S,
                 split if split is not None else table, BLOCK_E=triton.next_power_of_2(num_experts),
                 BLOCK_M=32, BLOCK_K=triton.next_power_of_2(max(K, 1)),
                 HAS_SPLIT=split is not None, num_warps=4)
    return slot_ids.view(topk_ids.shape), load_rows, load_slots


def copy_rows(src: ExpertSlots, dst: ExpertSlots, rows: torch.Tensor, slots: torch.Tensor,
              *, block: int = 2048) -> None:
    """Triton version of `copy_rows_ref` (`host_rows.copy_rows` per field, one launch each):
    `src` may live in registered host memory."""
    for name in FIELDS:
        a = getattr(src, name)
        if a is not None:
            host_rows.copy_rows(a, getattr(dst, name), rows, slots, block=block)
