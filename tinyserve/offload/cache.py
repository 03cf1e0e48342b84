"""Expert-cache policy: which (layer, expert) lives in which GPU slot, and which slot goes next.

One slot pool is shared by every layer. A slot's priority is

    score = last_step + freq_weight * log2(1 + uses)

(`uses`: steps in which the expert was routed to, halved every `aging_steps` steps). Lowest
score is evicted first, free slots before occupied ones, ties to the lower slot id; a slot the
current step asked for is pinned until `end_step()`. The default `freq_weight` 2 keeps a
batch's shared experts resident without costing one sequence the hits of plain LRU
(docs/ROUTING.md). The cache drives it from the device: `victim_array(n)` feeds the lookup
kernel and `replay_step` mirrors what it did; `access(layer, experts)` -> slots and loads is the
same policy driven from the host (simulations and tests). Plain Python and numpy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

Key = tuple[int, int]  # (layer, expert)

DEFAULT_FREQ_WEIGHT = 2.0
DEFAULT_AGING_STEPS = 256


@dataclass
class CacheStats:
    """Counters of an expert cache. `h2d_bytes` counts bytes copied host -> device."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    layer_hits: dict[int, int] = field(default_factory=dict)
    layer_misses: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def layer_hit_rate(self, layer: int) -> float:
        h, m = self.layer_hits.get(layer, 0), self.layer_misses.get(layer, 0)
        return h / (h + m) if h + m else 0.0

    def count(self, layer: int, hits: int, misses: int, bytes_per_miss: int) -> None:
        self.hits += hits
        self.misses += misses
        self.h2d_bytes += misses * bytes_per_miss
        self.layer_hits[layer] = self.layer_hits.get(layer, 0) + hits
        self.layer_misses[layer] = self.layer_misses.get(layer, 0) + misses

    def as_dict(self) -> dict:
        layers = sorted(set(self.layer_hits) | set(self.layer_misses))
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
                "h2d_bytes": self.h2d_bytes,
                "layer_hit_rate": {layer: self.layer_hit_rate(layer) for layer in layers}}


class CacheFullError(RuntimeError):
    """Every slot is pinned by the current step: the pool is too small for one step's experts."""


