"""Continuous batching with chunked prefill and admission by memory. Plain Python, no torch.

Each step, running requests first (decodes before prefill chunks) get their next tokens: 1 for a
decode, up to `prefill_chunk_tokens` of a prompt; then waiting requests are admitted first come, first
served while `max_num_seqs`, the token budget `max_num_batched_tokens` and the pages allow.

Admission (`kv_admission="reserve"`, the default) reserves pages for prompt + max_tokens: an admitted
request always runs to completion. `"optimistic"` (vLLM's way) reserves the known tokens' pages plus
one and keeps 1 % of the pages free; when a running request's next chunk finds no page, the newest
requests are preempted and recomputed later from what the prefix cache kept. A request shares the
cached pages its prompt starts with (cache/prefix.py) and reserves only the rest. `tenant_pages`
(`tenant_kv_share`) caps what a tenant's running requests reserve, or with optimistic admission
guarantees it: a tenant within its share that waits preempts tenants over theirs (docs/tenants.md).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .cache.pages import PageAllocator
from .cache.prefix import CachedPrefix, PrefixCache, PrefixHit
from .cache.tenant_pages import TenantPages
from .request import Request, RequestStatus
from .scheduler_output import ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_tokens: int, prefix: PrefixCache | None = None, tenant_pages: int | None = None,
                 optimistic: bool = False):
        self.allocator, self.prefix, self.tenant_pages, self.optimistic = allocator, prefix, tenant_pages, optimistic
        self.watermark = max(1, allocator.num_pages // 100) if optimistic else 0  # pages kept free at admission
        self.on_preempt: Callable[[Request], None] = lambda req: None  # the cache side's part of a preemption
        self.on_release: Callable[[Request, RequestStatus], None] = lambda req, status: None  # ... of a request's end
        self.num_preemptions = 0
        self._reclaimer: Request | None = None  # this step's waiting request taking pages back (optimistic shares)
        self._held: dict[str, int] = {}  # pages per tenant when this step's reclaim ran
        self._restored: list[int] = []  # pages this step's admissions restored from prefix-cache tiers
        self._deferred: set[str] = set()  # requests whose drafts did not fit whole last step: first in line
        self.tenants = TenantPages(allocator)
        self.pages_by_tenant = self.tenants.reserved  # pages reserved (prompt + max_tokens) by running requests
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self, tenant: str | None = None) -> int:
        """Requests queued (of one tenant, or all)."""
        return len(self.waiting) if tenant is None else sum(r.tenant == tenant for r in self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks, self._restored = [], []
        self._reclaimer = self._reclaim() if self.optimistic and self.tenant_pages is not None else None
        # a decode never waits behind a prompt; a request whose drafts waited goes first
        order = sorted(self.running, key=lambda r: (r.request_id not in self._deferred, r.is_prefilling))
        self._deferred = set()
        while order:
            req = order.pop(0)
            n = self._tokens_to_run(req, min(self.prefill_chunk_tokens, budget))
            if n > 0 and self._room_for(req, n, order):
                chunks.append(self._take(req, n))
                budget -= n
        deferred = []  # requests waiting for a prefix page being computed, disk reads, or another tenant
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            admitted = self._admit(req)
            if admitted is None:
                deferred.append(req)
                continue
            if not admitted:
                self.waiting.appendleft(req)
                break
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req is self._reclaimer:
                self._reclaimer = None  # admitted: the others are served first come, first served again
            n = min(req.num_uncomputed_tokens, self.prefill_chunk_tokens, budget)
            if req.draft_token_ids:  # a preempted request's drafts: verified with its last token, by the loop above
                n = min(n, req.num_uncomputed_tokens - 1)
                self._deferred.add(req.request_id)
            if n > 0:
                chunks.append(self._take(req, n))
                budget -= n
        self.waiting.extendleft(reversed(deferred))  # still first in line, in their order
        return SchedulerOutput(chunks, self._restored)

    def _tokens_to_run(self, req: Request, limit: int) -> int:
        """How many of `req`'s next tokens (its uncomputed ones, then its drafts) run this step, within
        `limit`. Drafts left out of a chunk that reaches the request's last token are dropped (it samples
        there instead), unless its draws must not depend on the batch: a seeded, sampled request's
        drafts are verified whole (its chunk stops short of its last token, or it waits a step), so it
        draws the same whatever else shares the step."""
        uncomputed, drafts = req.num_uncomputed_tokens, len(req.draft_token_ids)
        if uncomputed + drafts <= limit:
            return uncomputed + drafts
        if drafts and req.params.seed is not None and not req.params.greedy and \
                uncomputed + drafts <= min(self.prefill_chunk_tokens, self.max_num_batched_tokens):
            self._deferred.add(req.request_id)
            return min(uncomputed - 1, limit)
        if limit == uncomputed:
            req.draft_token_ids.clear()  # no room for them this step: a plain decode
        return limit  # past its last token: the drafts that fit

    def update(self, output: SchedulerOutput, accepted_drafts: dict[str, int], finished: list[Request]) -> None:
        """After the step: each chunk's positions are computed (with the drafts accepted in it, whose
        entries hold the emitted tokens), its newly full pages named for the prefix cache, and the
        requests that finished let go of their pages. The only writer of computed positions."""
        for ch in output.chunks:
            req = ch.request
            req.num_computed_tokens += ch.num_new_tokens - ch.num_draft_tokens + accepted_drafts.get(ch.request_id, 0)
        for req in finished:
            self.finish(req, RequestStatus.FINISHED, req.finish_reason)
        if self.prefix is not None:
            for ch in output.chunks:
                if not ch.request.finished:
                    self.prefix.register(ch.request)

    def _admit(self, req: Request) -> bool | None:
        """Reserve pages for prompt + max_tokens (optimistic: the known tokens and one more), less the
        prompt's cached pages, which it shares. False: no room (it waits, and so does everyone behind
        it); None: its tenant holds its share of the pages (or is over it while a tenant within its
        share waits), or a running request is computing this prompt's next page, or its pages on the
        disk tier are being read ahead, so it waits (the requests behind it go ahead)."""
        if self.tenant_pages is not None and not self.optimistic and \
                self.pages_by_tenant.get(req.tenant, 0) + self.tenants.footprint(req) > self.tenant_pages:
            return None
        hit = self.prefix.match(req) if self.prefix is not None else PrefixHit()
        if hit is None:
            return None  # a running request computes its next page, or its disk pages are being read
        entitled = self._reclaimer
        if entitled is not None and req.tenant != entitled.tenant and not self._within_share(req, self._held, hit):
            return None  # a tenant within its share waits for pages: those over theirs wait for it
        tokens = min(req.num_tokens + 1, req.max_total_tokens) if self.optimistic else req.max_total_tokens
        keep_free = self.watermark if self.running else 0
        if not self.allocator.share_and_reserve(req.request_id, hit.pages,
                                                self.allocator.pages_for(tokens) - len(hit.pages), keep_free):
            return False
        cached = self.prefix.take(req, hit) if self.prefix is not None else CachedPrefix()
        self._restored += cached.restored_page_ids
        req.page_ids = cached.page_ids
        req.num_computed_tokens = cached.num_pages * self.allocator.page_size + cached.num_tail_tokens
        if not req.num_preemptions:  # the prompt's cached tokens, as first admitted (the usage reports them)
            req.num_cached_tokens = req.num_computed_tokens
        self.tenants.admit(req)
        return True

    def _room_for(self, req: Request, n: int, later: list[Request]) -> bool:
        """Pages for `req`'s next `n` tokens. With optimistic admission, while they are short, preempt the
        most recently admitted of `req` and the requests after it in this step's order (decodes go
        first, so an older request's prefill chunk can come after a newer decode); False when that is
        `req` itself (it does not run this step). The requests before it have their chunks already:
        their reservations cover them, as a prompt's covers its prefill."""
        while self.optimistic:
            needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.page_ids)
            if needed - min(needed, self.allocator.reserved(req.request_id)) <= self.allocator.num_available:
                return True
            admitted = {id(r): i for i, r in enumerate(self.running)}  # self.running is in admission order
            victim = max([req, *later], key=lambda r: admitted[id(r)])
            if victim is not req:
                later.remove(victim)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _admission_pages(self, req: Request) -> int:
        return self.allocator.pages_for(min(req.num_tokens + 1, req.max_total_tokens))

    def _within_share(self, req: Request, held: dict[str, int], hit: PrefixHit | None = None) -> bool:
        """Whether admitting `req` keeps its tenant within its share. The pages of its prefix hit that
        running requests hold are already the tenant's (a hit is within one tenant's namespace)."""
        held_already = 0 if hit is None else sum(self.allocator.num_owners(p) > 0 for p in hit.pages)
        return held.get(req.tenant, 0) + self._admission_pages(req) - held_already <= self.tenant_pages

    def _reclaim(self) -> Request | None:
        """Optimistic admission with tenant shares: the first waiting request whose tenant stays within its
        share by admitting it. If it finds no room, the newest running requests of tenants over their
        share are preempted (queued right behind it) until it does, or none is left. Returns it."""
        self._held = self.tenants.held(self.running)  # this step's snapshot: O(running + waiting), not their product
        entitled = next((r for r in self.waiting if self._within_share(r, self._held)), None)
        if entitled is None:
            return None
        keep_free = self.watermark if self.running else 0
        while self._admission_pages(entitled) + keep_free > self.allocator.num_available:
            held = self.tenants.held(self.running)
            victim = next((r for r in reversed(self.running) if held[r.tenant] > self.tenant_pages), None)
            if victim is None:
                break
            self.preempt(victim, behind=entitled)
        self._held = self.tenants.held(self.running)
        return entitled

    def preempt(self, req: Request, behind: Request | None = None) -> None:
        """Take a running request's pages back: it returns to the front of the queue (or right behind
        `behind`) with its tokens, to be recomputed from what the prefix cache kept of them (its full
        pages stay cached)."""
        self.on_preempt(req)
        self._free(req)
        req.num_computed_tokens, req.status = 0, RequestStatus.WAITING  # NOTE: its drafts stay, verified after
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0 if behind is None else self.waiting.index(behind) + 1, req)

    def _take(self, req: Request, n: int) -> ScheduledChunk:
        needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.page_ids)
        if needed > 0:
            req.page_ids.extend(self.allocator.allocate(req.request_id, needed))
        start = req.num_computed_tokens
        drafts = max(0, start + n - req.num_tokens)
        warm, req.warm = req.warm, ()  # its first chunk's alone
        return ScheduledChunk(req.request_id, start, n, tuple(req.token_at(p) for p in range(start, start + n)),
                              req.page_ids, start + n >= req.num_tokens, drafts, warm, request=req)

    def finish(self, req: Request, status: RequestStatus, reason: str | None) -> None:
        """Release every page of a finished or aborted request, running or waiting."""
        self.on_release(req, status)
        req.status, req.finish_reason = status, reason
        if req in self.waiting:
            self.waiting.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        """Let go of a request's pages and reservation, and of its tenant's share if it runs."""
        if req in self.running:
            self.running.remove(req)
            self.tenants.release(req)
        # Last page first: cached pages are evicted least recently released first, so a prompt's tail
        # goes before its head and what stays in the pool is a prefix that lookups can still reach.
        self.allocator.free(req.request_id, req.page_ids[::-1])
        req.page_ids = []

    def tenant_stats(self, held: list[Request] = ()) -> dict[str, dict[str, int]]:
        """Per tenant; `held`: requests held out of the queue (a weight update's), waiting too."""
        return self.tenants.stats(self.running, [*self.waiting, *held], self.optimistic)

    def check_integrity(self) -> None:
        self.tenants.check_integrity(self.running, None if self.optimistic else self.tenant_pages)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in [*self.running, *self.waiting] if r.request_id == request_id), None)
