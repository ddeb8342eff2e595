"""The prefix cache's pages moving between engines (prefill/decode disaggregation, docs/disaggregation.md):
how many of a prompt's pages a cache holds, their rows out, another engine's rows in. A part of
`PrefixCache` (prefix.py), kept apart so the cache's own bookkeeping reads alone; torch-free (rows
are opaque to it: the pool's `PageRows` copies them)."""
from __future__ import annotations

_IMPORTING = "\x00prefix-import"  # the allocator owner of pages an import is writing (no request id)
MAX_TAILS = 64  # imported tails waiting for their requests; past it the oldest goes (its request computes the page)


def tail_tokens(num_tokens: int, page_size: int) -> int:
    """A prompt's tail: the tokens of its last token's page, that token included (1 to page_size)."""
    return (num_tokens - 1) % page_size + 1


class PageTransfer:
    """`PrefixCache`'s export and import (it provides the names, tiers, rows and allocator used here)."""

    def held(self, token_ids: list[int], tenant: str, cache_salt: str | None) -> int:
        """How many of a prompt's first pages this cache holds, in any tier (what a transfer can skip)."""
        n = 0
        for name in self.prompt_names(token_ids, tenant, cache_salt):
            if name not in self._page_of and self._tier_of(name) is None:
                break
            n += 1
        return n

    def export(self, token_ids: list[int], tenant: str, cache_salt: str | None, skip: int = 0) -> list:
        """(name, rows) of a prompt's cached pages after its first `skip`, up to the first page not held:
        the rows of every slot-indexed tensor (latents, indexer keys, the MTP layer's, the selector's)."""
        out = []
        for name in self.prompt_names(token_ids, tenant, cache_salt)[skip:]:
            page, tier = self._page_of.get(name), self._tier_of(name)
            if page is None and tier is None:
                break
            if page is not None:
                self.before_copy()
            rows = self.rows.copy_out(page) if page is not None else self.tiers[tier].take(name)
            if rows is None:  # a disk copy that did not read back (its file gone or damaged): not held
                break
            out.append((name, rows))
        return out

    def import_pages(self, pages: list, tenant: str, chains: list[list[bytes]] = ()) -> int:
        """Keep another engine's exported pages, all or none (ValueError: a page whose rows do not fit
        this cache's layout). Returns how many. With `land_in_pool` they land in pool pages when the
        pool has room (`_land`), else, like every import without it, in the host tier."""
        for i, (name, rows) in enumerate(pages):
            if not isinstance(name, bytes) or self.rows is None or not self.rows.fits(rows):
                raise ValueError(f"page {i}: its rows do not fit this cache's layout "
                                 f"({[(tuple(r.shape), r.dtype) for r in rows]} against "
                                 f"{None if self.rows is None else self.rows.layout})")
        if self.land_in_pool and self._land(pages, tenant, chains):
            return len(pages)
        host = self.tiers.get("host")
        if host is None:
            raise ValueError("importing KV pages needs the prefix cache's host tier (prefix_cache_host_bytes)")
        room = host.capacity_bytes // host.page_bytes
        if host.max_pages_per_tenant is not None:
            room = min(room, host.max_pages_per_tenant)
        if len(pages) > room:  # the first pages would be pushed out by the last: the hit would be empty
            raise ValueError(f"{len(pages)} pages of {host.page_bytes} bytes do not fit the prefix cache's host tier, "
                             f"which holds {room} for this tenant (raise prefix_cache_host_bytes, "
                             f"--prefix-cache-host-bytes)")
        for name, rows in pages:
            host.put(name, rows, tenant)
        return len(pages)

    def padded_tails(self, tails: list[tuple[bytes, list, int]]) -> list[tuple[bytes, list, int]]:
        """Prompts' tails (`tail_name`, rows of each kind [n, ...], the prompt's length) padded to whole
        pages, with their row counts, checked (ValueError: rows that do not fit this cache, or a count
        that is neither kind of tail). A tail holds the rows of a prompt's last token's page through that
        token (its requests come with their first token), or through the token before it, a short tail
        (its requests compute that last token: their first token is sampled here)."""
        padded = []
        for i, (key, rows, num_tokens) in enumerate(tails):
            whole = tail_tokens(num_tokens, self.page_size)
            count = rows[0].shape[0] if rows else 0
            if count not in (whole, whole - 1) or count == 0 or any(r.shape[0] != count for r in rows):
                raise ValueError(f"tail {i}: {[r.shape[0] for r in rows]} rows, not the {whole} (or {whole - 1}) "
                                 f"of a {num_tokens}-token prompt's last page")
            rows = [_padded(r, self.page_size) for r in rows]
            if self.rows is None or not self.rows.fits(rows):
                raise ValueError(f"tail {i}: its rows do not fit this cache's layout")
            padded.append((key, rows, count))
        return padded

    def keep_tails(self, padded: list[tuple[bytes, list, int]], uses: int = 1, tenant: str = "default") -> None:
        """Keep checked tails (`padded_tails`) until `uses` requests (a prompt's choices) were admitted
        (`PrefixCache.take`). Not named: a partial page is never a hit for another request. `tenant`:
        whose they are (`reset` of one tenant drops its own). Kept or taken is a use (`PrefixCache.expire`
        forgets a tail unused for the TTL)."""
        if uses < 1:
            raise ValueError(f"a tail needs at least one use, got {uses}")
        now = self.allocator.cached.clock()
        for key, rows, count in padded:
            kept = self._tails.get(key)
            if kept is not None and kept[2] == count:  # the same prompt's tail from another transfer: the
                kept[1] += uses                        # same rows, and the requests before still need theirs
                kept[4] = now
            else:
                self._tails[key] = [rows, uses, count, tenant, now]
            self._tails.move_to_end(key)
        while len(self._tails) > MAX_TAILS:
            self._tails.popitem(last=False)

    def forget(self, names: list[bytes]) -> int:
        """Forget the pages of these names in every tier, unless a request holds one (a failed import's
        pages, undone where it had succeeded: parallel/dp_kv.py). Returns how many copies were forgotten (a
        name held in two tiers counts in each)."""
        pool = [self._page_of[name] for name in names if name in self._page_of]
        dropped = self.allocator.cached.drop([page for page in pool if page in self.allocator.cached])
        for page in dropped:
            self._unname(page)
        return len(dropped) + sum(store.drop_page(name) for store in self.tiers.values() for name in names)

    def _land(self, pages: list, tenant: str, chains: list[list[bytes]]) -> bool:
        """Write imported pages' rows into pool pages and name them, cached like pages a request computed
        and released: a request hits them in the pool it decodes from, and no host-tier copy is kept
        (with the tiered pool their latents are host-store rows, held once). Each of `chains` (a
        prompt's page names) has its pages before the imported ones kept in the pool too, so the hit
        runs from page 0 without leaving it (a lookup stops at a pool page after lower-tier copies):
        pool pages are held while the new ones are allocated (no eviction takes them), lower-tier
        copies land with the imported rows. False, and nothing changed, when the pool has no room."""
        walk, pinned, sources = self._landing(dict(pages), chains)
        owner = _IMPORTING
        if not self.allocator.share_and_reserve(owner, pinned, len(sources)):
            return False
        # NOTE: lower-tier rows are read before allocating: its evictions may push them out of their tier
        saved = [rows if tier is None else self.tiers[tier].take(name) for name, tier, rows in sources]
        if any(rows is None for rows in saved):  # a disk copy that did not read back
            self.allocator.free(owner, pinned)
            return False
        landed = self.allocator.allocate(owner, len(sources))
        try:
            self.before_copy()
            self.rows.copy_in(landed, saved)
        except BaseException:
            self.allocator.free(owner, pinned + landed)
            raise
        for (name, _, _), page in zip(sources, landed):
            self._page_of[name], self._name_of[page], self._tenant_of[page] = page, name, tenant
        self._unmirrored.update(landed)
        # NOTE: a chain's last pages released first are evicted first, so its pool run stays from page 0
        self.allocator.free(owner, [self._page_of[name] for name in reversed(walk)])
        return True

    def _landing(self, given: dict, chains: list[list[bytes]]):
        """What `_land` does: (every page name it keeps, in chain order; the pool pages among them, to
        hold; (name, lower tier or None, given rows) of those to write)."""
        walk, pinned, sources, seen = [], [], [], set()
        for chain in chains:
            for name in chain:
                if name not in self._page_of and name not in given and self._tier_of(name) is None:
                    break
                if name not in seen:
                    seen.add(name)
                    walk.append(name)
        walk += [name for name in given if name not in seen]  # pages on no chain given (or past a gap)
        for name in walk:
            if name in self._page_of:
                pinned.append(self._page_of[name])
            else:
                sources.append((name, None if name in given else self._tier_of(name), given.get(name)))
        return walk, pinned, sources


def _padded(rows, n: int):
    """`rows` [k, ...] as the first k of n rows, the rest zeros (a tensor method: no torch import here)."""
    out = rows.new_zeros(n, *rows.shape[1:])
    out[:rows.shape[0]] = rows
    return out
