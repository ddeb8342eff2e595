"""The prefix cache: full KV pages reused by later requests whose prompts start with the same tokens.

Torch-free bookkeeping over the page allocator (pages.py), in the manner of vLLM's automatic prefix
caching. Page i of a request is named by a hash chain: sha256(name of page i - 1, its page_size
tokens), whose root is sha256(tenant, cache_salt). So a page is found only by a request of the same
tenant and salt whose tokens agree from position 0 through the page's last one: the KV entries of a
position (latent, indexer keys, Quest bounds) depend on exactly those tokens, so a hit reads what the
request would have computed. Tenants never see each other's pages, in any tier: one page id
addresses a position in every tier (device pool, or host store and device indexer keys when tiered).

A page is registered once it is full and computed; released, it stays cached (allocatable, evicted
least recently released first) until a hit takes it or an allocation reuses it. Hits are counted by
tier: "device" for pages still in the engine's KV pool (with kv_tiering: latents in the host store,
indexer keys on the device), "host" and "disk" for pages copied back from a lower tier (below). A request's
last prompt token is always computed, so the step that samples its first token has logits. Pages
are only read by a request that shares them: it writes from its first uncached position on, which
is always at a page boundary.

Below the pool are optional lower tiers, in order: the host tier (prefix_host.py) and the disk tier
(prefix_disk.py). A page evicted from the pool goes to the first; one pushed out of the host tier goes
to the disk tier. A lookup continues its chain through them after the pool's pages.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from ..request import Request
from .pages import PageAllocator
from .prefix_transfer import PageTransfer, tail_tokens  # noqa: F401  (importable from here too)


def cacheable_pages(num_tokens: int, page_size: int) -> int:
    """How many of a prompt's pages can be cached: every full page but the one holding its last token
    (a hit must leave that token to compute, for its logits)."""
    return (num_tokens - 1) // page_size


@dataclass
class PrefixHit:
    pages: list[int] = field(default_factory=list)         # pool pages to share, in order from page 0
    lower_names: list[bytes] = field(default_factory=list)  # then pages to copy back from a lower tier
    wait: bool = False  # the next page is being computed by a running request: admit after it


@dataclass(frozen=True)
class CachedPrefix:
    """What an admitted request took from the prefix cache: `page_ids`, the shared pool pages then the
    pages taken from its reservation for lower-tier copies, of which the first `num_pages` hold its
    cached tokens (a copy that did not come back leaves its page to be computed); `restored_page_ids`,
    the pages whose rows a copy was written into, and `tiers`, the tier each came from."""

    page_ids: list[int] = field(default_factory=list)
    num_pages: int = 0
    restored_page_ids: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    num_tail_tokens: int = 0  # cached tokens of the page after the `num_pages` (an imported tail)


class PrefixCache(PageTransfer):
    """`lookahead` 1 (speculative decoding): a page's name also covers the token after it, since the
    MTP layer's entry at the page's last position is made from that token. `tiers`: the lower tiers by
    name, in order ({"host": PrefixHostStore, "disk": PrefixDiskStore}, either or both, or none), with
    `before_copy` run before they read or write pool rows (the tiered pool's flush of pending backups).
    `ttl_s`: a page no request has used for that long is forgotten in every tier (`expire`)."""

    def __init__(self, allocator: PageAllocator, lookahead: int = 0, tiers: dict | None = None,
                 before_copy=lambda: None, ttl_s: float | None = None, disk_read_ahead: bool = True,
                 rows=None, land_in_pool: bool = False):
        self.allocator, self.page_size, self.lookahead = allocator, allocator.page_size, lookahead
        self.land_in_pool = land_in_pool  # imports land in pool pages (else in the host tier)
        self._unmirrored: set[int] = set()  # pool pages an import wrote on this rank only (see `take`)
        self.disk_read_ahead = disk_read_ahead
        self.rows = rows  # PageRows of the pool: what a page's contents are (export)
        self.tiers, self.before_copy, self.ttl_s = tiers or {}, before_copy, ttl_s
        self.expired_pages = 0
        self._page_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._chains: dict[str, list[bytes]] = {}  # request -> names of its first pages
        self._named: dict[str, int] = {}  # request -> pages registered so far
        self._tenant_of: dict[int, str] = {}  # named page -> the tenant whose request computed it
        self._inflight: dict[bytes, str] = {}  # prompt page name -> running request computing it
        self._claims: dict[str, list[bytes]] = {}  # request -> the names it claimed
        self._reading: dict[str, list[bytes]] = {}  # waiting request -> its disk pages being read ahead
        self._served: dict[str, dict[str, int]] = {}  # request -> its cached tokens by lower tier, as first admitted
        self._tails: OrderedDict[bytes, list] = OrderedDict()  # by `tail_name`: [rows, uses, count, tenant, last use]
        allocator.cached.tenant_of_named = self._tenant_of.get
        allocator.cached.on_evict = self._forget_page
        self.queried_tokens = 0
        self.hit_tokens = {"device": 0, "host": 0, "disk": 0}
        # a preempted request's lookups again, apart (vLLM keeps them apart too): tokens looked up, served by tier
        self.preempted_queried_tokens = 0
        self.preempted_hit_tokens = {"device": 0, "host": 0, "disk": 0}
        self.by_tenant: dict[str, dict[str, int]] = {}  # tenant -> queried and hit prompt tokens

    def _names(self, req: Request, num_pages: int) -> list[bytes]:
        """Names of the request's first `num_pages` pages, extending its chain (prompt, then output)."""
        chain = self._chains.setdefault(req.request_id, [])
        ps = self.page_size
        while len(chain) < num_pages:
            start, end, n = len(chain) * ps, (len(chain) + 1) * ps + self.lookahead, req.num_prompt_tokens
            tokens = req.prompt_token_ids[start:end] + req.output_token_ids[max(0, start - n):max(0, end - n)]
            chain.append(_next_name(chain[-1] if chain else _root(req.tenant, req.cache_salt), tokens))
        return chain[:num_pages]

    def prompt_names(self, token_ids: list[int], tenant: str, cache_salt: str | None) -> list[bytes]:
        """The names of a prompt's pages that can be cached: every full page but the last token's."""
        ps, chain = self.page_size, []
        for i in range(cacheable_pages(len(token_ids), ps)):
            chain.append(_next_name(chain[-1] if chain else _root(tenant, cache_salt),
                                    token_ids[i * ps:(i + 1) * ps + self.lookahead]))
        return chain

    def tail_name(self, token_ids: list[int], tenant: str, cache_salt: str | None,
                  chain: list[bytes] | None = None) -> bytes:
        """The key of a prompt's tail (`keep_tails`): its last cacheable page's name (or the root) and
        the tokens after that page (`chain`: the prompt's `prompt_names`, if the caller has them)."""
        if chain is None:
            chain = self.prompt_names(token_ids, tenant, cache_salt)
        return self._tail_key(chain, token_ids, tenant, cache_salt)

    def _tail_key(self, chain: list[bytes], token_ids: list[int], tenant: str, cache_salt: str | None) -> bytes:
        parent = chain[-1] if chain else _root(tenant, cache_salt)
        return _next_name(parent + b"tail", token_ids[len(chain) * self.page_size:])

    def match(self, req: Request) -> PrefixHit | None:
        """What the request's known tokens hit, or None while it must wait: a running request computes
        its next page, or its pages on the disk tier are being read (the read is started here). A
        request with prompt_logprobs hits nothing: every prompt row is computed for them (as in vLLM)."""
        if req.params.prompt_logprobs is not None:
            return PrefixHit()
        hit = self.lookup(req)
        if hit.wait or (hit.lower_names and not self.read_ahead(req, hit.lower_names)):
            return None
        return hit

    def take(self, req: Request, hit: PrefixHit) -> CachedPrefix:
        """Once the allocator has shared the hit's pool pages with `req` and reserved the rest: copy the
        hit's lower-tier pages back into pages of its reservation, count the hit, and claim the prompt
        pages it will compute."""
        pages, tiers = self._restore(req, hit.lower_names) if hit.lower_names else ([], [])
        self._served.setdefault(req.request_id, {t: tiers.count(t) * self.page_size for t in ("host", "disk")})
        self._claim(req)
        landed = [p for p in hit.pages if p in self._unmirrored]  # written by an import: copied to every rank
        self._unmirrored.difference_update(landed)
        num_pages = len(hit.pages) + len(tiers)
        tail, tail_rows = self._take_tail(req, num_pages)
        if req.params.prompt_logprobs is None:
            self._count_hit(req, len(hit.pages) * self.page_size + tail_rows, tiers)
        return CachedPrefix(hit.pages + pages + tail, num_pages, landed + pages[:len(tiers)] + tail, tiers, tail_rows)

    def _take_tail(self, req: Request, num_pages: int) -> tuple[list[int], int]:
        """The prompt's imported tail (`keep_tails`) for a request that fits it: a whole tail (its last
        token's page through that token) for one whose first token was sampled where the prompt was
        computed (its one output token), a short tail (through the token before) for one that samples
        its first token here (none yet). Written into a page of its reservation when the hit covers
        every page before it: ([that page], its rows), or ([], 0) (the request computes the page). Each
        admission that fits takes one of the tail's uses either way (one per choice of the prompt), the
        last one the tail."""
        if not self._tails or req.num_output_tokens > 1:
            return [], 0
        cacheable = cacheable_pages(req.num_prompt_tokens, self.page_size)
        key = self._tail_key(self._names(req, cacheable), req.prompt_token_ids, req.tenant, req.cache_salt)
        entry = self._tails.get(key)
        whole = tail_tokens(req.num_prompt_tokens, self.page_size)
        if entry is None or entry[2] != (whole if req.num_output_tokens else whole - 1):  # whole, or short
            return [], 0
        rows, entry[1], entry[4] = entry[0], entry[1] - 1, self.allocator.cached.clock()  # used or not
        if entry[1] == 0:
            del self._tails[key]
        if num_pages != cacheable or req.params.prompt_logprobs is not None:
            return [], 0
        page = self.allocator.allocate(req.request_id, 1)
        self.before_copy()
        self.rows.copy_in(page, [rows])
        return page, entry[2]

    def lookup(self, req: Request) -> PrefixHit:
        """The pages the request's known tokens start with (its prompt; after a preemption, its output
        too), never the last token's page: the longest run of named pool pages from page 0, then of
        pages saved in the lower tiers."""
        hit = PrefixHit()
        for name in self._names(req, (req.num_tokens - 1) // self.page_size):
            page = self._page_of.get(name)
            if page is not None and hit.lower_names:
                break  # a pool page after lower-tier copies (evicted out of chain order): computed instead
            if page is not None:
                hit.pages.append(page)
            elif self._tier_of(name) is not None:
                hit.lower_names.append(name)
            else:
                hit.wait = self._inflight.get(name, req.request_id) != req.request_id
                break
        return hit

    def _claim(self, req: Request) -> None:
        """An admitted request's prompt pages that no page holds yet: being computed by it, so a
        request with the same prefix waits for them instead of computing them again."""
        for name in self._names(req, (req.num_tokens - 1) // self.page_size):
            if name not in self._page_of and name not in self._inflight:
                self._inflight[name] = req.request_id
                self._claims.setdefault(req.request_id, []).append(name)

    def _tier_of(self, name: bytes) -> str | None:
        return next((tier for tier, store in self.tiers.items() if store.has(name)), None)

    def _restore(self, req: Request, names: list[bytes]) -> tuple[list[int], list[str]]:
        """Copy lower-tier pages back into new pool pages of `req` (from its reservation), naming them
        again. Returns the pages taken and the tier each restored page came from, in order: an
        allocation's eviction may push a copy out of its tier, or a disk page may not read back, and the
        pages from there on are computed instead."""
        for name in names:
            for store in self.tiers.values():
                store.touch(name)  # newest: the evictions below push older copies out first
        pages, restored, saved = [], [], []
        for name in names:
            pages.append(self.allocator.allocate(req.request_id, 1)[0])
            tier = self._tier_of(name) if len(restored) == len(pages) - 1 else None
            rows = self.tiers[tier].take(name) if tier is not None else None
            if rows is None:
                continue
            self._page_of[name], self._name_of[pages[-1]], self._tenant_of[pages[-1]] = pages[-1], name, req.tenant
            restored.append(tier)
            saved.append(rows)
        if saved:  # every restored page's rows in one copy per tensor
            self.before_copy()
            self.tiers[restored[0]].rows.copy_in(pages[:len(saved)], saved)
        return pages, restored

    def _count_hit(self, req: Request, device_tokens: int, restored: list[str]) -> None:
        """One prompt's lookup: its prompt tokens queried (not a first token carried from a prefill
        worker), the tokens served from the pool (an imported tail's included) and from each lower tier.
        A preempted request's lookup again is counted apart: it is no new prompt (and its tokens are its
        output's too)."""
        if req.num_preemptions:
            self.preempted_queried_tokens += req.num_tokens
            self.preempted_hit_tokens["device"] += device_tokens
            for tier in restored:
                self.preempted_hit_tokens[tier] += self.page_size
            return
        self.queried_tokens += req.num_prompt_tokens
        self.hit_tokens["device"] += device_tokens
        for tier in restored:
            self.hit_tokens[tier] += self.page_size
        tenant = self.by_tenant.setdefault(req.tenant, {"queries": 0, "hits": 0})
        tenant["queries"] += req.num_prompt_tokens
        tenant["hits"] += device_tokens + len(restored) * self.page_size

    def register(self, req: Request) -> None:
        """Name the request's full, computed pages; a name already held by another page keeps that page."""
        known = req.num_tokens - self.lookahead  # a name needs its lookahead token
        full = min(req.num_computed_tokens // self.page_size, known // self.page_size, len(req.page_ids))
        done = self._named.get(req.request_id, 0)
        if full <= done:
            return
        for name, page in zip(self._names(req, full)[done:], req.page_ids[done:full]):  # the newly full pages
            if self._inflight.get(name) == req.request_id:
                del self._inflight[name]
            if name not in self._page_of and page not in self._name_of:
                self._page_of[name], self._name_of[page], self._tenant_of[page] = page, name, req.tenant
        self._named[req.request_id] = full

    def read_ahead(self, req: Request, names: list[bytes]) -> bool:
        """Start reading the disk-tier pages among a hit's `names`; True once they are in memory (the
        request is admitted then; until then it waits and the engine steps on without it)."""
        disk = self.tiers.get("disk")
        if disk is None or not self.disk_read_ahead:  # without read-ahead the restore reads them, in the step
            return True
        on_disk = [n for n in names if self._tier_of(n) == "disk"]
        if disk.prefetch(on_disk):
            self._reading.pop(req.request_id, None)
            return True
        self._reading[req.request_id] = on_disk
        return False

    def wait_for_reads(self, timeout: float) -> None:
        if "disk" in self.tiers and self._reading:
            self.tiers["disk"].wait_for_reads(timeout)

    def served(self, request_id: str) -> dict[str, int]:
        """The request's cached tokens copied back from each lower tier when it was first admitted."""
        return self._served.get(request_id, {"host": 0, "disk": 0})

    def forget_request(self, request_id: str, keep_served: bool = False) -> None:
        """A request leaves the running set; `keep_served`: a preemption (it is admitted again)."""
        if not keep_served:
            self._served.pop(request_id, None)
        reading = self._reading.pop(request_id, [])
        if reading:
            self.tiers["disk"].discard(reading)
        self._chains.pop(request_id, None)
        self._named.pop(request_id, None)
        for name in self._claims.pop(request_id, ()):
            if self._inflight.get(name) == request_id:
                del self._inflight[name]

    def _forget_page(self, page: int) -> None:
        """An evicted page: its contents go to the first lower tier, if any, before the name is forgotten."""
        if self.tiers:
            self.before_copy()
            next(iter(self.tiers.values())).save(self._name_of[page], page, self._tenant_of[page])
        self._unname(page)

    def _unname(self, page: int) -> None:
        del self._page_of[self._name_of.pop(page)]
        del self._tenant_of[page]
        self._unmirrored.discard(page)

    def set_clock(self, clock) -> None:
        """The time source of release and use times (time.time; a test's fake clock)."""
        self.allocator.cached.clock = clock
        for store in self.tiers.values():
            store.clock = clock

    def expire(self) -> int:
        """Forget, in every tier, the pages no request has used for `ttl_s` seconds (a retention
        bound: a tenant's cached prompt is gone within `ttl_s` of its last use), and the imported tails
        unused as long. Returns how many pages."""
        if self.ttl_s is None:
            return 0
        cutoff = self.allocator.cached.clock() - self.ttl_s
        pages = self.allocator.cached.drop(self.allocator.cached.unused_since(cutoff))
        for page in pages:
            self._unname(page)
        self._expire_tails(cutoff)
        n = len(pages) + sum(store.expire(cutoff) for store in self.tiers.values())
        self.expired_pages += n
        return n

    def _expire_tails(self, cutoff: float) -> None:
        for key in [k for k, kept in self._tails.items() if kept[4] < cutoff]:
            del self._tails[key]  # its request, if it comes, computes the page

    def reset(self, tenant: str | None = None) -> int:
        """Forget a tenant's cached pages in every tier (every tenant's with None): vLLM's
        reset_prefix_cache, SGLang's flush_cache, per tenant. Pages held by running requests stay (in
        use). Returns how many were forgotten."""
        pages = self.allocator.cached.drop(self.allocator.cached.pages(tenant))
        for page in pages:
            self._unname(page)
        for key in [k for k, kept in self._tails.items() if tenant is None or kept[3] == tenant]:
            del self._tails[key]  # a request without its tail computes the page
        return len(pages) + sum(store.drop(tenant) for store in self.tiers.values())

    def new_weights(self, disk=None) -> int:
        """The model's weights changed: forget every cached page in the pool and the host tier, of every
        tenant (their KV was computed with the old weights), and replace the disk tier by `disk` (one
        for the new weights' checkpoint, or None). The old disk tier is closed, its files kept: they are
        named by the old checkpoint's identity, so only an engine with those weights reads them again.
        Pages held by running requests stay (the engine updates weights with none running). Returns how
        many pages were forgotten."""
        old = self.tiers.pop("disk", None)
        if old is not None:
            old.close()
        self._reading.clear()  # reads from the old disk tier: a waiting request looks its prefix up again
        n = self.reset(None)
        if "host" in self.tiers:
            self.tiers["host"].spill = disk.save_rows if disk is not None else None
        if disk is not None:
            disk.clock = self.allocator.cached.clock
            self.tiers["disk"] = disk
        return n

    def persist(self) -> None:
        """Before the engine closes: save the pool's cached pages and the host tier's copies to the disk
        tier, so a restart finds them. Expired pages first go (a restart must not serve a page older
        than the TTL); the rest are saved least recently used first (the budget keeps the newest), each
        file stamped with its page's last use, so the TTL after a restart counts from there."""
        disk = self.tiers.get("disk")
        if disk is None:
            return
        self.expire()
        self.before_copy()
        for used_at, name, held, tenant in sorted(self._pages_to_persist(), key=lambda entry: entry[0]):
            if isinstance(held, int):
                disk.save(name, held, tenant, used_at)
            else:
                disk.save_rows(name, held, tenant, used_at)
        disk.flush()

    def _pages_to_persist(self) -> list[tuple[float, bytes, int | list, str]]:
        """(last use, name, pool page or host copy's rows, tenant) of every page the pool and the host
        tier hold."""
        host, cached = self.tiers.get("host"), self.allocator.cached
        copies = [(host.last_used(name), name, rows, tenant) for name, rows, tenant in host.items()] if host else []
        return copies + [(cached.last_used(page), self._name_of[page], page, self._tenant_of[page])
                         for page in cached.pages()]

    def stats(self) -> dict:
        hits = sum(self.hit_tokens.values())
        return {**{f"prefix_cache_hits_{tier}": n for tier, n in self.hit_tokens.items()},
                **{f"prefix_cache_preempted_hits_{tier}": n for tier, n in self.preempted_hit_tokens.items()},
                "prefix_cache_queries": self.queried_tokens, "prefix_cached_pages": len(self.allocator.cached),
                "prefix_cache_preempted_queries": self.preempted_queried_tokens,
                "prefix_cache_hit_rate": hits / self.queried_tokens if self.queried_tokens else 0.0,
                "prefix_cache_expired_pages": self.expired_pages, "prefix_cache_by_tenant": self.tenant_stats(),
                **{k: v for store in self.tiers.values() for k, v in store.stats().items()}}

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: prompt tokens looked up and served, and the pages cached for it in each tier (an
        operator's view of who holds the cache; tenants come from the server's API keys, a bounded set).
        Disk files record only a digest of their tenant: files of a tenant no request has named since
        the engine started are listed under "digest:" and the digest's first 12 hex digits."""
        held = {"cached_pages": self.allocator.cached.by_tenant()}
        if "host" in self.tiers:
            held["host_pages"] = self.tiers["host"].pages_by_tenant()
        if "disk" in self.tiers:
            disk = self.tiers["disk"]
            names = {disk.tenant_digest(t): t for t in self.by_tenant.keys() | held["cached_pages"].keys()}
            held["disk_pages"] = {names.get(d, f"digest:{d[:12]}"): n for d, n in disk.pages_by_tenant().items()}
        tenants = self.by_tenant.keys() | {t for counts in held.values() for t in counts}
        return {t: {**self.by_tenant.get(t, {"queries": 0, "hits": 0}),
                    **{key: counts.get(t, 0) for key, counts in held.items()}} for t in tenants}

    def names_all(self, pages: list[int]) -> bool:
        return all(p in self._name_of for p in pages)

    def check_integrity(self, active: set[str]) -> None:
        assert len(self._page_of) == len(self._name_of) == len(self._tenant_of), "prefix names and pages disagree"
        assert all(self._name_of[p] == n for n, p in self._page_of.items()), "a page is named twice"
        for page in self._name_of:
            assert page in self.allocator.cached or self.allocator.num_owners(page), "a named page is free"
        assert self._unmirrored <= self._name_of.keys(), "an imported page is not named"
        for store in self.tiers.values():
            store.check_integrity()
        stale = (set(self._chains) | set(self._named) | set(self._inflight.values()) | set(self._claims)
                 | set(self._reading) | set(self._served)) - active
        assert not stale, f"prefix chains kept for finished requests {sorted(stale)}"


def _root(tenant: str, cache_salt: str | None) -> bytes:
    return hashlib.sha256(repr((tenant, cache_salt)).encode()).digest()


def _next_name(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()
