"""A differentiable pure-torch GLM-DSA model for training; parameter names equal the HF checkpoint's.

Attention runs in the expanded (MHA) form with explicit masks, as the transformers reference does,
so every attention distribution is available for indexer distillation.
RMSNorm and RoPE reuse the engine's functions, so the numerics match the engine by construction.

Per layer the forward returns a `LayerTrace`: the index scores I (full layers), the selection mask
used (sparse mode) and, on request, the head-averaged attention distribution p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..model.layers import rope_half_split, rope_interleaved, rope_inv_freq, route_experts

NEG = -1e9  # finite "minus infinity": keeps KL terms finite where a probability is exactly 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Rope:
    """cos/sin for a [B, S] position tensor; applies the engine's RoPE functions on flattened rows."""

    def __init__(self, cfg: ModelConfig, positions: torch.Tensor):
        inv_freq, scale = rope_inv_freq(cfg)
        freqs = positions.reshape(-1, 1).float() * inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale   # [B*S, R]
        self.shape = positions.shape

    def __call__(self, x: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
        """x: [B, S, ..., R] -> same shape, rotated."""
        flat = x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])
        fn = rope_interleaved if interleaved else rope_half_split
        return fn(flat, self.cos, self.sin).reshape(x.shape)


class Indexer(nn.Module):
    """Lightning indexer: I[t,s] = sum_h w_h(x_t) H^-1/2 ReLU(<q_{t,h}, k_s> D^-1/2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hi, d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = _linear(cfg.q_lora_rank, hi * d)
        self.wk = _linear(cfg.hidden_size, d)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = _linear(cfg.hidden_size, hi)

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        r = self.cfg.qk_rope_head_dim
        return torch.cat([rope(x[..., :r], self.cfg.indexer_rope_interleave), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: Rope, causal: torch.Tensor, far=None):
        """Index scores [B, S, S] (causal-masked), and with `far` (data.FarNegatives) also the scores
        [B, S, M] of every query against its row's far negatives (else None)."""
        cfg = self.cfg
        b, s, _ = x.shape
        q = self._rotate(self.wq_b(q_resid).view(b, s, cfg.index_n_heads, cfg.index_head_dim), rope).float()
        w = self.weights_proj(x.float()) * cfg.index_n_heads ** -0.5
        index = self._score(q, w, self._keys(x, rope)).masked_fill(~causal, NEG)
        if far is None:
            return index, None
        far_x = x.reshape(b * s, -1)[far.source]                                          # [B, M, hidden]
        return index, self._score(q, w, self._keys(far_x, Rope(cfg, far.positions)))

    def _keys(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2).float()

    def _score(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * self.cfg.index_head_dim ** -0.5)
        return torch.einsum("bsh,bsht->bst", w, scores)


