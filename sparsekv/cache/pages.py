"""Page allocator for the paged KV cache. Plain Python, no torch.

One page table per request covers both the MLA latent cache and the indexer key cache: page `p`
holds positions [p_i * page_size, (p_i + 1) * page_size) of a request in every layer's pool.

With the prefix cache (prefix.py) a full page may be shared by several requests (reference counted)
and, once no request holds it, kept with its contents as *cached*: still allocatable, and reused by a
later request whose prompt starts with the same tokens. Cached pages are grouped by tenant; an
allocation that must evict takes the least recently released page of the tenant holding the most
cached pages, so one tenant's traffic evicts its own pages before it can push another tenant's
below its own count. Every page is in exactly one state::

    free  --allocate-->  owned (1..n owners)  --free, no owner left-->  free, or cached if registered
    cached  --share (a prefix hit)-->  owned            cached  --allocate (evicted, oldest first)-->  owned
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids plus per-owner accounting and reservations (admission by memory)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owners: dict[int, set[str]] = {}
        self._reserved: dict[str, int] = {}
        # unowned pages whose contents are kept, by tenant, each oldest first
        self._cached: dict[str, OrderedDict[int, None]] = {}
        self._group: dict[int, str] = {}  # cached page -> its tenant
        self._released_at: dict[int, float] = {}  # cached page -> when it was released (clock())
        self.clock: Callable[[], float] = time.time
        self.max_cached_per_tenant: int | None = None  # a tenant's cached pages beyond this are evicted
        # Set by the prefix cache: a released page's tenant if it is worth keeping (else None), and
        # what to forget when a cached page is evicted.
        self.keeps: Callable[[int], str | None] = lambda page: None
        self.on_evict: Callable[[int], None] = lambda page: None

    @property
    def num_free(self) -> int:
        """Pages a request may take: never used, or cached (evicted on allocation)."""
        return len(self._free) + len(self._group)

    @property
    def num_cached(self) -> int:
        return len(self._group)

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
        if num_pages > self.num_available:
            return False
        self._reserved[owner] = self._reserved.get(owner, 0) + num_pages
        return True

    def share_and_reserve(self, owner: str, shared: list[int], num_pages: int) -> bool:
        """Admit `owner` onto `shared` pages (a prefix hit) plus `num_pages` future ones, or do nothing
        and return False: sharing a cached page takes it out of the allocatable pool."""
        leaving = sum(p in self._group for p in shared)
        if num_pages > self.num_available - leaving:
            return False
        for p in shared:
            if p in self._group:
                self._uncache(p)
            self._owners.setdefault(p, set()).add(owner)
        self._reserved[owner] = self._reserved.get(owner, 0) + num_pages
        return True

    def allocate(self, owner: str, n: int) -> list[int]:
        """Take n pages, drawing first on the owner's reservation; cached pages go last, oldest first."""
        from_reservation = min(n, self._reserved.get(owner, 0))
        if n - from_reservation > self.num_available:
            raise OutOfPages(f"need {n} pages for {owner}, {self.num_available} available")
        if from_reservation:
            self._reserved[owner] -= from_reservation
        pages = [self._take() for _ in range(n)]
        for p in pages:
            self._owners[p] = {owner}
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        tenant = max(self._cached, key=lambda t: len(self._cached[t]))  # the largest holder evicts first
        page = next(iter(self._cached[tenant]))
        self._uncache(page)
        self.on_evict(page)
        return page

    def _uncache(self, page: int) -> None:
        tenant = self._group.pop(page)
        del self._released_at[page]
        del self._cached[tenant][page]
        if not self._cached[tenant]:
            del self._cached[tenant]

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            owners = self._owners.get(p, ())
            if owner not in owners:
                raise RuntimeError(f"page {p} is owned by {sorted(owners)!r}, not {owner!r}")
            owners.discard(owner)
            if not owners:
                del self._owners[p]
                tenant = self.keeps(p)
                if tenant is not None:
                    self._group[p] = tenant
                    self._released_at[p] = self.clock()
                    self._cached.setdefault(tenant, OrderedDict())[p] = None
                    self._hold_quota(tenant)
                else:
                    self._free.append(p)
        self._reserved.pop(owner, None)

    def _hold_quota(self, tenant: str) -> None:
        """Evict the tenant's oldest cached pages beyond `max_cached_per_tenant` (to the prefix cache's
        lower tiers, if any): one tenant's traffic cannot fill the pool's cache."""
        group = self._cached[tenant]
        while self.max_cached_per_tenant is not None and len(group) > self.max_cached_per_tenant:
            page = next(iter(group))
            self._uncache(page)
            self.on_evict(page)
            self._free.append(page)

    def num_owners(self, page: int) -> int:
        return len(self._owners.get(page, ()))

    def expire_cached(self, cutoff: float) -> list[int]:
        """Free the cached pages released before `cutoff` (their contents are forgotten); returns them."""
        expired = []
        for tenant in list(self._cached):
            group = self._cached[tenant]
            while group and self._released_at[next(iter(group))] < cutoff:
                page = next(iter(group))
                self._uncache(page)
                self._free.append(page)
                expired.append(page)
        return expired

    def drop_cached(self, tenant: str | None = None) -> list[int]:
        """Free a tenant's cached pages (every tenant's with None), contents forgotten; returns them."""
        dropped = [p for t, group in self._cached.items() if tenant is None or t == tenant for p in group]
        for page in dropped:
            self._uncache(page)
            self._free.append(page)
        return dropped

    def cached_by_tenant(self) -> dict[str, int]:
        return {tenant: len(group) for tenant, group in self._cached.items()}

    def cached_pages(self) -> list[int]:
        """Cached pages, each tenant's oldest first."""
        return [p for group in self._cached.values() for p in group]

    def is_cached(self, page: int) -> bool:
        return page in self._group

    def check_integrity(self) -> None:
        free, cached, owned = list(self._free), set(self._group), set(self._owners)
        assert cached == {p for g in self._cached.values() for p in g}, "cached pages and their tenants disagree"
        assert cached == set(self._released_at), "cached pages and their release times disagree"
        assert all(self._cached.values()), "an empty tenant group of cached pages"
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert not set(free) & owned, "a page is both free and owned"
        assert not cached & (owned | set(free)), "a cached page is also free or owned"
        assert len(free) + len(cached) + len(owned) == self.num_pages, "free + cached + used != total"
        assert all(self._owners.values()), "an owned page with no owner"
        assert all(v >= 0 for v in self._reserved.values()), "negative reservation"
        assert self.num_reserved_unallocated <= self.num_free, "reservations exceed free pages"
