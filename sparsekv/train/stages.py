"""The training stages and their losses.

  1 pretrain  dense attention, LM loss; indexers and the MTP layer idle.
  2 warmup    main model frozen, dense attention; each kept indexer is distilled with
              KL(p_bar || softmax(I)), p_bar = the head-summed, L1-normalised attention averaged
              over the layers of its IndexShare group (IndexCache Prop. 1).
  3 sparse    top-k attention on; LM loss for the main model plus the same KL restricted to the
              selected set S_t and renormalised; the indexer input is detached, so each part
              learns only from its own loss.
  4 mtp       main model frozen; the MTP layer predicts token t+2 (CE) plus a total-variation
              term TV(p_target, q_draft) (acceptance = 1 - TV). Its own indexer gets a dense
              KL warm-up for the first half, then the sparse KL.
  5 PoSE      position-id skipping in every stage (see data.py).
  far         (optional, after mtp) only the indexers of the chosen full layers train: the
              warm-up's KL with negatives in the softmax, each standing for context / M positions
              of a long context. Layer 0 (target smoothed towards uniform over the row): copies of
              the batch's tokens thousands to a million positions back; its indexer sees only
              token embeddings, so at long context its top-k filled with far copies of the current
              token (docs/training.md, "Where 64K fails"). A later full layer: other rows' tokens
              (their hidden states in their own rows), interleaved with the row at its own
              positions, so that they differ from the row's keys in content only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import STAGES  # noqa: F401  (re-exported: the trainer and the CLI name the stages from here)
from .model import NEG, GlmDsaForTraining, LayerTrace


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    if weights is None:
        return ce.mean()
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum()


def kl_to_index(target: torch.Tensor, index: torch.Tensor, allowed: torch.Tensor,
                far_index: torch.Tensor | None = None, far_log_weight: float = 0.0,
                smoothing: float = 0.0) -> torch.Tensor:
    """Mean over queries of KL(p || softmax(I)), both restricted to `allowed` and renormalised.

    `far_index` [B, S, M]: scores of far negatives, which join the softmax (target 0), each weighted
    by exp(`far_log_weight`); `smoothing` mixes the target with the uniform over `allowed`."""
    scores = index.masked_fill(~allowed, NEG)
    if far_index is not None:
        scores = torch.cat([scores, far_index + far_log_weight], dim=-1)
    log_q = torch.log_softmax(scores, dim=-1)[..., :index.shape[-1]]
    p = target * allowed
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    if smoothing:
        p = (1 - smoothing) * p + smoothing * allowed / allowed.sum(-1, keepdim=True).clamp_min(1)
    return (p * (p.clamp_min(1e-30).log() - log_q)).sum(-1).mean()


def index_groups(indexer_types) -> dict[int, list[int]]:
    """Full layer -> the layers it serves (itself and the shared layers after it)."""
    groups: dict[int, list[int]] = {}
    owner = 0
    for i, t in enumerate(indexer_types):
        if t == "full":
            owner = i
        groups.setdefault(owner, []).append(i)
    return groups


def group_attention(traces: list[LayerTrace], members: list[int]) -> torch.Tensor:
    """p_bar: the attention of an IndexShare group's layers, averaged (each already head-averaged)."""
    return torch.stack([traces[j].probs for j in members]).mean(0)


def indexer_loss(traces: list[LayerTrace], indexer_types, sparse: bool) -> torch.Tensor:
    """Group-averaged KL for each kept indexer, plus (when present) each auxiliary indexer of a
    shared layer distilled towards its own layer's attention over the keys that layer used."""
    total = 0.0
    groups = index_groups(indexer_types)
    for owner, members in groups.items():
        p_bar = group_attention(traces, members)
        tr = traces[owner]
        allowed = tr.selected if sparse else tr.index > NEG / 2
        total = total + kl_to_index(p_bar, tr.index, allowed)
        for j in members[1:]:
            if traces[j].index is not None:
                aux_allowed = traces[j].selected if sparse else traces[j].index > NEG / 2
                total = total + kl_to_index(traces[j].probs, traces[j].index, aux_allowed) / len(members)
    return total / len(groups)


