"""Speculative decoding with the checkpoint's MTP (NextN) layer: K draft tokens per step.

A step of a drafting request feeds the target model [t_n, d_1 .. d_K] at positions n .. n + K, where
t_n is the last sampled token and d_j the MTP drafts. The target's logits at n + j - 1 decide d_j,
in order, stopping at the first rejection:

  * greedy: d_j is accepted iff it is the target's argmax, so the tokens are exactly those of plain
    greedy decoding;
  * sampling (Leviathan et al. 2023): accept d_j with probability min(1, p(d_j) / q(d_j)), else draw
    from normalise(max(0, p - q)) and stop. Each emitted token is distributed exactly as the target's p.

If every draft is accepted, the logits at n + K give one more token for free. Then the MTP layer runs
over the positions whose next token just became known ("extend": position p combines
the target's final hidden state at p with the embedding of token p + 1, writes the MTP layer's own
cache at p's slot, and predicts token p + 2); its last row gives d_1. Draft steps 2..K chain the MTP
layer on its own output (SGLang: the hidden after shared_head.norm) and the previous draft, at the
next positions, reusing the extend row's top-k selection (MTP index reuse) and attending only
to cache entries made from the target's hidden states: they write nothing. Rejected drafts leave no
state behind: the next step feeds the true tokens at those positions and overwrites their entries.

Counters (`SpecDecodingCounts`) mean what vLLM's do (its SpecDecodingStats and
`vllm:spec_decode_*` metrics): `num_drafts` counts verification steps, `num_draft_tokens` every draft
token the target verified against (accepted or not, including those after the first rejection),
`num_accepted_tokens` the accepted ones, `num_accepted_tokens_per_pos[i]` the steps whose draft i was
accepted. A step verifies K drafts except where fewer were proposed: none past max_tokens or
max_model_len (`Speculator._chain`), or fewer than K fitted in the step's token budget (the scheduler
drops the tail); only the drafts that reached the target count. A request that finishes inside a step
(EOS, a stop string, a grammar dead end) leaves the drafts after that token unjudged: they count as
drafted, not accepted (vLLM judges them before it checks stops; this differs on at most one step per
request). Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts,
the tokens a verification step yields (the form GLM reports MTP results in).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from .context import ForwardContext
from .model.layers import rms_norm
from .request import SamplingParams
from .sampling import draw, draw_rows, filter_logits, filter_logits_rows


@dataclass
class Draft:
    token: int
    probs: torch.Tensor | None  # the draft distribution q (None when greedy)


def draft_rows(logits: torch.Tensor, reqs: list, generators: dict) -> list[Draft]:
    """Each drafting request's draft from the MTP logits [B, V], processed as the target's will be:
    one argmax for all (B ints cross to the host, not B x V); for the sampled ones one filter, softmax
    and draw, each row drawn with its request's generator (row-wise: a row gets what it gets alone)."""
    tokens = logits.argmax(-1)
    sampled = [i for i, req in enumerate(reqs) if not req.params.greedy]
    probs = {}
    if sampled:
        q = filter_logits_rows(logits[sampled], [reqs[i].params for i in sampled]).softmax(-1)
        tokens[sampled] = draw_rows(q, [generators[reqs[i].request_id] for i in sampled]).to(tokens.device)
        probs = dict(zip(sampled, q.cpu()))  # where the target's probabilities are (runner.execute)
    return [Draft(token, probs.get(i)) for i, token in enumerate(tokens.tolist())]


def verify_draft(target_logits: torch.Tensor, draft: Draft, params: SamplingParams,
                 generator: torch.Generator) -> tuple[int, bool]:
    """(the token to emit at the draft's position, whether it is the draft)."""
    if params.greedy:
        token = int(target_logits.argmax())
        return token, token == draft.token
    p = filter_logits(target_logits, params).softmax(-1)
    q = draft.probs
    if float(torch.rand((), generator=generator)) * float(q[draft.token]) < float(p[draft.token]):
        return draft.token, True
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: any token drawn from p is exact
        residual = p
    return draw(residual / residual.sum(), generator), False


@dataclass
class SpecDecodingCounts:
    """vLLM's speculative-decoding counters, for one request or the whole engine (module docstring)."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.k

    def observe_step(self, num_draft_tokens: int) -> None:
        """A verification step with this many drafts fed to the target."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens

    def observe_accepted(self, position: int) -> None:
        """The step's draft at `position` (0-based) was accepted; acceptance stops at the first
        rejection, so the drafts before it were accepted too."""
        self.num_accepted_tokens += 1
        self.num_accepted_tokens_per_pos[position] += 1

    def metrics(self) -> dict:
        drafts, tokens, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
                "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


