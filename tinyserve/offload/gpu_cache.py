"""The GPU expert cache: slot buffers, the device lookup table and the host policy mirror.

Two ways to resolve a layer's experts (`lookup(layer, topk_ids) -> slot ids`):

- "device" (CUDA with a registered store; also runnable on CPU through the torch references):
  the lookup and the miss copies run on the compute stream as two kernels reading the store
  over PCIe (zero-copy), so a decode step has no host round trip per layer and can be
  captured in a CUDA graph. The host policy only hands out victim lists, one step behind:
  `begin_step()` replays the previous step's lookups (from device logs, one small copy at the
  step boundary where the runner already synchronises) into the policy and writes new victim
  lists. Stale victims cost hit rate, never correctness: the kernel skips slots the layer hits
  and keeps table and owner exact itself.
- "host" (CPU, or a pageable store): the ids come to the host, the policy decides, and the
  misses are copied with plain tensor copies.

Why a copy kernel on the compute stream rather than async copies on a side stream: a layer's
experts are known only after its router runs, and deciding which to copy on the host needs
the ids there, i.e. a synchronisation per layer. A kernel that reads the routing from device
memory and the weights from mapped host memory needs none, and the compute stream orders it
after the previous layer's fused MoE (whose slots it may overwrite) and before this layer's.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.kernels.fused_moe import allocate_expert_slots
from tinyserve.log import get_logger
from tinyserve.offload import lookup as lk
from tinyserve.offload.cache import CacheStats, ExpertCachePolicy
from tinyserve.offload.store import HostExpertStore

logger = get_logger(__name__)


class DeviceExpertCache:
    """`num_slots` expert slots on `device`, filled from `store` on demand.

    Args:
        store: the host expert store (all layers).
        num_slots: slots in the pool (>= experts per layer; the planner's `expert_slots`).
        max_ids: most (token, k) pairs one lookup may see (prefill chunk x top_k).
        mode: "device", "host" or None (device when CUDA and the store is registered).
        use_triton: run the Triton kernels (default: on CUDA); else the torch references.
    """

    def __init__(self, store: HostExpertStore, num_slots: int, *, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, max_ids: int = 2048 * 8,
                 mode: str | None = None, use_triton: bool | None = None,
                 policy: ExpertCachePolicy | None = None) -> None:
        self.store = store
        self.device = torch.device(device)
        L, E = store.num_layers, store.num_experts
        if num_slots < E:
            raise ValueError(f"the expert cache needs at least one layer's experts ({E} slots), "
                             f"got {num_slots}")
        self.num_layers, self.num_experts, self.num_slots = L, E, num_slots
        src = store.slots
        self.slots = allocate_expert_slots(num_slots, src.hidden_size, src.intermediate_size,
                                           fp4=src.is_fp4, device=self.device, dtype=dtype)
        self.policy = policy or ExpertCachePolicy(num_slots,
                                                  bytes_per_expert=store.bytes_per_expert)
        cuda = self.device.type == "cuda"
        if mode is None:
            mode = "device" if cuda and store.pinned else "host"
        if mode == "device" and cuda and not store.pinned:
            logger.warning("expert store is not pinned: expert misses go through the host")
            mode = "host"
        self.mode = mode
        self.use_triton = cuda if use_triton is None else use_triton
        # Device lookup state (see offload.lookup).
        i32 = dict(dtype=torch.int32, device=self.device)
        self.table = torch.full((L * E + 1,), -1, **i32)
        self.owner = torch.full((num_slots + 1,), -1, **i32)
        self.victim_len = min(E, max_ids, num_slots)
        self.victims = torch.zeros(L, self.victim_len, **i32)
        self._scratch = (torch.empty(num_slots + 1, **i32),
                         torch.empty(self.victim_len + 1, **i32))
        self._log_ids = torch.full((L, max_ids), -1, **i32)
        self._log_rows = torch.full((L, self.victim_len), -1, **i32)
        self._log_slots = torch.full((L, self.victim_len), -1, **i32)
        self._calls: list[tuple[int, int]] = []  # (layer, number of ids) since begin_step
        self._last_calls: list[tuple[int, int]] = []
        # Layer l's victims: the policy order's entries l, l+L, l+2L, ... first (so decode
        # layers share the best victims without overlap), then the rest in order.
        n = self._victim_n = min(num_slots, L * self.victim_len)
        idx = torch.arange(n)
        self._victim_perm = torch.stack([
            torch.cat([idx[layer::L], idx[idx % L != layer]])[:self.victim_len]
            for layer in range(L)])
        self._fill_victims()

    @property
    def stats(self) -> CacheStats:
        return self.policy.stats

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Fold the last step's lookups into the policy and hand out fresh victim lists.

        Called by the provider when layer 0 comes round again; a runner replaying a CUDA
        graph calls it between replays (skipping it only makes victims staler).
        """
        calls = self._calls or self._last_calls
        if self.mode == "device" and calls:
            ids = self._log_ids[:, :max(m for _, m in calls)].cpu()
            rows, slots = self._log_rows.cpu(), self._log_slots.cpu()
            E = self.num_experts
            for layer, m in calls:
                loads = {int(r) - layer * E: int(s) for r, s in zip(rows[layer], slots[layer],
                                                                      strict=True) if r >= 0}
                experts = list(dict.fromkeys(ids[layer, :m].tolist()))
                got = [(e, loads[e], True) if e in loads else (e, self.policy.slot_of(layer, e),
                                                              False) for e in experts]
                got = [g for g in got if g[1] >= 0]
                self.policy.observe(layer, [g[0] for g in got], [g[1] for g in got],
                                    [g[2] for g in got])
                self.policy.release()
        self.policy.end_step()
        if self.mode == "device" and calls:
            self._fill_victims()
        if self._calls:
            self._last_calls = self._calls
        self._calls = []

    def _fill_victims(self) -> None:
        """Victim lists from the policy: disjoint per layer while the pool allows."""
        if self.mode != "device":
            return
        order = torch.tensor(self.policy.victims(self._victim_n), dtype=torch.int32)
        self.victims.copy_(order[self._victim_perm])

    # ------------------------------------------------------------------ lookup
    def lookup(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Slots [N, k] int32 holding `topk_ids` of `layer`, after copying in the misses."""
        if self.mode == "host":
            return self._lookup_host(layer, topk_ids)
        m = topk_ids.numel()
        if m > self._log_ids.shape[1]:
            raise ValueError(f"{m} routed pairs exceed the cache's max_ids "
                             f"{self._log_ids.shape[1]}")
        result = None
        if self.use_triton:
            try:
                result = lk.expert_lookup(topk_ids, layer, self.table, self.owner,
                                          self.victims[layer], self.num_experts,
                                          scratch=self._scratch)
                lk.copy_rows(self.store.slots, self.slots, result[1], result[2])
            except Exception as exc:  # no Triton, or host memory not device-addressable
                logger.warning("Triton expert lookup/copy failed (%r); using the torch path",
                               exc)
                self.use_triton = False
                if result is not None:  # the lookup ran: only the copy is left
                    lk.copy_rows_ref(self.store.slots, self.slots, result[1], result[2])
        if result is None:
            result = lk.expert_lookup_ref(topk_ids, layer, self.table, self.owner,
                                          self.victims[layer], self.num_experts)
            lk.copy_rows_ref(self.store.slots, self.slots, result[1], result[2])
        slot_ids, rows, slots = result
        self._log_ids[layer, :m].copy_(topk_ids.reshape(-1))
        self._log_rows[layer].copy_(rows)
        self._log_slots[layer].copy_(slots)
        self._calls.append((layer, m))
        return slot_ids

    def _lookup_host(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.reshape(-1).tolist()
        slots, loads = self.policy.access(layer, ids)
        self.policy.release()  # this layer's copies are ordered before any later eviction
        if loads:
            rows = torch.tensor([layer * self.num_experts + e for e, _ in loads])
            dst = torch.tensor([s for _, s in loads], device=self.device)
            lk.copy_rows_ref(self.store.slots, self.slots, rows, dst)
        self._calls.append((layer, len(ids)))
        return torch.tensor(slots, dtype=torch.int32, device=self.device).view(topk_ids.shape)

    def preload_all(self) -> None:
        """Copy every expert into slot = row (needs num_slots >= layers x experts): the
        all-resident configuration through the same lookup and kernels."""
        rows = self.num_layers * self.num_experts
        if self.num_slots < rows:
            raise ValueError(f"{self.num_slots} slots cannot hold all {rows} experts")
        for name in lk.FIELDS:
            src, dst = getattr(self.store.slots, name), getattr(self.slots, name)
            if src is not None:
                dst[:rows].copy_(src, non_blocking=True)
        ar = torch.arange(rows, dtype=torch.int32, device=self.device)
        self.table[:rows] = ar
        self.owner[:rows] = ar
        for r in range(rows):
            self.policy.observe(r // self.num_experts, [r % self.num_experts], [r], [True])
        self.policy.end_step()
        self.policy.stats = CacheStats()
        self._fill_victims()

    def resident(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> slot, read from the device table (a synchronisation)."""
        tab = self.table[:-1].cpu().view(self.num_layers, self.num_experts)
        return {(int(la), int(e)): int(tab[la, e]) for la, e in (tab >= 0).nonzero().tolist()}

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "slots": self.num_slots, "triton": self.use_triton,
                **self.stats.as_dict()}
