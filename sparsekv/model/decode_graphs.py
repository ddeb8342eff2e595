"""Decode steps as pieces of fixed shapes, replayed from CUDA graphs per batch-size bucket.

A decode step (every request one new token, or with MTP drafting its last token and its drafts to
verify) runs here as a fixed sequence of pieces, whose tensors' shapes are set by the step's bucket
(its rows padded up to a power of two, or to the most rows `max_bs` requests have) and k alone,
never by the requests' context lengths::

    piece 0    embedding, RoPE, layer 0's projections (its latents and indexer keys written)
    select     layer 0's selection: each row's k picks -> the bucket's [rows, k] slot table and mask
    piece 1    layer 0's attention over its picks and its FFN, the shared layers after it, the next
               full layer's projections
    select     that layer's selection
    ...
    piece n    the last full layer's attention and FFN, the shared layers after it, the norm, logits

Only the selections run between the pieces: a full layer's indexer scores over each request's
history and its top-k (their shapes follow the context lengths), written into the bucket's static
slot table and mask by the engine's own decode path (`MLAttention._decode_selection`, the same
groups and picks). A decode within top-k (the dense regime) attends its whole history, padded to k
and masked by each row's position, so that every row has the same shape. The padding rows (the
bucket's rows past the step's) read and write the pool's padding page, which no request holds.
What the slot table holds is the pool's affair (its `piece_reads`): pool slots (cache/pool.py,
`PoolPieceReads`), or over the tiered cache working-set rows, resolved between the pieces as the
engine's decode path resolves them, the step's new rows backed up to the host after the last piece
(cache/tiers.py, `WorkingSetPieceReads`). A selector's per-request state on the host runs around the
pieces too (`TokenSelector.rewind` before them, `remember` after each full layer's: Quest's page
bounds past a rejected draft, model/selectors.py).

With MTP drafting, a draft step after the first (the MTP layer over one row per drafting request,
past its history, reading the cache and writing nothing) is one piece per bucket of requests
(`DraftPieces`): its inputs are the previous drafts, the hidden states they came from, their
positions, and the slot table and mask of what each row attends, its extend row's selection (MTP
index reuse) or within top-k its whole history, the same for every draft step of a chain, so they
are loaded once per chain (over the tiered cache resolved again at every step, as the engine's path
resolves them). The MTP layer's extend pass over decode rows (each request's accepted
drafts and one more) is two pieces per bucket of rows, its selection between (`ExtendPieces`).

On CUDA (`capture`) each piece of a bucket is captured as a CUDA graph the first time the bucket
runs, all into one memory pool, and replayed from then on, the selections between the replays. The
first step of a bucket runs eagerly first: its logits are the step's, and the captured replay of the
same step must give them bit for bit, else the bucket stays eager (logged). Without `capture` (the
engine's `decode_graphs="eager"`) the same pieces run as plain ops on any device: what the graphs
replay, which the CPU tests check against the engine's own decode path.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from ..context import ForwardContext, index_tensor
from .decode_plan import plan_of
from .layers import rms_norm

log = logging.getLogger(__name__)


def buckets(max_bs: int) -> list[int]:
    """The batch sizes a step's rows are padded up to: powers of two below `max_bs`, and `max_bs`."""
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b *= 2
    return out + [max_bs]


def bucket_of(rows: int, max_bs: int) -> int | None:
    """The bucket of a step of `rows` rows (None: more than `max_bs`)."""
    return next((b for b in buckets(max_bs) if b >= rows), None)


class StaticPicks:
    """context.DecodePicks' `slots()` of a bucket: its static [rows, k] slot table."""

    def __init__(self, slots: torch.Tensor):
        self._slots = slots

    def slots(self) -> torch.Tensor:
        return self._slots


