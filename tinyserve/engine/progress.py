"""LoadProgress: the work of bringing an engine up, counted as it is done.

Stages: WEIGHTS, PINNING, EXPERTS (bytes) and WARM_UP (one unit), each weighed by
`STAGE_COST` so the bar moves with time spent; `timings()` gives each stage's seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

WEIGHTS = "loading weights"
PINNING = "pinning the expert store"
EXPERTS = "loading experts"
WARM_UP = "warming up"
# Relative cost of one unit of each stage (a checkpoint byte read = 1). Pinning a byte is
# cheaper than reading and converting one; the warm-up's one unit stands for WARM_UP_SHARE of
# everything else.
STAGE_COST = {WEIGHTS: 1.0, PINNING: 0.25, EXPERTS: 1.0}
WARM_UP_SHARE = 0.05


class LoadProgress:
    """Thread-safe counters of the stages above. `on_change(fraction, stage)` is called on
    every change (from the thread doing the work; keep it cheap)."""

    def __init__(self, on_change: Callable[[float, str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._total: dict[str, float] = {}
        self._done: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self.stage = "starting"
        self._on_change = on_change

    def expect(self, stage: str, units: float) -> None:
        """Announce `units` of work in `stage` (before it starts)."""
        with self._lock:
            self._total[stage] = float(units)
            self._done.setdefault(stage, 0.0)

    def advance(self, stage: str, units: float) -> None:
        """`units` more of `stage` are done."""
        now = time.perf_counter()
        with self._lock:
            self._started.setdefault(stage, now)
            self._ended[stage] = now
            self._done[stage] = self._done.get(stage, 0.0) + float(units)
            self.stage = stage
            frac = self._fraction()
        if self._on_change is not None:
            self._on_change(frac, stage)

    def begin(self, stage: str) -> None:
        self.advance(stage, 0.0)

    def complete(self, stage: str) -> None:
        """Mark all of `stage` done (what was announced and not reported; nothing when it
        was not announced)."""
        with self._lock:
            if stage not in self._total:
                return
            left = self._total[stage] - self._done.get(stage, 0.0)
        self.advance(stage, max(left, 0.0))

    def _weights(self) -> dict[str, float]:
        w = {s: t * STAGE_COST.get(s, 1.0) for s, t in self._total.items() if s != WARM_UP}
        if WARM_UP in self._total:
            w[WARM_UP] = WARM_UP_SHARE / (1 - WARM_UP_SHARE) * max(sum(w.values()), 1.0)
        return w

    def _fraction(self) -> float:
        weights = self._weights()
        total = sum(weights.values())
        if total <= 0:
            return 0.0
        done = sum(weights[s] * min(1.0, self._done.get(s, 0.0) / t)
                   for s, t in self._total.items() if t > 0)
        return min(1.0, done / total)

    @property
    def fraction(self) -> float:
        with self._lock:
            return self._fraction()

    def timings(self) -> dict[str, float]:
        """Seconds from the first to the last report of each stage."""
        with self._lock:
            return {s: round(self._ended[s] - t0, 3) for s, t0 in self._started.items()}