class MTPDrafter:
    """Runs the MTP layer, in the executor (on every rank): the extend pass over the rows whose next
    token became known, then the draft steps chained on its own output."""

    def __init__(self, model, runner, cache, num_tokens: int):
        self.model, self.mtp, self.cfg = model, model.mtp, model.cfg
        self.runner, self.cache, self.k = runner, cache, num_tokens
        self._chain: DraftChain | None = None

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, ctx: ForwardContext,
                cache, every_row_drafts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: final hidden states [N, H] at ctx.positions (the target's after model.norm, or the
        previous draft step's); next_tokens: the token at position + 1 of each row; ctx.cos / ctx.sin
        already set or computed here. Returns (fp32 logits, hidden after shared_head.norm) of
        ctx.logits_rows (`every_row_drafts`: those are all the rows, in order)."""
        mtp, eps = self.mtp, self.cfg.rms_norm_eps
        x = self.model.mtp_input(hidden, next_tokens)
        if ctx.cos is None:
            ctx.cos, ctx.sin = self.model.rotary.cos_sin(ctx.positions)
        x = mtp.layer.forward(x, ctx, cache)
        h = rms_norm(x if every_row_drafts else x[ctx.logits_rows], mtp.head_norm, eps)
        return self.model.logits(h, mtp.head), h

    @torch.inference_mode()
    def extend(self, hidden: torch.Tensor, plan: "MTPPlan") -> torch.Tensor:
        """The extend pass over `plan.rows` of the target step's `hidden`; the logits of the drafting
        rows (draft 1). Keeps what the draft steps chain on."""
        ctx = self.runner.build_mtp_context(plan.parts, plan.logits_rows)
        self.cache.begin_mtp_pass(ctx.seqs, {request_id: pages for request_id, pages, _, _ in plan.parts})
        graphs, rows = self.runner.graphs, _rows_of(hidden, plan.rows)
        if graphs is not None and graphs.takes_extend(ctx):  # the decode graphs' pieces
            logits, h = graphs.extend(ctx, rows)
        else:
            logits, h = self.forward(rows, ctx.input_ids, ctx, self.cache)
        seqs = [ctx.seqs[i] for i in plan.drafting]
        selection = {s.request_id: ctx.selection[s.request_id][-1:] for s in seqs if s.request_id in ctx.selection}
        self._chain = DraftChain(seqs, selection, h, self._chain_rope(seqs))
        return logits

    @property
    def chain(self) -> DraftChain | None:
        """What the draft steps after the last extend pass chain on."""
        return self._chain

    def _chain_rope(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos / sin of draft steps 2..K (one row per drafting request past its history), computed
        once for the whole chain; None with fewer than two draft steps (each computes its own)."""
        if self.k < 3 or not seqs:
            return None
        positions = [s.context_len - 1 + step for step in range(1, self.k) for s in seqs]
        cos, sin = self.model.rotary.cos_sin(torch.tensor(positions, device=self.model.device))
        shape = (self.k - 1, len(seqs), *cos.shape[1:])  # step-major: step s's rows are [s - 1]
        return cos.view(shape), sin.view(shape)

    @torch.inference_mode()
    def step(self, step: int, tokens: list[int]) -> torch.Tensor:
        """Draft step `step` (1-based after the extend pass) from the previous drafts `tokens`: reads,
        never writes."""
        chain = self._chain
        ctx = self.runner.build_draft_step_context(chain.seqs, step, tokens, chain.selection)
        graphs = self.runner.graphs
        if graphs is not None and graphs.takes_drafts(chain):  # the decode graphs' draft piece
            logits, chain.hidden = graphs.draft(chain, ctx)
            return logits
        if chain.rope is not None:
            ctx.cos, ctx.sin = chain.rope[0][step - 1], chain.rope[1][step - 1]
        logits, chain.hidden = self.forward(chain.hidden, ctx.input_ids, ctx, self.cache, every_row_drafts=True)
        return logits


@dataclass
class DraftChain:
    """What draft steps 2..K chain on: the drafting requests' slices of the extend pass, their
    drafting row's selection (MTP index reuse), the last hidden state (after shared_head.norm) and
    every step's cos / sin."""

    seqs: list
    selection: dict
    hidden: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None


def _rows_of(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]: a view when the rows are consecutive (one request's, or a whole batch's)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return hidden[rows[0]:rows[0] + len(rows)]
    return hidden[torch.tensor(rows, device=hidden.device)]


@dataclass
class MTPPlan:
    """An MTP extend pass as plain data (what an executor, on every rank, needs to run it).

    parts, one per request in batch order: (request id, its pages, first position, the next token of
    each position); rows: the target step's rows they continue; logits_rows: the rows that draft
    (one per drafting request, its last); drafting: those requests' indices in `parts`."""

    parts: list[tuple[str, list[int], int, list[int]]]
    rows: list[int]
    logits_rows: list[int]
    drafting: list[int]


class Speculator:
    """The engine's MTP drafting state: pending drafts per request, acceptance counters. The MTP
    layer itself runs in the executor (`MTPDrafter`), from the plain-data plans this builds."""

    def __init__(self, executor, has_mtp_layer: bool, num_hidden_layers: int, num_tokens: int, max_model_len: int):
        if not has_mtp_layer:
            raise ValueError("num_speculative_tokens needs a checkpoint with an MTP layer "
                             f"(model.layers.{num_hidden_layers}.*); this one has none")
        self.executor, self.k, self.max_model_len = executor, num_tokens, max_model_len
        self.drafts: dict[str, list[Draft]] = {}
        self.counts: dict[str, SpecDecodingCounts] = {}
        self.totals = SpecDecodingCounts(num_tokens)
        self._pass_observers: list[Callable[[str], ContextManager]] = []

    def add_pass_observer(self, observer: Callable[[str], ContextManager]) -> None:
        """Enter `observer(name)` around each MTP pass the engine runs: "extend" (the MTP cache over the
        step's final rows, and draft 1) and "draft step" (each of drafts 2..K). Benchmarks and tests
        count or time the passes through this."""
        self._pass_observers.append(observer)

    def _observed(self, name: str) -> ExitStack:
        stack = ExitStack()
        for observer in self._pass_observers:
            stack.enter_context(observer(name))
        return stack

    def begin_verification(self, request_id: str, num_draft_tokens: int) -> None:
        """A step feeds the target the request's first `num_draft_tokens` drafts (the ones that fitted)."""
        for c in (self._request_counts(request_id), self.totals):
            c.observe_step(num_draft_tokens)

    def verify(self, req, target_logits: torch.Tensor, index: int, generator: torch.Generator) -> tuple[int, bool]:
        """The token at the position of the request's draft `index` (0-based), and whether it is the draft."""
        token, accepted = verify_draft(target_logits, self.drafts[req.request_id][index], req.params, generator)
        if accepted:
            for c in (self._request_counts(req.request_id), self.totals):
                c.observe_accepted(index)
        return token, accepted

    def _request_counts(self, request_id: str) -> SpecDecodingCounts:
        return self.counts.setdefault(request_id, SpecDecodingCounts(self.k))

    def forget(self, request_id: str) -> dict:
        self.drafts.pop(request_id, None)
        return self.counts.pop(request_id, SpecDecodingCounts(self.k)).metrics()

    def request_metrics(self, request_id: str) -> dict:
        return self.counts.get(request_id, SpecDecodingCounts(self.k)).metrics()

    def stats(self) -> dict:
        return self.totals.metrics()

    def draft(self, chunks, generators: dict) -> None:
        """Extend the MTP cache over each running request's newly final rows; draft where the step sampled."""
        plan, drafting, row = MTPPlan([], [], [], []), [], 0
        for ch in chunks:
            req, start = ch.request, ch.first_position
            valid = 0 if req.finished else req.num_computed_tokens - start
            if valid > 0:
                plan.rows.extend(range(row, row + valid))
                plan.parts.append((req.request_id, req.page_ids, start,
                                   [req.token_at(p + 1) for p in range(start, start + valid)]))
                if ch.samples_token:
                    plan.logits_rows.append(len(plan.rows) - 1)
                    plan.drafting.append(len(plan.parts) - 1)
                    drafting.append(req)
            row += ch.num_new_tokens
        if not plan.rows:
            return
        with self._observed("extend"):
            logits = self.executor.draft_extend(plan)
        if drafting:
            self._chain(drafting, logits, generators)

    def _chain(self, reqs, logits: torch.Tensor, generators: dict) -> None:
        """Draft steps 1..K: step 1 from the extend rows, then the MTP layer on its own output."""
        drafts = [[] for _ in reqs]
        for step in range(self.k):
            if step:
                with self._observed("draft step"):
                    logits = self.executor.draft_step(step, [d[-1].token for d in drafts])
            for d, draft in zip(drafts, draft_rows(logits, reqs, generators)):
                d.append(draft)
        for req, d in zip(reqs, drafts):
            # a step emits at most drafts + 1 tokens: no draft past max_tokens or max_model_len
            room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            self.drafts[req.request_id] = d[:max(room, 0)]
            req.draft_token_ids[:] = [x.token for x in self.drafts[req.request_id]]
