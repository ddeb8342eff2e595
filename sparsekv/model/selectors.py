"""Token selectors: which k cached positions a full layer's query rows attend to.

Two real implementations behind one interface, so tiering (cache/tiers.py) never depends on how a
selection was made:

  * `DSASelector`: the DeepSeek Sparse Attention lightning indexer (keys cached per token);
  * `QuestSelector`: Quest (Tang et al., 2024), training-free. Per page of `page_tokens` positions
    it keeps the element-wise min m and max M of the cached latents [c_KV ++ k_R]. For query q the
    score of any key in the page is at most  sum_i max(q_i m_i, q_i M_i) = q+ . M + q- . m  (q+/q-
    the positive/negative parts). MLA shares one latent across heads, so a page's score is the max
    of that bound over heads. Every position takes its page's score; the deterministic `select_topk`
    then keeps the top pages (whole pages; ties at the boundary go to the most recent positions).

Both return sorted positions [S, k], so selection is a set and attention's summation order is fixed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import ModelConfig
from ..context import index_tensor
from ..kernels.attention import causal_mask_scores, fill_blocks, query_block_size, select_topk
from .indexer import keys_major


class TokenSelector:
    """Interface. `prepare` runs once per layer per step over all new rows (it stores what later
    steps need); `rows` cuts its result to one request; `select` picks positions for that request."""

    name = "abstract"

    def prepare(self, layer: int, ctx, x: torch.Tensor, q_resid: torch.Tensor, latent: torch.Tensor, cache):
        raise NotImplementedError

    def rows(self, state, rows: slice):
        return None if state is None else state[rows]

    def select(self, layer: int, seq, state, q: torch.Tensor, positions: torch.Tensor, k: int, cache) -> torch.Tensor:
        raise NotImplementedError

    def select_decode(self, layer: int, seq, state, q: torch.Tensor, positions: torch.Tensor, k: int,
                      cache) -> torch.Tensor:
        """`select` of one decode's rows (1 + drafts, each seeing more than k keys), scored as
        `select_group` scores them, so a decode selects the same alone or batched."""
        return self.select(layer, seq, state, q, positions, k, cache)

    def forget(self, request_id: str) -> None:
        """The request finished: drop anything kept for it."""

    def rewind(self, ctx) -> None:
        """Before a decode graph's pieces (model/decode_graphs.py), whose `prepare` runs with fixed
        shapes: the per-request bookkeeping `prepare` does on the host first. Nothing here."""

    def remember(self, layer: int, ctx, state) -> None:
        """After the decode graph's piece that ran `prepare` for `layer` (`state`: what it returned):
        the per-request bookkeeping `prepare` does on the host last. Nothing here."""

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """State kept per slot (with its tokens per row), part of a KV page's contents: none here."""
        return []

    def reserve_slots(self, num_slots: int) -> None:
        """Size the state kept per slot for a cache of `num_slots` (the cache manager calls it)."""

    def batches(self, device: torch.device) -> bool:
        """Whether a step's decodes are selected in batched passes (`select_group`)."""
        return False

    def select_group(self, layer: int, seqs: list, state, q: torch.Tensor, positions: torch.Tensor, k: int,
                     cache, major: bool) -> torch.Tensor:
        """`select` of several decodes at once: their rows padded to R each (state, q and positions
        [B, R, ...]; every row sees more than k keys), sorted positions [B, R, k]; the same sets as
        `select` one request at a time. `major`: the group's scoring layout (indexer.keys_major)."""
        raise NotImplementedError

    def check_integrity(self, active: set[str]) -> None:
        """Nothing is kept for requests that are not running."""


