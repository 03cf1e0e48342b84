"""The fast per-step host path of the expert cache against the heap-based policy it replaced:
same victims, residency and statistics on random and skewed traces, host-driven and through
the expert cache's `begin_step` (CPU, torch references)."""

from __future__ import annotations

import heapq
import math
import random

import pytest
import torch

from bench.cache_sim import synthetic_trace
from tinyserve.offload.cache import ExpertCachePolicy
from tinyserve.offload.gpu_cache import DeviceExpertCache
from tinyserve.offload.store import HostExpertStore


class HeapPolicy(ExpertCachePolicy):
    """The previous implementation: a lazy heap of (score, slot, version), victims popped and
    pushed back, observe through `_take` + `_use`."""

    def __init__(self, num_slots: int, **kwargs) -> None:
        super().__init__(num_slots, **kwargs)
        self._heap = [(-math.inf, s, 0) for s in range(num_slots)]
        self._version = [0] * num_slots

    def _push(self, slot: int) -> None:
        self._version[slot] += 1
        key = self.owner[slot]
        score = -math.inf if key is None else self.score(key)
        heapq.heappush(self._heap, (score, slot, self._version[slot]))

    def victims(self, n: int, exclude=()) -> list[int]:
        skip = set(exclude) | self._pinned
        out, popped = [], []
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            if entry[2] != self._version[entry[1]]:
                continue
            popped.append(entry)
            if entry[1] not in skip:
                out.append(entry[1])
        for entry in popped:
            heapq.heappush(self._heap, entry)
        assert len(out) == n
        return out

    def observe(self, layer, experts, slots, loaded) -> None:
        hits = misses = 0
        seen = set()
        for e, s, was_loaded in zip(experts, slots, loaded, strict=True):
            if e in seen:
                continue
            seen.add(e)
            if was_loaded:
                self._take(s, (layer, e))
                self._pinned.add(s)
                misses += 1
            else:
                self._pinned.add(s)
                hits += 1
            self._use((layer, e))
            self._push(self.where[(layer, e)])
        self.stats.count(layer, hits, misses, self.bytes_per_expert)


def _trace(kind: str, steps: int, layers: int, experts: int, k: int, seed: int):
    if kind == "zipf":
        return synthetic_trace(layers, experts, k, steps, zipf=1.0, drift_every=16, seed=seed)
    rng = random.Random(seed)
    return [[rng.sample(range(experts), k) for _ in range(layers)] for _ in range(steps)]


@pytest.mark.parametrize("kind", ["random", "zipf"])
@pytest.mark.parametrize("freq_weight", [0.0, 16.0], ids=lambda w: f"w{w:g}")
def test_host_driven_policy_matches_the_heap_policy(kind: str, freq_weight: float) -> None:
    layers, experts, k, slots = 5, 24, 4, 50
    kw = dict(bytes_per_expert=10, freq_weight=freq_weight, aging_steps=9)
    new, old = ExpertCachePolicy(slots, **kw), HeapPolicy(slots, **kw)
    for step in _trace(kind, 70, layers, experts, k, seed=1):
        for layer, ids in enumerate(step):
            assert new.access(layer, ids) == old.access(layer, ids)
            # Mid-step victims: pinned slots and an exclusion list are skipped.
            assert new.victims(5, exclude=[0, 3]) == old.victims(5, exclude=[0, 3])
        new.end_step()
        old.end_step()
        assert new.victims(slots) == old.victims(slots)
        assert new.where == old.where
    assert new.stats.as_dict() == old.stats.as_dict()


@pytest.mark.parametrize("kind", ["random", "zipf"])
@pytest.mark.parametrize("tokens", [1, 3], ids=lambda n: f"N{n}")
def test_begin_step_matches_the_heap_replay(kind: str, tokens: int) -> None:
    """Drive the expert cache through its lookups and `begin_step`; replay the same
    lookups into the heap policy the way the previous `begin_step` did (experts in order of
    first appearance, loaded = not where the mirror had it): same residency, statistics and
    victim lists after every step."""
    L, E, k, S = 6, 32, 4, 60
    store = HostExpertStore(L, E, 64, 32, fp4=True, pin=False)
    cache = DeviceExpertCache(store, S, device="cpu", max_ids=4 * k)
    ref = HeapPolicy(S, bytes_per_expert=store.bytes_per_expert)
    trace = _trace(kind, 40 * tokens, L, E, k, seed=2)
    for step in range(40):
        calls = []
        for layer in range(L):
            ids = torch.tensor([trace[step * tokens + t][layer] for t in range(tokens)])
            calls.append((layer, ids.view(-1).tolist(), cache.lookup(layer, ids).view(-1)
                          .tolist()))
        cache.begin_step()
        for layer, ids, slot_ids in calls:
            first = dict(zip(ids, slot_ids, strict=True))  # first appearance order
            es = list(first)
            ref.observe(layer, es, [first[e] for e in es],
                        [ref.where.get((layer, e), -1) != first[e] for e in es])
            ref.release()
        ref.end_step()
        assert cache.policy.where == ref.where
        assert cache.policy.stats.as_dict() == ref.stats.as_dict()
        n = cache._victim_n
        want = torch.tensor(ref.victims(n), dtype=torch.int32)[cache._victim_perm]
        assert torch.equal(cache.victims, want)
    assert cache.policy.where == cache.resident()
    # A second begin_step without lookups in between replays nothing twice.
    stats = cache.stats.as_dict()
    cache.begin_step()
    assert cache.stats.as_dict() == stats


def test_lookups_of_two_replays_in_one_log_keep_the_mirror_consistent() -> None:
    """Two passes of lookups without `begin_step` in between (as two graph replays would
    make): the second overwrites the first's log, so the mirror misses those loads. The
    device stays exact, and the mirror must stay a one-to-one map, never raise, and agree
    with the device again for every expert a step loads."""
    L, E, k, S = 3, 8, 2, 12
    store = HostExpertStore(L, E, 64, 32, fp4=True, pin=False)
    cache = DeviceExpertCache(store, S, device="cpu", max_ids=k)
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        loaded = []
        for _ in range(1 + step % 2):
            for layer in range(L):
                ids = torch.rand(1, E, generator=g).topk(k).indices
                before = cache.table.clone()
                slot_ids = cache.lookup(layer, ids)
                rows = layer * E + ids
                assert torch.equal(cache.owner[slot_ids.long()], rows.int())  # device exact
                loaded += [(layer, int(e)) for e in ids.view(-1)
                           if before[layer * E + e] < 0]
        cache.begin_step()
        p = cache.policy
        assert all(p.owner[s] == key for key, s in p.where.items())
        if step % 2 == 0:  # one pass: the log holds every load
            device = cache.resident()
            assert all(p.where[key] == device[key] for key in loaded)
