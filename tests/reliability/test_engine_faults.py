"""The engine alone (no HTTP), on CPU and on CUDA: many requests, aborts at random points (before
the first token and during decode), one request that raises inside a step. Every other request
ends normally with all its tokens, the broken one fails alone, and the pools end idle."""

from __future__ import annotations

import random
import threading

import pytest

from tests.reliability import report
from tests.reliability.conftest import build
from tests.reliability.pools import leaks
from tinyserve.core import SamplingParams

POISON = [5, 5, 5, 5, 5, 9, 9, 9, 9, 9]


def poison_hook(logits, seqs):
    for s in seqs:
        if list(s.history[:len(POISON)]) == POISON and s.num_generated >= 2:
            raise RuntimeError("fault injected by the reliability test")
    return logits


def run(engine, *, seed: int, n: int) -> dict[str, int]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        prompt = [rng.randrange(10, 400) for _ in range(rng.choice((4, 30, 120, 300)))]
        cut = rng.choice((None, None, None, 0, rng.randint(1, 20)))
        jobs.append((prompt, rng.choice((1, 5, 24, 40)), cut))
    jobs.insert(n // 2, (POISON, 30, None))
    outcomes: list[tuple[str | None, int] | None] = [None] * len(jobs)
    engine.set_logits_hook(poison_hook)

    def consume(i: int, handle, cut: int | None) -> None:
        if cut == 0:
            handle.abort()
        seen, last = 0, None
        for out in handle:
            seen += len(out.token_ids)
            last = out
            if cut and seen >= cut and not out.finished:
                handle.abort()
                cut = None
        outcomes[i] = (last.finish_reason, last.completion_tokens)

    try:
        threads = []
        for i, (prompt, max_tokens, cut) in enumerate(jobs):
            h = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     ignore_eos=True))
            threads.append(threading.Thread(target=consume, args=(i, h, cut), daemon=True))
            threads[-1].start()
        for t in threads:
            t.join(300)
    finally:
        engine.set_logits_hook(None)
    counts = {"aborted": 0, "served": 0}
    for (prompt, max_tokens, cut), got in zip(jobs, outcomes, strict=True):
        assert got is not None, "a request never finished"
        if prompt is POISON:
            assert got[0] == "error", got
        elif cut is None:
            assert got == ("length", max_tokens), got
            counts["served"] += 1
        else:
            assert got[0] in ("abort", "length"), got
            counts["aborted"] += got[0] == "abort"
    left = leaks(engine)
    report.add("leaked_kv_pages", left["kv_pages"])
    report.add("leaked_state_slots", left["state_slots"])
    report.add("leaked_prefix_cache_refs", left["cache_refs"])
    assert left == {"requests": 0, "kv_pages": 0, "state_slots": 0, "cache_refs": 0}, left
    return counts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_engine_aborts_and_a_fault_leave_the_pools_idle(rel_ckpt, device: str):
    engine = build(rel_ckpt, device=device)
    try:
        counts = run(engine, seed=7, n=48 if device == "cpu" else 160)
    finally:
        engine.shutdown()
    assert counts["aborted"] > 0
    report.add("requests_served", counts["served"])
    report.add("engine_aborts_injected", counts["aborted"])
    report.add("faults_injected")
