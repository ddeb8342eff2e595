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
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(self.dtype), (emb.sin() * self.scale).to(self.dtype)


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


# ---------------------------------------------------------------------------------------------- FFN

class DenseMLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one GEMM."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = torch.cat([gate, up]), down
        self.intermediate = gate.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).split(self.intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


def route_experts(cfg: ModelConfig, x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor):
    """(expert ids [N, k], weights [N, k] fp32) exactly as the reference router: sigmoid scores in
    fp32; the correction bias only chooses experts; group-limited top-k; normalise, then scale.
    Shared by the engine and the training model (weights stay differentiable there)."""
    scores = F.linear(x.float(), router.float()).sigmoid()
    choice = (scores + bias).detach()
    n, per_group = choice.shape[0], cfg.n_routed_experts // cfg.n_group
    group_scores = choice.view(n, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(n, -1)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class MoE:
    """DeepSeekMoE: sigmoid router (fp32) with selection-only bias, group-limited top-k, shared experts.

    Under parallelism the output is this rank's partial sum (sharded experts, or only its own experts
    with expert parallelism; a None expert is another rank's); the decoder layer all-reduces it."""

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, bias: torch.Tensor,
                 experts: list[DenseMLP], shared: DenseMLP):
        self.cfg, self.router, self.bias = cfg, router.float(), bias.float()
        self.experts, self.shared = experts, shared

    record = None  # a callable given each call's expert ids [rows, k] (the engine's return_routed_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = route_experts(self.cfg, x, self.router, self.bias)
        if self.record is not None:
            self.record(ids)
        return ids, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + self.shared(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (this rank's experts only: a None expert is another's)."""
        ids, weights = self.route(x)
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