class DSASelector(TokenSelector):
    """The lightning indexer: keys in the cache pool, queries computed per step.

    `batch_decode`: select a step's decodes in one batched pass per group of similar lengths
    (`select_group`, groups: model/decode_plan.py), on every device: a fixed number of ops per layer
    whatever the batch. False: one request at a time, scored as a group of one (`select_decode`).
    """

    name = "dsa"
    batch_decode: bool = True

    def __init__(self, indexer):
        self.indexer = indexer

    def batches(self, device: torch.device) -> bool:
        return self.batch_decode

    def prepare(self, layer, ctx, x, q_resid, latent, cache):
        keys, queries = self.indexer.keys_and_queries(x, q_resid, ctx.cos, ctx.sin)
        cache.write_index_keys(layer, ctx.slot_mapping, keys)
        return queries

    def rows(self, state, rows):
        return state[0][rows], state[1][rows]

    def select(self, layer, seq, state, q, positions, k, cache):
        return self.indexer.select(*state, cache.index_key_segments(layer, seq), positions, k)

    def select_decode(self, layer, seq, state, q, positions, k, cache):
        if seq.first_new_position < k or keys_major(q.device, seq.num_new_tokens, seq.context_len):
            return self.select(layer, seq, state, q, positions, k, cache)  # as no group scores them
        index_q, weights = state
        return self.select_group(layer, [seq], (index_q[None], weights[None]), q, positions[None], k, cache, False)[0]

    def select_group(self, layer, seqs, state, q, positions, k, cache, major):
        """Keys-major groups over their padded key histories (gathered); the others page by page
        (`LightningIndexer.select_decode_pages`: in place on a CPU when the pages allow)."""
        if not major:
            keys, at, counts = cache.index_key_pages(layer, seqs)
            return self.indexer.select_decode_pages(*state, keys, at, counts, [s.context_len for s in seqs], positions, k)
        keys = cache.index_keys_batch(layer, seqs, self.indexer.scratch)  # valid until the next gather
        return self.indexer.select_decode_batch(*state, keys, positions, k, major)


class Kept(NamedTuple):
    """A drafting step's Quest bounds of one layer, per row of the step: its page's bound before the step,
    and its own-page bound after it (`QuestSelector._last` points into them)."""

    before_lo: torch.Tensor
    before_hi: torch.Tensor
    own_lo: torch.Tensor
    own_hi: torch.Tensor