def far_indexer_loss(traces: list[LayerTrace], targets: dict, far: dict, smoothing: float):
    """The `far` stage: each far layer's group-averaged KL with its negatives (`targets`: layer -> its
    group's averaged attention, `far_targets`; `far`: layer -> data.FarNegatives), averaged (see the
    module doc)."""
    total = 0.0
    for owner, negatives in far.items():
        tr = traces[owner]
        total = total + kl_to_index(targets[owner], tr.index, tr.index > NEG / 2,
                                    visible_scores(tr.far_index, negatives), negatives.log_weight, smoothing)
    return total / len(far)


def far_targets(traces: list[LayerTrace], indexer_types, far: dict) -> dict:
    """Each far layer's group-averaged attention, computed once for the loss and the metrics."""
    groups = index_groups(indexer_types)
    return {owner: group_attention(traces, groups[owner]) for owner in far}


def visible_scores(far_index: torch.Tensor, negatives) -> torch.Tensor:
    """[B, S, M] scores of the negatives, NEG where a query does not see one (haystack negatives
    placed at or after it)."""
    if negatives.after is None:
        return far_index
    rows = torch.arange(far_index.shape[1], device=far_index.device)
    return far_index.masked_fill(rows[None, :, None] <= negatives.after[:, None, :], NEG)


@torch.no_grad()
def far_metrics(traces: list[LayerTrace], targets: dict, far: dict) -> dict[str, float]:
    """Per far layer: far copies, `far_above_recent_L0`; haystack negatives, `haystack_above_target_L{i}`:
    the share of the negatives a query sees that score above its group's most attended key."""
    out = {}
    for owner, negatives in far.items():
        tr = traces[owner]
        if negatives.after is None:
            out[f"far_above_recent_L{owner}"] = far_ranking(tr)
            continue
        top = tr.index.gather(-1, targets[owner].argmax(-1, keepdim=True))
        seen = visible_scores(tr.far_index, negatives) > NEG / 2
        out[f"haystack_above_target_L{owner}"] = ((tr.far_index > top) & seen).sum().item() / max(seen.sum().item(), 1)
    return out


@torch.no_grad()
def far_ranking(trace: LayerTrace, local: int = 8) -> float:
    """Share of far negatives scored above the lowest of each query's `local` previous positions
    (0 when the indexer ranks every recent position above every far copy)."""
    index, far = trace.index, trace.far_index
    s = index.shape[1]
    if s <= local:
        return 0.0
    recent = torch.stack([index.diagonal(-j, 1, 2)[:, local - j:] for j in range(1, local + 1)], -1).amin(-1)
    return (far[:, local:] > recent[..., None]).float().mean().item()


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p_logits.softmax(-1) - q_logits.softmax(-1)).abs().sum(-1).mean()


def set_trainable(model: GlmDsaForTraining, stage: str, far_layers=(0,)) -> list[torch.nn.Parameter]:
    """Freezes everything, then unfreezes what the stage trains; returns those parameters."""
    far_prefixes = tuple(f"model.layers.{i}.self_attn.indexer." for i in far_layers)
    mtp_prefix = f"model.layers.{model.cfg.num_hidden_layers}."
    for name, p in model.named_parameters():
        in_mtp, is_index = name.startswith(mtp_prefix), ".indexer." in name
        if stage == "pretrain":
            p.requires_grad_(not in_mtp and not is_index)
        elif stage == "warmup":
            p.requires_grad_(is_index and not in_mtp)
        elif stage == "sparse":
            p.requires_grad_(not in_mtp)
        elif stage == "far":
            p.requires_grad_(name.startswith(far_prefixes))
        else:
            p.requires_grad_(in_mtp)
    return [p for p in model.parameters() if p.requires_grad]


