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

import itertools
import time
from collections import OrderedDict, deque
from typing import Callable, Hashable


class OutOfPages(RuntimeError):
    pass


class TenantLRU:
    """Keys grouped by tenant, each group least recently used first, with each key's time of last use:
    the eviction order of every prefix-cache tier (pool pages, host copies, disk files). The victim is
    the oldest key of the tenant holding the most (ties: the group formed first), so one tenant's
    traffic pushes out its own keys before it can bring another tenant below its own count; `over`
    gives a tenant's keys beyond a quota."""

    def __init__(self):
        self._groups: dict[str, OrderedDict[Hashable, float]] = {}
        self._tenant: dict[Hashable, str] = {}

    def __len__(self) -> int:
        return len(self._tenant)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tenant

    def tenant(self, key: Hashable) -> str:
        return self._tenant[key]

    def add(self, key: Hashable, tenant: str, now: float) -> None:
        """`key` is the tenant's newest (a new key must not be held already)."""
        assert key not in self._tenant, f"{key!r} is already held"
        self._tenant[key] = tenant
        self._groups.setdefault(tenant, OrderedDict())[key] = now

    def touch(self, key: Hashable, now: float) -> None:
        group = self._groups[self._tenant[key]]
        group.move_to_end(key)
        group[key] = now

    def remove(self, key: Hashable) -> str:
        """Forget `key`; returns its tenant."""
        tenant = self._tenant.pop(key)
        group = self._groups[tenant]
        del group[key]
        if not group:
            del self._groups[tenant]
        return tenant

    def victim(self, adding: str | None = None) -> Hashable:
        """The oldest key of the largest holder, counting the key `adding`'s tenant is about to add."""
        largest = max(self._groups, key=lambda t: len(self._groups[t]) + (t == adding))
        return next(iter(self._groups[largest]))

    def over(self, tenant: str, quota: int | None) -> list:
        """The tenant's oldest keys beyond `quota` (None: no bound)."""
        group = self._groups.get(tenant, {})
        return [] if quota is None else list(itertools.islice(group, max(0, len(group) - quota)))

    def unused_since(self, cutoff: float) -> list:
        """The keys last used before `cutoff`."""
        return [k for group in self._groups.values()
                for k in itertools.takewhile(lambda k, g=group: g[k] < cutoff, group)]

    def keys(self, tenant: str | None = None) -> list:
        """A tenant's keys (every tenant's with None), each tenant's oldest first."""
        return [k for t, group in self._groups.items() if tenant is None or t == tenant for k in group]

    def oldest_first(self) -> list:
        """Every key, least recently used first across tenants."""
        return sorted(self._tenant, key=lambda k: self._groups[self._tenant[k]][k])

    def counts(self) -> dict[str, int]:
        return {tenant: len(group) for tenant, group in self._groups.items()}

    def check_integrity(self) -> None:
        assert all(self._groups.values()), "an empty tenant group"
        assert sum(map(len, self._groups.values())) == len(self._tenant), "a key is in two tenant groups"
        assert all(k in self._groups[t] for k, t in self._tenant.items()), "a key is not in its tenant's group"


class PageAllocator:
    """Free list of page ids plus per-owner accounting and reservations (admission by memory)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owners: dict[int, set[str]] = {}
        self._reserved: dict[str, int] = {}
        self._cached = TenantLRU()  # unowned pages whose contents are kept, by tenant, with release times
        self.clock: Callable[[], float] = time.time
        self.max_cached_per_tenant: int | None = None  # a tenant's cached pages beyond this are evicted
        # Set by the prefix cache: a released page's tenant if it is worth keeping (else None), and
        # what to forget when a cached page is evicted.
        self.tenant_of_named: Callable[[int], str | None] = lambda page: None
        self.on_evict: Callable[[int], None] = lambda page: None

    @property
    def num_free(self) -> int:
        """Pages a request may take: never used, or cached (evicted on allocation)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

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

    def share_and_reserve(self, owner: str, shared: list[int], num_pages: int, keep_free: int = 0) -> bool:
        """Admit `owner` onto `shared` pages (a prefix hit) plus `num_pages` future ones, leaving at least
        `keep_free` pages available, or do nothing and return False: sharing a cached page takes it out
        of the allocatable pool."""
        leaving = sum(p in self._cached for p in shared)
        if num_pages + keep_free > self.num_available - leaving:
            return False
        for p in shared:
            if p in self._cached:
                self._cached.remove(p)
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
        pages = [self._take() for _ in range(n)]
        for p in pages:
            self._owners[p] = {owner}
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page = self._cached.victim()  # the largest holder's oldest
        self._cached.remove(page)
        self.on_evict(page)
        return page

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            owners = self._owners.get(p, ())
            if owner not in owners:
                raise RuntimeError(f"page {p} is owned by {sorted(owners)!r}, not {owner!r}")
            owners.discard(owner)
            if not owners:
                del self._owners[p]
                tenant = self.tenant_of_named(p)
                if tenant is not None:
                    self._cached.add(p, tenant, self.clock())
                    self._hold_quota(tenant)
                else:
                    self._free.append(p)
        self._reserved.pop(owner, None)

    def _hold_quota(self, tenant: str) -> None:
        """Evict the tenant's oldest cached pages beyond `max_cached_per_tenant` (to the prefix cache's
        lower tiers, if any): one tenant's traffic cannot fill the pool's cache."""
        for page in self._cached.over(tenant, self.max_cached_per_tenant):
            self._cached.remove(page)
            self.on_evict(page)
            self._free.append(page)

    def num_owners(self, page: int) -> int:
        return len(self._owners.get(page, ()))

    def expire_cached(self, cutoff: float) -> list[int]:
        """Free the cached pages released before `cutoff` (their contents are forgotten); returns them."""
        return self._free_cached(self._cached.unused_since(cutoff))

    def drop_cached(self, tenant: str | None = None) -> list[int]:
        """Free a tenant's cached pages (every tenant's with None), contents forgotten; returns them."""
        return self._free_cached(self._cached.keys(tenant))

    def _free_cached(self, pages: list[int]) -> list[int]:
        for page in pages:
            self._cached.remove(page)
            self._free.append(page)
        return pages

    def cached_by_tenant(self) -> dict[str, int]:
        return self._cached.counts()

    def cached_pages(self) -> list[int]:
        """Cached pages, each tenant's oldest first."""
        return self._cached.keys()

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def check_integrity(self) -> None:
        free, cached, owned = list(self._free), set(self._cached.keys()), set(self._owners)
        self._cached.check_integrity()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert not set(free) & owned, "a page is both free and owned"
        assert not cached & (owned | set(free)), "a cached page is also free or owned"
        assert len(free) + len(cached) + len(owned) == self.num_pages, "free + cached + used != total"
        assert all(self._owners.values()), "an owned page with no owner"
        assert all(v >= 0 for v in self._reserved.values()), "negative reservation"
        assert self.num_reserved_unallocated <= self.num_free, "reservations exceed free pages"
