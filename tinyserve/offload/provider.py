"""OffloadedExperts: the experts provider over a host store and a GPU slot cache.

Same `forward` as `model.moe.ResidentExperts`. Each call resolves the layer's experts to cache
slots (`offload.gpu_cache`) and runs the fused MoE over them; a call for a layer at or below
the previous call's starts a new step. A prefill-sized batch streams whole layers instead
(`offload.prefetch`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.kernels.moe.fused import ExpertSlots, fused_moe, fused_moe_ref
from tinyserve.log import get_logger
from tinyserve.model.experts_api import ExpertsProvider
from tinyserve.model.linear import kernels_enabled
from tinyserve.offload import prefetch
from tinyserve.offload.gpu_cache import DeviceExpertCache
from tinyserve.offload.store import HostExpertStore

logger = get_logger(__name__)

CPU_MAX_TOKENS = 16  # largest batch whose misses may go to the CPU (`set_hybrid`)


class OffloadedExperts(ExpertsProvider):
    """Routed experts from a `HostExpertStore` through a `DeviceExpertCache`. Prefill streams
    (`streamer`) when the cache holds two layers but not all; to switch streaming off later,
    `begin_step()` then set `streamer` to None."""

    def __init__(self, cache: DeviceExpertCache) -> None:
        self.cache = cache
        self.use_kernel = kernels_enabled(cache.device)  # fused_moe's kernels
        self.round_like_cpu = False  # a check's reference (`forward`; decode eager only)
        self._last_layer: int | None = None
        self.streamer: prefetch.LayerStreamer | None = None
        why = prefetch.can_stream(cache.num_slots, cache.num_layers, cache.num_experts)
        if why is None:
            self.streamer = prefetch.LayerStreamer(cache)
        elif cache.num_slots < cache.num_layers * cache.num_experts:
            logger.info("prefill streaming off: %s", why)
        self.hybrid_plan: Any = None  # the offload.hybrid.HybridPlan in force (`set_hybrid`)
        self.cpu_runner: Any = None  # its offload.hybrid.CpuExperts, None for a "gpu" plan
        self._split: torch.Tensor | None = None  # fp32 [2] on the device: the plan's (a, b)

    @classmethod
    def create(cls, store: HostExpertStore, num_slots: int, *, device: torch.device | str,
               dtype: torch.dtype = torch.bfloat16, **cache_kwargs: Any) -> OffloadedExperts:
        """A provider with a fresh cache of `num_slots` slots on `device`."""
        return cls(DeviceExpertCache(store, num_slots, device=device, dtype=dtype,
                                     **cache_kwargs))

    def begin_step(self, *, defer: bool = False) -> None:
        """Start a new step (called before each CUDA-graph replay; `defer`: see
        `DeviceExpertCache.begin_step`). The replay's lookups are unseen here, so the next
        eager call starts a new step too, or it would overwrite the replay's log unread."""
        if self.streamer is not None:
            self.streamer.release()
        self.cache.begin_step(defer=defer)
        self._last_layer = self.cache.num_layers

    def after_launch(self) -> None:
        """The step's device work is queued: do the cache's deferred host work now."""
        self.cache.after_launch()

    @property
    def accepts_shared(self) -> bool:
        """Whether `forward` takes the layer's shared expert along (the fused-MoE kernel)."""
        return self.use_kernel

    def set_hybrid(self, plan: Any, runner: Any = None) -> None:
        """Serve decode misses by `plan` (an `offload.hybrid.HybridPlan`), its CPU share on
        `runner` (an `offload.hybrid.CpuExperts`, unused by a "gpu" plan). Decode graphs
        captured before must be dropped."""
        self.hybrid_plan = plan
        self.cpu_runner = None if plan.mode == "gpu" else runner
        self._split = torch.tensor([plan.a, plan.b], dtype=torch.float32,
                                   device=self.cache.device)

    @property
    def cpu_computed(self) -> int | None:
        """Distinct experts computed on the CPU so far (None without a CPU part)."""
        return None if self.cpu_runner is None else self.cpu_runner.computed

    def forward(self, layer_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, shared_slots: ExpertSlots | None = None,
                shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_j topk_weights[:, j] * Expert_{topk_ids[:, j]}(x) (+ sigmoid(shared_logit) *
        the shared expert in `shared_slots`); x [N, H] -> [N, H] in x.dtype. Misses left to a
        CPU part (`set_hybrid`) get weight 0 here; the GPU part's sum stays in fp32 and the
        CPU part's is added to it before the one rounding to x.dtype.
        With `round_like_cpu`, batches a CPU part could take run the routed experts here
        through the torch reference with the CPU kernel's int8 rounding: then a CPU part moves
        the sum by its rounding order alone."""
        if self._last_layer is not None and layer_id <= self._last_layer:
            # NOTE: never inside a CUDA-graph capture (begin_step reads device logs); the
            # graph runner calls begin_step() before each replay instead.
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.cache.begin_step(defer=True)
        self._last_layer = layer_id
        gpu_part: list[tuple[torch.Tensor, torch.Tensor]] = []  # when a CPU part runs

        def fork(slot_ids: torch.Tensor) -> None:
            gpu_part.append(self.cpu_runner.start(layer_id, x, topk_ids, slot_ids, topk_weights))

        slot_ids = self._slot_ids(layer_id, topk_ids, fork)  # [N, k] int32
        weights = topk_weights
        if gpu_part:  # the CPU's pairs at slot 0 with weight 0
            slot_ids, weights = gpu_part[0]
        if self.round_like_cpu and x.shape[0] <= CPU_MAX_TOKENS:
            moe = functools.partial(fused_moe_ref, rnd=nvfp4_cpu.quantize_blocks_ref)
        else:
            moe = fused_moe if self.use_kernel else fused_moe_ref
        out = moe(x, slot_ids, weights, self.cache.slots, shared_slots=shared_slots,
                  shared_logit=shared_logit, out_dtype=torch.float32 if gpu_part else None)
        return self.cpu_runner.join(out, x.dtype) if gpu_part else out

    def _slot_ids(self, layer_id: int, topk_ids: torch.Tensor,
                  fork: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The slots of `topk_ids` [N, k]: streamed for a big batch, else from the cache; with
        a CPU part and `fork` for a decode-sized batch, the CPU's pairs get slot -1 and
        `fork(slot_ids)` starts their work."""
        streamer = self.streamer
        if streamer is not None:
            if streamer.wants(topk_ids):
                return streamer.slot_ids(layer_id, topk_ids)
            streamer.release()
        if self.cpu_runner is None or fork is None or not 0 < len(topk_ids) <= CPU_MAX_TOKENS:
            return self.cache.lookup(layer_id, topk_ids)
        return self.cache.lookup(layer_id, topk_ids, split=self._split, on_lookup=fork)

    @property
    def capturable(self) -> bool:
        """A decode step through this provider can be captured in a CUDA graph."""
        return self.cache.use_triton

    @property
    def stats(self):
        return self.cache.stats


def load_offloaded_experts(path: Any, config: Any, plan: Any, *, device: torch.device | str,
                           dtype: torch.dtype = torch.bfloat16,
                           on_pinned: Callable[[int], None] | None = None,
                           on_read: Callable[[int], None] | None = None) -> OffloadedExperts:
    """The experts provider a `MemoryPlan` asks for: the routed experts in a pinned host store
    behind `plan.expert_slots` GPU slots (preloaded when they hold all). `on_pinned` /
    `on_read`: load progress. Raises ValueError for fewer slots than one layer's experts."""
    store = HostExpertStore.from_checkpoint(path, config, dtype=dtype, on_pinned=on_pinned,
                                            on_read=on_read)
    experts = OffloadedExperts.create(store, plan.expert_slots, device=device, dtype=dtype,
                                      max_ids=plan.prefill_chunk * config.num_experts_per_tok)
    if plan.expert_slots >= store.num_layers * store.num_experts:
        experts.cache.preload_all()
    return experts