def stage_loss(model: GlmDsaForTraining, stage: str, batch, progress: float, tv_weight: float = 1.0,
               far_smoothing: float = 0.0):
    """(loss to minimise, metrics) for one batch. `progress` in [0, 1] is how far the stage is."""
    ids, pos, w = batch.ids, batch.positions, batch.weights
    inputs, targets = ids[:, :-1], ids[:, 1:]
    types = model.cfg.indexer_types
    if stage == "pretrain":
        out = model(inputs, pos)
        loss = lm_loss(out.logits, targets, w)
        return loss, {"lm": loss.item()}
    if stage == "warmup":
        out = model(inputs, pos, want_index=True, want_probs=True)
        kl = indexer_loss(out.traces, types, sparse=False)
        return kl, {"kl": kl.item()}
    if stage == "far":
        if batch.far is None:
            raise ValueError("the far stage needs far negatives (--far-negatives M)")
        out = model(inputs, pos, want_probs=True, far=batch.far)   # only the far layers' indexers score
        targets = far_targets(out.traces, types, batch.far)
        kl = far_indexer_loss(out.traces, targets, batch.far, far_smoothing)
        return kl, {"kl": kl.item(), **far_metrics(out.traces, targets, batch.far)}
    if stage == "sparse":
        out = model(inputs, pos, sparse=True, want_index=True, want_probs=True)
        lm = lm_loss(out.logits, targets, w)
        kl = indexer_loss(out.traces, types, sparse=True)
        return lm + kl, {"lm": lm.item(), "kl": kl.item()}
    return mtp_loss(model, inputs, targets, pos, sparse_draft=progress >= 0.5, tv_weight=tv_weight)


def mtp_loss(model, inputs, targets, pos, sparse_draft: bool, tv_weight: float):
    with torch.no_grad():
        out = model(inputs, pos, sparse=True)
    draft, trace = model.mtp_forward(inputs, pos, out.hidden, sparse=sparse_draft, want_probs=True)
    # draft row p predicts token p+2 = targets[:, p+1]; the target model's distribution for that
    # token is its logits at row p+1.
    q = draft
    ce = lm_loss(q, targets[:, 1:])
    tv = total_variation(out.logits[:, 1:], q)
    allowed = trace.selected if sparse_draft else trace.index > NEG / 2
    kl = kl_to_index(trace.probs, trace.index, allowed)
    return ce + tv_weight * tv + kl, {"mtp_ce": ce.item(), "accept": 1.0 - tv.item(), "kl": kl.item()}


@torch.no_grad()
def probe_metrics(model: GlmDsaForTraining, ids: torch.Tensor, mask: torch.Tensor, batch_size: int = 8) -> dict:
    """Teacher-forced retrieval on fixed prompts (data.retrieval_probe), dense attention: the share of
    answer tokens predicted (argmax) and of prompts whose whole answer is right."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits, tokens, exact = 0, 0, 0
    for i in range(0, ids.shape[0], batch_size):
        x, m = ids[i:i + batch_size].to(device), mask[i:i + batch_size].to(device)
        pos = torch.arange(x.shape[1] - 1, device=device).expand(x.shape[0], -1)
        ok = (model(x[:, :-1], pos).logits.argmax(-1) == x[:, 1:]) | ~m
        hits += (ok & m).sum().item()
        tokens += m.sum().item()
        exact += ok.all(-1).sum().item()
    model.train(was_training)
    return {"answer_token_acc": hits / max(tokens, 1), "answer_exact": exact / max(ids.shape[0], 1)}


@torch.no_grad()
def heldout_metrics(model: GlmDsaForTraining, rows: torch.Tensor, batch_size: int = 8) -> dict:
    """Held-out LM loss with dense and with sparse attention, and MTP acceptance (1 - TV) / top-1."""
    was_training = model.training
    model.eval()
    sums = {"loss_dense": 0.0, "loss_sparse": 0.0, "mtp_accept": 0.0, "mtp_top1": 0.0}
    n, device = 0, next(model.parameters()).device
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i:i + batch_size].to(device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        pos = torch.arange(inputs.shape[1], device=device).expand_as(inputs)
        k = ids.shape[0]
        sums["loss_dense"] += lm_loss(model(inputs, pos).logits, targets).item() * k
        out = model(inputs, pos, sparse=True)
        sums["loss_sparse"] += lm_loss(out.logits, targets).item() * k
        if model.mtp is not None:
            draft, _ = model.mtp_forward(inputs, pos, out.hidden, sparse=True)
            q, p = draft, out.logits[:, 1:]
            sums["mtp_accept"] += (1.0 - total_variation(p, q).item()) * k
            sums["mtp_top1"] += (q.argmax(-1) == p.argmax(-1)).float().mean().item() * k
        n += k
    model.train(was_training)
    return {key: v / n for key, v in sums.items()}
