"""The pool's cached pages: unowned pages whose contents the prefix cache keeps, evicted by tenant.

A page no request holds any more stays *cached* when the prefix cache has named it (prefix.py): still
allocatable, and reused by a later request whose prompt starts with the same tokens. Cached pages are
grouped by tenant; an allocation that must evict takes the least recently released page of the tenant
holding the most cached pages, so one tenant's traffic evicts its own pages before it can push another
tenant's below its own count. `TenantLRU` is that order, shared by every prefix-cache tier (pool pages
here, host copies in prefix_host.py, disk files in prefix_disk.py). Plain Python, no torch.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from typing import Callable, Hashable


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

    def last_used(self, key: Hashable) -> float:
        return self._groups[self._tenant[key]][key]

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


class CachedPages:
    """The page allocator's cached pages (pages.py), with their tenants and release times; the pages
    it lets go of go back to `free`, the allocator's free list. The prefix cache sets `tenant_of_named`
    (a released page's tenant if it is worth keeping, else None) and `on_evict` (what to forget when a
    cached page is evicted); `max_per_tenant` bounds a tenant's count."""

    def __init__(self, free: deque[int]):
        self._lru, self._free = TenantLRU(), free
        self.clock: Callable[[], float] = time.time
        self.max_per_tenant: int | None = None
        self.tenant_of_named: Callable[[int], str | None] = lambda page: None
        self.on_evict: Callable[[int], None] = lambda page: None

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, page: int) -> bool:
        return page in self._lru

    def keep(self, page: int) -> None:
        """A page no request holds any more: cached if named, else free. A tenant's oldest cached pages
        beyond `max_per_tenant` are evicted (to the prefix cache's lower tiers, if any) and freed: one
        tenant's traffic cannot fill the pool's cache."""
        tenant = self.tenant_of_named(page)
        if tenant is None:
            self._free.append(page)
            return
        self._lru.add(page, tenant, self.clock())
        for old in self._lru.over(tenant, self.max_per_tenant):
            self._lru.remove(old)
            self.on_evict(old)
            self._free.append(old)

    def evict(self) -> int:
        """Reuse the oldest cached page of the largest holder (its contents are forgotten)."""
        page = self._lru.victim()
        self._lru.remove(page)
        self.on_evict(page)
        return page

    def remove(self, page: int) -> None:
        """A cached page is shared by a prefix hit."""
        self._lru.remove(page)

    def drop(self, pages: list[int]) -> list[int]:
        """Free cached pages (their contents are forgotten by the caller); returns them."""
        for page in pages:
            self._lru.remove(page)
            self._free.append(page)
        return pages

    def unused_since(self, cutoff: float) -> list[int]:
        return self._lru.unused_since(cutoff)

    def last_used(self, page: int) -> float:
        """When the page was released (or last hit)."""
        return self._lru.last_used(page)

    def pages(self, tenant: str | None = None) -> list[int]:
        """A tenant's cached pages (every tenant's with None), each tenant's oldest first."""
        return self._lru.keys(tenant)

    def by_tenant(self) -> dict[str, int]:
        return self._lru.counts()

    def check_integrity(self) -> None:
        self._lru.check_integrity()
