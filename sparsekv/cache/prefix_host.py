"""The prefix cache's host tier: evicted pages' contents kept in host memory, so a later hit copies
them back instead of recomputing them (SGLang's HiCache idea, for the prefix cache).

When the page allocator evicts a named page (prefix.py), its rows in every slot-indexed tensor of the
cache are copied here under the page's name: MLA latents and indexer keys (device pool), or host-store
latents and device indexer keys (tiered pool), and Quest page bounds. A prefix lookup continues its
chain here after the pool's own pages; each host hit takes a new pool page, gets the saved rows back,
and is named again. Bounded by `capacity_bytes` (the oldest copy of the largest tenant first out) and
optionally per tenant; a copy pushed out goes to the disk tier below when there is one (`spill`,
prefix_disk.py). The copy is exact (the same bytes), so a host hit computes what a pool hit does.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .cached_pages import TenantLRU


class PageRows:
    """A pool page's rows in every slot-indexed tensor: (tensor, tokens per row) pairs, each tiling a
    page of `page_size` tokens with whole rows."""

    def __init__(self, tensors: list[tuple[torch.Tensor, int]], page_size: int):
        for tensor, tokens_per_row in tensors:
            if page_size % tokens_per_row:
                raise ValueError(f"a tensor with {tokens_per_row} tokens per row does not tile pages of {page_size}")
        self.tensors, self.page_size = tensors, page_size
        self.layout = [((page_size // per_row, *t.shape[1:]), t.dtype) for t, per_row in tensors]
        self.page_bytes = sum(page_size // per_row * t[0].numel() * t.element_size() for t, per_row in tensors)

    def _rows(self, page: int, per_row: int) -> slice:
        return slice(page * self.page_size // per_row, (page + 1) * self.page_size // per_row)

    def copy_out(self, page: int) -> list[torch.Tensor]:
        """Copies, in host memory, of pool page `page`'s rows."""
        return [t[self._rows(page, per_row)].to("cpu", copy=True) for t, per_row in self.tensors]

    def copy_in(self, pages: list[int], saved: list[list[torch.Tensor]]) -> None:
        """Write each page's saved rows into pool page `pages[i]`. In host memory each run of
        consecutive pages is one `cat` straight into the pool's rows (a single copy of the bytes); on
        CUDA one staged host -> device transfer per tensor for all the pages, not one per page and tensor."""
        if not pages:
            return
        for j, (t, per_row) in enumerate(self.tensors):
            n = self.page_size // per_row
            if t.device.type == "cuda":
                rows = torch.cat([torch.arange(p * n, (p + 1) * n) for p in pages]).to(t.device)
                values = torch.cat([page_rows[j] for page_rows in saved]).pin_memory()
                t.index_copy_(0, rows, values.to(t.device, non_blocking=True))
                continue
            for first, count in _runs(pages):
                start = pages[first] * n
                torch.cat([page_rows[j] for page_rows in saved[first:first + count]], out=t[start:start + count * n])

    def fits(self, rows: list[torch.Tensor]) -> bool:
        return len(rows) == len(self.layout) and all(
            tuple(r.shape) == shape and r.dtype == dtype for r, (shape, dtype) in zip(rows, self.layout))


