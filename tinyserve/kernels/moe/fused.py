"""Fused MoE over expert slots (NVFP4 or dense experts) and its torch reference.

A layer's routed experts are addressed by slot index, so the same kernels serve resident
experts (slot = expert id) and the GPU expert cache (slot = cache line). `choose_path` picks:
- "fused" (NVFP4 decode, <= FUSED_MAX_TOKENS tokens): the CUDA decode `nvfp4.cuda.moe_decode`,
  all pairs and the shared expert in two launches, no atomics, where `moe_takes` the call
  (16-bit x at the 35B-A3B's expert shapes); any other call runs as "dot";
- "gemv" (dense decode, <= GEMV_MAX_PAIRS pairs) and "dot" (pairs grouped per slot into
  BLOCK_M tiles by `align_pairs`, no host sync): `fused_triton.py`.
A shared expert outside the CUDA decode runs as a second, one-expert call.

Slot layout (gate = rows 0..F-1 of w13, up = rows F..2F-1):
- NVFP4: w13 uint8 [S, 2F, H/2], w13_scale uint8 [S, 2F, H/16], w13_global fp32 [S, 2]
  (gate, up); w2 uint8 [S, H, F/2], w2_scale uint8 [S, H, F/16], w2_global fp32 [S].
- dense: w13 [S, 2F, H], w2 [S, H, F] (bf16 on a GPU); the scale fields are None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinyserve.core import LinearWeight, NVFP4Weight
from tinyserve.kernels.launch import next_pow2
from tinyserve.kernels.nvfp4 import cuda as nvfp4_cuda
from tinyserve.kernels.nvfp4.ref import dequantize, dequantize_nvfp4

MOE_PATHS = ("fused", "gemv", "dot")
FUSED_MAX_TOKENS = 8  # NVFP4 slots: the CUDA decode up to this many tokens, then dot
GEMV_MAX_PAIRS = 64  # dense slots: gemv up to this many (token, expert) pairs, then dot
MOE_DOT_BLOCK_N, MOE_DOT_BLOCK_K = 64, 128  # dot: output rows / inputs per tile


def choose_path(num_tokens: int, topk: int, fp4: bool) -> str:
    """"fused" for NVFP4 decode, "gemv" for dense decode, else "dot"."""
    if fp4:
        return "fused" if num_tokens <= FUSED_MAX_TOKENS else "dot"
    return "gemv" if num_tokens * topk <= GEMV_MAX_PAIRS else "dot"


def fuses_shared_expert(x: torch.Tensor, topk_weights: torch.Tensor, shared_slots: ExpertSlots,
                        shared_logit: torch.Tensor) -> bool:
    """Whether `fused_moe` runs this shared expert inside the CUDA decode, for routed slots of
    its shape (as in every Qwen3.5 checkpoint; others still get it added, by a second call).
    Callers run it through their own GEMVs otherwise: faster than a one-expert dot."""
    n, topk = topk_weights.shape
    return n <= FUSED_MAX_TOKENS and nvfp4_cuda.moe_takes(
        x, topk_weights, topk, shared_slots, shared_slots, shared_logit)


def describe() -> str:
    return (f"NVFP4 decode (<= {FUSED_MAX_TOKENS} tokens, 16-bit x, H in {nvfp4_cuda.MOE_HS}, "
            f"F in {nvfp4_cuda.MOE_FS}): CUDA fused decode; dense decode: Triton gemv; "
            f"else Triton tl.dot")


@functools.cache
def _kernels():
    from tinyserve.kernels.moe import fused_triton as fused_moe_triton

    return fused_moe_triton


@dataclass(frozen=True)
class ExpertSlots:
    """Slot buffers for the routed experts of one layer (layout in the module docstring)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_global: torch.Tensor | None = None
    w2_global: torch.Tensor | None = None

    @property
    def is_fp4(self) -> bool:
        return self.w13_scale is not None

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def buffers(self) -> tuple[torch.Tensor | None, ...]:
        """(w13, w13_scale, w13_global, w2, w2_scale, w2_global)."""
        return (self.w13, self.w13_scale, self.w13_global, self.w2, self.w2_scale,
                self.w2_global)


