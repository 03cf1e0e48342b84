"""The runner interface the engine steps.

A step is `runner.launch(batch) -> PendingStep`, then `pending.result() -> ForwardOutput`
(its one wait for the sampled tokens). The defaults fit a synchronous runner (one that computes
the step at launch) that never chains steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tinyserve.core import Batch, ForwardOutput
from tinyserve.engine.graph import DecodeGraphs
from tinyserve.engine.sampler import Sampler


class PendingStep(Protocol):
    """A launched step; `device_tokens` ([S] int64 on the device) is set when every
    sequence sampled a token there."""

    device_tokens: torch.Tensor | None

    def result(self) -> ForwardOutput:
        """Wait for the sampled tokens; later calls return the same output."""
        ...


class Runner(ABC):
    """What the engine steps.

    Attributes:
        sampler: samples the next tokens; the engine sets its `logits_hook`.
        asynchronous: `launch` returns before the step's device work is done.
        overlap_hook: host work `launch` runs once the device work is queued (the engine's).
        graphs: the decode CUDA graphs (None: every step runs eagerly).
    """

    sampler: Sampler
    graphs: DecodeGraphs | None = None
    asynchronous: bool = False
    overlap_hook: Callable[[], None] | None = None

    @abstractmethod
    def launch(self, batch: Batch, *, after: PendingStep | None = None) -> PendingStep:
        """Start one step, sampling where `sample` is set. With `after` (a step with
        `device_tokens`; only for batches that pass `can_chain`) the input tokens are read
        from it."""

    def forward(self, batch: Batch) -> ForwardOutput:
        """One step, waited for."""
        return self.launch(batch).result()

    def can_chain(self, batch: Batch) -> bool:
        """Whether `batch` may take its input tokens on the device (`after=`)."""
        return False

    @abstractmethod
    def logits(self, token_ids: Sequence[int], *, page_ids: Sequence[int] | None = None,
               state_slot: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [T, V] float32 of one sequence from position 0."""

    def expert_stats(self) -> dict[str, Any]:
        """The expert cache's counters as `EngineStats` fields (empty: no expert cache)."""
        return {}
