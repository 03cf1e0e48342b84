"""The expert-cache policy against a plain dictionary reference, on random and skewed traces."""

from __future__ import annotations

import math
import random

import pytest

from bench.cache_sim import policy_hit_rate, synthetic_trace
from tinyserve.offload.cache import CacheFullError, ExpertCachePolicy


class RefCache:
    """The same policy written the obvious way: a dict and a linear scan for the victim."""

    def __init__(self, num_slots: int, freq_weight: float, aging_steps: int) -> None:
        self.slots: list[tuple[int, int] | None] = [None] * num_slots
        self.last: dict = {}
        self.uses: dict = {}
        self.w = freq_weight
        self.aging = aging_steps
        self.step = 0
        self.pinned: set[int] = set()
        self.touched: set = set()

    def score(self, key) -> float:
        return self.last.get(key, -1) + self.w * math.log2(1 + self.uses.get(key, 0.0))

    def access(self, layer: int, experts: list[int]) -> list[int]:
        unique = list(dict.fromkeys(experts))
        for e in unique:
            if (layer, e) in self.slots:
                self.pinned.add(self.slots.index((layer, e)))
        for e in unique:
            if (layer, e) in self.slots:
                continue
            free = [s for s, k in enumerate(self.slots) if k is None and s not in self.pinned]
            if free:
                victim = free[0]
            else:
                cands = [(self.score(k), s) for s, k in enumerate(self.slots)
                         if s not in self.pinned]
                victim = min(cands)[1]
            self.slots[victim] = (layer, e)
            self.pinned.add(victim)
        for e in unique:
            key = (layer, e)
            if key not in self.touched:
                self.touched.add(key)
                self.uses[key] = self.uses.get(key, 0.0) + 1
            self.last[key] = self.step
        return [self.slots.index((layer, e)) for e in experts]

    def end_step(self) -> None:
        self.pinned.clear()
        self.touched.clear()
        self.step += 1
        if self.aging and self.step % self.aging == 0:
            self.uses = {k: v / 2 for k, v in self.uses.items() if v >= 0.5}


def _random_trace(seed: int, steps: int, layers: int, experts: int, k: int):
    rng = random.Random(seed)
    return [[[rng.randrange(experts) for _ in range(rng.randint(1, k))] for _ in range(layers)]
            for _ in range(steps)]


@pytest.mark.parametrize("freq_weight", [0.0, 2.0, 16.0], ids=lambda w: f"w{w:g}")
@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"seed{s}")
def test_policy_matches_reference(seed: int, freq_weight: float) -> None:
    num_slots, layers, experts, k = 13, 3, 10, 4
    trace = _random_trace(seed, 60, layers, experts, k)
    pol = ExpertCachePolicy(num_slots, bytes_per_expert=100, freq_weight=freq_weight,
                            aging_steps=7)
    ref = RefCache(num_slots, freq_weight, aging_steps=7)
    hits = misses = 0
    for step in trace:
        for layer, ids in enumerate(step):
            before = dict(pol.where)
            slots, loads = pol.access(layer, ids)
            assert slots == ref.access(layer, ids)
            # Every requested expert is where the policy says, and loads are exactly the misses.
            assert all(pol.owner[s] == (layer, e) for s, e in zip(slots, ids, strict=True))
            assert {e for e, _ in loads} == {e for e in ids if (layer, e) not in before}
            misses += len(loads)
            hits += len(set(ids)) - len(loads)
        # No slot is assigned twice.
        keys = [k for k in pol.owner if k is not None]
        assert len(keys) == len(set(keys)) == len(pol.where)
        pol.end_step()
        ref.end_step()
    assert (pol.stats.hits, pol.stats.misses) == (hits, misses)
    assert pol.stats.h2d_bytes == 100 * misses


