"""Page allocator for the paged KV cache. Plain Python, no torch.

One page table per request covers both the MLA latent cache and the indexer key cache: page `p`
holds positions [p_i * page_size, (p_i + 1) * page_size) of a request in every layer's pool.
"""
from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids plus per-owner accounting and reservations (admission by memory)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, str] = {}
        self._reserved: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

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

    def allocate(self, owner: str, n: int) -> list[int]:
        """Take n pages, drawing first on the owner's reservation."""
        from_reservation = min(n, self._reserved.get(owner, 0))
        if n - from_reservation > self.num_available:
            raise OutOfPages(f"need {n} pages for {owner}, {self.num_available} available")
        if from_reservation:
            self._reserved[owner] -= from_reservation
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise RuntimeError(f"page {p} is owned by {self._owner.get(p)!r}, not {owner!r}")
            del self._owner[p]
            self._free.append(p)
        self._reserved.pop(owner, None)

    def check_integrity(self) -> None:
        free = list(self._free)
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert not set(free) & set(self._owner), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "free + used != total"
        assert all(v >= 0 for v in self._reserved.values()), "negative reservation"
        assert self.num_reserved_unallocated <= len(free), "reservations exceed free pages"

    def owned_by(self, owner: str) -> list[int]:
        return [p for p, o in self._owner.items() if o == owner]