def topk_mask(index: torch.Tensor, causal: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [B, S, T]: the top-k causal keys per query (all of them where at most k are visible)."""
    k = min(k, index.shape[-1])
    idx = index.topk(k, dim=-1).indices
    return torch.zeros_like(causal).scatter_(-1, idx, True) & causal


@dataclass
class LayerTrace:
    index: torch.Tensor | None = None      # [B, S, T] index scores (full layers, when computed)
    selected: torch.Tensor | None = None   # [B, S, T] bool: keys attention may use (sparse mode)
    probs: torch.Tensor | None = None      # [B, S, T] attention averaged over heads (when requested)
    far_index: torch.Tensor | None = None  # [B, S, M] index scores of the far negatives (`far` stage)


class Attention(nn.Module):
    """MLA in expanded form. `indexer` is absent on IndexShare "shared" layers, unless an auxiliary
    one is trained for the training-free IndexShare search (it never chooses this layer's keys)."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool, full: bool):
        super().__init__()
        self.cfg, self.full = cfg, full
        h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.attention_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, c + r)
        self.kv_a_layernorm = RMSNorm(c, cfg.attention_norm_eps)
        self.kv_b_proj = _linear(c, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(h * cfg.v_head_dim, cfg.hidden_size)
        if has_indexer:
            self.indexer = Indexer(cfg)

    def forward(self, x, rope: Rope, causal, selected, want_index: bool, want_probs: bool, far=None):
        """Returns (output, trace). `selected` is the previous full layer's selection (or None);
        `far`: score these far negatives too (data.FarNegatives; the `far` stage's layers)."""
        cfg = self.cfg
        b, s, _ = x.shape
        h, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rot = self.q_b_proj(q_resid).view(b, s, h, cfg.qk_head_dim).split([nope, r], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, r], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, s, h, nope + cfg.v_head_dim).split(
            [nope, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, rope(q_rot)], dim=-1).transpose(1, 2)
        k_rot = rope(k_rot.unsqueeze(2)).expand(b, s, h, r)
        k = torch.cat([k_nope, k_rot], dim=-1).transpose(1, 2)
        trace = LayerTrace(selected=selected)
        if hasattr(self, "indexer") and (want_index or far is not None or (selected is not None and self.full)):
            # NOTE: detached input: the indexer learns only from its KL loss (DeepSeek-V3.2's recipe).
            trace.index, trace.far_index = self.indexer(x.detach(), q_resid.detach(), rope, causal, far)
            if selected is not None and self.full:
                trace.selected = topk_mask(trace.index.detach(), causal, cfg.index_topk)
        allowed = causal if trace.selected is None else trace.selected
        scores = torch.matmul(q, k.transpose(-1, -2)) * cfg.softmax_scale
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min), dim=-1,
                              dtype=torch.float32).to(q.dtype)
        if want_probs:
            trace.probs = probs.detach().float().mean(1)
        out = torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2).reshape(b, s, h * cfg.v_head_dim)
        return self.o_proj(out), trace


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router; the bias only chooses experts and is tuned without gradients (aux-loss-free)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def route(self, x: torch.Tensor):
        return route_experts(self.cfg, x, self.gate.weight, self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, w = self.route(x)
        if self.training:
            self.gate.load += torch.bincount(ids.reshape(-1), minlength=self.cfg.n_routed_experts).float()
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            out = out.index_add(0, rows, (self.experts[e](x[rows]) * w[rows, slot, None]).to(x.dtype))
        return (out + self.shared_experts(x)).reshape(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """DeepSeek-V3's bias update: raise under-loaded experts, lower over-loaded ones."""
        load = self.gate.load
        if load.sum() > 0:
            self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, has_indexer: bool, mlp_type: str, full: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, has_indexer, full)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if mlp_type == "dense" else MoE(cfg)

    def forward(self, h, rope, causal, selected, want_index, want_probs, far=None):
        a, trace = self.self_attn(self.input_layernorm(h), rope, causal, selected, want_index, want_probs, far)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), trace


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """NextN layer: x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]) -> decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, True, "sparse" if cfg.n_routed_experts else "dense")
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, aux_indexers: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        full = [t == "full" for t in cfg.indexer_types]
        layers = [DecoderLayer(cfg, full[i] or aux_indexers, cfg.mlp_layer_types[i], full[i])
                  for i in range(cfg.num_hidden_layers)]
        if cfg.num_nextn_predict_layers:
            layers.append(MTPLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOut:
    hidden: torch.Tensor            # [B, S, hidden] after model.norm
    logits: torch.Tensor            # [B, S, vocab] fp32
    traces: list[LayerTrace]


class GlmDsaForTraining(nn.Module):
    def __init__(self, cfg: ModelConfig, init_std: float = 0.02, aux_indexers: bool = False,
                 embed_init_std: float | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, aux_indexers)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self._init(init_std, init_std if embed_init_std is None else embed_init_std)

    def _init(self, std: float, embed_std: float) -> None:
        """GPT-2 style: N(0, std), output projections scaled by (2 layers)^-1/2. `embed_std` of about 1
        keeps token identity visible next to the MLP outputs (a copy circuit needs it: docs/training.md)."""
        n_layers = self.cfg.num_hidden_layers
        for name, p in self.named_parameters():
            if name == "model.embed_tokens.weight":
                nn.init.normal_(p, std=embed_std)
            elif p.dim() >= 2:
                scale = (2 * n_layers) ** -0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)

    @property
    def main_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[:self.cfg.num_hidden_layers])

    @property
    def mtp(self) -> MTPLayer | None:
        return self.model.layers[self.cfg.num_hidden_layers] if self.cfg.num_nextn_predict_layers else None

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sparse: bool = False,
                want_index: bool = False, want_probs: bool = False, far: dict | None = None) -> ForwardOut:
        """`far` (full layer -> data.FarNegatives): those layers' indexers also score their negatives,
        each from its own input: the sources' hidden states in their rows, at the negatives' positions."""
        cfg = self.cfg
        s = ids.shape[1]
        rope = Rope(cfg, positions)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril().expand(ids.shape[0], s, s)
        h = self.model.embed_tokens(ids)
        traces, selected = [], None
        for i, layer in enumerate(self.main_layers):
            full = cfg.indexer_types[i] == "full"
            sel_in = (torch.zeros_like(causal) if full else selected) if sparse else None
            h, trace = layer(h, rope, causal, sel_in, want_index, want_probs, (far or {}).get(i))
            selected = trace.selected
            traces.append(trace)
        h = self.model.norm(h)
        return ForwardOut(h, self.lm_head(h).float(), traces)

    def mtp_forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, sparse: bool,
                    want_probs: bool = False):
        """Draft logits [B, S-1, vocab]: row p combines hidden_p with token p+1 and predicts token p+2."""
        mtp = self.mtp
        e = mtp.enorm(self.model.embed_tokens(ids[:, 1:]))
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden[:, :-1])], dim=-1))
        s = x.shape[1]
        rope = Rope(self.cfg, positions[:, :-1])
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril().expand(ids.shape[0], s, s)
        sel_in = torch.zeros_like(causal) if sparse else None
        x, trace = mtp(x, rope, causal, sel_in, True, want_probs)
        return self.lm_head(mtp.shared_head.norm(x)).float(), trace

    def aux_indexer_names(self) -> list[str]:
        """State-dict names of the auxiliary indexers on shared layers (not part of the HF checkpoint)."""
        shared = [i for i, t in enumerate(self.cfg.indexer_types) if t == "shared"]
        return [n for n in self.state_dict() if any(n.startswith(f"model.layers.{i}.self_attn.indexer.") for i in shared)]
