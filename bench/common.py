"""Helpers shared by the benchmark scripts (run as `python bench/<name>.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of fn(), synchronising the GPU around each call.

    For slow calls (Python loops per token) where CUDA events or graphs buy nothing."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