class ExpertCachePolicy:
    """LRU-with-frequency slot assignment over one pool of `num_slots` slots.

    Args:
        num_slots: slots in the pool (shared by all layers).
        bytes_per_expert: bytes one miss copies (for `stats.h2d_bytes`).
        freq_weight: weight of the frequency term; 0 gives plain LRU.
        aging_steps: halve every use count after this many steps (0: never).
    """

    def __init__(self, num_slots: int, *, bytes_per_expert: int = 0,
                 freq_weight: float = DEFAULT_FREQ_WEIGHT,
                 aging_steps: int = DEFAULT_AGING_STEPS) -> None:
        if num_slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_expert = bytes_per_expert
        self.freq_weight = freq_weight
        self.aging_steps = aging_steps
        self.stats = CacheStats()
        self.owner: list[Key | None] = [None] * num_slots
        self.where: dict[Key, int] = {}
        self.step = 0
        self._last: dict[Key, int] = {}  # step of the last use
        self._uses: dict[Key, float] = {}  # steps in which the key was used (aged)
        self._pinned: set[int] = set()
        self._touched: set[Key] = set()  # keys counted as used in this step
        # NOTE: the current score of every slot (-inf when free), rewritten whenever the
        # owner's score changes; victims are a stable argsort of it (ties -> lower slot).
        self._score = np.full(num_slots, -math.inf)

    def score(self, key: Key) -> float:
        uses = self._uses.get(key, 0.0)
        return self._last.get(key, -1) + self.freq_weight * math.log2(1.0 + uses)

    def _use(self, key: Key) -> float:
        """Count `key` as used in this step (once per step); its new score."""
        if key in self._touched:
            u = self._uses[key]
        else:
            self._touched.add(key)
            u = self._uses[key] = self._uses.get(key, 0.0) + 1.0
        self._last[key] = self.step
        return self.step + self.freq_weight * math.log2(1.0 + u)

    def _push(self, slot: int) -> None:
        key = self.owner[slot]
        self._score[slot] = -math.inf if key is None else self.score(key)

    def victims(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """The `n` slots to give up first (lowest score, never pinned), best victim first.
        Raises CacheFullError when fewer than `n` slots are evictable."""
        return self.victim_array(n, exclude).tolist()

    def victim_array(self, n: int, exclude: Iterable[int] = (), *,
                     filling: np.ndarray | None = None) -> np.ndarray:
        """`victims` as an int64 array [n]. `filling`: slots a step in flight may be filling;
        they rank at least as an expert first used in the current step."""
        score = self._score
        if filling is not None and len(filling):
            score = score.copy()
            score[filling] = np.maximum(score[filling], self.step + self.freq_weight)
        order = np.argsort(score, kind="stable")
        skip = self._pinned.union(exclude)
        if skip:
            keep = np.ones(self.num_slots, dtype=bool)
            keep[np.fromiter(skip, dtype=np.int64, count=len(skip))] = False
            order = order[keep[order]]
        if len(order) < n:
            raise CacheFullError(
                f"expert cache: {n} slots wanted but only {len(order)} of {self.num_slots} can "
                f"be evicted ({len(self._pinned)} pinned by this step)")
        return order[:n]

    def access(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """(slots of `experts` of `layer`, same order; loads [(expert, slot)] per distinct
        miss). Every returned slot stays pinned until `end_step()`."""
        unique = list(dict.fromkeys(int(e) for e in experts))
        hits = [e for e in unique if (layer, e) in self.where]
        for e in hits:
            self._pinned.add(self.where[(layer, e)])
        misses = [e for e in unique if (layer, e) not in self.where]
        loads: list[tuple[int, int]] = []
        if misses:
            for e, slot in zip(misses, self.victims(len(misses)), strict=True):
                self._take(slot, (layer, e))
                self._pinned.add(slot)
                loads.append((e, slot))
        for e in unique:
            self._use((layer, e))
            self._push(self.where[(layer, e)])
        self.stats.count(layer, len(hits), len(misses), self.bytes_per_expert)
        return [self.where[(layer, int(e))] for e in experts], loads

    def _take(self, slot: int, key: Key) -> None:
        """`key` now lives in `slot` (its score is the caller's to set).

        NOTE: a device-driven mirror can miss loads; the device is the truth then: a stale
        owner is overwritten, and a slot the mirror had for `key` elsewhere is freed.
        """
        where, owner = self.where, self.owner
        old = owner[slot]
        if old is not None and where.get(old) == slot:
            del where[old]
        prev = where.get(key)
        if prev is not None and prev != slot:
            owner[prev] = None
            self._score[prev] = -math.inf
        owner[slot] = key
        where[key] = slot

    def forget(self, start: int, stop: int) -> None:
        """Slots [start, stop) hold nothing now (free: first in line)."""
        for slot in range(start, stop):
            key = self.owner[slot]
            if key is not None and self.where.get(key) == slot:
                del self.where[key]
            self.owner[slot] = None
            self._push(slot)

    def release(self) -> None:
        """Unpin every slot without ending the step (the pinned layer's work is ordered
        before any later copy, e.g. on one stream)."""
        self._pinned.clear()

    def end_step(self) -> None:
        """The step is over: unpin its slots, advance the clock, age the counts."""
        self._pinned.clear()
        self._touched.clear()
        self.step += 1
        if self.aging_steps and self.step % self.aging_steps == 0:
            self._uses = {k: v / 2 for k, v in self._uses.items() if v >= 0.5}
            for slot in range(self.num_slots):
                self._push(slot)

    def replay_step(self, layers: Sequence[int], hits: Sequence[tuple[Key, int]],
                    loads: Sequence[tuple[Key, int]]) -> None:
        """Mirror a step of device lookups over `layers`: `hits` are (key, slot as the step
        began) of every resident expert, `loads` (key, slot) of every copied-in one, in lookup
        order; each key at most once. Unpins everything, like `release()`. The touches can
        follow all the loads because a layer never loads into a slot it hits.
        """
        for key, s in loads:
            self._take(s, key)
        at: list[int] = []
        new: list[float] = []
        for part in (hits, loads):
            for key, _ in part:
                score = self._use(key)
                slot = self.where.get(key)
                if slot is not None:  # (distinct keys hold distinct slots)
                    at.append(slot)
                    new.append(score)
        self._score[at] = new
        n_hits = Counter(key[0] for key, _ in hits)
        n_loads = Counter(key[0] for key, _ in loads)
        for layer in layers:
            self.stats.count(layer, n_hits[layer], n_loads[layer], self.bytes_per_expert)
        self._pinned.clear()