def test_slots_needed_by_the_step_are_never_evicted() -> None:
    pol = ExpertCachePolicy(4, freq_weight=0.0)
    s0, _ = pol.access(0, [0, 1])
    s1, _ = pol.access(1, [0, 1])  # fills the pool; layer 0's experts are pinned
    assert len(set(s0 + s1)) == 4
    with pytest.raises(CacheFullError, match="4 pinned"):
        pol.access(2, [0])
    pol.end_step()
    slots, loads = pol.access(2, [0])
    assert loads == [(0, slots[0])]


def test_replay_step_replays_the_host_decisions() -> None:
    trace = _random_trace(5, 30, 4, 12, 3)
    a = ExpertCachePolicy(16, freq_weight=16.0, aging_steps=5)
    b = ExpertCachePolicy(16, freq_weight=16.0, aging_steps=5)
    for step in trace:
        used: set[int] = set()  # slots of the step's earlier layers (pinned in `a`)
        for layer, ids in enumerate(step):
            # As many candidates as distinct experts: the device kernel skips the slots this
            # layer hits and hands the rest to the misses in order.
            unique = list(dict.fromkeys(ids))
            hit_slots = {b.where.get((layer, e), -1) for e in unique} - {-1}
            victims = [v for v in b.victims(len(unique), exclude=used) if v not in hit_slots]
            slots, loads = a.access(layer, ids)
            assert [s for _, s in loads] == victims[:len(loads)]
            hits = [((layer, e), b.where[(layer, e)]) for e in unique
                    if b.where.get((layer, e)) in hit_slots]
            b.replay_step([layer], hits, [((layer, e), s) for e, s in loads])
            used.update(slots)
        a.end_step()
        b.end_step()
        assert a.where == b.where
    assert a.stats.as_dict() == b.stats.as_dict()


def test_per_layer_hit_rate() -> None:
    pol = ExpertCachePolicy(8)
    pol.access(0, [1, 2])
    pol.end_step()
    pol.access(0, [1, 3])
    pol.access(1, [4])
    assert pol.stats.layer_hit_rate(0) == pytest.approx(0.25)
    assert pol.stats.layer_hit_rate(1) == 0.0
    assert pol.stats.as_dict()["layer_hit_rate"] == {0: 0.25, 1: 0.0}


def test_frequency_term_beats_plain_lru_on_a_skewed_trace() -> None:
    trace = synthetic_trace(8, 64, 4, 300, zipf=1.0, seed=3)
    lru = policy_hit_rate(ExpertCachePolicy(128, freq_weight=0.0), trace)
    lfru = policy_hit_rate(ExpertCachePolicy(128, freq_weight=16.0), trace)
    assert lfru > lru + 0.02, (lru, lfru)


def test_default_weight_on_realistic_routing() -> None:
    """The reason for the default (bench/cache_policies.py at full size, 40 layers): with
    realistic routing it keeps plain LRU's hits for one sequence, where a heavy frequency
    term loses, and gains over plain LRU for a batch of four."""
    from bench.cache_sim import EnginePolicy, batch_trace
    from bench.cache_sim import simulate as replay
    from bench.routing import RealisticRouting

    d = RealisticRouting(hidden=2048, num_experts=256, top_k=8, vocab_size=500,
                         text_tokens=range(491))
    routers = [d.router(la) for la in range(6)]
    one = d.expected_topk(d.text(int(d.cycle[0]), 260), routers)
    four = batch_trace([d.expected_topk(d.text(int(d.cycle[i * 120]), 260), routers)
                        for i in range(4)])
    default = ExpertCachePolicy(8).freq_weight
    weights = (0.0, default, 16.0)
    b1 = {w: replay(one, EnginePolicy(round(0.12 * 6 * 256), w), 60) for w in weights}
    assert b1[default] > b1[0.0] - 0.01 and b1[default] > b1[16.0] + 0.05, b1
    b4 = {w: replay(four, EnginePolicy(round(0.2 * 6 * 256), w), 60) for w in weights}
    assert b4[default] > b4[0.0] + 0.01 and b4[default] > b4[16.0], b4