class _Bucket:
    """What a bucket's pieces read besides the weights and the cache: token ids, positions, and the
    [rows, k] slot table and mask of the picks each row attends; the padding rows' (past a step's)
    see the padding slot once, so every softmax has a term."""

    mtp_pass = False  # the MTP layer's pieces

    def __init__(self, model, pool, rows: int, padding_slot: int, decode_rows: int = 1):
        cfg, device = model.cfg, model.device
        self.decode_rows = decode_rows  # the most rows a request has (1 + its drafts)
        self.model, self.pool, self.rows, self.k = model, pool, rows, cfg.index_topk
        # how the pieces address the pool (cache/pool.py PoolPieceReads, cache/tiers.py
        # WorkingSetPieceReads): what they pass as the cache, and what the slot table holds
        self.reads = pool.piece_reads(rows, self.mtp_pass)
        self.cache, self.padding_slot = self.reads.cache, padding_slot
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slots = torch.full((rows, self.k), self.reads.padding_pick, **long)
        self.hidden = torch.ones(rows, 1, self.k, dtype=torch.bool, device=device)
        self.hidden[:, :, 0] = False
        self.picks = StaticPicks(self.slots)
        self.graphs: list | None = None  # captured (CUDA), one per piece
        self.final = self.logits = None
        # a capture's first step: the slot table and mask after each selection (`recording`), restored
        # in order when the step runs again (`again`) rather than selected twice (a tiered pool's
        # resolution moves its LRUs and counts)
        self.recording: list | None = None
        self.again: list | None = None

    def _pad_picks(self, n: int) -> None:
        """The rows from `n` on: padding rows."""
        self.slots[n:] = self.reads.padding_pick
        self.hidden[n:] = True
        self.hidden[n:, :, 0] = False

    def _selecting(self, select) -> None:
        """`select()`, which fills the slot table and mask, or during a capture's step run again what it
        filled the first time."""
        if self.again is not None:
            slots, hidden = self.again.pop(0)
            self.slots.copy_(slots)
            self.hidden.copy_(hidden)
            return
        select()
        if self.recording is not None:
            self.recording.append((self.slots.clone(), self.hidden.clone()))

    def _select(self, attn, q: torch.Tensor, index_q, step: ForwardContext) -> None:
        """Layer `attn`'s selections of the step's sparse-regime rows from the queries the piece left (the
        first rows, the step's), as the engine's decode path makes them, into the slot table and mask;
        the dense-regime rows' too where each layer reads them elsewhere (a tiered pool's)."""
        plan, n = plan_of(step, attn.cfg), step.num_tokens
        if self.reads.resolves:  # each index group holds a history in its own rows
            self._load_dense(step, attn)
        if not plan.sparse:
            return
        picks, hidden = plan.picks(step, attn._decode_selection(plan, q[:n], attn.selector.rows(index_q, slice(0, n)),
                                                                step, self.pool))
        rows = plan.row_index(step)
        self.slots[rows], self.hidden[rows] = self.reads.table(attn.layer_idx, picks), hidden

    def _load_dense(self, step: ForwardContext, attn) -> None:
        """The padding rows reset, and the dense-regime rows' picks (by `attn`'s plan of the step): their
        request's whole history padded to k, each row seeing the positions up to its own."""
        self._pad_picks(step.num_tokens)
        dense = [seq for seqs in plan_of(step, attn.cfg).dense.values() for seq in seqs]
        if dense:
            self._dense_picks(step, dense, lambda rows: step.positions[rows], attn.layer_idx)

    def _dense_picks(self, step: ForwardContext, dense: list, visible, layer: int) -> None:
        """The rows of the `dense` (regime) requests attend their request's whole history (as layer
        `layer` reads it), padded to k, up to the position `visible(rows)` gives each row."""
        rows = step.rows_index([r for seq in dense for r in range(seq.token_start, seq.token_end)])
        history = self.reads.history(layer, dense, self.k)
        if rows.numel() != len(dense):  # drafts to verify: each row of a request reads its history
            history = history[step.rows_index([i for i, seq in enumerate(dense) for _ in range(seq.num_new_tokens)])]
        self.slots[rows] = history
        last = visible(rows)
        self.hidden[rows] = (torch.arange(self.k, device=last.device)[None, :] > last[:, None]).unsqueeze(1)


