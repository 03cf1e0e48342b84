"""The deferred expert-cache policy (`begin_step(defer=True)` + `after_launch()`, the order of
an overlapped decode step) on the expert cache through the torch references (CPU): the
policy folds exactly one step less than the lookups so far, nothing is lost or counted
twice, the mirror catches up with the device at a synchronous boundary, the guess of the
in-flight step's slots, and the hit-rate cost of the extra step of lag."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.cache_sim import synthetic_trace
from tinyserve.offload import gpu_cache
from tinyserve.offload.cache import ExpertCachePolicy
from tinyserve.offload.gpu_cache import DeviceExpertCache
from tinyserve.offload.store import HostExpertStore

L, E, K, S = 6, 32, 4, 60


def _cache(slots: int = S, max_ids: int = 4 * K) -> DeviceExpertCache:
    store = HostExpertStore(L, E, 64, 32, fp4=True, pin=False)
    return DeviceExpertCache(store, slots, device="cpu", max_ids=max_ids)


def _step(cache: DeviceExpertCache, step: list[list[list[int]]], *, deferred: bool) -> None:
    """One decode step of `len(step)` tokens: boundary, lookups (the device work), policy."""
    if deferred:
        cache.begin_step(defer=True)
    for layer in range(L):
        cache.lookup(layer, torch.tensor([token[layer] for token in step]))
    if deferred:
        cache.after_launch()
    else:
        cache.begin_step()


def _distinct(step: list[list[list[int]]]) -> int:
    return sum(len({e for token in step for e in token[layer]}) for layer in range(L))


@pytest.mark.parametrize("tokens", [1, 3], ids=lambda n: f"N{n}")
def test_deferred_policy_lags_one_more_step_and_loses_nothing(tokens: int) -> None:
    trace = synthetic_trace(L, E, K, 30 * tokens, zipf=1.0, drift_every=8, seed=1)
    steps = [trace[i:i + tokens] for i in range(0, len(trace), tokens)]
    cache = _cache()
    for n, step in enumerate(steps):
        _step(cache, step, deferred=True)
        s = cache.stats
        # folded: every step before this one (its own log waits for the next boundary)
        assert s.hits + s.misses == sum(_distinct(p) for p in steps[:n])
        assert cache.policy.step == n + 1  # one end_step per boundary, none twice
        p = cache.policy
        assert all(p.owner[slot] == key for key, slot in p.where.items())
    cache.begin_step()  # a synchronous boundary folds the last step too
    assert cache.stats.hits + cache.stats.misses == sum(_distinct(p) for p in steps)
    assert cache.policy.where == cache.resident()
    # A boundary without lookups in between replays nothing twice, deferred or not.
    before = cache.stats.as_dict()
    cache.begin_step(defer=True)
    cache.after_launch()
    cache.begin_step()
    assert cache.stats.as_dict() == before


def test_deferred_log_survives_a_boundary_without_after_launch() -> None:
    """A deferred boundary whose `after_launch` never comes (an eager call outside the runner)
    is folded at the next boundary, before that one copies its own log."""
    trace = synthetic_trace(L, E, K, 12, seed=2)
    cache = _cache()
    for step in trace:
        cache.begin_step(defer=True)
        for layer in range(L):
            cache.lookup(layer, torch.tensor([step[layer]]))
    cache.begin_step()
    assert cache.stats.hits + cache.stats.misses == sum(_distinct([s]) for s in trace)
    assert cache.policy.where == cache.resident()


def test_filling_slots_rank_as_freshly_used() -> None:
    p = ExpertCachePolicy(6, freq_weight=4.0)
    for layer, e in enumerate(range(4)):  # slots 0..3 hold experts of steps 0..3
        p.access(layer, [e])
        p.end_step()
    assert p.victims(6) == [4, 5, 0, 1, 2, 3]  # free slots first, then by score
    # slot 4 (free) and slot 0 (step 0) are being filled now: they rank as used at step 4
    # (ties to the lower slot)
    assert p.victim_array(6, filling=np.array([4, 0])).tolist() == [5, 1, 2, 3, 0, 4]
    # a slot that already ranks higher keeps its score
    p.access(0, [0])
    p.access(1, [1])
    p.end_step()
    assert p.victim_array(6, filling=np.array([1])).tolist()[-1] == 1


def test_guess_of_the_in_flight_slots(monkeypatch) -> None:
    """A deferred fold ranks the slots the step in flight may be filling (the heads of the
    lists it reads) as freshly used: with a margin of K the guess covers every slot a
    K-expert lookup can take, and the lists come from the policy order with that guess."""
    monkeypatch.setattr(gpu_cache, "IN_FLIGHT_MARGIN", K)
    cache = _cache()
    guesses = []
    victim_array = cache.policy.victim_array

    def spy(n, exclude=(), *, filling=None):
        guesses.append(filling)
        return victim_array(n, exclude, filling=filling)

    cache.policy.victim_array = spy
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        cache.begin_step(defer=True)
        for layer in range(L):
            cache.lookup(layer, torch.randperm(E, generator=g)[:K].view(1, -1))
        loaded = set(cache._log_slots[cache._log_slots >= 0].tolist())
        guesses.clear()
        cache.after_launch()
        if step >= 1:  # a log was folded (the first boundary had none)
            (guess,) = guesses
            assert loaded and loaded <= set(guess.tolist())
            want = victim_array(cache._victim_n, filling=guess)[cache._victim_perm]
            assert torch.equal(cache.victims, torch.from_numpy(want).to(torch.int32))
    cache.begin_step()  # synchronous: nothing in flight, no guess
    assert guesses[-1] is None


@pytest.mark.parametrize("zipf", [0.0, 1.0], ids=["uniform", "zipf"])
def test_hit_rate_cost_of_the_extra_lag_is_small(zipf: float) -> None:
    trace = synthetic_trace(L, E, K, 300, zipf=zipf, drift_every=64, seed=4)
    rates = []
    for deferred in (False, True):
        cache = _cache()
        for step in trace:
            _step(cache, [step], deferred=deferred)
        cache.begin_step()
        rates.append(cache.stats.hit_rate)
    serial, deferred = rates
    assert 0.0 < serial < 1.0
    assert deferred > serial - 0.03, rates


def test_eviction_after_a_deferred_boundary_waits_for_the_fold() -> None:
    """`evict_slots` (prefill streaming) between a deferred boundary and its fold: the fold
    replays the earlier lookups first (their hits and loads counted), then forgets the slots,
    so the mirror agrees with the device and the evicted slots come first as victims."""
    trace = synthetic_trace(L, E, K, 6, seed=5)
    cache = _cache()
    for step in trace[:5]:
        _step(cache, [step], deferred=True)
    cache.begin_step(defer=True)  # the last step's log is pending
    cache.evict_slots(0, 2 * E // 4)
    cache.after_launch()
    assert cache.stats.hits + cache.stats.misses == sum(_distinct([s]) for s in trace[:5])
    assert cache.policy.where == cache.resident()
    assert all(cache.policy.owner[s] is None for s in range(2 * E // 4))
    assert set(cache.victims[:, 0].tolist()) <= set(range(2 * E // 4))
