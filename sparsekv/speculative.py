"""Speculative decoding with the checkpoint's MTP (NextN) layer: K draft tokens per step.

A step of a drafting request feeds the target model [t_n, d_1 .. d_K] at positions n .. n + K, where
t_n is the last sampled token and d_j the MTP drafts. The target's logits at n + j - 1 decide d_j,
in order, stopping at the first rejection:

  * greedy: d_j is accepted iff it is the target's argmax, so the tokens are exactly those of plain
    greedy decoding;
  * sampling (Leviathan et al. 2023): accept d_j with probability min(1, p(d_j) / q(d_j)), else draw
    from normalise(max(0, p - q)) and stop. Each emitted token is distributed exactly as the target's p.

If every draft is accepted, the logits at n + K give one more token for free. Then the MTP layer runs
over the positions whose next token just became known ("extend", model-spec §8.1: position p combines
the target's final hidden state at p with the embedding of token p + 1, writes the MTP layer's own
cache at p's slot, and predicts token p + 2); its last row gives d_1. Draft steps 2..K chain the MTP
layer on its own output (SGLang: the hidden after shared_head.norm) and the previous draft, at the
next positions, reusing the extend row's top-k selection (MTP index reuse, §8.2) and attending only
to cache entries made from the target's hidden states: they write nothing. Rejected drafts leave no
state behind: the next step feeds the true tokens at those positions and overwrites their entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .context import ForwardContext, SeqSlice
from .model.layers import rms_norm
from .request import SamplingParams
from .sampling import draw, filter_logits


@dataclass
class Draft:
    token: int
    probs: torch.Tensor | None  # the draft distribution q (None when greedy)


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draft:
    """A draft from the MTP logits of one request, processed as the target's will be."""
    if params.greedy:
        return Draft(int(logits.argmax()), None)
    q = filter_logits(logits, params).softmax(-1)
    return Draft(draw(q, generator), q)


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


