"""Trace-driven expert-cache simulation (bench.cache_sim): each policy against a brute-force
model, Belady as the bound, LRU's inclusion property, the uniform baseline."""

from __future__ import annotations

import numpy as np
import pytest

from bench.cache_sim import (
    LRU,
    POLICIES,
    batch_trace,
    hit_curve,
    make_policy,
    simulate,
    uniform_trace,
)
from tinyserve.offload.cache import ExpertCachePolicy


def _skewed(steps: int, layers: int, experts: int, k: int, seed: int) -> np.ndarray:
    """Routing with popularity and repetition: each step keeps about half the previous
    step's experts, the rest drawn by a Zipf-like weight."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1)
    out = np.zeros((steps, layers, k), dtype=np.int64)
    for la in range(layers):
        prev = rng.choice(experts, k, replace=False, p=w / w.sum())
        for t in range(steps):
            keep = prev[rng.random(k) < 0.5]
            p = w.copy()
            p[keep] = 0
            new = rng.choice(experts, k - len(keep), replace=False, p=p / p.sum())
            prev = out[t, la] = np.concatenate([keep, new])
    return out


def _brute_lru(trace: np.ndarray, slots: int, per_layer: bool, warmup: int) -> float:
    """LRU by timestamps (one tick per access); a layer's experts are all made resident
    before any eviction (as the engine pins them), then the oldest pairs go."""
    layers = trace.shape[1]
    cap = slots // layers if per_layer else slots
    last: list[dict] = [{} for _ in range(layers if per_layer else 1)]
    clock = hits = total = 0
    for t in range(trace.shape[0]):
        for la in range(layers):
            pool = last[la if per_layer else 0]
            for e in dict.fromkeys(trace[t, la].tolist()):
                clock += 1
                hit = (la, e) in pool
                pool[(la, e)] = clock
                if t >= warmup:
                    hits += hit
                    total += 1
            while len(pool) > cap:
                del pool[min(pool, key=pool.get)]
    return hits / total


@pytest.mark.parametrize("per_layer", [False, True], ids=["pool", "per-layer"])
@pytest.mark.parametrize("slots", [12, 24, 40])
def test_lru_matches_a_timestamp_reference(per_layer: bool, slots: int) -> None:
    trace = _skewed(60, 4, 16, 3, seed=slots)
    got = simulate(trace, LRU(slots, 4, per_layer=per_layer), warmup=10)
    assert got == pytest.approx(_brute_lru(trace, slots, per_layer, warmup=10))


def test_the_engine_lru_is_lru_up_to_ties_within_a_step() -> None:
    """The engine's policy with freq_weight 0 ranks by the step of the last use (ties to the
    lower slot), the reference by the exact access order: close, not equal."""
    trace = _skewed(200, 4, 32, 4, seed=7)
    a = simulate(trace, make_policy("lru", 48, 4), warmup=20)
    b = simulate(trace, LRU(48, 4), warmup=20)
    assert a == pytest.approx(b, abs=0.03)


def test_engine_policy_hits_are_the_policys_own_statistics() -> None:
    trace = _skewed(50, 3, 16, 4, seed=1)
    sim = make_policy("lru-f2", 20, 3)
    rate = simulate(trace, sim)
    ref = ExpertCachePolicy(20, freq_weight=2.0)
    for step in trace:
        for la, experts in enumerate(step):
            ref.access(la, experts.tolist())
            ref.release()
        ref.end_step()
    assert rate == pytest.approx(ref.stats.hit_rate)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_bounds_every_policy(seed: int) -> None:
    trace = _skewed(80, 4, 32, 4, seed=seed)
    for slots in (16, 40, 72):
        rates = {name: simulate(trace, make_policy(name, slots, 4, trace)) for name in POLICIES}
        assert all(rates["belady"] >= r - 1e-12 for r in rates.values()), rates
        assert 0.0 < min(rates.values()) and rates["belady"] < 1.0


def test_lru_hits_grow_with_the_cache() -> None:
    trace = _skewed(80, 4, 32, 4, seed=5)
    curve = hit_curve(trace, 32, (0.1, 0.2, 0.3, 0.5, 0.8), ("lru", "lru-layer"))
    for c in curve.values():
        rates = list(c.values())
        assert rates == sorted(rates) and rates[-1] > rates[0]


@pytest.mark.parametrize("name", ["slru", "lru2", "lru-layer", "belady"])
def test_capacity_is_respected_and_a_repeated_step_always_hits(name: str) -> None:
    step = np.array([[[1, 2, 3], [4, 5, 6]]])
    trace = np.repeat(step, 10, axis=0)  # [10, 2, 3]
    policy = make_policy(name, 6, 2, trace)
    assert simulate(trace, policy, warmup=1) == 1.0
    trace = _skewed(40, 2, 16, 3, seed=3)
    policy = make_policy(name, 8, 2, trace)
    simulate(trace, policy)
    held = getattr(policy, "resident", None)
    if held is None:
        pools = getattr(policy, "pools", None) or [policy.probation, policy.protected]
        held = [k for p in pools for k in p]
    assert len(held) <= 8


def test_uniform_routing_hits_the_cached_fraction() -> None:
    trace = uniform_trace(400, 4, 64, 4, seed=0)
    curve = hit_curve(trace, 64, (0.25, 0.5), ("lru",), warmup=50)["lru"]
    assert curve[0.25] == pytest.approx(0.25, abs=0.03)
    assert curve[0.5] == pytest.approx(0.5, abs=0.03)


def test_batch_trace_concatenates_the_sequences() -> None:
    a, b = uniform_trace(5, 2, 16, 2, seed=1), uniform_trace(7, 2, 16, 2, seed=2)
    t = batch_trace([a, b])
    assert t.shape == (5, 2, 4)
    assert np.array_equal(t[:, :, :2], a) and np.array_equal(t[:, :, 2:], b[:5])


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", 8, 2)
    with pytest.raises(ValueError, match="needs the trace"):
        make_policy("belady", 8, 2)
