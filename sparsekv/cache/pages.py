"""Page allocator for the paged KV cache: admission by memory. Plain Python, no torch.

A request's page table covers every layer's pools (latents and indexer keys): its i-th page holds
positions [i * page_size, (i + 1) * page_size). With the prefix cache (prefix.py) a full page may be
shared by several requests (reference counted) and, once no request holds it, kept with its contents
as *cached* (cached_pages.py). Every page is in exactly one state::

    free  --allocate-->  owned (1..n owners)  --free, no owner left-->  free, or cached if named
    cached  --share (a prefix hit)-->  owned            cached  --allocate (evicted, oldest first)-->  owned
"""
from __future__ import annotations

from collections import deque

from .cached_pages import CachedPages


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids plus per-owner accounting and reservations (admission by memory)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owners: dict[int, set[str]] = {}
        self._reserved: dict[str, int] = {}
        self.cached = CachedPages(self._free)  # unowned pages whose contents are kept, by tenant

    @property
    def num_free(self) -> int:
        """Pages a request may take: never used, or cached (evicted on allocation)."""
        return len(self._free) + len(self.cached)

    @property
    def num_reserved_unallocated(self) -> int:
        return sum(self._reserved.values())

    @property
    def num_available(self) -> int:
        """Pages neither allocated nor promised to an admitted request."""
        return self.num_free - self.num_reserved_unallocated

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, owner: str, num_pages: int) -> bool:
        """Promise `num_pages` future pages to `owner`; False if that would overcommit."""
        return self.share_and_reserve(owner, [], num_pages)

    def share_and_reserve(self, owner: str, shared: list[int], num_pages: int, keep_free: int = 0) -> bool:
        """Admit `owner` onto `shared` pages (a prefix hit) plus `num_pages` future ones, leaving at least
        `keep_free` pages available, or do nothing and return False: sharing a cached page takes it out
        of the allocatable pool."""
        leaving = sum(p in self.cached for p in shared)
        if num_pages + keep_free > self.num_available - leaving:
            return False
        for p in shared:
            if p in self.cached:
                self.cached.remove(p)
            self._owners.setdefault(p, set()).add(owner)
        self._reserved[owner] = self._reserved.get(owner, 0) + num_pages
        return True

    def reserved(self, owner: str) -> int:
        """Pages promised to `owner` and not yet allocated."""
        return self._reserved.get(owner, 0)

    def allocate(self, owner: str, n: int) -> list[int]:
        """Take n pages, drawing first on the owner's reservation; cached pages go last, oldest first."""
        from_reservation = min(n, self._reserved.get(owner, 0))
        if n - from_reservation > self.num_available:
            raise OutOfPages(f"need {n} pages for {owner}, {self.num_available} available")
        if from_reservation:
            self._reserved[owner] -= from_reservation
        pages = [self._free.popleft() if self._free else self.cached.evict() for _ in range(n)]
        # NOTE: in ascending order, whatever order they were freed or evicted in (a request's pages are
        # freed last first): consecutive pages are one run of slots, which decode reads in place
        pages.sort()
        for p in pages:
            self._owners[p] = {owner}
        return pages

    def add_owner(self, owner: str, pages: list[int]) -> None:
        """One more owner of pages already owned: they stay owned until it frees them too."""
        for p in pages:
            if p not in self._owners:
                raise RuntimeError(f"page {p} is not owned: only an owned page takes another owner")
        for p in pages:
            self._owners[p].add(owner)

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            owners = self._owners.get(p, ())
            if owner not in owners:
                raise RuntimeError(f"page {p} is owned by {sorted(owners)!r}, not {owner!r}")
            owners.discard(owner)
            if not owners:
                del self._owners[p]
                self.cached.keep(p)
        self._reserved.pop(owner, None)

    def num_owners(self, page: int) -> int:
        return len(self._owners.get(page, ()))

    def check_integrity(self) -> None:
        free, cached, owned = list(self._free), set(self.cached.pages()), set(self._owners)
        self.cached.check_integrity()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert not set(free) & owned, "a page is both free and owned"
        assert not cached & (owned | set(free)), "a cached page is also free or owned"
        assert len(free) + len(cached) + len(owned) == self.num_pages, "free + cached + used != total"
        assert all(self._owners.values()), "an owned page with no owner"
        assert all(v >= 0 for v in self._reserved.values()), "negative reservation"
        assert self.num_reserved_unallocated <= self.num_free, "reservations exceed free pages"
