"""The prefix cache's host tier: evicted pages' contents kept in host memory, so a later hit copies
them back instead of recomputing them (SGLang's HiCache idea, for the prefix cache).

When the page allocator evicts a named page (prefix.py), its rows in every slot-indexed tensor of the
cache are copied here under the page's name: MLA latents and indexer keys (device pool), or host-store
latents and device indexer keys (tiered pool), and Quest page bounds. A prefix lookup continues its
chain here after the pool's own pages; each host hit takes a new pool page, gets the saved rows back,
and is named again. Bounded by `capacity_bytes`, least recently stored or used first out. The copy is
exact (the same bytes), so a host hit computes what a pool hit does.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixHostStore:
    def __init__(self, tensors: list[tuple[torch.Tensor, int]], page_size: int, capacity_bytes: int):
        for tensor, tokens_per_row in tensors:
            if page_size % tokens_per_row:
                raise ValueError(f"a tensor with {tokens_per_row} tokens per row does not tile pages of {page_size}")
        self.tensors, self.page_size = tensors, page_size
        self.page_bytes = sum(page_size // per_row * t[0].numel() * t.element_size() for t, per_row in tensors)
        self.capacity_bytes = capacity_bytes
        self._pages: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()  # oldest first
        self.saved = self.loaded = self.dropped = 0

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def bytes_used(self) -> int:
        return len(self._pages) * self.page_bytes

    def _rows(self, page: int, per_row: int) -> slice:
        return slice(page * self.page_size // per_row, (page + 1) * self.page_size // per_row)

    def has(self, name: bytes) -> bool:
        return name in self._pages

    def touch(self, name: bytes) -> None:
        if name in self._pages:
            self._pages.move_to_end(name)

    def save(self, name: bytes, page: int) -> None:
        """Keep a copy of pool page `page`'s rows under `name` (dropping the oldest copies over budget)."""
        if self.page_bytes > self.capacity_bytes:
            return
        if name in self._pages:
            self._pages.move_to_end(name)
            return
        while self.bytes_used + self.page_bytes > self.capacity_bytes:
            self._pages.popitem(last=False)
            self.dropped += 1
        self._pages[name] = [t[self._rows(page, per_row)].to("cpu", copy=True) for t, per_row in self.tensors]
        self.saved += 1

    def load(self, name: bytes, page: int) -> None:
        """Write the copy saved under `name` into pool page `page` (the copy is kept)."""
        self._pages.move_to_end(name)
        for (t, per_row), rows in zip(self.tensors, self._pages[name]):
            t[self._rows(page, per_row)] = rows.to(t.device)
        self.loaded += 1

    def stats(self) -> dict:
        return {"prefix_host_pages": self.num_pages, "prefix_host_bytes": self.bytes_used,
                "prefix_host_budget_bytes": self.capacity_bytes}

    def check_integrity(self) -> None:
        assert self.bytes_used <= self.capacity_bytes, "the prefix host store is over its budget"
        for rows in self._pages.values():
            assert len(rows) == len(self.tensors), "a saved page lacks a tensor's rows"
