"""Per-token costs of a DSA model, from its config alone: cache bytes, parameter counts, FLOPs.

Everything here is arithmetic on `ModelConfig` fields (no torch), so the planner can describe
machines and models we do not have. Notation: L layers, H heads,
C = kv_lora_rank, R = qk_rope_head_dim, H_I x D_I indexer heads, k = index_topk, T context.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sparsekv.config import ModelConfig

FP8_WEIGHT_TILE = 128 * 128  # one fp32 scale per 128x128 weight tile
VARIANTS = ("dense-mla", "dsa-every-layer", "dsa-indexshare")


def with_variant(cfg: ModelConfig, variant: str) -> tuple[ModelConfig, int]:
    """(config, number of layers running an indexer) for one of the three compared designs.

    `dsa-indexshare` keeps the config's own schedule when it already shares; otherwise it applies
    GLM-5.2's (one indexer per group of four, freq 4 / offset 3), so GLM-5 can be compared too.
    """
    L = cfg.num_hidden_layers
    if variant == "dense-mla":
        return cfg, 0
    if variant == "dsa-every-layer":
        return cfg.replace(indexer_types=("full",) * L), L
    if variant == "dsa-indexshare":
        if "shared" in cfg.indexer_types:
            return cfg, len(cfg.full_layers)
        types = tuple("full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(L))
        return cfg.replace(indexer_types=types), types.count("full")
    raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how decode touches them: always (attention, dense MLP, shared experts,
    router, lm_head), per activated routed expert, or never per step (embedding rows)."""

    attention_per_layer: int
    indexer_per_full_layer: int
    dense_mlp_per_layer: int
    moe_always_per_layer: int    # router + shared experts
    expert: int                  # one routed expert
    embedding: int
    lm_head: int
    num_dense: int
    num_moe: int
    num_full: int
    n_routed: int
    k_routed: int

    @property
    def non_expert(self) -> int:
        """Read every decode step on every rank that serves a token."""
        return (self.attention_per_layer * (self.num_dense + self.num_moe)
                + self.indexer_per_full_layer * self.num_full
                + self.dense_mlp_per_layer * self.num_dense
                + self.moe_always_per_layer * self.num_moe + self.lm_head)

    @property
    def routed_total(self) -> int:
        return self.expert * self.n_routed * self.num_moe

    @property
    def total(self) -> int:
        return self.non_expert + self.routed_total + self.embedding

    @property
    def active(self) -> int:
        """Parameters one token multiplies (the embedding is a lookup, not a matmul)."""
        return self.non_expert + self.expert * self.k_routed * self.num_moe


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Shapes as the checkpoints store them (norms included; MTP layer excluded, as in the published totals)."""
    d, H = cfg.hidden_size, cfg.num_attention_heads
    attn = (d * cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim
            + d * cfg.latent_dim + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            + H * cfg.v_head_dim * d + cfg.q_lora_rank + cfg.kv_lora_rank + 2 * d)
    indexer = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim
               + 2 * cfg.index_head_dim + d * cfg.index_n_heads)
    expert = 3 * d * cfg.moe_intermediate_size
    return ParamCounts(
        attention_per_layer=attn, indexer_per_full_layer=indexer,
        dense_mlp_per_layer=3 * d * cfg.intermediate_size,
        moe_always_per_layer=cfg.n_routed_experts * (d + 1) + cfg.n_shared_experts * expert,
        expert=expert, embedding=cfg.vocab_size * d,
        lm_head=(0 if cfg.tie_word_embeddings else cfg.vocab_size * d) + d,
        num_dense=cfg.mlp_layer_types.count("dense"), num_moe=cfg.mlp_layer_types.count("sparse"),
        num_full=len(cfg.full_layers), n_routed=cfg.n_routed_experts, k_routed=cfg.num_experts_per_tok)


def attended_keys(context: int, topk: int | None) -> int:
    """Keys one query attends to: all of them (dense) or at most top-k (DSA)."""
    return context if topk is None else min(context, topk)


def mean_attended_keys(context: int, topk: int | None) -> float:
    """Mean over causal prefill positions t = 1..T of min(t, k)."""
    T = context
    if topk is None or T <= topk:
        return (T + 1) / 2
    k = topk
    return (k * (k + 1) / 2 + (T - k) * k) / T


def absorbed_attention_flops(cfg: ModelConfig, keys: float) -> float:
    """MQA-mode (absorbed) MLA per query per layer: scores over C+R dims, values over C dims."""
    return 2 * cfg.num_attention_heads * keys * (cfg.latent_dim + cfg.kv_lora_rank)


def mha_attention_flops(cfg: ModelConfig, keys: float) -> float:
    """MHA-mode MLA per query per layer (dense prefill: K/V expanded, qk_head_dim + v_head_dim)."""
    return 2 * cfg.num_attention_heads * keys * (cfg.qk_head_dim + cfg.v_head_dim)


def indexer_flops(cfg: ModelConfig, keys: float) -> float:
    """Lightning indexer per query per full layer: H_I dot products of D_I, ReLU, weighted sum."""
    return cfg.index_n_heads * keys * (2 * cfg.index_head_dim + 2)


@dataclass(frozen=True)
class FlopBreakdown:
    weights: float
    attention: float
    indexer: float

    @property
    def total(self) -> float:
        return self.weights + self.attention + self.indexer

    def to_dict(self) -> dict:
        return {"weights": self.weights, "attention": self.attention, "indexer": self.indexer,
                "total": self.total}


def flops_per_token(cfg: ModelConfig, context: int, variant: str, phase: str) -> FlopBreakdown:
    """FLOPs for one token at context T, in `decode` (one new token after T) or `prefill`
    (averaged over a causal prompt of T tokens).

    Dense MLA decodes in absorbed mode over all T keys and prefills in MHA mode; DSA attends
    top-k keys in absorbed mode (FlashMLA's sparse kernels) and adds the indexer's dot products
    over every earlier key in each layer that runs one. Top-k selection is not counted (it moves
    bytes, it does no multiply-adds).
    """
    vcfg, n_indexed = with_variant(cfg, variant)
    counts = param_counts(vcfg) if variant != "dense-mla" else _without_indexer(param_counts(cfg))
    L = cfg.num_hidden_layers
    topk = None if variant == "dense-mla" else cfg.index_topk
    if phase == "decode":
        keys, idx_keys = attended_keys(context, topk), context
    elif phase == "prefill":
        keys, idx_keys = mean_attended_keys(context, topk), (context + 1) / 2
    else:
        raise ValueError(f"unknown phase {phase!r}; use decode or prefill")
    dense_prefill = variant == "dense-mla" and phase == "prefill"
    attn = (mha_attention_flops if dense_prefill else absorbed_attention_flops)(cfg, keys) * L
    return FlopBreakdown(2.0 * counts.active, attn, indexer_flops(cfg, idx_keys) * n_indexed)


def _without_indexer(counts: ParamCounts) -> ParamCounts:
    return replace(counts, num_full=0)


def flop_table(cfg: ModelConfig, contexts=(131072, 1048576)) -> list[dict]:
    """Rows of FLOPs/token for each variant, phase and context, with ratios against DSA every layer."""
    rows = []
    for phase in ("prefill", "decode"):
        for T in contexts:
            by_variant = {v: flops_per_token(cfg, T, v, phase) for v in VARIANTS}
            base = by_variant["dsa-every-layer"].total
            for v, f in by_variant.items():
                rows.append({"phase": phase, "context": T, "variant": v, **f.to_dict(),
                             "vs_dsa_every_layer": base / f.total})
    return rows
