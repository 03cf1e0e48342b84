"""Reference-counted allocator of fixed-size units (KV pages, GDN state slots).

Pure Python. `alloc` hands out units with count 1, `incref` adds an owner (the prefix cache),
`free` / `decref` return a unit once its last owner lets go.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PageAllocator:
    """Units 0 .. num_pages-1 with reference counts. Raises ValueError on an id out of
    range, `incref` of a free unit and a double free."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # NOTE: FIFO reuse keeps recently freed pages (possibly cached) alive longest.
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` units with reference count 1, or None (and nothing taken) when too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def refcount(self, page: int) -> int:
        self._check(page)
        return self._refs[page]

    def incref(self, pages: Iterable[int]) -> None:
        """Add an owner to each of `pages` (all must be allocated)."""
        pages = list(pages)
        for p in pages:
            self._check(p)
            if self._refs[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p in pages:
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one owner of each of `pages`; returns the pages that became free.

        Checks every page before changing any, so a double free leaves the state untouched.
        """
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            self._check(p)
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refs[p]:
                raise ValueError(f"double free of page {p}")
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    free = decref

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
