"""Continuous batching with chunked prefill and admission by memory. Plain Python, no torch.

Each step, in order:
  1. every running request gets its next tokens: 1 for a decode, up to `prefill_chunk_tokens` for
     a prompt still being prefilled (so one step mixes prefill chunks and decode tokens);
  2. waiting requests are admitted first-come-first-served while `max_num_seqs`, the token budget
     `max_num_batched_tokens` and the page pool allow.

Admission (`kv_admission="reserve"`, the default) reserves pages for prompt + max_tokens up front, so
an admitted request can always run to completion and no running request is ever preempted for memory:
some capacity traded for never recomputing. `kv_admission="optimistic"` (vLLM's way) reserves the known
tokens' pages plus one, allocates the rest as tokens come, and keeps 1 % of the pages free at
admission; when a running request's next chunk finds no page, the most recently admitted requests not
yet scheduled this step are preempted (then the request itself, if it is the newest): their pages are
freed, their full pages staying in the prefix cache, and they go back to the front of the queue with
their tokens, to be recomputed from what the cache kept. With the prefix cache (cache/prefix.py) a request
is admitted onto the cached pages its prompt starts with: it shares them, reserves only the rest, and
starts computing at the first uncached position.

With `tenant_pages` (the engine's `tenant_kv_share`) and reserving admission, a tenant's running
requests together reserve at most that many pages: a request that would take its tenant past it waits
while the requests behind it, other tenants', go ahead, so one tenant's long contexts cannot hold the
whole cache. With optimistic admission the share is a guarantee instead of a cap: a tenant may hold
more while no one else needs the pages, and when a request of a tenant within its share waits for
pages, the newest requests of tenants over theirs are preempted for it (queued behind it), and their
tenants' other requests wait for it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from .cache.pages import PageAllocator
from .cache.prefix import PrefixCache
from .request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions [first_position, context_len) of a request run this step (a snapshot at scheduling).

    Every field but `request` is plain data: what an executor needs to run the chunk. `request` is the
    engine side's handle on the request, dropped by `SchedulerOutput.for_executor()`."""

    request_id: str
    first_position: int
    num_new_tokens: int
    token_ids: tuple[int, ...]  # the tokens at the chunk's positions (drafts last)
    page_ids: list[int]  # the request's pages (read only; in process, the request's own list)
    samples_token: bool  # the chunk reaches the end of the known tokens, so the step samples a new one
    num_draft_tokens: int = 0  # speculative tokens at the chunk's end (verified, not sampled from)
    request: Request | None = field(default=None, compare=False)

    @property
    def context_len(self) -> int:
        return self.first_position + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, decided by the scheduler: the chunks to run, in batch order."""

    chunks: list[ScheduledChunk]

    def for_executor(self) -> "SchedulerOutput":
        """The same step as plain, picklable data (no engine-side request objects). Page lists are
        shared, not copied: the executor only reads them, and a remote one receives a pickled copy."""
        return SchedulerOutput([replace(ch, request=None) for ch in self.chunks])


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_tokens: int, prefix: PrefixCache | None = None, tenant_pages: int | None = None,
                 optimistic: bool = False):
        self.allocator, self.prefix, self.tenant_pages, self.optimistic = allocator, prefix, tenant_pages, optimistic
        self.watermark = max(1, allocator.num_pages // 100) if optimistic else 0  # pages kept free at admission
        self.on_preempt: Callable[[Request], None] = lambda req: None  # the cache side's part of a preemption
        # ... and of a request's end, before its pages are freed
        self.on_release: Callable[[Request, RequestStatus], None] = lambda req, status: None
        self.num_preemptions = 0
        self._reclaimer: Request | None = None  # this step's waiting request taking pages back (optimistic shares)
        self._held: dict[str, int] = {}  # pages per tenant when this step's reclaim ran
        self.pages_by_tenant: dict[str, int] = {}  # pages reserved (prompt + max_tokens) by running requests
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
        chunks = []
        self._reclaimer = self._reclaim() if self.optimistic and self.tenant_pages is not None else None
        # Decodes before prefills: a running decode never waits behind a long prompt.
        order = sorted(self.running, key=lambda r: r.is_prefilling)
        while order:
            req = order.pop(0)
            n = min(req.num_uncomputed_tokens + len(req.draft_token_ids), self.prefill_chunk_tokens, budget)
            if n <= req.num_uncomputed_tokens:
                req.draft_token_ids.clear()  # no room for the draft this step: a plain decode
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
            chunks.append(self._take(req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # still first in line, in their order
        return SchedulerOutput(chunks)

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
        footprint = self.allocator.pages_for(req.max_total_tokens)
        held = self.pages_by_tenant.get(req.tenant, 0)
        if self.tenant_pages is not None and not self.optimistic and held + footprint > self.tenant_pages:
            return None
        entitled = self._reclaimer
        if entitled is not None and req.tenant != entitled.tenant and not self._within_share(req, self._held):
            return None  # a tenant within its share waits for pages: those over theirs wait for it
        # prompt_logprobs need every prompt row computed: no hits for them (as in vLLM)
        hit = self.prefix.lookup(req) if self.prefix is not None and req.params.prompt_logprobs is None else None
        if hit is not None and (hit.wait or (hit.lower_names and not self.prefix.read_ahead(req, hit.lower_names))):
            return None  # a running request computes its next page, or its disk pages are being read
        shared = hit.pages if hit is not None else []
        tokens = min(req.num_tokens + 1, req.max_total_tokens) if self.optimistic else req.max_total_tokens
        keep_free = self.watermark if self.running else 0
        if not self.allocator.share_and_reserve(req.request_id, shared, self.allocator.pages_for(tokens) - len(shared),
                                                keep_free):
            return False
        pages, tiers = self.prefix.restore(req, hit.lower_names) if hit is not None and hit.lower_names else ([], [])
        if hit is not None:
            self.prefix.count_hit(req, len(shared), tiers)
        req.page_ids = shared + pages
        req.num_computed_tokens = (len(shared) + len(tiers)) * self.allocator.page_size
        if not req.num_preemptions:  # the prompt's cached tokens, as first admitted (the usage reports them)
            req.num_cached_tokens = req.num_computed_tokens
            req.num_cached_tokens_host = tiers.count("host") * self.allocator.page_size
            req.num_cached_tokens_disk = tiers.count("disk") * self.allocator.page_size
        if self.prefix is not None:
            self.prefix.claim(req)
        self.pages_by_tenant[req.tenant] = held + footprint
        return True

    def _room_for(self, req: Request, n: int, later: list[Request]) -> bool:
        """Pages for `req`'s next `n` tokens. With optimistic admission, while they are short, preempt the
        requests after it in this step's order (the most recently admitted first), then `req` itself
        (False: it does not run this step)."""
        while self.optimistic and self._pages_short(req, n) > 0:
            victim = later.pop() if later else req
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _pages_short(self, req: Request, n: int) -> int:
        needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.page_ids)
        return needed - min(needed, self.allocator.reserved(req.request_id)) - self.allocator.num_available

    def _held_pages(self) -> dict[str, int]:
        """Pages each tenant's running requests hold or have reserved (optimistic admission's accounting)."""
        held: dict[str, int] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.page_ids) + self.allocator.reserved(r.request_id)
        return held

    def _admission_pages(self, req: Request) -> int:
        return self.allocator.pages_for(min(req.num_tokens + 1, req.max_total_tokens))

    def _within_share(self, req: Request, held: dict[str, int]) -> bool:
        return held.get(req.tenant, 0) + self._admission_pages(req) <= self.tenant_pages

    def _reclaim(self) -> Request | None:
        """Optimistic admission with tenant shares: the first waiting request whose tenant stays within its
        share by admitting it. If it finds no room, the newest running requests of tenants over their
        share are preempted (queued right behind it) until it does, or none is left. Returns it."""
        self._held = self._held_pages()  # this step's snapshot: O(running + waiting), not their product
        entitled = next((r for r in self.waiting if self._within_share(r, self._held)), None)
        if entitled is None:
            return None
        keep_free = self.watermark if self.running else 0
        while self._admission_pages(entitled) + keep_free > self.allocator.num_available:
            held = self._held_pages()
            victim = next((r for r in reversed(self.running) if held[r.tenant] > self.tenant_pages), None)
            if victim is None:
                break
            self.preempt(victim, behind=entitled)
        self._held = self._held_pages()
        return entitled

    def preempt(self, req: Request, behind: Request | None = None) -> None:
        """Take a running request's pages back: it returns to the front of the queue (or right behind
        `behind`) with its tokens, to be recomputed from what the prefix cache kept of them (its full
        pages stay cached)."""
        self.on_preempt(req)
        self.running.remove(req)
        self._release_share(req)
        self.allocator.free(req.request_id, req.page_ids[::-1])
        req.page_ids, req.num_computed_tokens, req.status = [], 0, RequestStatus.WAITING
        req.draft_token_ids.clear()
        req.num_preemptions += 1
        self.num_preemptions += 1
        if behind is None:
            self.waiting.appendleft(req)
        else:
            self.waiting.insert(self.waiting.index(behind) + 1, req)

    def _take(self, req: Request, n: int) -> ScheduledChunk:
        needed = self.allocator.pages_for(req.num_computed_tokens + n) - len(req.page_ids)
        if needed > 0:
            req.page_ids.extend(self.allocator.allocate(req.request_id, needed))
        start = req.num_computed_tokens
        drafts = max(0, start + n - req.num_tokens)
        return ScheduledChunk(req.request_id, start, n, tuple(req.token_at(p) for p in range(start, start + n)),
                              req.page_ids, start + n >= req.num_tokens, drafts, request=req)

    def finish(self, req: Request, status: RequestStatus, reason: str | None) -> None:
        """Release every page of a finished or aborted request, running or waiting."""
        self.on_release(req, status)
        req.status, req.finish_reason = status, reason
        if req in self.running:
            self.running.remove(req)
            self._release_share(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        # Last page first: cached pages are evicted least recently released first, so a prompt's tail
        # goes before its head and what stays in the pool is a prefix that lookups can still reach.
        self.allocator.free(req.request_id, req.page_ids[::-1])
        req.page_ids = []

    def _release_share(self, req: Request) -> None:
        left = self.pages_by_tenant[req.tenant] - self.allocator.pages_for(req.max_total_tokens)
        if left:
            self.pages_by_tenant[req.tenant] = left
        else:
            del self.pages_by_tenant[req.tenant]

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: running and waiting requests, and the KV pages its running requests reserve (prompt +
        max_tokens; with optimistic admission, the pages they hold or have reserved)."""
        out: dict[str, dict[str, int]] = {}
        for state, reqs in (("running", self.running), ("waiting", self.waiting)):
            for req in reqs:
                figures = out.setdefault(req.tenant, {"running": 0, "waiting": 0, "kv_pages": 0})
                figures[state] += 1
        for tenant, pages in (self._held_pages() if self.optimistic else self.pages_by_tenant).items():
            out[tenant]["kv_pages"] = pages
        return out

    def check_integrity(self) -> None:
        held: dict[str, int] = {}
        for req in self.running:
            held[req.tenant] = held.get(req.tenant, 0) + self.allocator.pages_for(req.max_total_tokens)
        assert held == self.pages_by_tenant, "the pages reserved per tenant disagree with the running requests"
        assert self.tenant_pages is None or self.optimistic or all(n <= self.tenant_pages for n in held.values()), \
            "a tenant holds more than its share of the KV cache"

    def find(self, request_id: str) -> Request | None:
        for req in list(self.running) + list(self.waiting):
            if req.request_id == request_id:
                return req
        return None
