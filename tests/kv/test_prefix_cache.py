"""The prefix-cache radix tree on its own: matching, branching, reference counts, snapshot
slots, LRU eviction, and exact page/slot accounting under random operations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.kv.allocator import PageAllocator
from tinyserve.kv.prefix_cache import PrefixCache
from tinyserve.kv.state_pool import GDNStatePool

PS = 4


class FakeStates:
    """A state pool whose 'state' per slot is any Python value; records the copies."""

    def __init__(self) -> None:
        self.data: dict[int, object] = {}
        self.copies: list[tuple[int, int]] = []

    def copy_slot(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.data[dst] = self.data.get(src)


def make(num_pages: int = 32, snapshots: int = 3, interval: int = 0):
    pages, states = PageAllocator(num_pages), FakeStates()
    cache = PrefixCache(pages, page_size=PS, states=states,
                        snapshot_slots=range(100, 100 + snapshots), snapshot_interval=interval)
    return cache, pages, states


def seq(cache: PrefixCache, states: FakeStates, tokens: list[int], slot: int = 0):
    """A 'request' that computed `tokens`: own pages, state in `slot`; inserts its prefix."""
    pages = cache.pages.alloc(-(-len(tokens) // PS))
    states.data[slot] = tuple(tokens)
    return pages


def test_match_ends_at_a_snapshot() -> None:
    cache, pages, states = make()
    toks = list(range(1, 14))  # 13 tokens: 3 full pages
    own = seq(cache, states, toks[:12])
    states.data[0] = tuple(toks[:8])
    node8 = cache.insert(toks[:8], own, 0)
    assert node8 is not None and states.data[node8.snapshot] == tuple(toks[:8])
    m = cache.match(toks)
    assert (m.num_tokens, m.pages) == (8, tuple(own[:2]))
    assert states.data[m.snapshot_slot] == tuple(toks[:8])
    assert cache.match(toks, max_tokens=7).num_tokens == 0  # no snapshot at 4
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 0, 9]).num_tokens == 0  # differs inside page 2
    states.data[0] = tuple(toks[:12])
    cache.insert(toks[:12], own, 0)
    assert cache.match(toks).num_tokens == 12 and cache.match(toks[:12]).num_tokens == 12
    assert cache.match(toks, max_tokens=11).num_tokens == 8
    # the tree holds one reference on each of the 3 pages
    assert [pages.refcount(p) for p in own] == [2, 2, 2] and cache.num_pages == 3
    cache.check()
    pages.decref(own)  # the request finishes: the cache keeps them
    assert pages.num_used == 3 and cache.num_idle_pages == 3
    cache.clear()
    assert pages.num_free == pages.num_pages and cache.num_snapshots == 0
    cache.check()


def test_restore_copies_the_snapshot_into_the_sequence_slot() -> None:
    cache, _, states = make()
    toks = [7] * 8
    own = seq(cache, states, toks)
    cache.insert(toks, own, 0)
    m = cache.match(toks + [1])
    cache.restore(m, 5)
    assert states.data[5] == tuple(toks) and states.copies[-1] == (m.snapshot_slot, 5)
    cache.record(m)
    cache.record(cache.match([3, 3, 3, 3, 3]))
    assert (cache.queries, cache.hits, cache.hit_tokens) == (2, 1, 8)


def test_branches_split_and_keep_each_snapshot() -> None:
    cache, pages, states = make()
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    b = [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
    pa, pb = seq(cache, states, a, 0), seq(cache, states, b, 1)
    cache.insert(a, pa, 0)
    cache.insert(b, pb, 1)  # shares the first 8 tokens: the tree keeps a's pages there
    cache.check()
    assert cache.num_pages == 4 and pages.refcount(pb[0]) == 1
    ma, mb = cache.match(a + [0]), cache.match(b + [0])
    assert ma.pages == tuple(pa) and mb.pages == (pa[0], pa[1], pb[2])
    assert states.data[ma.snapshot_slot] == tuple(a)
    assert states.data[mb.snapshot_slot] == tuple(b)
    assert cache.match(a[:8] + [9] * 4).num_tokens == 0  # no snapshot at the branch point
    states.data[0] = tuple(a[:8])
    cache.insert(a[:8], pa, 0)
    assert cache.match(a[:8] + [9] * 5).num_tokens == 8
    cache.check()


def test_snapshot_slots_are_recycled_least_recently_used_first() -> None:
    cache, pages, states = make(snapshots=2)
    seqs = [[k] * 8 for k in (1, 2, 3)]
    own = [seq(cache, states, s, i) for i, s in enumerate(seqs)]
    cache.insert(seqs[0], own[0], 0)
    cache.insert(seqs[1], own[1], 1)
    cache.match(seqs[0] + [0])  # 0 is now more recent than 1
    cache.insert(seqs[2], own[2], 2)
    assert cache.match(seqs[1] + [0]).num_tokens == 0  # evicted, and its pages pruned
    assert cache.match(seqs[0] + [0]).num_tokens == 8
    assert cache.match(seqs[2] + [0]).num_tokens == 8
    assert [pages.refcount(p) for p in own[1]] == [1, 1]  # only the request holds them now
    cache.check()


def test_replace_moves_a_rolling_snapshot_and_merges_the_chain() -> None:
    cache, pages, states = make(snapshots=1)
    toks = list(range(20))
    own = seq(cache, states, toks)
    node = None
    for n in (4, 8, 12, 16):
        states.data[0] = tuple(toks[:n])
        node = cache.insert(toks[:n], own, 0, replace=node)
        assert node is not None and cache.num_snapshots == 1
        cache.check()
    assert len(cache.root.children) == 1 and len(node.key) == 16  # one merged edge
    m = cache.match(toks)
    assert m.num_tokens == 16 and states.data[m.snapshot_slot] == tuple(toks[:16])
    # an insert where a snapshot already exists drops the caller's replaceable one
    states.data[0] = tuple(toks[:4])
    cache.insert(toks[:4], own, 0)  # no free slot: evicts the LRU snapshot (the one at 16)
    assert cache.match(toks).num_tokens == 4
    cache.check()


def test_eviction_frees_idle_pages_only() -> None:
    cache, pages, states = make(num_pages=8, snapshots=3)
    a, b = [1] * 8, [2] * 8
    pa, pb = seq(cache, states, a, 0), seq(cache, states, b, 1)
    cache.insert(a, pa, 0)
    cache.insert(b, pb, 1)
    pages.decref(pa)  # a finished; b still runs
    assert cache.evictable_pages() == 2 and cache.num_idle_pages == 2
    assert cache.evict(8) == 2  # only a's pages: b's are in use
    assert pages.num_used == 2 and cache.match(b + [0]).num_tokens == 8
    assert cache.match(a + [0]).num_tokens == 0
    cache.check()
    pages.decref(pb)
    assert cache.evict(1) == 2 and pages.num_free == 8 and cache.num_snapshots == 0
    cache.check()


def test_evict_is_least_recently_used_and_stops_when_enough() -> None:
    cache, pages, states = make(num_pages=8, snapshots=4)
    seqs = [[k] * 4 for k in (1, 2, 3, 4)]
    for i, s in enumerate(seqs):
        own = seq(cache, states, s, i)
        cache.insert(s, own, i)
        pages.decref(own)
    cache.match(seqs[0] + [0])
    assert cache.evict(2) == 2
    assert [cache.match(s + [0]).num_tokens for s in seqs] == [4, 0, 0, 4]


def test_bad_inserts_are_refused() -> None:
    cache, _, states = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [0], 0)
    with pytest.raises(ValueError):
        cache.insert([1] * 8, [0], 0)
    with pytest.raises(ValueError):
        PrefixCache(PageAllocator(4), page_size=4, states=states, snapshot_slots=[1],
                    snapshot_interval=6)


def test_no_snapshot_slots_caches_nothing() -> None:
    cache, pages, states = make(snapshots=0)
    own = seq(cache, states, [1] * 8)
    assert cache.insert([1] * 8, own, 0) is None and cache.num_pages == 0
    assert cache.match([1] * 9).num_tokens == 0


def test_state_pool_copy_slot_copies_every_layer() -> None:
    pool = GDNStatePool(layer_ids=[0, 2], num_slots=3, conv_dim=6, conv_kernel=4,
                        num_v_heads=2, k_head_dim=3, v_head_dim=2, device="cpu",
                        dtype=torch.bfloat16)
    pool.conv.normal_()
    pool.recurrent.normal_()
    before = pool.conv[:, 0].clone(), pool.recurrent[:, 0].clone()
    pool.conv[:, 2].fill_(float("nan"))
    pool.recurrent[:, 2].fill_(float("nan"))
    pool.copy_slot(1, 2)
    assert torch.equal(pool.conv[:, 2], pool.conv[:, 1])
    assert torch.equal(pool.recurrent[:, 2], pool.recurrent[:, 1])
    assert torch.equal(pool.conv[:, 0], before[0]) and torch.equal(pool.recurrent[:, 0], before[1])
    with pytest.raises(ValueError):
        pool.copy_slot(0, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1,
                                                      max_size=6), st.booleans()),
                min_size=1, max_size=25))
def test_random_operations_keep_accounting_exact(ops) -> None:
    """Requests (token strings over a tiny alphabet, so prefixes collide) insert their pages,
    reuse matches, finish and are evicted in any order; every page and slot comes back."""
    cache, pages, states = make(num_pages=64, snapshots=3)
    live: list[list[int]] = []  # page lists held by 'running requests'
    for kind, word, flag in ops:
        tokens = [t for t in word for _ in range(PS)]  # whole pages of one token each
        if kind <= 2:  # a request: reuse a match, compute the rest, insert a boundary or two
            m = cache.match(tokens, len(tokens) - 1 if flag else None)
            pages.incref(m.pages)
            own = pages.alloc(len(word) - len(m.pages))
            if own is None:
                cache.evict(len(word))
                own = pages.alloc(len(word) - len(m.pages))
            if own is None:
                pages.decref(m.pages)
                continue
            held = list(m.pages) + own
            live.append(held)
            node = None
            for n in range(max(m.num_tokens // PS, 1), len(word) + 1):
                states.data[0] = tuple(tokens[:n * PS])
                node = cache.insert(tokens[:n * PS], held, 0, replace=node if flag else None)
        elif kind == 3 and live:  # a request finishes
            pages.decref(live.pop(len(word) % len(live)))
        elif kind == 4:
            cache.evict(len(word))
        else:
            m = cache.match(tokens)
            if m.num_tokens:
                assert states.data[m.snapshot_slot] == tuple(tokens[:m.num_tokens])
        cache.check()
    for held in live:
        pages.decref(held)
    cache.clear()
    cache.check()
    assert pages.num_free == pages.num_pages and cache.num_pages == 0
