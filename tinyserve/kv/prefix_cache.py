"""Prefix cache: a radix tree over token ids whose nodes own KV pages and, at page
boundaries, snapshots of the GDN state (a request can resume only at a snapshot).

Pages are shared by reference count, so eviction never frees a page in use; snapshots live in
state-pool slots and are copied into a request's own slot at admission, so any may be evicted.
Invariants (`check()`): edges are whole pages; every leaf holds a snapshot; a node without one
has two children or more; a page appears once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tinyserve.kv.allocator import PageAllocator


class RadixNode:
    """One edge of the tree: `key` tokens (whole pages) stored in `pages`, and optionally the
    GDN state after the node's last token in snapshot slot `snapshot`. Opaque to callers."""

    __slots__ = ("key", "pages", "parent", "children", "snapshot", "last_used", "snap_used",
                 "alive")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page of key -> child
        self.snapshot: int | None = None
        self.last_used = 0
        self.snap_used = 0
        self.alive = True


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: `num_tokens` (a multiple of the page size; 0 when nothing matched),
    the `pages` holding their KV, and the state-pool slot with the GDN state after them."""

    num_tokens: int = 0
    pages: tuple[int, ...] = ()
    snapshot_slot: int | None = None


class PrefixCache:
    """Radix tree of cached prefixes over a shared page allocator and snapshot slots
    of a state pool (`states.copy_slot(src, dst)`). `snapshot_interval`: also keep a snapshot
    every this many prefill tokens (a multiple of page_size). Raises ValueError on bad sizes."""

    def __init__(self, pages: PageAllocator, *, page_size: int, states: Any,
                 snapshot_slots: Sequence[int], snapshot_interval: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if snapshot_interval < 0 or snapshot_interval % page_size:
            raise ValueError(f"snapshot_interval ({snapshot_interval}) must be a non-negative "
                             f"multiple of the page size ({page_size})")
        if len(set(snapshot_slots)) != len(snapshot_slots):
            raise ValueError("snapshot slots must be distinct")
        self.pages = pages
        self.page_size = page_size
        self.states = states
        self.snapshot_interval = snapshot_interval
        self.snapshot_slots = tuple(snapshot_slots)
        self._free_slots: deque[int] = deque(self.snapshot_slots)
        self.root = RadixNode((), [], None)
        self._page_set: set[int] = set()
        self._snap_nodes: set[RadixNode] = set()
        self._clock = itertools.count(1)
        self.queries = 0  # admissions that looked the cache up
        self.hits = 0  # ... and reused a cached prefix
        self.hit_tokens = 0  # prompt tokens served from the cache

    @property
    def num_pages(self) -> int:
        """Pages the tree holds a reference on."""
        return len(self._page_set)

    @property
    def num_idle_pages(self) -> int:
        """Pages held by the tree alone (approximate from another thread)."""
        refcount = self.pages.refcount
        return sum(1 for p in list(self._page_set) if refcount(p) == 1)

    @property
    def num_snapshots(self) -> int:
        return len(self._snap_nodes)

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `tokens`, at most `max_tokens` long, that ends at a
        snapshot. Marks it recently used."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        pages: list[int] = []
        best: tuple[RadixNode, int, int] | None = None
        for node, pos in self._path(tokens, limit):
            pages += node.pages
            if node.snapshot is not None:
                best = (node, pos, len(pages))
        if best is None:
            return PrefixMatch()
        found, length, num_pages = best
        self._touch(found)
        found.snap_used = found.last_used
        return PrefixMatch(length, tuple(pages[:num_pages]), found.snapshot)

    def restore(self, match: PrefixMatch, slot: int) -> None:
        """Copy the matched snapshot into a sequence's state slot (before its next forward)."""
        if match.snapshot_slot is not None:
            self.states.copy_slot(match.snapshot_slot, slot)

    def record(self, match: PrefixMatch) -> None:
        """Count one admission that looked the cache up (the hit counters)."""
        self.queries += 1
        if match.num_tokens:
            self.hits += 1
            self.hit_tokens += match.num_tokens

    def insert(self, tokens: Sequence[int], pages: Sequence[int], state_slot: int, *,
               replace: RadixNode | None = None) -> RadixNode | None:
        """Cache `tokens` (whole pages, KV in `pages`) with a snapshot of the GDN state now in
        `state_slot`; `replace` (a node from an earlier insert) gives its snapshot up. Returns
        the node holding the new snapshot, or None when none was made (the prefix had one, or
        no slot exists)."""
        ps, n_tok = self.page_size, len(tokens)
        if n_tok == 0 or n_tok % ps:
            raise ValueError(f"insert of {n_tok} tokens: must be a positive multiple of {ps}")
        if len(pages) < n_tok // ps:
            raise ValueError(f"{len(pages)} pages cannot hold {n_tok} tokens")
        key = tuple(tokens)
        found = self._find(key)
        if found is not None and found.snapshot is not None:
            self._touch(found)
            if replace is not None and replace is not found:
                self.drop_snapshot(replace)
            return None
        slot = self._take_slot(replace)
        if slot is None:
            return None
        node = self._add_path(key, list(pages[:n_tok // ps]))
        node.snapshot = slot
        self._snap_nodes.add(node)
        self.states.copy_slot(state_slot, slot)
        self._touch(node)
        node.snap_used = node.last_used
        if replace is not None and replace is not node:
            self._tidy(replace)
        return node

    def drop_snapshot(self, node: RadixNode) -> None:
        """Give up `node`'s snapshot (a stale handle is ignored); prunes what became useless."""
        if node.alive and node.snapshot is not None:
            self._free_slots.append(self._detach_snapshot(node))
            self._tidy(node)

    def evictable_pages(self) -> int:
        """Pages that `evict` could free now: those of subtrees no running request uses."""
        idle: dict[int, bool] = {}
        total = 0
        for node in reversed(self._nodes()):  # children before parents
            idle[id(node)] = ok = (all(idle[id(c)] for c in node.children.values())
                                   and self._idle(node))
            total += len(node.pages) if ok else 0
        return total

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (least recently used leaves first) when the tree
        can; returns the number of pages freed. Never frees a page a request holds."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            if not leaf.alive or leaf.children or not self._idle(leaf):
                continue
            parent = leaf.parent
            freed += self._remove(leaf)
            freed += self._tidy(parent)
            if (parent is not self.root and parent.alive and not parent.children
                    and self._idle(parent)):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def clear(self) -> None:
        """Drop every cached prefix and snapshot (requests keep their own page references)."""
        for node in self._nodes():
            self.pages.decref(node.pages)
            node.alive = False
        self.root.children = {}
        self._page_set.clear()
        self._snap_nodes.clear()
        self._free_slots = deque(self.snapshot_slots)

    def check(self) -> None:
        """Assert the tree's invariants and its page and slot accounting (tests)."""
        ps, seen_pages, seen_slots = self.page_size, [], []
        for node in self._nodes():
            assert node.alive and node.key and len(node.key) == len(node.pages) * ps
            assert node.parent.children[node.key[:ps]] is node
            assert node.snapshot is not None or len(node.children) >= 2, "useless node"
            seen_pages += node.pages
            if node.snapshot is not None:
                seen_slots.append(node.snapshot)
                assert node in self._snap_nodes
        assert len(seen_pages) == len(set(seen_pages)) and set(seen_pages) == self._page_set
        assert all(self.pages.refcount(p) >= 1 for p in seen_pages)
        assert len(seen_slots) == len(self._snap_nodes)
        assert sorted(seen_slots + list(self._free_slots)) == sorted(self.snapshot_slots)

    # ---------------------------------------------------------------- internals

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _touch(self, node: RadixNode) -> None:
        now = next(self._clock)
        while node is not self.root:
            node.last_used = now
            node = node.parent

    def _idle(self, node: RadixNode) -> bool:
        return all(self.pages.refcount(p) == 1 for p in node.pages)

    def _path(self, tokens: Sequence[int], limit: int) -> Iterator[tuple[RadixNode, int]]:
        """(node, tokens up to its end) along the cached whole edges of `tokens[:limit]`."""
        node, pos, ps = self.root, 0, self.page_size
        while pos + ps <= limit:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            n = 0 if child is None else len(child.key)
            if child is None or pos + n > limit or child.key != tuple(tokens[pos:pos + n]):
                return
            node, pos = child, pos + n
            yield node, pos

    def _find(self, key: tuple[int, ...]) -> RadixNode | None:
        """The node whose path is exactly `key`."""
        return next((n for n, pos in self._path(key, len(key)) if pos == len(key)), None)

    def _take_slot(self, replace: RadixNode | None) -> int | None:
        if replace is not None and replace.alive and replace.snapshot is not None:
            return self._detach_snapshot(replace)  # tidied by the caller after the insert
        if self._free_slots:
            return self._free_slots.popleft()
        if not self._snap_nodes:
            return None
        victim = min(self._snap_nodes, key=lambda n: n.snap_used)
        slot = self._detach_snapshot(victim)
        self._tidy(victim)
        return slot

    def _detach_snapshot(self, node: RadixNode) -> int:
        slot = node.snapshot
        node.snapshot = None
        self._snap_nodes.discard(node)
        return slot

    def _add_path(self, key: tuple[int, ...], pages: list[int]) -> RadixNode:
        ps = self.page_size
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos:pos + ps])
            if child is None:
                new = RadixNode(key[pos:], pages[pos // ps:], node)
                node.children[key[pos:pos + ps]] = new
                self.pages.incref(new.pages)
                self._page_set.update(new.pages)
                return new
            n = ps
            while n < len(child.key) and child.key[n:n + ps] == key[pos + n:pos + n + ps]:
                n += ps
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        return node

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child`'s edge after `n` tokens; returns the new upper node."""
        ps = self.page_size
        upper = RadixNode(child.key[:n], child.pages[:n // ps], child.parent)
        upper.last_used = child.last_used
        child.parent.children[child.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps:], upper
        upper.children[child.key[:ps]] = child
        return upper

    def _remove(self, node: RadixNode) -> int:
        """Remove a leaf; returns the pages freed."""
        del node.parent.children[node.key[:self.page_size]]
        if node.snapshot is not None:
            self._free_slots.append(self._detach_snapshot(node))
        self._page_set.difference_update(node.pages)
        node.alive = False
        return len(self.pages.decref(node.pages))

    def _tidy(self, node: RadixNode) -> int:
        """Prune snapshot-less leaves upwards and merge a snapshot-less single-child node into
        its child. Returns the pages freed."""
        freed = 0
        while node is not self.root and node.alive and node.snapshot is None:
            if node.children:
                if len(node.children) == 1:
                    self._merge(node)
                break
            parent = node.parent
            freed += self._remove(node)
            node = parent
        return freed

    def _merge(self, node: RadixNode) -> None:
        (child,) = node.children.values()
        child.key, child.pages = node.key + child.key, node.pages + child.pages
        child.parent = node.parent
        child.last_used = max(child.last_used, node.last_used)
        node.parent.children[node.key[:self.page_size]] = child
        node.alive = False
