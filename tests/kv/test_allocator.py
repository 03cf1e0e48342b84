from __future__ import annotations

import random

import pytest

from tinyserve.kv.allocator import PageAllocator


def test_alloc_until_empty_then_none() -> None:
    a = PageAllocator(5)
    got = a.alloc(3)
    assert got is not None and len(set(got)) == 3
    assert a.num_free == 2 and a.num_used == 3
    assert a.alloc(3) is None
    assert a.num_free == 2  # a failed alloc takes nothing
    rest = a.alloc(2)
    assert sorted(got + rest) == list(range(5))
    assert a.alloc(1) is None
    assert a.alloc(0) == []


def test_free_returns_pages_and_double_free_raises() -> None:
    a = PageAllocator(4)
    pages = a.alloc(2)
    assert a.free(pages) == pages
    assert a.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.free([pages[0]])
    with pytest.raises(ValueError, match="double free"):
        b = a.alloc(1)
        a.free(b + b)
    assert a.refcount(b[0]) == 1  # the failed free left the count untouched


def test_refcounts_share_pages() -> None:
    a = PageAllocator(3)
    p = a.alloc(2)
    a.incref(p[:1])
    assert a.refcount(p[0]) == 2
    assert a.decref(p) == [p[1]]
    assert a.num_free == 2
    assert a.decref(p[:1]) == [p[0]]
    assert a.num_free == 3
    with pytest.raises(ValueError, match="free page"):
        a.incref(p[:1])


def test_out_of_range_and_negative() -> None:
    a = PageAllocator(2)
    with pytest.raises(ValueError, match="out of range"):
        a.free([2])
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(ValueError):
        PageAllocator(-1)


def test_random_ops_keep_accounting() -> None:
    rng = random.Random(0)
    a = PageAllocator(32)
    owned: list[int] = []
    for _ in range(2000):
        if owned and rng.random() < 0.5:
            p = owned.pop(rng.randrange(len(owned)))
            a.free([p])
        else:
            got = a.alloc(rng.randint(1, 4))
            if got is not None:
                owned += got
        assert a.num_used == len(owned)
        assert len(set(owned)) == len(owned)
    a.free(owned)
    assert a.num_free == 32
