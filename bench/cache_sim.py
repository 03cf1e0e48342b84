"""Trace-driven expert-cache simulation: the hit rate a routing trace gets under a policy.

A trace is an int array [steps, layers, ids]: the experts each layer routes to in one engine
step (one token at batch 1: top-k ids; a batch: every token's ids, duplicates allowed). A
policy sees the layers of a step in order and keeps at most `slots` (layer, expert) pairs
resident, like the GPU expert cache; the hit rate counts the distinct experts of each
(step, layer) that were resident, over the steps from `warmup` on ("warm" hits).

Policies (`POLICIES`, each built by `make_policy(name, slots, layers)`):
- the engine's own `offload.cache.ExpertCachePolicy`, host-driven, with its frequency weight
  w: "lru" (w = 0), "lru-f2" (w = 2), "lru-f16" (w = 16), "lfu" (w = 1e9: least used
  first, uses halved every 256 steps);
- candidates: "lru-layer" (per-layer quotas: slots // layers per layer, LRU inside),
  "slru" (segmented LRU: a hit moves a pair from the probation segment to a protected one
  of 20 % of the slots), "lru2" (LRU-2: evicts the pair whose second-last use is oldest);
- "belady": the clairvoyant optimum (evicts the pair used again furthest in the future),
  an upper bound no policy reaches.
`simulate(trace, policy)` runs one; the device-driven engine path (victim lists two steps
behind the lookups) is measured by `bench/cache_policies.py` through `DeviceExpertCache`.
`trace_from_checkpoint` reads the trace of a realistic-routing checkpoint;
`synthetic_trace` draws a Zipf one; `policy_hit_rate` replays one through the engine policy.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bench.routing import ROUTING_FILE, expected_topk
from tinyserve.model.config import load_config
from tinyserve.model.loader import CheckpointReader
from tinyserve.offload.cache import ExpertCachePolicy

ENGINE_WEIGHTS = {"lru": 0.0, "lru-f2": 2.0, "lru-f16": 16.0, "lfu": 1e9}
CANDIDATES = ("lru-layer", "slru", "lru2")
POLICIES = (*ENGINE_WEIGHTS, *CANDIDATES, "belady")


class SimPolicy(Protocol):
    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        """Make `experts` of `layer` resident; returns how many were already."""

    def end_step(self) -> None: ...


class EnginePolicy:
    """`offload.cache.ExpertCachePolicy`, host-driven (`access` + `end_step`)."""

    def __init__(self, slots: int, freq_weight: float) -> None:
        self.policy = ExpertCachePolicy(slots, freq_weight=freq_weight)

    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        before = self.policy.stats.hits
        self.policy.access(layer, experts)
        self.policy.release()
        return self.policy.stats.hits - before

    def end_step(self) -> None:
        self.policy.end_step()


class LRU:
    """Least recently used over one pool, or per layer (`per_layer`: slots // layers each)."""

    def __init__(self, slots: int, layers: int, per_layer: bool = False) -> None:
        n = layers if per_layer else 1
        self.cap = slots // n
        self.pools = [OrderedDict() for _ in range(n)]
        self.per_layer = per_layer

    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        pool = self.pools[layer if self.per_layer else 0]
        hits = 0
        for key in _distinct(layer, experts):
            if key in pool:
                pool.move_to_end(key)
                hits += 1
            else:
                pool[key] = None
        while len(pool) > self.cap:
            pool.popitem(last=False)
        return hits

    def end_step(self) -> None:
        pass


class SegmentedLRU:
    """SLRU: new pairs enter a probation segment; a hit there promotes to the protected
    segment (whose oldest pair drops back to probation when it is full); evictions take the
    oldest probation pair first."""

    def __init__(self, slots: int, probation: float = 0.8) -> None:
        self.cap = slots
        self.protected_cap = max(1, round(slots * (1.0 - probation)))
        self.probation: OrderedDict = OrderedDict()
        self.protected: OrderedDict = OrderedDict()

    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        hits = 0
        for key in _distinct(layer, experts):
            if key in self.protected:
                self.protected.move_to_end(key)
                hits += 1
            elif key in self.probation:
                del self.probation[key]
                self.protected[key] = None
                hits += 1
                if len(self.protected) > self.protected_cap:
                    old, _ = self.protected.popitem(last=False)
                    self.probation[old] = None
            else:
                self.probation[key] = None
        while len(self.probation) + len(self.protected) > self.cap:
            (self.probation if self.probation else self.protected).popitem(last=False)
        return hits

    def end_step(self) -> None:
        pass


class LRU2:
    """LRU-2: the victim is the resident pair whose second-last use is oldest (a pair used
    once ranks by -1, its last use breaking ties); the last two uses of evicted pairs are
    remembered."""

    def __init__(self, slots: int) -> None:
        self.cap = slots
        self.resident: set = set()
        self.uses: dict = {}  # key -> (second-last step, last step)
        self.heap: list = []  # ((second-last, last), key), lazily deleted

    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        keys = list(_distinct(layer, experts))
        hits = 0
        for key in keys:
            hits += key in self.resident
            last = self.uses.get(key, (-1, -1))[1]
            self.uses[key] = (last, step)
            self.resident.add(key)
            heapq.heappush(self.heap, ((last, step), key))
        now = set(keys)
        keep = []
        while len(self.resident) > self.cap:
            rank, key = heapq.heappop(self.heap)
            if key not in self.resident or self.uses[key] != rank:
                continue  # stale entry
            if key in now:
                keep.append((rank, key))
                continue
            self.resident.discard(key)
        for item in keep:
            heapq.heappush(self.heap, item)
        return hits

    def end_step(self) -> None:
        pass


class Belady:
    """The clairvoyant optimum over a known trace: evict the pair used again furthest ahead."""

    def __init__(self, slots: int, trace: np.ndarray) -> None:
        self.cap = slots
        self.next_use = _next_uses(trace)  # (step, layer, expert) -> next step or inf
        self.resident: dict = {}  # key -> next use
        self.heap: list = []  # (-next use, key), lazily deleted

    def access(self, step: int, layer: int, experts: Sequence[int]) -> int:
        keys = list(_distinct(layer, experts))
        hits = 0
        for key in keys:
            hits += key in self.resident
            nxt = self.next_use[(step, layer, key[1])]
            self.resident[key] = nxt
            heapq.heappush(self.heap, (-nxt, key))
        now = set(keys)
        keep = []
        while len(self.resident) > self.cap:
            neg, key = heapq.heappop(self.heap)
            if self.resident.get(key) != -neg:
                continue  # stale entry
            if key in now:
                keep.append((neg, key))
                continue
            del self.resident[key]
        for item in keep:
            heapq.heappush(self.heap, item)
        return hits

    def end_step(self) -> None:
        pass


def make_policy(name: str, slots: int, layers: int,
                trace: np.ndarray | None = None) -> SimPolicy:
    """The policy `name` (one of POLICIES) over `slots` slots; "belady" needs the trace."""
    if name in ENGINE_WEIGHTS:
        return EnginePolicy(slots, ENGINE_WEIGHTS[name])
    if name == "lru-layer":
        return LRU(slots, layers, per_layer=True)
    if name == "slru":
        return SegmentedLRU(slots)
    if name == "lru2":
        return LRU2(slots)
    if name == "belady":
        if trace is None:
            raise ValueError("belady needs the trace")
        return Belady(slots, trace)
    raise ValueError(f"unknown policy {name!r} (expected one of {POLICIES})")


def simulate(trace: np.ndarray, policy: SimPolicy, warmup: int = 0) -> float:
    """Hit rate of `trace` [steps, layers, ids] under `policy`, from step `warmup` on."""
    hits = total = 0
    for step in range(trace.shape[0]):
        for layer in range(trace.shape[1]):
            h = policy.access(step, layer, trace[step, layer].tolist())
            if step >= warmup:
                hits += h
                total += len(set(trace[step, layer].tolist()))
        policy.end_step()
    return hits / total if total else math.nan


def hit_curve(trace: np.ndarray, num_experts: int, fractions: Sequence[float],
              policies: Sequence[str], warmup: int = 0) -> dict[str, dict[float, float]]:
    """{policy: {fraction: hit rate}} with slots = round(fraction x layers x experts)."""
    layers = trace.shape[1]
    out: dict[str, dict[float, float]] = {}
    for name in policies:
        out[name] = {}
        for f in fractions:
            slots = max(round(f * layers * num_experts), trace.shape[2])
            policy = make_policy(name, slots, layers, trace)
            out[name][f] = simulate(trace, policy, warmup)
    return out


def uniform_trace(steps: int, layers: int, num_experts: int, top_k: int,
                  seed: int = 0) -> np.ndarray:
    """Uniform random routing [steps, layers, top_k] (what a random checkpoint's router does)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((steps, layers, num_experts))
    return np.argpartition(keys, top_k - 1, axis=2)[:, :, :top_k]


def batch_trace(traces: Sequence[np.ndarray]) -> np.ndarray:
    """One trace [steps, layers, B x k] of B sequences decoding together."""
    steps = min(t.shape[0] for t in traces)
    return np.concatenate([t[:steps] for t in traces], axis=2)


def _distinct(layer: int, experts: Sequence[int]):
    return dict.fromkeys((layer, int(e)) for e in experts)


def _next_uses(trace: np.ndarray) -> dict:
    out: dict = {}
    last: dict = {}
    for step in range(trace.shape[0] - 1, -1, -1):
        for layer in range(trace.shape[1]):
            for e in set(trace[step, layer].tolist()):
                out[(step, layer, e)] = last.get((layer, e), math.inf)
                last[(layer, e)] = step
    return out


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, *,
                    zipf: float = 1.0, drift_every: int = 128, drift_frac: float = 0.25,
                    seed: int = 0) -> list[list[list[int]]]:
    """A skewed routing trace `[step][layer] -> top_k distinct experts` (one token per step).

    Each layer has its own Zipf(`zipf`) popularity over a random order of its experts; every
    `drift_every` steps a random `drift_frac` of the ranks are reshuffled (a topic change).
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    weights = ranks ** -zipf
    order = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])  # [L, E]
    trace: list[list[list[int]]] = []
    for step in range(steps):
        if drift_every and step and step % drift_every == 0:
            n = max(2, int(drift_frac * num_experts))
            for layer in range(num_layers):
                pos = rng.choice(num_experts, size=n, replace=False)
                order[layer, pos] = order[layer, rng.permutation(pos)]
        # Efraimidis-Spirakis: top-k of u ** (1 / w) samples k distinct experts by weight.
        keys = rng.random((num_layers, num_experts)) ** (1.0 / weights)
        top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        trace.append([order[layer, top[layer]].tolist() for layer in range(num_layers)])
    return trace


def policy_hit_rate(policy: ExpertCachePolicy, trace: list[list[list[int]]]) -> float:
    """Run `trace` through `policy` (host-driven) and return its hit rate."""
    for step in trace:
        for layer, experts in enumerate(step):
            policy.access(layer, experts)
        policy.end_step()
    return policy.stats.hit_rate


def trace_from_checkpoint(path: str | Path, tokens: list[int] | np.ndarray) -> np.ndarray:
    """The routing [T, L, k] a realistic checkpoint at `path` gives `tokens` (read from its
    embedding and routers; the checkpoint must have been written with realistic routing)."""
    path = Path(path)
    manifest = json.loads((path / ROUTING_FILE).read_text())
    lo, hi = manifest["reserved_channels"]
    config = load_config(path)
    reader = CheckpointReader(path)
    names = set(reader.names())
    prefix = next(p for p in ("model.language_model.", "model.")
                  if p + "embed_tokens.weight" in names)
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
    block = reader.get(prefix + "embed_tokens.weight")[ids, lo:hi].float()
    routers = [reader.get(f"{prefix}layers.{la}.mlp.gate.weight").float()
               for la in range(config.num_layers)]
    return expected_topk(block, routers, slice(lo, hi), config.num_experts_per_tok)