class BucketPieces(_Bucket):
    """One bucket's static inputs (token ids, positions, slots to write, the [rows, k] slot table and
    mask of the picks), its pieces, and what each piece leaves for the selection and the piece after
    it: by full layer, the hidden states entering it, its queries and its indexer state. Each is kept
    under its own layer, never replaced by a later piece's: a replay writes the tensors its capture
    made, so the selection between two replays must read the ones of the piece just replayed, and
    a tensor no longer referenced would give its memory to a later capture."""

    def __init__(self, model, cache, rows: int, padding_slot: int, decode_rows: int = 1):
        super().__init__(model, cache, rows, padding_slot, decode_rows)
        self.slot_mapping = torch.full((rows,), padding_slot, dtype=torch.long, device=model.device)
        self.every_row = torch.arange(rows, device=model.device)
        self.request_start = self.every_row.clone()  # each row's request's first row, a padding row its own
        self.ctx = ForwardContext(self.input_ids, self.positions, self.slot_mapping, [], self.every_row,
                                  decode_rows=decode_rows, request_start=self.request_start)
        self.selectors = model.selectors()  # their host state runs around the pieces (`load`, `select`)
        self.full = list(model.cfg.full_layers)
        self.h: dict[int, torch.Tensor] = {}  # by full layer: the hidden states entering it
        self.q: dict[int, torch.Tensor] = {}  # by full layer: its queries
        self.index_q: dict[int, object] = {}  # by full layer: its selector's state of them

    # -- the pieces (fixed shapes; nothing read back to the host) -------------------------------
    def pieces(self) -> list:
        middle = [lambda i=i: self._after(i) for i in range(1, len(self.full))]
        return [self._first, *middle, self._last]

    def _first(self) -> None:
        ctx, model = self.ctx, self.model
        ctx.cos, ctx.sin = model.rotary.cos_sin(ctx.positions)
        self._project(model.comm.embed(ctx.input_ids, model.embed), self.full[0])

    def _after(self, i: int) -> None:
        """Full layer full[i - 1]'s attention onwards, up to full layer full[i]'s projections."""
        self._project(self._through(self.full[i - 1], self.full[i]), self.full[i])

    def _last(self) -> None:
        model = self.model
        self.final = rms_norm(self._through(self.full[-1], len(model.layers)), model.norm, model.cfg.rms_norm_eps)
        self.logits = model.logits(self.final)

    def _project(self, h: torch.Tensor, layer: int) -> None:
        decoder = self.model.layers[layer]
        self.h[layer] = h
        self.q[layer], self.index_q[layer] = decoder.attn.project(decoder.attention_input(h), self.ctx, self.cache)

    def _through(self, full: int, end: int) -> torch.Tensor:
        """Layer `full`'s attention over the picks and its FFN, then the shared layers up to `end`."""
        h = self._attended(full, self.h[full], self.q[full])
        for layer in range(full + 1, end):
            decoder = self.model.layers[layer]
            q, _ = decoder.attn.project(decoder.attention_input(h), self.ctx, self.cache)
            h = self._attended(layer, h, q)
        return h

    def _attended(self, layer: int, h: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        decoder = self.model.layers[layer]
        return decoder.attended(h, decoder.attn.output(decoder.attn.attend_picked(q, self.picks, self.hidden,
                                                                                   self.cache)))

    # -- between the pieces (the step's own shapes) ----------------------------------------------
    def load(self, step: ForwardContext) -> None:
        """The step's inputs into the static ones, the padding rows reset, the selectors' host state
        rewound (Quest's page bounds past a rejected draft), and the dense-regime rows' picks where
        every layer reads them alike: their request's whole history padded to k, each row seeing the
        positions up to its own."""
        n = step.num_tokens
        self.input_ids[:n], self.positions[:n], self.slot_mapping[:n] = step.input_ids, step.positions, step.slot_mapping
        self.input_ids[n:], self.positions[n:], self.slot_mapping[n:] = 0, 0, self.padding_slot
        if self.decode_rows > 1:
            starts = [seq.token_start for seq in step.seqs for _ in range(seq.num_new_tokens)]
            self.request_start[:n] = index_tensor(starts, self.request_start.device)
            self.request_start[n:] = self.every_row[n:]
        for selector in self.selectors:
            selector.rewind(step)
        self.reads.load(step)
        if not self.reads.resolves:
            self._load_dense(step, self.model.layers[0].attn)

    def select(self, layer: int, step: ForwardContext) -> None:
        """Full layer `layer`'s selections of the step's sparse-regime rows into the slot table, after
        its selector's host state is kept from the piece (Quest's page bounds as of each draft)."""
        attn = self.model.layers[layer].attn
        attn.selector.remember(layer, step, self.index_q[layer])
        self._selecting(lambda: self._select(attn, self.q[layer], self.index_q[layer], step))

    def run(self, step: ForwardContext) -> None:
        """The pieces in order, eagerly or replayed, the selections between them."""
        calls = self.pieces() if self.graphs is None else [g.replay for g in self.graphs]
        self.load(step)
        calls[0]()
        for layer, call in zip(self.full, calls[1:]):
            self.select(layer, step)
            call()
        self.reads.finish(step)


class DraftPieces(_Bucket):
    """One bucket's MTP draft step: static inputs (the previous drafts, the hidden states they came
    from, their positions, and the chain's [rows, k] slot table and mask), one piece."""

    mtp_pass = True

    def __init__(self, model, cache, rows: int, padding_slot: int, decode_rows: int = 1):
        super().__init__(model, cache, rows, padding_slot, decode_rows)
        self.hidden_in = torch.zeros(rows, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
        self.ctx = ForwardContext(self.input_ids, self.positions, self.positions, [],
                                  torch.arange(rows, device=model.device), draft_step=True)
        self.chain = None  # the DraftChain whose picks the slot table holds

    def pieces(self) -> list:
        return [self._draft]

    def _draft(self) -> None:
        model, ctx = self.model, self.ctx
        mtp, eps = model.mtp, model.cfg.rms_norm_eps
        x = model.mtp_input(self.hidden_in, ctx.input_ids)
        ctx.cos, ctx.sin = model.rotary.cos_sin(ctx.positions)
        layer = mtp.layer
        q, _ = layer.attn.project(layer.attention_input(x), ctx, self.cache)  # a draft step writes nothing
        x = layer.attended(x, layer.attn.output(layer.attn.attend_picked(q, self.picks, self.hidden, self.cache)))
        self.final = rms_norm(x, mtp.head_norm, eps)
        self.logits = model.logits(self.final, mtp.head)

    def load_chain(self, chain, step: ForwardContext) -> None:
        """The chain's picks (what its draft steps attend), from a draft step's context: a sparse-regime
        row its extend row's selection, a dense-regime row its request's whole history; padding rows
        reset."""
        self._pad_picks(step.num_tokens)
        attn = self.model.mtp.layer.attn
        plan = plan_of(step, attn.cfg)
        dense = [seq for seqs in plan.dense.values() for seq in seqs]
        if dense:  # a draft row past its history sees all of it
            ends = index_tensor([seq.context_len - 1 for seq in dense], self.slots.device)
            self._dense_picks(step, dense, lambda rows: ends, attn.layer_idx)
        if plan.sparse:
            selected = torch.cat([step.selection[seq.request_id] for seq in plan.sparse])
            picks, hidden = plan.picks(step, selected)
            rows = plan.row_index(step)
            self.slots[rows], self.hidden[rows] = self.reads.table(attn.layer_idx, picks), hidden
        self.chain = chain

    def run(self, step) -> None:
        """The draft step (`step`: its context and its DraftChain), eagerly or replayed. The chain's picks
        are loaded at its first step, or at every step where each read resolves (a tiered pool's)."""
        ctx, chain = step
        if self.chain is not chain or self.reads.resolves:
            self._selecting(lambda: self.load_chain(chain, ctx))
        n, hidden = ctx.num_tokens, chain.hidden
        self.input_ids[:n], self.positions[:n], self.hidden_in[:n] = ctx.input_ids, ctx.positions, hidden
        self.input_ids[n:], self.positions[n:], self.hidden_in[n:] = 0, 0, 0
        (self.pieces()[0] if self.graphs is None else self.graphs[0].replay)()


class ExtendPieces(_Bucket):
    """One bucket's MTP extend pass over decode rows (each request's rows whose next token became known:
    its accepted drafts and one more): the MTP layer's input and projections (its cache entries
    written), its selection between, then its attention, FFN, head norm and logits: two pieces."""

    mtp_pass = True

    def __init__(self, model, cache, rows: int, padding_slot: int, decode_rows: int = 1):
        super().__init__(model, cache, rows, padding_slot, decode_rows)
        self.slot_mapping = torch.full((rows,), padding_slot, dtype=torch.long, device=model.device)
        self.hidden_in = torch.zeros(rows, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
        self.ctx = ForwardContext(self.input_ids, self.positions, self.slot_mapping, [],
                                  torch.arange(rows, device=model.device))
        self.x = self.q = self.index_q = None

    def pieces(self) -> list:
        return [self._project, self._attend]

    def _project(self) -> None:
        model, ctx, layer = self.model, self.ctx, self.model.mtp.layer
        self.x = model.mtp_input(self.hidden_in, ctx.input_ids)
        ctx.cos, ctx.sin = model.rotary.cos_sin(ctx.positions)
        self.q, self.index_q = layer.attn.project(layer.attention_input(self.x), ctx, self.cache)

    def _attend(self) -> None:
        model, mtp = self.model, self.model.mtp
        o_lat = mtp.layer.attn.attend_picked(self.q, self.picks, self.hidden, self.cache)
        self.final = rms_norm(mtp.layer.attended(self.x, mtp.layer.attn.output(o_lat)), mtp.head_norm,
                              model.cfg.rms_norm_eps)
        self.logits = model.logits(self.final, mtp.head)

    def run(self, step) -> None:
        """The extend pass (`step`: its context and the target's final hidden states of its rows)."""
        ctx, hidden = step
        n, attn = ctx.num_tokens, self.model.mtp.layer.attn
        self.input_ids[:n], self.positions[:n], self.slot_mapping[:n] = ctx.input_ids, ctx.positions, ctx.slot_mapping
        self.hidden_in[:n] = hidden
        self.input_ids[n:], self.positions[n:], self.slot_mapping[n:], self.hidden_in[n:] = 0, 0, self.padding_slot, 0
        self.reads.load(ctx)
        if not self.reads.resolves:
            self._load_dense(ctx, attn)
        calls = self.pieces() if self.graphs is None else [g.replay for g in self.graphs]
        calls[0]()
        self._selecting(lambda: self._select(attn, self.q, self.index_q, ctx))
        calls[1]()
        self.reads.finish(ctx)


class DecodeGraphs:
    """The runner's decode steps of up to `max_bs` requests, through `BucketPieces` (`capture`: replayed
    from CUDA graphs). A request has up to `runner.decode_rows` rows (1 + its drafts): the buckets are
    of rows, up to max_bs x decode_rows."""

    def __init__(self, runner, max_bs: int, capture: bool):
        self.runner, self.max_bs, self.capture = runner, max_bs, capture
        self.max_rows = max_bs * runner.decode_rows
        self.padding_slot = runner.cache.padding_slot
        self.buckets: dict[int, BucketPieces] = {}
        self.drafts: dict[int, DraftPieces] = {}  # draft steps, by bucket of drafting requests
        self.extends: dict[int, ExtendPieces] = {}  # MTP extend passes, by bucket of rows
        self.memory_pool = None  # one CUDA graph memory pool for every bucket's pieces
        self.steps = self.draft_steps = self.extend_steps = 0
        self.eager_buckets: set = set()  # left eager: rows, or ("draft" | "extend", rows)
        # data-parallel ranks whose tokens meet at every MoE layer (parallel/executor.py's LaneExecutor):
        # the bucket every rank runs the step's pass in, agreed before it; 0: the engine's path
        self.agreed_rows: int | None = None

    # -- what the pieces take: each pass kind's rows (a data-parallel rank votes with them) ------------
    def takes(self, chunks) -> bool:
        """A decode step of at most max_bs requests: each its last token and its drafts, sampling."""
        return self._agreed_or(self.step_rows(chunks))

    def step_rows(self, chunks) -> int:
        """The rows of a step the pieces can run (-1: they cannot)."""
        fits = 0 < len(chunks) <= self.max_bs and all(
            ch.samples_token and ch.num_new_tokens == 1 + ch.num_draft_tokens for ch in chunks)
        return sum(ch.num_new_tokens for ch in chunks) if fits else -1

    def takes_extend(self, ctx: ForwardContext) -> bool:
        return self._agreed_or(self.extend_rows([seq.num_new_tokens for seq in ctx.seqs]))

    def extend_rows(self, rows: list[int]) -> int:
        """The rows of an extend pass (each request's rows: `rows`) the pieces can run: over decode rows
        only (not a prompt's), of at most max_bs requests (-1: they cannot)."""
        fits = 0 < sum(rows) <= self.max_rows and len(rows) <= self.max_bs and max(rows) <= self.runner.decode_rows
        return sum(rows) if fits else -1

    def takes_drafts(self, chain) -> bool:
        return self._agreed_or(self.draft_rows(chain))

    def draft_rows(self, chain) -> int:
        """The rows of a draft step of `chain` the pieces can run: at most max_bs requests, each of which
        the pieces can read (over the tiered cache: its MTP layer's last pass was a decode's, through its
        working set); -1: they cannot."""
        requests = [seq.request_id for seq in chain.seqs]
        fits = 0 < len(requests) <= self.max_bs and self.runner.cache.pieces_read(requests, mtp=True)
        return len(requests) if fits else -1

    def _agreed_or(self, rows: int) -> bool:
        return self.agreed_rows > 0 if self.agreed_rows is not None else rows > 0

    def bucket_for(self, kind: str, rows: int) -> int | None:
        """The bucket of a pass of `kind` ("target", "extend" or "draft") of `rows` rows (None: none)."""
        return bucket_of(rows, self.max_bs if kind == "draft" else self.max_rows) if rows > 0 else None

    # -- the passes --------------------------------------------------------------------------------
    def execute(self, step: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden states) of the step's rows, as `ModelRunner.execute` returns them."""
        n = step.num_tokens
        bucket = self.agreed_rows or bucket_of(n, self.max_rows)
        self.steps += 1
        return self._run(self._pieces(self.buckets, BucketPieces, bucket), bucket, step, n)

    @torch.inference_mode()
    def idle(self, kind: str, rows: int) -> None:
        """A data-parallel rank with no rows in a pass of `kind` the others run through the `rows`-row
        bucket: the same pieces over padding rows only, so that its MoE exchanges meet theirs."""
        device, model = self.runner.device, self.runner.model
        empty = torch.zeros(0, dtype=torch.long, device=device)
        nothing = torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=device)  # no hidden states
        ctx = ForwardContext(empty, empty, empty, [], empty, draft_step=kind == "draft")
        made, kind_of, step = {"target": (self.buckets, BucketPieces, ctx),
                               "extend": (self.extends, ExtendPieces, (ctx, nothing)),
                               "draft": (self.drafts, DraftPieces, (ctx, SimpleNamespace(seqs=[], hidden=nothing)))}[kind]
        self._run(self._pieces(made, kind_of, rows), rows if kind == "target" else (kind, rows), step, 0)

    def draft(self, chain, step: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states after the MTP layer's head norm) of an MTP draft step of `chain`
        (speculative.py's DraftChain), as `MTPDrafter.forward` returns them for every row."""
        n = step.num_tokens
        bucket = self.agreed_rows or bucket_of(n, self.max_bs)
        pieces = self._pieces(self.drafts, DraftPieces, bucket)
        self.draft_steps += 1
        return self._run(pieces, ("draft", bucket), (step, chain), n)

    def extend(self, ctx: ForwardContext, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states after the MTP layer's head norm) of the extend pass's `ctx.logits_rows`,
        as `MTPDrafter.forward` returns them; `hidden`: the target's final hidden states of its rows."""
        n = ctx.num_tokens
        bucket = self.agreed_rows or bucket_of(n, self.max_rows)
        self.extend_steps += 1
        logits, final = self._run(self._pieces(self.extends, ExtendPieces, bucket), ("extend", bucket), (ctx, hidden), n)
        return logits[ctx.logits_rows], final[ctx.logits_rows]

    def _pieces(self, made: dict, kind, rows: int):
        """The `kind` pieces of the `rows`-row bucket, made at its first use."""
        if rows not in made:
            made[rows] = kind(self.runner.model, self.runner.cache, rows, self.padding_slot, self.runner.decode_rows)
        return made[rows]

    def _run(self, pieces, key, step, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`pieces` run on `step` (captured first where they are to be and are not yet): the first `n`
        rows' logits and final hidden states."""
        if self.capture and pieces.graphs is None and key not in self.eager_buckets:
            return self._capture(pieces, key, step, n)
        pieces.run(step)
        if pieces.graphs is None:
            return pieces.logits[:n], pieces.final[:n]
        return pieces.logits[:n].clone(), pieces.final[:n].clone()  # the next replay overwrites them

    def _capture(self, pieces, key, step, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's first step: run eagerly (on a side stream, as torch.cuda.graphs asks before a
        capture), then each piece captured and the step replayed, which must give the eager logits. The
        step's selections are made once, in the eager run; the runs after it restore them."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        pieces.recording = []
        try:
            with torch.cuda.stream(side):
                pieces.run(step)
        finally:
            selected, pieces.recording = pieces.recording, None
        torch.cuda.current_stream().wait_stream(side)
        logits, final = pieces.logits[:n].clone(), pieces.final[:n].clone()
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        graphs = []
        try:
            for piece in pieces.pieces():
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls meanwhile (the server's) do not void the capture
                with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
                    piece()
                graphs.append(graph)
            pieces.graphs = graphs
            self._again(pieces, step, selected)
            same = torch.equal(pieces.logits[:n], logits)
        except RuntimeError as e:  # an op the capture refuses
            log.warning("decode graphs: capturing the %d-row bucket failed, it runs eagerly: %s", pieces.rows, e)
            same = False
        # NOTE: every tensor-parallel rank replays or runs eagerly alike, so their collectives pair up
        same = self.runner.model.comm.all_true(same, pieces.input_ids.device)
        if not same:
            if pieces.graphs is not None:
                log.warning("decode graphs: the %d-row bucket's replay differs from its eager run, it runs eagerly",
                            pieces.rows)
            pieces.graphs = None
            self.eager_buckets.add(key)
            self._again(pieces, step, selected)  # the step's cache entries written again as the eager run wrote them
            logits, final = pieces.logits[:n], pieces.final[:n]
        return logits, final

    @staticmethod
    def _again(pieces, step, selected: list) -> None:
        """`pieces` run on `step` again, with the selections `selected` of its first run."""
        pieces.again = list(selected)
        try:
            pieces.run(step)
        finally:
            pieces.again = None

    def reset(self) -> None:
        """Forget every bucket (new weights: captured graphs would read the old tensors)."""
        self.buckets.clear()
        self.drafts.clear()
        self.extends.clear()
        self.eager_buckets.clear()

    def stats(self) -> dict:
        every = [*self.buckets.values(), *self.drafts.values(), *self.extends.values()]
        captured = [p for p in every if p.graphs is not None]
        return {"decode_graph_steps": self.steps, "decode_graph_draft_steps": self.draft_steps,
                "decode_graph_extend_steps": self.extend_steps,
                "decode_graph_buckets": len(captured), "decode_graph_eager_buckets": len(self.eager_buckets)}
