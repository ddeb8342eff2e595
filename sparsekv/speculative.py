"""Speculative decoding with the checkpoint's MTP (NextN) layer: one draft token per step.

A step of a drafting request feeds the target model [t_n, d] at positions n, n + 1, where t_n is the
last sampled token and d the MTP draft for position n + 1. The target's logits at n decide d:

  * greedy: d is accepted iff it is the target's argmax, so the tokens are exactly those of plain
    greedy decoding;
  * sampling (Leviathan et al. 2023): accept d with probability min(1, p(d) / q(d)), else draw from
    normalise(max(0, p - q)). Each emitted token is distributed exactly as the target's p.

If d is accepted, the logits at n + 1 give one more token for free. Then the MTP layer runs over the
positions whose next token just became known (model-spec §8.1: position p combines the target's
final hidden state at p with the embedding of token p + 1, writes the MTP layer's own cache at p's
slot, and predicts token p + 2); its last row drafts the next step's d. A rejected d's cache entry
at n + 1 is simply overwritten by the next step, which feeds the true token there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .context import ForwardContext
from .model.layers import rms_norm
from .request import SamplingParams
from .sampling import filter_logits


@dataclass
class Draft:
    token: int
    probs: torch.Tensor | None  # the draft distribution q (None when greedy)


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draft:
    """A draft from the MTP logits of one request, processed as the target's will be."""
    if params.greedy:
        return Draft(int(logits.argmax()), None)
    q = filter_logits(logits, params).softmax(-1)
    return Draft(int(torch.multinomial(q, 1, generator=generator)), q)


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
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


class MTPDrafter:
    """Runs the MTP layer over rows whose next token is known; returns logits for the drafting rows."""

    def __init__(self, model):
        self.model, self.mtp, self.cfg = model, model.mtp, model.cfg

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        """hidden: the target's final hidden states [N, H] (after model.norm) at ctx.positions;
        next_tokens: the token at position + 1 of each row. Writes the MTP cache; logits of ctx.logits_rows."""
        mtp, eps = self.mtp, self.cfg.rms_norm_eps
        e = F.embedding(next_tokens, mtp.embed if mtp.embed is not None else self.model.embed)
        x = F.linear(torch.cat([rms_norm(e, mtp.enorm, eps), rms_norm(hidden, mtp.hnorm, eps)], -1), mtp.eh_proj)
        ctx.cos, ctx.sin = self.model.rotary.cos_sin(ctx.positions)
        x = mtp.layer.forward(x, ctx, cache)
        head = mtp.head if mtp.head is not None else self.model.lm_head
        return F.linear(rms_norm(x[ctx.logits_rows], mtp.head_norm, eps), head).float()


class Speculator:
    """The engine's MTP drafting state: one pending draft per request, acceptance counters."""

    def __init__(self, model, runner, cache):
        if model.mtp is None:
            raise ValueError("num_speculative_tokens needs a checkpoint with an MTP layer "
                             f"(model.layers.{model.cfg.num_hidden_layers}.*); this one has none")
        self.drafter, self.runner, self.cache = MTPDrafter(model), runner, cache
        self.drafts: dict[str, Draft] = {}
        self.counts: dict[str, list[int]] = {}  # request -> [drafted, accepted]
        self.totals = [0, 0]

    def verify(self, req, target_logits: torch.Tensor, generator: torch.Generator) -> tuple[int, bool]:
        draft = self.drafts.pop(req.request_id)
        token, accepted = verify_draft(target_logits, draft, req.params, generator)
        counts = self.counts.setdefault(req.request_id, [0, 0])
        for c in (counts, self.totals):
            c[0] += 1
            c[1] += accepted
        return token, accepted

    def forget(self, request_id: str) -> dict:
        self.drafts.pop(request_id, None)
        drafted, accepted = self.counts.pop(request_id, (0, 0))
        return metrics(drafted, accepted)

    def request_metrics(self, request_id: str) -> dict:
        return metrics(*self.counts.get(request_id, (0, 0)))

    def stats(self) -> dict:
        return metrics(*self.totals)

    def draft(self, chunks, hidden: torch.Tensor, generators: dict) -> None:
        """MTP over each running request's rows whose next token is now known; draft where the step sampled."""
        rows, tokens, positions, seqs, logits_rows, drafting, row = [], [], [], [], [], [], 0
        for ch in chunks:
            req, start = ch.request, ch.first_position
            valid = 0 if req.finished else req.num_computed_tokens - start
            if valid > 0:
                rows.extend(range(row, row + valid))
                positions.extend(range(start, start + valid))
                tokens.extend(req.token_at(p + 1) for p in range(start, start + valid))
                seqs.append(self._seq(req, len(rows) - valid, len(rows)))
                if ch.samples:
                    logits_rows.append(len(rows) - 1)
                    drafting.append(req)
            row += ch.num_new_tokens
        if not rows:
            return
        device = hidden.device
        pos = torch.tensor(positions, device=device)
        slots = torch.cat([s.slots[s.context_len - (s.token_end - s.token_start):] for s in seqs])
        ctx = ForwardContext(torch.tensor(tokens, device=device), pos, slots, seqs,
                             torch.tensor(logits_rows, dtype=torch.long, device=device), self.runner.attention)
        logits = self.drafter.forward(hidden[torch.tensor(rows, device=device)], ctx.input_ids, ctx, self.cache).cpu()
        for req, row_logits in zip(drafting, logits):
            d = draft_token(row_logits, req.params, generators[req.request_id])
            self.drafts[req.request_id] = d
            req.draft_token_ids[:] = [d.token]

    def _seq(self, req, token_start: int, token_end: int):
        from .context import SeqSlice
        from .runner import clip_runs
        context_len = req.num_computed_tokens
        slots, runs = self.runner.slot_table(req.request_id, req.page_ids)
        return SeqSlice(req.request_id, token_start, token_end, context_len, slots[:context_len],
                        runs=clip_runs(runs, context_len))


def metrics(drafted: int, accepted: int) -> dict:
    return {"spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0}