def allocate_expert_slots(num_slots: int, hidden_size: int, intermediate_size: int, *,
                          fp4: bool, device: torch.device | str,
                          dtype: torch.dtype = torch.bfloat16) -> ExpertSlots:
    """Empty slot buffers (zero codes, unit scales for NVFP4; zeros for dense `dtype`)."""
    s, h, f = num_slots, hidden_size, intermediate_size
    if fp4:
        if h % 16 or f % 16:
            raise ValueError(f"NVFP4 experts need H and F divisible by 16, got H={h} F={f}")
        z = functools.partial(torch.zeros, dtype=torch.uint8, device=device)
        return ExpertSlots(
            w13=z(s, 2 * f, h // 2), w2=z(s, h, f // 2),
            w13_scale=z(s, 2 * f, h // 16), w2_scale=z(s, h, f // 16),
            w13_global=torch.ones(s, 2, dtype=torch.float32, device=device),
            w2_global=torch.ones(s, dtype=torch.float32, device=device))
    return ExpertSlots(w13=torch.zeros(s, 2 * f, h, dtype=dtype, device=device),
                       w2=torch.zeros(s, h, f, dtype=dtype, device=device))


def write_slot(slots: ExpertSlots, slot_id: int, gate: LinearWeight, up: LinearWeight,
               down: LinearWeight, *, non_blocking: bool = False) -> None:
    """Copy one expert (gate, up [F, H], down [H, F]) into slot `slot_id`. NVFP4 slots need
    NVFP4 weights (else TypeError); dense slots dequantize any weight."""
    f, h = slots.intermediate_size, slots.hidden_size
    for name, w, shape in (("gate", gate, (f, h)), ("up", up, (f, h)), ("down", down, (h, f))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} weight {list(w.shape)} != {list(shape)}")
    if not 0 <= slot_id < slots.num_slots:
        raise IndexError(f"slot {slot_id} out of range [0, {slots.num_slots})")
    if not slots.is_fp4:
        dt = slots.w13.dtype
        slots.w13[slot_id, :f].copy_(dequantize(gate, dt), non_blocking=non_blocking)
        slots.w13[slot_id, f:].copy_(dequantize(up, dt), non_blocking=non_blocking)
        slots.w2[slot_id].copy_(dequantize(down, dt), non_blocking=non_blocking)
        return
    if not all(isinstance(w, NVFP4Weight) for w in (gate, up, down)):
        raise TypeError("NVFP4 expert slots need NVFP4Weight gate, up and down")
    assert slots.w13_scale is not None and slots.w2_scale is not None
    assert slots.w13_global is not None and slots.w2_global is not None
    nb = non_blocking
    slots.w13[slot_id, :f].copy_(gate.packed, non_blocking=nb)
    slots.w13[slot_id, f:].copy_(up.packed, non_blocking=nb)
    slots.w13_scale[slot_id, :f].copy_(gate.block_scale, non_blocking=nb)
    slots.w13_scale[slot_id, f:].copy_(up.block_scale, non_blocking=nb)
    slots.w2[slot_id].copy_(down.packed, non_blocking=nb)
    slots.w2_scale[slot_id].copy_(down.block_scale, non_blocking=nb)
    # NOTE: fill_ with a python float never synchronises.
    slots.w13_global[slot_id, 0].fill_(float(gate.global_scale))
    slots.w13_global[slot_id, 1].fill_(float(up.global_scale))
    slots.w2_global[slot_id].fill_(float(down.global_scale))


def pack_expert_slots(experts: Sequence[tuple[LinearWeight, LinearWeight, LinearWeight]],
                      device: torch.device | str,
                      dtype: torch.dtype = torch.bfloat16) -> ExpertSlots:
    """Slot buffers holding `experts[i]` (gate, up, down) in slot i: NVFP4 when every weight
    is NVFP4, else dense in `dtype`."""
    if not experts:
        raise ValueError("pack_expert_slots needs at least one expert")
    fp4 = all(isinstance(w, NVFP4Weight) for e in experts for w in e)
    f, h = experts[0][0].shape
    slots = allocate_expert_slots(len(experts), h, f, fp4=fp4, device=device, dtype=dtype)
    for i, (gate, up, down) in enumerate(experts):
        write_slot(slots, i, gate, up, down)
    return slots


def single_expert_slots(gate: NVFP4Weight, up: NVFP4Weight, down: NVFP4Weight) -> ExpertSlots:
    """One NVFP4 expert (a layer's shared expert) as slot 0 of its own ExpertSlots."""
    return pack_expert_slots([(gate, up, down)], gate.packed.device)


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
           slots: ExpertSlots) -> None:
    if x.dim() != 2 or x.shape[1] != slots.hidden_size:
        raise ValueError(f"x must be [N, {slots.hidden_size}], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"topk ids {list(ids.shape)} / weights {list(weights.shape)} must be "
                         f"[N={x.shape[0]}, k]")
    if ids.dtype not in (torch.int32, torch.int64) or ids.is_floating_point():
        raise TypeError(f"topk_slot_ids must be int32/int64, got {ids.dtype}")
    if not (x.device == ids.device == weights.device == slots.device):
        raise ValueError("x, topk ids/weights and the slots must be on one device")
    if not all(b is None or b.is_contiguous() for b in slots.buffers):
        raise ValueError("ExpertSlots buffers must be contiguous")


def _check_shared(x: torch.Tensor, slots: ExpertSlots, shared_slots: ExpertSlots | None,
                  shared_logit: torch.Tensor | None) -> None:
    if (shared_slots is None) != (shared_logit is None):
        raise ValueError("shared_slots and shared_logit go together")
    if shared_slots is None or shared_logit is None:
        return
    if shared_slots.hidden_size != slots.hidden_size or shared_slots.device != x.device:
        raise ValueError(f"shared expert slots must be [.., H={slots.hidden_size}] on "
                         f"{x.device}")
    if tuple(shared_logit.shape) != (x.shape[0], 1) or not shared_logit.is_floating_point():
        raise ValueError(f"shared_logit must be float [{x.shape[0]}, 1], got "
                         f"{list(shared_logit.shape)} {shared_logit.dtype}")
    if shared_logit.device != x.device:
        raise ValueError("shared_logit must be on x's device")


def fused_moe(x: torch.Tensor, topk_slot_ids: torch.Tensor, topk_weights: torch.Tensor,
              slots: ExpertSlots, *, shared_slots: ExpertSlots | None = None,
              shared_logit: torch.Tensor | None = None, path: str | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed-expert MLP: sum_j w[t, j] * down_s(silu(gate_s(x_t)) * up_s(x_t)), s = ids[t, j],
    plus sigmoid(shared_logit[t]) * shared(x_t) when a shared expert is given.

    Args:
        x: [N, H] bf16 / fp16 / fp32; topk_slot_ids: [N, k] int32/int64 slots in [0, S);
        topk_weights: [N, k] float; slots: on x's device.
        shared_slots: the shared expert as slot 0 of its own ExpertSlots, or None; the CUDA
            decode runs it as one more pair, the other paths as a second one-expert call.
        shared_logit: [N, 1] gate logits with shared_slots (sigmoid rounded to x.dtype).
        path: "fused", "gemv" or "dot"; None = `choose_path` (tests force one).
        out_dtype: x.dtype (None) or float32 (a sum that another part joins before rounding).
    Returns:
        [N, H] in out_dtype: fp32 accumulation in a fixed order (the same bits every run), no
        host synchronisation. The CUDA decode rounds x and the intermediate to fp16 after a
        power-of-two scale per block of 16.
    Raises ValueError on bad shapes, devices or path, TypeError on bad dtypes.
    """
    _check(x, topk_slot_ids, topk_weights, slots)
    _check_shared(x, slots, shared_slots, shared_logit)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise TypeError(f"fused_moe writes x's dtype or float32, not {out_dtype}")
    n, topk = topk_slot_ids.shape
    if n * topk == 0:
        return torch.zeros_like(x, dtype=out_dtype)
    path = path or choose_path(n, topk, slots.is_fp4)
    if path not in MOE_PATHS:
        raise ValueError(f"unknown fused_moe path {path!r}; choose from {MOE_PATHS}")
    if path == "fused" and not slots.is_fp4:
        raise ValueError("the fused path needs NVFP4 slots")
    x = x.contiguous()
    ids = topk_slot_ids.contiguous().view(-1)
    wts = topk_weights.contiguous().view(-1)
    if path == "fused" and nvfp4_cuda.moe_takes(x, wts, topk, slots, shared_slots, shared_logit):
        return nvfp4_cuda.moe_decode(x, ids, wts, topk, slots, shared_slots, shared_logit,
                                     out_dtype)
    if path == "gemv":
        out = _moe_gemv(x, ids, wts, topk, slots, out_dtype)
    else:  # "dot", and the "fused" calls the CUDA decode does not take
        pair_out = _moe_dot(x, ids, wts, topk, slots)  # [P, H] fp32, weighted
        out = pair_out.view(n, topk, -1).sum(1).to(out_dtype)
    if shared_slots is None or shared_logit is None:
        return out
    # the shared expert as a one-expert MoE of its own
    sh_ids = torch.zeros(n, 1, dtype=torch.int32, device=x.device)
    sh_w = torch.sigmoid(shared_logit.float()).to(x.dtype)
    return out + fused_moe(x, sh_ids, sh_w, shared_slots, out_dtype=out_dtype)


def _moe_gemv(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
              slots: ExpertSlots, out_dtype: torch.dtype) -> torch.Tensor:
    if slots.is_fp4:
        raise ValueError("the gemv path takes dense slots (NVFP4 decode: the fused path)")
    kern = _kernels()
    pairs, h, f = ids.numel(), slots.hidden_size, slots.intermediate_size
    n = pairs // topk
    # NOTE: a stable sort keeps token order within a slot; one token needs none.
    has_order = n > 1
    order = torch.argsort(ids, stable=True).to(torch.int32) if has_order else ids
    # tiles: gate_up 4 + 4 rows, down 8 rows, 8 * pow2(K / 16) <= 1024 inputs per K step
    block_k13 = 8 * min(128, next_pow2(h // 16))
    block_k2 = 8 * min(128, next_pow2(f // 16))
    inter = torch.empty(pairs, f, device=x.device, dtype=torch.float32)
    kern.moe_gate_up_kernel[(pairs, -(-f // 4))](
        x, ids, order, slots.w13, inter, x.stride(0), H=h, F=f, TOPK=topk,
        HAS_ORDER=has_order, BLOCK_N=4, BLOCK_K=block_k13, num_warps=4)
    out = torch.empty(n, h, device=x.device, dtype=out_dtype)
    kern.moe_down_kernel[(n, -(-h // 8))](
        inter, ids, wts, slots.w2, out, H=h, F=f, TOPK=topk, BLOCK_N=8, BLOCK_K=block_k2,
        num_warps=2)
    return out


def align_pairs(ids: torch.Tensor, num_slots: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair indices grouped by slot, each run padded to a multiple of `block_m`: (sorted_pairs
    int32 [blocks * block_m], pads = P; block_slot int32 [blocks], -1 past the end); the
    number of blocks is a bound known without a sync."""
    pairs = ids.numel()
    dev = ids.device
    order = torch.argsort(ids, stable=True)
    sorted_slot = ids[order]
    counts = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends_padded = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=dev) - starts[sorted_slot]
    dest = (ends_padded - padded)[sorted_slot] + rank
    num_blocks = -(-(pairs + min(pairs, num_slots) * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts_b = torch.arange(num_blocks, device=dev) * block_m
    block_slot = torch.searchsorted(ends_padded, starts_b, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1).to(torch.int32)
    return sorted_pairs, block_slot


def _moe_dot(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
             slots: ExpertSlots) -> torch.Tensor:
    kern = _kernels()
    pairs, h, f = ids.numel(), slots.hidden_size, slots.intermediate_size
    per_slot = pairs / min(pairs, slots.num_slots)
    block_m = 16 if per_slot <= 16 else (32 if per_slot <= 32 else 64)
    sorted_pairs, block_slot = align_pairs(ids.long(), slots.num_slots, block_m)
    num_blocks = block_slot.numel()
    fp4 = slots.is_fp4
    # dense slots: wts stands in for the scale pointers the kernels do not read
    s13, s2, g13, g2 = ((slots.w13_scale, slots.w2_scale, slots.w13_global, slots.w2_global)
                        if fp4 else (wts,) * 4)
    inter = torch.empty(pairs, f, device=x.device, dtype=x.dtype)
    kern.moe_dot_gate_up_kernel[(num_blocks, -(-f // MOE_DOT_BLOCK_N))](
        x, block_slot, sorted_pairs, slots.w13, s13, g13, inter, topk, pairs, x.stride(0),
        H=h, F=f, IS_FP4=fp4, BLOCK_M=block_m, BLOCK_N=MOE_DOT_BLOCK_N,
        BLOCK_K=MOE_DOT_BLOCK_K, num_warps=4)
    pair_out = torch.empty(pairs, h, device=x.device, dtype=torch.float32)
    kern.moe_dot_down_kernel[(num_blocks, -(-h // MOE_DOT_BLOCK_N))](
        inter, block_slot, sorted_pairs, wts, slots.w2, s2, g2, pair_out, pairs,
        H=h, F=f, IS_FP4=fp4, BLOCK_M=block_m, BLOCK_N=MOE_DOT_BLOCK_N, BLOCK_K=MOE_DOT_BLOCK_K,
        num_warps=4)
    return pair_out


def slot_weights(slots: ExpertSlots, slot_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 (w13 [2F, H], w2 [H, F]) of one slot (reference path)."""
    if not slots.is_fp4:
        return slots.w13[slot_id].float(), slots.w2[slot_id].float()
    assert slots.w13_scale is not None and slots.w2_scale is not None
    assert slots.w13_global is not None and slots.w2_global is not None
    f = slots.intermediate_size
    g13 = slots.w13_global[slot_id].tolist()
    halves = [dequantize_nvfp4(NVFP4Weight(slots.w13[slot_id, r], slots.w13_scale[slot_id, r],
                                           g13[i]))
              for i, r in enumerate((slice(0, f), slice(f, 2 * f)))]
    w2 = dequantize_nvfp4(NVFP4Weight(slots.w2[slot_id], slots.w2_scale[slot_id],
                                      float(slots.w2_global[slot_id])))
    return torch.cat(halves), w2


def fused_moe_ref(x: torch.Tensor, topk_slot_ids: torch.Tensor, topk_weights: torch.Tensor,
                  slots: ExpertSlots, *, shared_slots: ExpertSlots | None = None,
                  shared_logit: torch.Tensor | None = None,
                  rnd: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-slot fp32 torch loop with the contract of `fused_moe`; `rnd` rounds the routed
    experts' inputs and hidden activations (as the CPU kernel's int8 inputs,
    `kernels.moe.cpu.quantize_blocks_ref`), not the shared expert's."""
    _check(x, topk_slot_ids, topk_weights, slots)
    _check_shared(x, slots, shared_slots, shared_logit)
    xf = x.float() if rnd is None else rnd(x.float())
    out = moe_pairs_ref(xf, topk_slot_ids, topk_weights.float(), slots, rnd)
    if shared_slots is not None and shared_logit is not None:
        gate = torch.sigmoid(shared_logit.float()).to(x.dtype).float()  # [N, 1]
        zeros = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
        out += moe_pairs_ref(x.float(), zeros, gate, shared_slots)
    return out.to(out_dtype or x.dtype)


def moe_pairs_ref(xf: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  slots: ExpertSlots, rnd: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """fp32 sum over the pairs (ids >= 0) of weight * expert(xf); `rnd` rounds the hidden
    activations (the CPU kernel's int8 inputs)."""
    f = slots.intermediate_size
    out = torch.zeros(xf.shape, dtype=torch.float32, device=xf.device)
    for s in torch.unique(ids[ids >= 0]).tolist():
        tok, j = (ids == s).nonzero(as_tuple=True)
        w13, w2 = slot_weights(slots, s)
        gu = xf[tok] @ w13.T  # [n_s, 2F]
        hid = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
        if rnd is not None:
            hid = rnd(hid)
        out.index_add_(0, tok, (hid @ w2.T) * weights[tok, j][:, None])
    return out
