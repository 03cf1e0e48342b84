"""The GPU expert cache: slot buffers, the device lookup table and the host policy mirror.

`lookup(layer, topk_ids) -> slot ids`: lookup and miss copies are two kernels on the compute
stream reading the store zero-copy, so a decode step has no host round trip per layer and can
be captured in a CUDA graph (on CPU, or with a store that is not pinned, the torch references
do the same with a host sync per copy). The host policy only hands out victim lists, one step
behind (two when deferred, `begin_step(defer=True)` + `after_launch()`). Stale victims cost
hit rate, never correctness: the lookup skips slots the layer hits and keeps table and owner
exact itself.
Why not async copies on a side stream: the experts are known only after the router runs, so
the host would have to synchronise per layer; the compute stream also orders the copy after
the previous layer's fused MoE (whose slots it may overwrite).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tinyserve.kernels.launch import host_event
from tinyserve.kernels.moe.fused import allocate_expert_slots
from tinyserve.log import get_logger
from tinyserve.offload import lookup as lk
from tinyserve.offload.cache import CacheStats, ExpertCachePolicy
from tinyserve.offload.store import HostExpertStore

logger = get_logger(__name__)

# A fold that overlaps a step in flight guesses which slots that step is filling from its
# victim lists (per layer, the head of its list as long as the loads of the step just folded
# + IN_FLIGHT_MARGIN) and ranks them as freshly used.
IN_FLIGHT_MARGIN = 2


def _record(event: Any, device: torch.device) -> None:
    if event is not None:
        event.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)


class DeviceExpertCache:
    """`num_slots` (>= experts per layer) expert slots on `device`, filled from `store` on
    demand. `max_ids`: most (token, k) pairs one lookup may see."""

    def __init__(self, store: HostExpertStore, num_slots: int, *, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, max_ids: int = 2048 * 8,
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
        if cuda and not store.pinned:
            logger.warning("expert store is not pinned: expert misses go through the host")
        self.use_triton = cuda and store.pinned  # else the torch references
        # Debug knob of benchmarks: hold the stream after each miss copy so that misses move
        # at most this many bytes per second (0: off; `kernels.throttle`).
        self.throttle_bytes_per_s = 0.0
        # Device lookup state (see offload.lookup).
        i32 = dict(dtype=torch.int32, device=self.device)
        self.table = torch.full((L * E + 1,), -1, **i32)
        self.owner = torch.full((num_slots + 1,), -1, **i32)
        self.victim_len = min(E, max_ids, num_slots)
        self.victims = torch.zeros(L, self.victim_len, **i32)
        # NOTE: uploaded without a host wait; the next write of this staging buffer first
        # waits for that copy (`_victims_copied`; a deferred fold writes it while a step is
        # in flight, and nothing synchronises between __init__ and preload_all).
        self._victims_host = torch.zeros(L, self.victim_len, dtype=torch.int32,
                                         pin_memory=cuda)
        self._victims_copied = host_event(self.device)
        self._scratch = (torch.empty(num_slots + 1, **i32),
                         torch.empty(self.victim_len + 1, **i32))
        # The step's log, read by begin_step in one copy: per layer the load list (rows, slots;
        # -1 padded) the lookup wrote and the routed ids (-1 beyond the call's ids: begin_step
        # resets what it read, so a layer whose first id is -1 was not called).
        V = self.victim_len
        self._log = torch.full((L, 2 * V + max_ids), -1, **i32)  # [L, rows | slots | ids]
        self._log_rows, self._log_slots = self._log[:, :V], self._log[:, V:2 * V]
        self._log_ids = self._log[:, 2 * V:]
        # The log's host copy (begin_step, without a host wait): read after `_log_copied`.
        self._log_host = torch.empty(self._log.numel(), dtype=torch.int32, pin_memory=cuda)
        self._log_copied = host_event(self.device)
        self._pending: int | None = None  # ids width of a copied log not folded yet
        self._evicted: list[tuple[int, int]] = []  # evict_slots ranges waiting for that fold
        self._width = 0  # most ids of an eager call since begin_step
        self._graph_width = 0  # most ids of a call captured in a CUDA graph (replayed later)
        # Layer l's victims: the policy order's entries l, l+L, l+2L, ... first (so decode
        # layers share the best victims without overlap), then the rest in order.
        n = self._victim_n = min(num_slots, L * self.victim_len)
        idx = np.arange(n)
        self._victim_perm = np.stack([
            np.concatenate([idx[layer::L], idx[idx % L != layer]])[:self.victim_len]
            for layer in range(L)])
        self._fill_victims()

    @property
    def stats(self) -> CacheStats:
        return self.policy.stats

    # per step
    def begin_step(self, *, defer: bool = False) -> None:
        """Step boundary: fold the last step's lookups into the policy, hand out fresh victims.

        Skipping it only makes victims staler. The log is copied to a pinned buffer without a
        host wait, stream-ordered before whatever may overwrite it. With `defer` the policy
        work waits for `after_launch()` (called once the next step is queued), so it overlaps
        the device. A log still pending from an earlier deferred boundary is folded first.
        """
        if self._pending is not None:
            self._fold(in_flight=False)
        width = max(self._width, self._graph_width)
        if width > 0:
            cols = 2 * self.victim_len + width
            host = self._log_host[:self.num_layers * cols].view(self.num_layers, cols)
            host.copy_(self._log[:, :cols].contiguous(), non_blocking=True)
            _record(self._log_copied, self.device)
            self._log_ids[:, :width].fill_(-1)  # after the copy, on the same stream
        self._pending = width
        self._width = 0
        if not defer:
            self._fold(in_flight=False)

    def after_launch(self) -> None:
        """Fold a log left by `begin_step(defer=True)` while the step queued since runs; the
        slots that step may be filling rank as freshly used (`IN_FLIGHT_MARGIN`)."""
        if self._pending is not None:
            self._fold(in_flight=True)

    def _fold(self, *, in_flight: bool) -> None:
        width, self._pending = self._pending, None
        loads = None
        if width:
            if self._log_copied is not None:
                self._log_copied.synchronize()  # the copy into the pinned buffer is done
            cols = 2 * self.victim_len + width
            log = self._log_host[:self.num_layers * cols].view(self.num_layers, cols)
            loads = self._replay(log.numpy())
        for start, stop in self._evicted:  # evictions queued after the log's lookups
            self.policy.forget(start, stop)
        self._evicted.clear()
        self.policy.end_step()
        if loads is not None:
            busy = self._in_flight_slots(loads) if in_flight else None
            self._fill_victims(busy)

    def _replay(self, log: np.ndarray) -> np.ndarray | None:
        """Replay a step's log [L, 2V + width] into the policy; returns the number of loads
        per layer [L], or None when no layer was called."""
        V, E = self.victim_len, self.num_experts
        ids = log[:, 2 * V:]
        called = np.flatnonzero(ids[:, 0] >= 0)
        if not len(called):
            return None
        ids, rows, slots = ids[called], log[called, :V], log[called, V:2 * V]
        n = len(called)
        # Distinct experts of each called layer: [n, E] flags (-1 -> the dump column E).
        needed = np.zeros((n, E + 1), dtype=bool)
        needed[np.arange(n)[:, None], np.where(ids >= 0, ids, E)] = True
        load_i, load_j = np.nonzero(rows >= 0)  # row-major: in the order the layers ran
        load_e = rows[load_i, load_j] % E
        needed[load_i, load_e] = False
        hit_i, hit_e = np.nonzero(needed[:, :E])
        # NOTE: a hit's slot is the one the mirror had when the step began: only the layer of
        # a key loads it, so nothing earlier in the step can have moved it.
        where = self.policy.where
        hits = []
        for key in zip(called[hit_i].tolist(), hit_e.tolist(), strict=True):
            s = where.get(key)
            if s is not None:
                hits.append((key, s))
        loads = list(zip(zip(called[load_i].tolist(), load_e.tolist(), strict=True),
                         slots[load_i, load_j].tolist(), strict=True))
        self.policy.replay_step(called.tolist(), hits, loads)
        per_layer = np.zeros(self.num_layers, dtype=np.int64)
        np.add.at(per_layer, called[load_i], 1)
        return per_layer

    def _in_flight_slots(self, loads: np.ndarray) -> np.ndarray:
        """Slots the step in flight may be filling: the heads of the victim lists it reads
        (the last ones uploaded), `loads + IN_FLIGHT_MARGIN` entries per layer."""
        lists = self._victims_host.numpy()  # [L, V], what the device holds now
        n = np.minimum(loads + IN_FLIGHT_MARGIN, lists.shape[1])
        return np.unique(lists[np.arange(lists.shape[1])[None, :] < n[:, None]])

    def _fill_victims(self, busy: np.ndarray | None = None) -> None:
        """Victim lists from the policy: disjoint per layer while the pool allows; `busy`
        slots (a step in flight may be filling them) rank as freshly used."""
        order = self.policy.victim_array(self._victim_n, filling=busy)
        if self._victims_copied is not None:
            self._victims_copied.synchronize()  # the last copy out of the staging buffer
        self._victims_host.numpy()[:] = order[self._victim_perm]
        self.victims.copy_(self._victims_host, non_blocking=True)
        _record(self._victims_copied, self.device)

    # lookup
    def lookup(self, layer: int, topk_ids: torch.Tensor, *, split: torch.Tensor | None = None,
               on_lookup: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Slots [N, k] int32 holding `topk_ids` of `layer`, after copying in the misses.
        `split` (`offload.hybrid`): misses left to the CPU get slot -1, not loaded or counted.
        `on_lookup(slot_ids)` runs before the miss copies are queued (the CPU work forks)."""
        m = topk_ids.numel()
        if m > self._log_ids.shape[1]:
            raise ValueError(f"{m} routed pairs exceed the cache's max_ids "
                             f"{self._log_ids.shape[1]}")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._graph_width = max(self._graph_width, m)
        else:
            self._width = max(self._width, m)
        ids = self._log_ids[layer, :m]  # int32: the lookup's input and the step's log
        ids.copy_(topk_ids.reshape(-1))
        ids = ids.view(topk_ids.shape)
        out = (self._log_rows[layer], self._log_slots[layer])
        args = (ids, layer, self.table, self.owner, self.victims[layer], self.num_experts)
        result = None
        if self.use_triton:
            try:
                result = lk.expert_lookup(*args, scratch=self._scratch, out=out, split=split)
                if on_lookup is not None:
                    on_lookup(result[0])
                self._copy(result[1], result[2])
                return result[0]
            except Exception as exc:  # no Triton
                logger.warning("Triton expert lookup/copy failed (%r); using the torch path",
                               exc)
                self.use_triton = False
        if result is None:  # else the lookup ran: only the copy is left
            result = lk.expert_lookup_ref(*args, out=out, split=split)
            if on_lookup is not None:
                on_lookup(result[0])
        lk.copy_rows_ref(self.store.slots, self.slots, result[1], result[2])
        return result[0]

    def _copy(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """The miss copy kernel (then the debug throttle of the host-to-device rate, when
        `throttle_bytes_per_s` is set: a benchmark's slower PCIe link)."""
        rate = self.throttle_bytes_per_s
        if rate:
            from tinyserve.kernels import throttle

            throttle.stamp(self.device)
        lk.copy_rows(self.store.slots, self.slots, rows, slots)
        if rate:
            throttle.hold(rows, self.store.bytes_per_expert / rate)

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
        E = self.num_experts
        loads = [((r // E, r % E), r) for r in range(rows)]
        self.policy.replay_step(range(self.num_layers), [], loads)
        self.policy.end_step()
        self.policy.stats = CacheStats()
        self._fill_victims()

    def evict_slots(self, start: int, stop: int) -> None:
        """Forget what slots [start, stop) hold (device table and owner, the policy mirror), so
        no lookup finds them until one takes them again. For `offload.prefetch`, whose writes
        to the slots are ordered before the next lookup. Stream-ordered, no host sync."""
        dump = self.table.numel() - 1
        held = self.owner[start:stop]
        self.table.index_fill_(0, torch.where(held >= 0, held, dump).long(), -1)
        held.fill_(-1)
        if self._pending:  # a deferred log of lookups before this: the mirror forgets after it
            self._evicted.append((start, stop))
        else:
            self.policy.forget(start, stop)

    def resident(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> slot, read from the device table (a synchronisation)."""
        tab = self.table[:-1].cpu().view(self.num_layers, self.num_experts)
        return {(int(la), int(e)): int(tab[la, e]) for la, e in (tab >= 0).nonzero().tolist()}
