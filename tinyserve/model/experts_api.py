"""The experts provider interface: what the MoE layers and the engine call on routed experts
(`model.moe.ResidentExperts`, `offload.provider.OffloadedExperts`). The defaults fit a provider
without per-step host state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class ExpertsProvider(ABC):
    """Routed experts of every MoE layer."""

    hybrid_plan: Any = None  # the CPU/GPU split of expert work chosen at start-up
    stats: Any = None  # the expert cache's counters (`offload.cache.CacheStats`)
    cpu_computed: int | None = None  # distinct experts computed on the CPU so far

    @abstractmethod
    def forward(self, layer_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, **shared: Any) -> torch.Tensor:
        """Σ_j topk_weights[:, j] * Expert_{topk_ids[:, j]}(x); x [N, H] -> [N, H] in x.dtype,
        topk_ids [N, k] int64. A provider with `accepts_shared` also takes `shared_slots=`
        and `shared_logit=` [N, 1] and adds sigmoid(logit) * the shared expert."""

    @property
    def capturable(self) -> bool:  # a decode step through `forward` fits in a CUDA graph
        return False

    @property
    def accepts_shared(self) -> bool:  # `forward` takes the shared expert along
        return False

    def begin_step(self, *, defer: bool = False) -> None:  # noqa: B027 - no-op default
        """A step starts (before each CUDA-graph replay, whose calls bypass `forward`);
        `defer`: leave its host work to `after_launch`."""

    def after_launch(self) -> None:  # noqa: B027 - no-op default
        """The step's device work is queued: do host work that may overlap it."""
