"""Small building blocks in the reference's numerics: RMSNorm, RoPE tables, dense MLP, MoE.

Numerics follow transformers 5.23: norms compute in fp32 and cast back before the
weight multiply; the router runs in fp32; cos/sin are cast to the model dtype before use.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig, yarn_mscale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # no casts to make: torch's rms_norm runs the same ops in one call (bitwise equal on a CPU:
        # tests/test_batched_decode.py)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for default or yarn RoPE."""
    rp = cfg.rope_parameters
    base, dim = float(rp["rope_theta"]), cfg.qk_rope_head_dim
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rp.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    return _yarn_inv_freq(rp, pos_freqs, base, dim)


def _yarn_inv_freq(rp: dict, pos_freqs: torch.Tensor, base: float, dim: int) -> tuple[torch.Tensor, float]:
    factor, orig = float(rp["factor"]), float(rp["original_max_position_embeddings"])
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rp.get("beta_fast") or 32), correction_dim(rp.get("beta_slow") or 1)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos/sin for arbitrary positions, computed per step (positions reach 1M; no precomputed table)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.inv_freq, self.scale = rope_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, R/2] of each position, for `rotate` (a full [N, R] table's two halves are
        equal; the middle dim broadcasts over heads)."""
        freqs = positions.view(-1, 1, 1).float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        if cos.dtype != self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of x [N, M, R] by a step's cos/sin [N, 1, R/2] (`RotaryTable.cos_sin`): the pairs (2i, 2i+1)
    de-interleaved into [evens' | odds'] (`rope_interleaved`) or the pairs (i, i + R/2)
    (`rope_half_split`); bitwise what those compute from full tables."""
    if cos.dim() == 2:  # [N, R/2]: a table viewed without its heads' dim
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J pairs (2i, 2i+1); output de-interleaved [evens' | odds'] exactly like transformers.

    x: [N, ..., R]; cos/sin: [N, R] broadcast over the middle dims.
    """
    half = cos.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos[..., :half].reshape(shape), sin[..., :half].reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX layout (pairs i, i+R/2), used by the DeepSeek-V3.2 indexer."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


# ---------------------------------------------------------------------------------------------- GEMM

def gemm_layout(w: torch.Tensor) -> torch.Tensor:
    """A projection's weight [out, in] as F.linear reads it fastest on its device: on a CPU stored
    column-major (the same shape and values; its transpose, [in, out], is the contiguous one), so a
    decode step's few-row GEMMs read it as the plain [in, out] operand, which MKL runs 1.3-2x faster
    than the transposed one at 1-32 rows and as fast at prefill's thousands (BENCHMARKS.md, "Weights
    laid out for the GEMM"); elsewhere as it is. Slices of rows stay views; `copy_` writes through."""
    if w.device.type != "cpu" or w.dim() != 2:
        return w
    return w.t().contiguous().t()


# ---------------------------------------------------------------------------------------------- FFN

class DenseMLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one GEMM."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = torch.cat([gate, up]), down
        self.intermediate = gate.shape[0]

    def laid_out(self) -> DenseMLP:
        """Its weights in `gemm_layout` (not a routed expert's: those are the stacked experts' views, whose
        grouped GEMM gives the same bits as F.linear on row-major weights, as the per-expert loop must)."""
        self.gate_up, self.down = gemm_layout(self.gate_up), gemm_layout(self.down)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).split(self.intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


def route_experts(cfg: ModelConfig, x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor):
    """(expert ids [N, k], weights [N, k] fp32) exactly as the reference router: sigmoid scores in
    fp32; the correction bias only chooses experts; group-limited top-k; normalise, then scale.
    Shared by the engine and the training model (weights stay differentiable there)."""
    fp32 = lambda t: t if t.dtype == torch.float32 else t.float()  # noqa: E731 (no cast op when already fp32)
    scores = F.linear(fp32(x), fp32(router)).sigmoid()
    choice = scores + bias
    if choice.requires_grad:
        choice = choice.detach()
    if cfg.topk_group < cfg.n_group:  # otherwise every group is kept: the mask would change nothing
        choice = _best_groups_only(cfg, choice)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights if cfg.routed_scaling_factor == 1 else weights * cfg.routed_scaling_factor


def _best_groups_only(cfg: ModelConfig, choice: torch.Tensor) -> torch.Tensor:
    """`choice` with the experts outside each token's topk_group best groups at -inf (a group's score:
    its two best experts' sum)."""
    n, per_group = choice.shape[0], cfg.n_routed_experts // cfg.n_group
    group_scores = choice.view(n, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(n, -1)
    return choice.masked_fill(~expert_mask.bool(), float("-inf"))


class StackedExperts:
    """Every routed expert's weights stacked ([E, 2I, D] gate/up, [E, D, I] down; the experts' own
    DenseMLPs hold views of them): the routed sum of all rows in a fixed number of ops, whatever the
    number of rows or of experts they reach.

    The rows are sorted by expert (ascending id, tokens in order within one), each expert's rows go
    through its weights in one grouped GEMM (the same products as one F.linear per expert), and each
    token's terms are added in ascending expert id, as the reference's per-expert loop adds them."""

    def __init__(self, experts: list[DenseMLP]):
        self.gate_up = torch.stack([e.gate_up for e in experts])
        self.down = torch.stack([e.down for e in experts])
        for e, gate_up, down in zip(experts, self.gate_up, self.down):
            e.gate_up, e.down = gate_up, down
        self.intermediate = experts[0].intermediate
        self.gate_up_t, self.down_t = self.gate_up.transpose(1, 2), self.down.transpose(1, 2)  # [E, in, out] views
        self.expert_ids = torch.arange(self.gate_up.shape[0], device=self.gate_up.device)  # made once, not per call

    @staticmethod
    def of(experts: list) -> StackedExperts | None:
        """Stacked experts, or None where some are another rank's or the device has no grouped GEMM."""
        if not experts or any(e is None for e in experts) or not _grouped_mm_runs(experts[0].down):
            return None
        return StackedExperts(experts)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        ids, order = ids.sort(dim=-1)                  # each token's experts ascending: the order of its sum
        weights = weights.gather(1, order)
        flat = ids.view(-1)
        by_expert = flat.argsort(stable=True)          # (token, slot) entries grouped by expert
        ends = self._group_ends(flat.index_select(0, by_expert))
        rows = x.index_select(0, by_expert // k)
        gate, up = torch._grouped_mm(rows, self.gate_up_t, offs=ends).split(self.intermediate, -1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_t, offs=ends)
        terms = y.new_empty(y.shape).index_copy_(0, by_expert, y).view(-1, k, y.shape[-1]) * weights.unsqueeze(-1)
        if terms.dtype != x.dtype:
            terms = terms.to(x.dtype)
        terms = terms.unbind(1)
        out = terms[0]
        for term in terms[1:]:
            out = out + term
        return out

    def _group_ends(self, sorted_ids: torch.Tensor) -> torch.Tensor:
        """[E] int32: where each expert's rows end among the sorted entries. A search of the sorted
        ids, not `bincount`: bincount sizes its output from the ids' maximum, a read back to the host
        that a CUDA graph cannot hold (docs/exactness.md, "Graph-ready pieces")."""
        return torch.searchsorted(sorted_ids, self.expert_ids, right=True).to(torch.int32)


_GROUPED_MM: dict[tuple, bool] = {}


def _grouped_mm_runs(like: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs for this device and dtype (not every accelerator takes fp32)."""
    key = (like.device.type, like.dtype)
    if key not in _GROUPED_MM:
        a = torch.zeros(2, 16, dtype=like.dtype, device=like.device)
        try:
            torch._grouped_mm(a, torch.zeros(2, 16, 16, dtype=like.dtype, device=like.device).transpose(1, 2),
                              offs=torch.tensor([1, 2], dtype=torch.int32, device=like.device))
            _GROUPED_MM[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]


class MoE:
    """DeepSeekMoE: sigmoid router (fp32) with selection-only bias, group-limited top-k, shared experts.

    Under parallelism the output is this rank's partial sum (sharded experts, or only its own experts
    with expert parallelism; a None expert is another rank's); the decoder layer all-reduces it."""

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, bias: torch.Tensor,
                 experts: list[DenseMLP], shared: DenseMLP):
        self.cfg, self.router, self.bias = cfg, router.float(), bias.float()
        self.experts, self.shared = experts, shared
        # every expert here: one grouped pass for all rows (else, expert parallelism: one expert at a time)
        self.stacked = StackedExperts.of(experts)

    record = None  # a callable given each call's expert ids [rows, k] (the engine's return_routed_experts)

    def route(self, x: torch.Tensor, own: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and weights; `own`: the rows of this rank's batch, the ones recorded
        (data-parallel expert parallelism routes every rank's rows here: parallel/comm.py)."""
        ids, weights = route_experts(self.cfg, x, self.router, self.bias)
        if self.record is not None:
            self.record(ids if own is None else ids[own])
        return ids, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + self.shared(x)

    def routed(self, x: torch.Tensor, own: slice | None = None) -> torch.Tensor:
        """The routed experts' weighted sum (this rank's experts only: a None expert is another's)."""
        ids, weights = self.route(x, own)
        if self.stacked is not None:
            return self.stacked(x, ids, weights)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode: no scatter needed
            for e, w in sorted(zip(ids[0].tolist(), weights[0])):
                if self.experts[e] is not None:
                    out += (self.experts[e](x) * w).to(out.dtype)
            return out
        for e in torch.unique(ids).tolist():  # ascending expert id, as the reference iterates
            if self.experts[e] is None:  # another rank's (expert parallelism): its share of the sum comes there
                continue
            token_idx, slot = torch.where(ids == e)
            y = self.experts[e](x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