def _owns_host_memory(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """(index of its first, length) of each run of consecutive page numbers in `pages`."""
    runs = []
    for i, page in enumerate(pages):
        if runs and page == pages[i - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class PrefixHostStore:
    """`max_pages_per_tenant`: a tenant's copies beyond this many go to the spill tier (None: no bound).
    Over budget, the oldest copy of the tenant holding the most goes first (cached_pages.TenantLRU)."""

    def __init__(self, rows: PageRows, capacity_bytes: int,
                 spill: Callable[[bytes, list[torch.Tensor], str], None] | None = None,
                 max_pages_per_tenant: int | None = None):
        self.rows, self.page_bytes, self.capacity_bytes, self.spill = rows, rows.page_bytes, capacity_bytes, spill
        self.max_pages_per_tenant = max_pages_per_tenant
        self._pages: dict[bytes, list[torch.Tensor]] = {}
        self._lru = TenantLRU()  # by the tenant whose request computed the page, with use times
        self.clock: Callable[[], float] = time.time
        self.saved = self.loaded = self.dropped = 0

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def bytes_used(self) -> int:
        return len(self._pages) * self.page_bytes

    def has(self, name: bytes) -> bool:
        return name in self._pages

    def touch(self, name: bytes) -> None:
        if name in self._pages:
            self._lru.touch(name, self.clock())

    def _forget(self, name: bytes) -> tuple[list[torch.Tensor], str]:
        return self._pages.pop(name), self._lru.remove(name)

    def expire(self, cutoff: float) -> int:
        """Drop the copies last used before `cutoff` (not spilled); returns how many."""
        names = self._lru.unused_since(cutoff)
        for name in names:
            self._forget(name)
        return len(names)

    def drop(self, tenant: str | None = None) -> int:
        """Forget a tenant's copies (every tenant's with None), not spilled; returns how many."""
        names = self._lru.keys(tenant)
        for name in names:
            self._forget(name)
        return len(names)

    def drop_page(self, name: bytes) -> bool:
        """Forget one copy, not spilled; whether there was one."""
        if name not in self._pages:
            return False
        self._forget(name)
        return True

    def _push_out(self, name: bytes) -> None:
        rows, tenant = self._forget(name)
        self.dropped += 1
        if self.spill is not None:
            self.spill(name, rows, tenant)

    def save(self, name: bytes, page: int, tenant: str) -> None:
        """Keep a copy of pool page `page`'s rows under `name`; copies over the budget or the tenant's
        quota go to the spill tier (or are dropped), a page that cannot stay goes there at once."""
        self._keep(name, lambda: self.rows.copy_out(page), tenant)

    def put(self, name: bytes, rows: list[torch.Tensor], tenant: str) -> None:
        """Keep a page's rows made elsewhere (another engine's export, checked with `rows.fits`). A row
        that is a host tensor owning all of its memory is kept as it is (the caller hands it over);
        any other (a view into a larger tensor, a device tensor) is copied, so a copy holds its page's
        bytes and nothing more."""
        self._keep(name, lambda: [r if _owns_host_memory(r) else r.to("cpu", copy=True) for r in rows], tenant)

    def _keep(self, name: bytes, rows, tenant: str) -> None:
        if name in self._pages:
            self.touch(name)
            return
        quota = self.max_pages_per_tenant
        if self.page_bytes > self.capacity_bytes or quota == 0:
            if self.spill is not None:
                self.spill(name, rows(), tenant)
            return
        for old in self._lru.over(tenant, None if quota is None else quota - 1):
            self._push_out(old)
        while self.bytes_used + self.page_bytes > self.capacity_bytes:
            self._push_out(self._lru.victim(adding=tenant))
        self._pages[name] = rows()
        self._lru.add(name, tenant, self.clock())
        self.saved += 1

    def take(self, name: bytes) -> list[torch.Tensor]:
        """The rows saved under `name`, for `PageRows.copy_in` (the copy is kept)."""
        self.touch(name)
        self.loaded += 1
        return self._pages[name]

    def items(self):
        """(name, rows, tenant) of every copy, least recently used first."""
        return [(name, self._pages[name], self._lru.tenant(name)) for name in self._lru.oldest_first()]

    def last_used(self, name: bytes) -> float:
        return self._lru.last_used(name)

    def pages_by_tenant(self) -> dict[str, int]:
        return self._lru.counts()

    def stats(self) -> dict:
        return {"prefix_host_pages": self.num_pages, "prefix_host_bytes": self.bytes_used,
                "prefix_host_budget_bytes": self.capacity_bytes, "prefix_host_saves": self.saved,
                "prefix_host_loads": self.loaded, "prefix_host_evictions": self.dropped}

    def check_integrity(self) -> None:
        assert self.bytes_used <= self.capacity_bytes, "the prefix host store is over its budget"
        self._lru.check_integrity()
        assert set(self._lru.keys()) == self._pages.keys(), "host copies and their tenants disagree"
        quota = self.max_pages_per_tenant
        assert quota is None or all(n <= quota for n in self._lru.counts().values()), "a tenant is over its quota"
        for rows in self._pages.values():
            assert self.rows.fits(rows), "a saved page's rows do not match the pool's layout"
