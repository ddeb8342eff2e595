"""Which data-parallel rank a request goes to. Torch-free.

Each rank has its own prefix cache, so a prompt is sent where its longest prefix was sent before
(counted in whole KV pages, per tenant and cache_salt, as the prefix cache keys them), and among
equals to the rank with the fewest requests in flight. The router remembers the page chains it
routed, up to `max_pages_per_rank` per rank (least recently used first out): an approximation of each
rank's cache, which may have evicted them since (a miss then costs what it costs anyway).

Affinity yields to load, as in SGLang's cache-aware router: only ranks within `BALANCE_SLACK` requests
in flight of the least loaded rank, or within `BALANCE_RATIO` times its count, take a request for its
prefix; past that the prefix is recomputed on a less loaded rank. Without it every prompt sharing a
page with the first one (a system prompt, a chat template's opening) went to one rank while the
others idled; once a rank has taken such a prompt it holds the shared pages too.
"""
from __future__ import annotations

from collections import OrderedDict


BALANCE_SLACK = 4  # requests in flight a rank may have over the least loaded one and still be preferred for its prefix
BALANCE_RATIO = 1.25  # or this many times the least loaded rank's, whichever is more


class PrefixAffinityRouter:
    def __init__(self, num_ranks: int, page_size: int, max_pages_per_rank: int = 1 << 20):
        self.page_size, self.max_pages = page_size, max_pages_per_rank
        self.seen: list[OrderedDict] = [OrderedDict() for _ in range(num_ranks)]
        self.in_flight = [0] * num_ranks

    def chain(self, token_ids: list[int], tenant: str, cache_salt: str | None) -> list[int]:
        """One key per whole page of the prompt, each naming the page and everything before it."""
        keys, key = [], hash((tenant, cache_salt))
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            key = hash((key, tuple(token_ids[start:start + self.page_size])))
            keys.append(key)
        return keys

    def matched_pages(self, rank: int, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.seen[rank]:
            n += 1
        return n

    def choose(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None) -> int:
        """The rank for a new request (counted as in flight there until `finished`)."""
        rank = self.peek(token_ids, tenant, cache_salt)
        self.assign(rank, token_ids, tenant, cache_salt)
        return rank

    def peek(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None) -> int:
        """The rank `choose` would give the prompt now, changing nothing."""
        keys = self.chain(token_ids, tenant, cache_salt)
        least = min(self.in_flight)
        bound = max(least + BALANCE_SLACK, BALANCE_RATIO * least)
        eligible = [r for r in range(len(self.seen)) if self.in_flight[r] <= bound]
        return min(eligible, key=lambda r: (-self.matched_pages(r, keys), self.in_flight[r], r))

    def assign(self, rank: int, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None) -> None:
        """A request goes to `rank`: its pages are remembered there, and it is in flight until `finished`."""
        seen = self.seen[rank]
        for key in self.chain(token_ids, tenant, cache_salt):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_pages:
            seen.popitem(last=False)
        self.reserve(rank)

    def reserve(self, rank: int) -> None:
        """Count one more request in flight on `rank` (a claim for a request still to come)."""
        self.in_flight[rank] += 1

    def finished(self, rank: int) -> None:
        self.in_flight[rank] -= 1