class MTPDrafter:
    """Runs the MTP layer over rows; returns logits and the normed hidden states of the drafting rows."""

    def __init__(self, model):
        self.model, self.mtp, self.cfg = model, model.mtp, model.cfg

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, ctx: ForwardContext,
                cache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: final hidden states [N, H] at ctx.positions (the target's after model.norm, or the
        previous draft step's); next_tokens: the token at position + 1 of each row.
        Returns (fp32 logits, hidden after shared_head.norm) of ctx.logits_rows."""
        mtp, eps = self.mtp, self.cfg.rms_norm_eps
        e = F.embedding(next_tokens, mtp.embed if mtp.embed is not None else self.model.embed)
        x = F.linear(torch.cat([rms_norm(e, mtp.enorm, eps), rms_norm(hidden, mtp.hnorm, eps)], -1), mtp.eh_proj)
        ctx.cos, ctx.sin = self.model.rotary.cos_sin(ctx.positions)
        x = mtp.layer.forward(x, ctx, cache)
        h = rms_norm(x[ctx.logits_rows], mtp.head_norm, eps)
        return F.linear(h, mtp.head if mtp.head is not None else self.model.lm_head).float(), h


class Speculator:
    """The engine's MTP drafting state: pending drafts per request, acceptance counters."""

    def __init__(self, model, runner, cache, num_tokens: int, max_model_len: int):
        if model.mtp is None:
            raise ValueError("num_speculative_tokens needs a checkpoint with an MTP layer "
                             f"(model.layers.{model.cfg.num_hidden_layers}.*); this one has none")
        self.drafter, self.runner, self.cache, self.k = MTPDrafter(model), runner, cache, num_tokens
        self.max_model_len = max_model_len
        self.drafts: dict[str, list[Draft]] = {}
        self.counts: dict[str, list[int]] = {}  # request -> [drafted, accepted]
        self.totals = [0, 0]

    def verify(self, req, target_logits: torch.Tensor, index: int, generator: torch.Generator) -> tuple[int, bool]:
        """The token at the position of the request's draft `index` (0-based), and whether it is the draft."""
        token, accepted = verify_draft(target_logits, self.drafts[req.request_id][index], req.params, generator)
        counts = self.counts.setdefault(req.request_id, [0, 0])
        for c in (counts, self.totals):
            c[0] += 1
            c[1] += accepted
        return token, accepted

    def drop_drafts(self, request_id: str) -> None:
        """A preempted request's drafts are never verified (its counts stay)."""
        self.drafts.pop(request_id, None)

    def forget(self, request_id: str) -> dict:
        self.drafts.pop(request_id, None)
        drafted, accepted = self.counts.pop(request_id, (0, 0))
        return metrics(drafted, accepted)

    def request_metrics(self, request_id: str) -> dict:
        return metrics(*self.counts.get(request_id, (0, 0)))

    def stats(self) -> dict:
        return metrics(*self.totals)

    def draft(self, chunks, hidden: torch.Tensor, generators: dict) -> None:
        """Extend the MTP cache over each running request's newly final rows; draft where the step sampled."""
        rows, tokens, positions, seqs, logits_rows, drafting, row, pages = [], [], [], [], [], [], 0, {}
        for ch in chunks:
            req, start = ch.request, ch.first_position
            valid = 0 if req.finished else req.num_computed_tokens - start
            if valid > 0:
                rows.extend(range(row, row + valid))
                positions.extend(range(start, start + valid))
                tokens.extend(req.token_at(p + 1) for p in range(start, start + valid))
                seqs.append(self.runner.seq_slice(req.request_id, req.page_ids, len(rows) - valid, len(rows),
                                                  req.num_computed_tokens))
                pages[req.request_id] = req.page_ids
                if ch.samples_token:
                    logits_rows.append(len(rows) - 1)
                    drafting.append((req, seqs[-1]))
            row += ch.num_new_tokens
        if not rows:
            return
        device = hidden.device
        self.cache.begin_mtp_pass(seqs, pages)
        slots = torch.cat([s.slots[s.first_new_position:] for s in seqs])
        ctx = ForwardContext(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), slots,
                             seqs, torch.tensor(logits_rows, dtype=torch.long, device=device), self.runner.attention,
                             decode_rows=self.runner.decode_rows, batch_dense_decodes=self.runner.batch_dense_decodes)
        logits, h = self.drafter.forward(hidden[torch.tensor(rows, device=device)], ctx.input_ids, ctx, self.cache)
        if drafting:
            selection = {r.request_id: ctx.selection[r.request_id][-1:] for r, _ in drafting
                         if r.request_id in ctx.selection}
            self._chain([r for r, _ in drafting], [s for _, s in drafting], logits, h, selection, generators)

    def _chain(self, reqs, seqs, logits: torch.Tensor, h: torch.Tensor, selection: dict, generators: dict) -> None:
        """Draft steps 1..K: step 1 from the extend rows, then the MTP layer on its own output."""
        drafts = [[] for _ in reqs]
        for step in range(self.k):
            if step:
                logits, h = self._draft_step(seqs, step, [d[-1].token for d in drafts], h, selection)
            greedy = logits.argmax(-1).tolist()  # every greedy draft in one op; B ints cross to the host, not B x V
            for i, req in enumerate(reqs):
                drafts[i].append(Draft(greedy[i], None) if req.params.greedy else
                                 draft_token(logits[i], req.params, generators[req.request_id]))
        for req, d in zip(reqs, drafts):
            # a step emits at most drafts + 1 tokens: no draft past max_tokens or max_model_len
            room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            self.drafts[req.request_id] = d[:max(room, 0)]
            req.draft_token_ids[:] = [x.token for x in self.drafts[req.request_id]]

    def _draft_step(self, seqs, step: int, tokens: list[int], h: torch.Tensor, selection: dict):
        """One row per request at the position after its last verified one + step - 1: reads, never writes."""
        device = h.device
        rows = [SeqSlice(s.request_id, i, i + 1, s.context_len, s.slots, runs=s.runs) for i, s in enumerate(seqs)]
        positions = torch.tensor([s.context_len - 1 + step for s in seqs], device=device)
        ctx = ForwardContext(torch.tensor(tokens, device=device), positions, positions, rows,
                             torch.arange(len(seqs), device=device), self.runner.attention,
                             selection=dict(selection), draft_step=True,
                             batch_dense_decodes=self.runner.batch_dense_decodes)
        return self.drafter.forward(h, ctx.input_ids, ctx, self.cache)


def metrics(drafted: int, accepted: int) -> dict:
    return {"spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0}
