"""Prefill streaming: a big batch copies whole layers of experts while the previous layer computes.

A prefill chunk routes to almost every expert, so lookup + miss copy on the compute stream
would serialise all the copies with the compute. A batch of at least `min_pairs` (token,
expert) pairs instead takes two staging regions of E slots out of the cache (slots [0, 2E),
`DeviceExpertCache.evict_slots`), keeps layer l's expert e in slot (l % 2) * E + e (the fused
MoE runs on `topk_ids + base`, no lookup), and copies whole layers on a side stream (the DMA
engine, no SMs). At layer l: mark the compute stream (the MoE of l - 1 is the last reader of
region (l + 1) % 2), copy l if its region lacks it, copy l + 1 after the mark, make the
compute stream wait for l's copy. `release()` waits for the last copy and gives the regions
back free. A streamed layer counts all E experts as misses (bytes per token stay honest); the
routed ids are never read on the host. A plain `CopyQueue` copies at once (CPU, tests).
"""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.log import get_logger
from tinyserve.offload import lookup as lk

logger = get_logger(__name__)

MIN_PAIRS_PER_EXPERT = 4  # a batch streams from E * this (token, expert) pairs on

Copy = tuple[torch.Tensor, torch.Tensor]  # (destination, source)


class CopyQueue:
    """Where layer copies run, relative to the compute stream. This base class copies at once
    (CPU: no streams); its events are increasing integers."""

    def __init__(self) -> None:
        self._n = 0

    def _event(self) -> Any:
        self._n += 1
        return self._n

    def mark(self) -> Any:
        """An event after everything enqueued on the compute stream so far."""
        return self._event()

    def copy(self, after: Any, copies: list[Copy]) -> Any:
        """Run `copies` once `after` has passed; returns the event of their completion."""
        for dst, src in copies:
            dst.copy_(src)
        return self._event()

    def wait(self, event: Any) -> None:
        """Order the compute stream's next work after `event`."""


class CudaCopyQueue(CopyQueue):
    """Copies on a side CUDA stream (host -> device from registered memory: the DMA engine)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, after: Any, copies: list[Copy]) -> Any:
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def can_stream(num_slots: int, num_layers: int, num_experts: int) -> str | None:
    """None when a cache of `num_slots` slots can stream prefill; else why not."""
    if num_slots >= num_layers * num_experts:
        return "the cache holds every expert"
    if num_slots < 2 * num_experts:
        return (f"the cache has {num_slots} slots, fewer than two layers' experts "
                f"({2 * num_experts})")
    return None


class LayerStreamer:
    """Streams whole layers of experts into two staging regions of `cache` (>= 2E slots).
    `min_pairs`: smallest (token, expert) count of a streamed call (MIN_PAIRS_PER_EXPERT * E)."""

    def __init__(self, cache: Any, *, queue: CopyQueue | None = None,
                 min_pairs: int | None = None) -> None:
        E = cache.num_experts
        if cache.num_slots < 2 * E:
            raise ValueError(f"prefill streaming needs {2 * E} slots, the cache has "
                             f"{cache.num_slots}")
        self.cache = cache
        if queue is None:
            queue = CudaCopyQueue(cache.device) if cache.device.type == "cuda" else CopyQueue()
        self.queue = queue
        self.min_pairs = MIN_PAIRS_PER_EXPERT * E if min_pairs is None else min_pairs
        self.active = False  # the regions are out of the cache
        self.region_layer: list[int | None] = [None, None]  # the layer each region holds
        self._ready: list[Any] = [None, None]  # the event of each region's last copy
        self._last: Any = None  # the last copy's event

    def wants(self, topk_ids: torch.Tensor) -> bool:
        """Whether a call with these routed ids [N, k] streams (never inside a graph capture)."""
        if topk_ids.numel() < self.min_pairs:
            return False
        return not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing())

    def slot_ids(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Slots [N, k] int32 of `topk_ids` [N, k] of `layer`, its experts streamed in; the
        compute stream is ordered after their copy, and layer + 1's copy is under way."""
        if not self.active:
            self.cache.evict_slots(0, 2 * self.cache.num_experts)
            self.active = True
        mark = self.queue.mark()
        self._copy(layer, mark)  # (only when its region does not hold it yet)
        if layer + 1 < self.cache.num_layers:
            self._copy(layer + 1, mark)
        self.queue.wait(self._ready[layer % 2])
        return (topk_ids + (layer % 2) * self.cache.num_experts).to(torch.int32)  # its region

    def _copy(self, layer: int, after: Any) -> None:
        """Copy `layer` into its region after `after`, unless the region holds it already."""
        r = layer % 2
        if self.region_layer[r] == layer:
            return
        E, src, dst = self.cache.num_experts, self.cache.store.slots, self.cache.slots
        rows, slots = slice(layer * E, (layer + 1) * E), slice(r * E, (r + 1) * E)
        copies = [(getattr(dst, f)[slots], getattr(src, f)[rows]) for f in lk.FIELDS
                  if getattr(src, f) is not None]
        self._ready[r] = self._last = self.queue.copy(after, copies)
        self.region_layer[r] = layer
        self.cache.stats.count(layer, 0, E, self.cache.store.bytes_per_expert)

    def release(self) -> None:
        """Give the regions back to the cache (free slots) once their last copy is done. A
        no-op inside a capture (the runner calls `begin_step()`, which releases, per replay)."""
        if not self.active:
            return
        if self.cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._last is not None:
            self.queue.wait(self._last)
        self.active = False
        self.region_layer = [None, None]  # (the next copy of each region sets its _ready)
        self._last = None