class QuestSelector(TokenSelector):
    """Quest page bounds, device-resident, indexed by logical page (slot // page_tokens).

    One instance serves every full layer. The bounds live here rather than in the cache pool so that
    both pools (tiered or not) get the same selector; the cache manager sizes it to the pool's slots
    (`reserve_slots`) once the model is built with it.

    A query at position p scores its own page by the bound over that page's positions <= p only, so
    the selection never depends on how a prompt was chunked: `prepare` returns, for every new row, the
    min/max over its page's cached positions before the chunk and the chunk's rows up to itself.
    """

    name = "quest"
    batch_decode: bool = True  # False: a step's decodes select one request at a time

    def __init__(self, cfg: ModelConfig, num_slots: int, page_tokens: int, device, layers: list[int]):
        self.page_tokens, self.dim, self.device, self.layers = page_tokens, cfg.latent_dim, device, layers
        # a page's score is the maximum over the query heads; under tensor parallelism each rank holds
        # some heads, and an all-reduce of the maximum gives every rank the whole (exact: max)
        self.heads_max = lambda scores: scores
        self.reserve_slots(num_slots)
        # Speculative decoding rewrites positions a rejected draft wrote, and min/max cannot forget a
        # value. So each request's last decode keeps, per layer and page it wrote, the page's bounds
        # as of each of its positions: (page, first position, positions + 1, the step's `Kept`, the
        # row of that first position in it). The next decode starts its page from the bound as of its
        # own first position. Requests are dropped by `forget` when they finish or are preempted.
        self._last: dict[str, dict[int, list[tuple[int, int, int, Kept, int]]]] = {}
        # Per layer, the last drafting step's `Kept` and the requests pointing into it. A request left
        # out of the next step keeps a copy of its own rows instead (`_keep_own`), so what is kept is one
        # step's tensors and at most one request's rows for each other request, never a step per request.
        self._holders: dict[int, tuple[Kept, set[str]]] = {}

    def prepare(self, layer, ctx, x, q_resid, latent, cache):
        """Write the new rows into their pages' bounds; return each row's own-page bounds (lo, hi) [N, D].
        With drafts, in a step of decodes, every decode's rows at once, whatever the batch
        (`_window_bounds`). In a decode graph's piece (`ctx.request_start` set) the shapes are fixed
        and the host's part runs around it (`rewind`, `remember`); its state also carries the bounds
        before the step."""
        slots, v = ctx.slot_mapping, cache.fmt.as_stored(latent).float()  # bounds of the keys attention reads
        page = slots // self.page_tokens
        lo, hi = self.lo[layer], self.hi[layer]
        self._reset_opened(page, slots, lo, hi)
        piece, drafting = ctx.request_start is not None, ctx.decode_rows > 1
        if drafting and not piece:
            self._rewind(layer, ctx)
        runs = [seq for seq in ctx.seqs if seq.num_new_tokens > 1]  # a prefill chunk's rows, or a decode's drafts
        before = (lo.index_select(0, page), hi.index_select(0, page)) if runs or drafting else None
        idx = page[:, None].expand_as(v)
        lo.scatter_reduce_(0, idx, v, "amin")
        hi.scatter_reduce_(0, idx, v, "amax")
        # a step of decodes only (every decode graph's): all rows at once, whatever the batch; a step
        # with a prefill chunk one request at a time, which the chunk is anyway (the window is per row)
        if drafting and all(seq.num_new_tokens <= ctx.decode_rows for seq in runs):
            starts = ctx.request_start if piece else ctx.rows_index(
                [seq.token_start for seq in ctx.seqs for _ in range(seq.num_new_tokens)])
            own_lo, own_hi = self._window_bounds(v, ctx.positions, starts, ctx.decode_rows, before)
        else:
            own_lo, own_hi = lo.index_select(0, page), hi.index_select(0, page)  # exact for a page's last new row
            for seq in runs:  # earlier rows of a page see only the page's positions up to themselves
                rows = slice(seq.token_start, seq.token_end)
                own_lo[rows], own_hi[rows] = self._prefix_bounds(v[rows], seq.first_new_position, before[0][rows],
                                                                 before[1][rows])
        if piece and drafting:
            return own_lo, own_hi, *before
        if drafting:
            self._remember(layer, ctx, Kept(*before, own_lo, own_hi))
        return own_lo, own_hi

    def _window_bounds(self, v: torch.Tensor, positions: torch.Tensor, request_start: torch.Tensor, width: int,
                       before) -> tuple[torch.Tensor, torch.Tensor]:
        """`_prefix_bounds` of every decode row at once in fixed shapes: a row's own page over the bound
        before the step and the step's rows of its request and page up to itself, which are among the
        `width` (1 + drafts) rows ending at it (a request's rows are consecutive positions from
        `request_start`, its first row)."""
        n = v.shape[0]
        rows = torch.arange(n, device=v.device)
        back = rows[:, None] - torch.arange(width, device=v.device)[None, :]                # [N, W]
        first = torch.maximum(request_start, rows - positions % self.page_tokens)          # its page run's first row
        unseen = (back < first[:, None]).unsqueeze(-1)
        window = v[back.clamp(min=0)]                                                       # [N, W, D]
        return (torch.minimum(before[0], window.masked_fill(unseen, float("inf")).amin(dim=1)),
                torch.maximum(before[1], window.masked_fill(unseen, float("-inf")).amax(dim=1)))

    def rewind(self, ctx) -> None:
        # NOTE: before the pieces, so before `_reset_opened`, which `prepare` runs first: the same bounds,
        # since a page rewound to its first position is rewound to its empty bound
        if ctx.decode_rows > 1:
            for layer in self.layers:
                self._rewind(layer, ctx)

    def remember(self, layer: int, ctx, state) -> None:
        if ctx.decode_rows > 1:  # the step's rows copied: the next replay writes the piece's tensors
            n = ctx.num_tokens
            self._remember(layer, ctx, Kept(*(t[:n].clone() for t in (state[2], state[3], state[0], state[1]))))

    def _reset_opened(self, page: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """A row at its page's first position empties the page's bounds; the other rows empty the
        scratch page, which no slot maps to. Fixed shapes, nothing read back to the host: a decode
        graph's pieces run it."""
        opened = page.masked_fill(slots % self.page_tokens != 0, self.scratch_page)
        lo.index_fill_(0, opened, float("inf"))
        hi.index_fill_(0, opened, float("-inf"))

    def reserve_slots(self, num_slots: int) -> None:
        pages = -(-num_slots // self.page_tokens)
        self.scratch_page = pages  # one more page (`_reset_opened`)
        self.lo = {l: torch.empty(pages + 1, self.dim, dtype=torch.float32, device=self.device) for l in self.layers}
        self.hi = {l: torch.empty(pages + 1, self.dim, dtype=torch.float32, device=self.device) for l in self.layers}

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)
        for layer, (_, holders) in list(self._holders.items()):
            holders.discard(request_id)
            if not holders:  # the step's tensors go with its last request
                del self._holders[layer]

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """The page bounds, one row per `page_tokens` slots (part of a KV page's contents)."""
        return [(t, self.page_tokens) for t in list(self.lo.values()) + list(self.hi.values())]

    def check_integrity(self, active: set[str]) -> None:
        stale = set(self._last) - active
        assert not stale, f"Quest keeps page history for finished requests {sorted(stale)}"
        owners: dict[int, set[str]] = {}
        for request_id, layers in self._last.items():
            for layer, entries in layers.items():
                latest = self._holders.get(layer, (None, set()))
                for *_, kept, row in entries:
                    if kept is latest[0]:
                        assert request_id in latest[1], f"{request_id} points into layer {layer}'s last step unlisted"
                        continue
                    owners.setdefault(id(kept), set()).add(request_id)
                    span = max(r + length - 1 for _, _, length, k, r in entries if k is kept)
                    assert kept.own_lo.shape[0] == span and min(r for *_, k, r in entries if k is kept) == 0, \
                        f"Quest keeps {kept.own_lo.shape[0]} rows of an earlier step for {request_id}'s {span}"
        shared = sorted(sorted(ids) for ids in owners.values() if len(ids) > 1)
        assert not shared, f"requests {shared} share an earlier step's Quest bounds (each keeps its own rows)"

    def _rewind(self, layer: int, ctx) -> None:
        """Each decode that starts inside a page its last decode wrote: the page back to its bound as of
        the decode's first position (positions from there on are rewritten). All at once: an index
        copy per step they were kept in and per kind of row (the bound before that step, or after
        one of its rows), whatever the batch."""
        moves: dict[tuple[int, bool], tuple[Kept, list[int], list[int]]] = {}
        for seq in ctx.seqs:
            first = seq.first_new_position
            for page_id, start, length, kept, row in self._last.get(seq.request_id, {}).get(layer, ()):
                if start <= first < start + length:
                    after = first > start  # the bound after row `row + first - start - 1` of that step
                    _, pages, rows = moves.setdefault((id(kept), after), (kept, [], []))
                    pages.append(page_id)
                    rows.append(row + first - start - 1 if after else row)
        for (_, after), (kept, pages, rows) in moves.items():
            device = self.lo[layer].device
            into, at = index_tensor(pages, device), index_tensor(rows, device)
            lo, hi = (kept.own_lo, kept.own_hi) if after else (kept.before_lo, kept.before_hi)
            self.lo[layer].index_copy_(0, into, lo.index_select(0, at))
            self.hi[layer].index_copy_(0, into, hi.index_select(0, at))

    def _remember(self, layer: int, ctx, kept: "Kept") -> None:
        """Each drafting request's page bounds as of each of its new rows, as entries into the step's
        `kept` tensors (no copy per request). A prefill chunk's pages are never rewritten, but for its
        drafts: a preempted request's recomputation ends in the drafts it kept, so its entries start at
        the page run holding its first draft."""
        pt, holders = self.page_tokens, set()
        for seq in ctx.seqs:
            if seq.num_new_tokens > ctx.decode_rows and not seq.num_drafts:
                self._last.get(seq.request_id, {}).pop(layer, None)
                continue
            entries, first, row = [], seq.first_new_position, seq.token_start
            if seq.num_new_tokens > ctx.decode_rows:  # from the first draft's page run (a run reads its page's
                draft = seq.token_end - seq.num_drafts  # bound before the step at its first row)
                row = max(row, draft - (first + draft - row) % pt)
            while row < seq.token_end:  # one entry per page run of the chunk's rows
                position = first + row - seq.token_start
                end = min(seq.token_end, row + pt - position % pt)
                entries.append((seq.host_slot(position) // pt, position, 1 + end - row, kept, row))
                row = end
            self._last.setdefault(seq.request_id, {})[layer] = entries
            holders.add(seq.request_id)
        before = self._holders.pop(layer, None)
        if holders:
            self._holders[layer] = (kept, holders)
        if before is not None:
            for request_id in before[1] - holders:
                self._keep_own(layer, request_id, before[0])

    def _keep_own(self, layer: int, request_id: str, kept: Kept) -> None:
        """A request left out of a step: its entries into the step before it repointed to a copy of its
        own rows there (its rows are consecutive; an entry reads the row of its first position and the
        `length - 1` after it), so that step's tensors can go."""
        entries = self._last.get(request_id, {}).get(layer)
        if not entries:  # forgotten, or its last step was a prefill chunk
            return
        first = entries[0][4]
        end = max(row + length - 1 for _, _, length, _, row in entries)
        own = Kept(*(t[first:end].clone() for t in kept))
        self._last[request_id][layer] = [(page, start, length, own, row - first)
                                         for page, start, length, _, row in entries]

    def _prefix_bounds(self, v: torch.Tensor, first: int, before_lo: torch.Tensor, before_hi: torch.Tensor):
        """Running min/max over consecutive rows (positions first, first + 1, ...) within each page,
        started from the page's bound before the chunk (`before_*`: +-inf on pages the chunk opens)."""
        pt, n = self.page_tokens, v.shape[0]
        lead = first % pt
        pages = -(-(lead + n) // pt)
        grid_lo = v.new_full((pages * pt, v.shape[1]), float("inf"))
        grid_hi = v.new_full((pages * pt, v.shape[1]), float("-inf"))
        grid_lo[lead:lead + n], grid_hi[lead:lead + n] = v, v
        grid_lo[0], grid_hi[0] = torch.minimum(grid_lo[0], before_lo[0]), torch.maximum(grid_hi[0], before_hi[0])
        run_lo = grid_lo.view(pages, pt, -1).cummin(dim=1).values.view(pages * pt, -1)
        run_hi = grid_hi.view(pages, pt, -1).cummax(dim=1).values.view(pages * pt, -1)
        return run_lo[lead:lead + n], run_hi[lead:lead + n]

    def rows(self, state, rows):
        return state[0][rows], state[1][rows]

    def page_scores(self, layer: int, seq, q: torch.Tensor) -> torch.Tensor:
        """Upper bound of q . k over each of the request's pages: [S, num_pages] fp32."""
        pages = seq.slots[::self.page_tokens] // self.page_tokens
        lo, hi = self.lo[layer].index_select(0, pages), self.hi[layer].index_select(0, pages)
        return self._bound(q, lo.t(), hi.t())

    def _bound(self, q: torch.Tensor, lo_t: torch.Tensor, hi_t: torch.Tensor) -> torch.Tensor:
        qf = q.float()
        return self.heads_max((qf.clamp(min=0) @ hi_t + qf.clamp(max=0) @ lo_t).amax(dim=-2))  # [S, H, P] -> [S, P]

    def batches(self, device: torch.device) -> bool:
        return self.batch_decode

    def select_group(self, layer, seqs, state, q, positions, k, cache, major):
        """Every request's pages padded to the longest (repeating its last page), scored in one pass;
        positions past a row's own are masked, as `select` does."""
        pt, (b, r) = self.page_tokens, positions.shape
        lengths = index_tensor([s.context_len for s in seqs], positions.device)
        starts, pages = lengths.cumsum(0) - lengths, (lengths + pt - 1) // pt
        width = max(-(-s.context_len // pt) for s in seqs)
        at = starts[:, None] + torch.minimum(torch.arange(width, device=q.device)[None, :], pages[:, None] - 1) * pt
        page_ids = torch.cat([s.slots for s in seqs])[at] // pt                                # [B, P]
        lo, hi = (t.index_select(0, page_ids.reshape(-1)).view(b, width, -1) for t in (self.lo[layer], self.hi[layer]))
        qf = q.float().view(b, -1, q.shape[-1])                                                 # [B, R * H, D]
        scores = (torch.bmm(qf.clamp(min=0), hi.transpose(1, 2)) + torch.bmm(qf.clamp(max=0), lo.transpose(1, 2)))
        scores = self.heads_max(scores.view(b * r, q.shape[2], width).amax(dim=-2))             # [B * R, P]
        flat_q, flat_pos = q.reshape(b * r, *q.shape[2:]), positions.reshape(-1)
        own = self._bound(flat_q, state[0].reshape(b * r, -1, 1), state[1].reshape(b * r, -1, 1)).squeeze(-1)
        scores.scatter_(1, (flat_pos // pt)[:, None], own[:, None])
        total = max(s.context_len for s in seqs)
        scores = scores.repeat_interleave(pt, dim=1)[:, :total]
        later = torch.arange(total, device=q.device)[None, :] > flat_pos[:, None]
        return select_topk(scores.masked_fill_(later, float("-inf")), k).view(b, r, k)

    def select(self, layer, seq, state, q, positions, k, cache):
        total, own_lo, own_hi = seq.context_len, state[0], state[1]

        def block(start: int, end: int) -> torch.Tensor:
            qb, pos = q[start:end], positions[start:end]
            pages = self.page_scores(layer, seq, qb)
            own = self._bound(qb, own_lo[start:end, :, None], own_hi[start:end, :, None]).squeeze(-1)  # [S]
            pages.scatter_(1, (pos // self.page_tokens)[:, None], own[:, None])
            scores = pages.repeat_interleave(self.page_tokens, dim=1)[:, :total]
            return select_topk(causal_mask_scores(scores, pos), k)
        return fill_blocks(q.shape[0], query_block_size(total + q.shape[1] * total // self.page_tokens, q.shape[0]),
                           block)


def install_quest(model, page_tokens: int) -> QuestSelector:
    """Replace the DSA selector of every full layer by one Quest selector (sized later: `reserve_slots`)."""
    quest = QuestSelector(model.cfg, 0, page_tokens, model.device, model.cfg.full_layers)
    quest.heads_max = model.comm.all_reduce_max
    use_selector(model, quest)
    return quest


def use_selector(model, selector: TokenSelector) -> None:
    """Install `selector` in every full layer (layers that run their own selection)."""
    for layer in model.layers:
        if layer.attn.selector is not None:
            layer.attn.selector = selector


class ObservedSelector:
    """Passes every call to `inner` and reports each selection to `observe(layer, seq, positions,
    selected)` (the evals and benchmarks that look at what was selected). Decode rows are never
    batched, so that every selection goes through `select` or `select_decode` (the batched path selects
    the same sets)."""

    def __init__(self, inner: TokenSelector, observe):
        self.inner, self.observe, self.name = inner, observe, inner.name

    def __getattr__(self, name):  # prepare, rows, forget, check_integrity, ...: the selector's own
        return getattr(self.inner, name)

    def batches(self, device: torch.device) -> bool:
        return False

    def select(self, layer, seq, state, q, positions, k, cache):
        out = self.inner.select(layer, seq, state, q, positions, k, cache)
        self.observe(layer, seq, positions, out)
        return out

    def select_decode(self, layer, seq, state, q, positions, k, cache):
        out = self.inner.select_decode(layer, seq, state, q, positions, k, cache)
        self.observe(layer, seq, positions, out)
        return out


def observe_selections(model, observe) -> None:
    """Wrap the selector of every full layer in an `ObservedSelector` reporting to `observe`."""
    for layer in model.layers:
        if layer.attn.selector is not None:
            layer.attn.selector = ObservedSelector(layer.attn.selector, observe)
