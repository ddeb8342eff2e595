"""Bytes per token of every KV store, the tier sizes a budget allows, and what one rank of a parallel
layout holds (weights) and sends (collectives): the one place they are computed.

Torch-free arithmetic on `ModelConfig` fields, shared by the engine (which allocates what these say)
and the planner (which sizes machines we do not have). Number formats are named as the planner names
them: fp32, bf16, fp16, fp8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ConfigError, EngineConfig, ModelConfig

ELEMENT_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
FP8_TILE = 128  # one fp32 scale per 128 latent values (FlashMLA's cache layout)


def element_bytes(fmt: str) -> int:
    if fmt not in ELEMENT_BYTES:
        raise ValueError(f"unknown number format {fmt!r}; use one of fp32, bf16, fp16, fp8")
    return ELEMENT_BYTES[fmt]


def format_of(itemsize: int, fp8: bool = False) -> str:
    """The format name of a stored element: fp8, or the model dtype's by its size."""
    return "fp8" if fp8 else {4: "fp32", 2: "bf16"}[itemsize]


def latent_bytes_per_token_layer(cfg: ModelConfig, fmt: str) -> int:
    """One MLA cache entry: the latent c (C values) and the rope key (R values).

    FP8 is FlashMLA's layout: C x e4m3, one fp32 scale per tile of 128 latent values, and the rope key
    kept in bf16 (512 + 16 + 128 = 656 B for C = 512, R = 64). Tiles are gcd(C, 128) values when C is
    not a multiple of 128, as the engine stores them (latent_format.py).
    """
    if fmt == "fp8":
        tiles = cfg.kv_lora_rank // math.gcd(cfg.kv_lora_rank, FP8_TILE)
        return cfg.kv_lora_rank + 4 * tiles + 2 * cfg.qk_rope_head_dim
    return cfg.latent_dim * element_bytes(fmt)


def indexer_bytes_per_token_layer(cfg: ModelConfig, fmt: str) -> int:
    """One indexer key: D_I values; FP8 adds one fp32 scale per key (DeepSeek: 128 + 4 = 132 B)."""
    if fmt == "fp8":
        return cfg.index_head_dim + 4
    return cfg.index_head_dim * element_bytes(fmt)


def quest_bytes_per_token(cfg: ModelConfig, page_tokens: int) -> int:
    """Quest's device metadata per cached token over the full layers (fp32 min and max per page)."""
    return 2 * cfg.latent_dim * 4 * len(cfg.full_layers) // page_tokens


def latent_bytes_per_token(cfg: ModelConfig, row_bytes: int) -> int:
    """One token's latents in every layer, at `row_bytes` per layer (latent_format.py's row_bytes)."""
    return row_bytes * cfg.num_hidden_layers


def index_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    """One token's indexer keys over the layers that keep them (the full layers)."""
    return indexer_bytes_per_token_layer(cfg, fmt) * len(cfg.full_layers)


@dataclass(frozen=True)
class TierSizes:
    """What the budgets allow. Logical pages bound the host rows and the device indexer keys."""

    num_pages: int
    num_buffers: int
    device_buffer_tokens: int
    limit: str  # the binding budget, for admission errors


def plan_tier_sizes(config: EngineConfig, cfg: ModelConfig, latent_per_token: int, selector_per_token: int,
                    default_pages: int) -> TierSizes:
    page, n = config.kv_page_size, config.device_buffer_tokens or 2 * cfg.index_topk
    buffers = config.max_num_seqs
    limits = []
    if config.num_kv_pages:
        limits.append((config.num_kv_pages, f"num_kv_pages={config.num_kv_pages}"))
    if config.host_kv_budget_bytes:
        limits.append((config.host_kv_budget_bytes // (page * latent_per_token),
                       f"host_kv_budget_bytes={config.host_kv_budget_bytes}"))
    rows = n + 1 + config.num_speculative_tokens  # LRU slots + the step's new tokens
    if config.device_kv_budget_bytes:
        left = config.device_kv_budget_bytes - buffers * rows * latent_per_token
        if left < page * max(selector_per_token, 1):
            raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} cannot hold {buffers} working "
                              f"sets of {rows} tokens ({rows * latent_per_token} B each, max_num_seqs={buffers}) "
                              f"plus one page of indexer keys; raise it or lower max_num_seqs / device_buffer_tokens")
        limits.append((left // (page * max(selector_per_token, 1)),
                       f"device_kv_budget_bytes={config.device_kv_budget_bytes} (indexer keys after working sets)"))
    pages, limit = min(limits) if limits else (default_pages, "the default cache size")
    if pages < 1:
        raise ConfigError(f"{limit} holds less than one {page}-token page of host KV "
                          f"({page * latent_per_token} B); raise it")
    return TierSizes(pages, buffers, n, limit)


def untiered_bytes_per_token(config: EngineConfig, cfg: ModelConfig, key_fmt: str, latent_row_bytes: int) -> int:
    """A fully device-resident cache's bytes per token: every layer's latent, the indexer keys (Quest's
    page bounds instead with Quest, which reads no indexer keys), and with drafting the MTP layer's own."""
    selector = (quest_bytes_per_token(cfg, config.quest_page_tokens) if config.selector == "quest"
                else index_bytes_per_token(cfg, key_fmt))
    per_token = latent_bytes_per_token(cfg, latent_row_bytes) + selector
    if config.num_speculative_tokens:  # the MTP layer's own latent and indexer keys
        per_token += latent_row_bytes + indexer_bytes_per_token_layer(cfg, key_fmt)
    return per_token


def untiered_pages(config: EngineConfig, cfg: ModelConfig, key_fmt: str, latent_row_bytes: int) -> int:
    """Pages of a fully device-resident cache that fit in `device_kv_budget_bytes`."""
    per_page = config.kv_page_size * untiered_bytes_per_token(config, cfg, key_fmt, latent_row_bytes)
    if config.device_kv_budget_bytes < per_page:
        raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} holds less than one "
                          f"{config.kv_page_size}-token page ({per_page} B)")
    return config.device_kv_budget_bytes // per_page


# ------------------------------------------------------------------ one rank of a parallel layout
#
# world = tp x dp ranks. Tensor parallelism splits the query heads (q_b_proj, kv_b_proj by rows, o_proj
# by input columns), dense MLPs and shared experts on their intermediate dimension, and the embedding
# and lm_head by vocabulary rows. Routed experts are split on their intermediate dimension too, unless
# expert parallelism puts E / world whole experts on each rank. Everything else is replicated: the MLA
# down-projections and norms, the router, the whole lightning indexer, the MTP layer's glue. The KV
# cache (latent and indexer keys) is the same on every tp rank: tp does not divide it.

@dataclass(frozen=True)
class Parallelism:
    """A world of `tp x dp` ranks; `ep` spreads whole routed experts over all of them."""

    tp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def check(self, cfg: ModelConfig) -> None:
        """ConfigError naming the option unless every split dimension divides evenly."""
        if self.tp < 1 or self.dp < 1:
            raise ConfigError(f"the tensor-parallel size (--tp, {self.tp}) and data-parallel size "
                              f"(--dp, {self.dp}) must be >= 1")
        tp_dims = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size),
                   ("intermediate_size", cfg.intermediate_size)]
        if cfg.n_routed_experts:
            tp_dims.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for field, value in tp_dims:
            if value % self.tp:
                raise ConfigError(f"the model's {field} ({value}) is not divisible by the tensor-parallel "
                                  f"size (--tp / tensor_parallel_size, {self.tp})")
        if self.ep and cfg.n_routed_experts % self.world:
            raise ConfigError(f"the model's n_routed_experts ({cfg.n_routed_experts}) is not divisible by the "
                              f"world size {self.world} (--tp {self.tp} x --dp {self.dp}) with expert "
                              f"parallelism (--ep / enable_expert_parallel)")


@dataclass(frozen=True)
class _Tensors:
    """`count` tensors of `shape`; `split` how tp/ep cut them; `kind` how an FP8 release stores them."""

    shape: tuple[int, ...]
    count: int
    split: str = "replicated"   # replicated | rows | cols | expert_rows | expert_cols
    kind: str = "quantized"     # quantized (e4m3 + 128x128 scales) | plain (bf16 in FP8) | fp32


def _attention(cfg: ModelConfig, n: int) -> list[_Tensors]:
    d, H, C, R, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
    return [_Tensors((d,), 2 * n, kind="plain"),  # input / post-attention norms
            _Tensors((q, d), n), _Tensors((q,), n, kind="plain"), _Tensors((H * cfg.qk_head_dim, q), n, "rows"),
            _Tensors((C + R, d), n), _Tensors((C,), n, kind="plain"),
            _Tensors((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C), n, "rows"),
            _Tensors((d, H * cfg.v_head_dim), n, "cols")]


def _indexer(cfg: ModelConfig, n: int) -> list[_Tensors]:
    d, D, HI = cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
    return [_Tensors((HI * D, cfg.q_lora_rank), n), _Tensors((D, d), n), _Tensors((D,), 2 * n, kind="plain"),
            _Tensors((HI, d), n, kind="fp32")]  # weights_proj: computed in fp32


def _mlp(d: int, inter: int, n: int, expert: bool = False) -> list[_Tensors]:
    rows, cols = ("expert_rows", "expert_cols") if expert else ("rows", "cols")
    return [_Tensors((inter, d), 2 * n, rows), _Tensors((d, inter), n, cols)]


def _moe(cfg: ModelConfig, n: int) -> list[_Tensors]:
    d, E = cfg.hidden_size, cfg.n_routed_experts
    return [_Tensors((E, d), n, kind="plain"), _Tensors((E,), n, kind="fp32"),  # router, correction bias
            *_mlp(d, cfg.moe_intermediate_size, n * E, expert=True),
            *_mlp(d, cfg.moe_intermediate_size * cfg.n_shared_experts, n)]


def model_tensors(cfg: ModelConfig, mtp: bool = False) -> list[_Tensors]:
    """Every weight of the model as the checkpoint stores it; `mtp` adds the NextN layer (its embedding
    and head are the model's own)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    extra = 1 if mtp else 0
    moe_mtp = extra if cfg.n_routed_experts else 0
    out = [_Tensors((V, d), 1 if cfg.tie_word_embeddings else 2, "rows", "plain"), _Tensors((d,), 1, kind="plain"),
           *_attention(cfg, cfg.num_hidden_layers + extra), *_indexer(cfg, len(cfg.full_layers) + extra),
           *_mlp(d, cfg.intermediate_size, cfg.mlp_layer_types.count("dense") + extra - moe_mtp),
           *_moe(cfg, cfg.mlp_layer_types.count("sparse") + moe_mtp)]
    if mtp:  # enorm, hnorm, shared_head.norm; eh_proj [d, 2d] (unquantized in FP8 releases)
        out += [_Tensors((d,), 3, kind="plain"), _Tensors((d, 2 * d), 1, kind="plain")]
    return out


@dataclass(frozen=True)
class RankWeights:
    """One rank's weights in bytes (or parameters), by how they are split."""

    replicated: int  # held whole by every rank
    sharded: int     # this rank's 1/tp of attention heads, dense MLPs, shared experts, vocabulary
    experts: int     # routed experts: E/world whole ones with ep, else 1/tp of every one

    @property
    def total(self) -> int:
        return self.replicated + self.sharded + self.experts


def _local(t: _Tensors, par: Parallelism) -> tuple[tuple[int, ...], int]:
    """(shape, count) of one rank's part of `t`."""
    if t.split == "replicated":
        return t.shape, t.count
    if t.split.startswith("expert") and par.ep:
        return t.shape, t.count // par.world
    dim = 0 if t.split.endswith("rows") else 1
    shape = list(t.shape)
    shape[dim] //= par.tp
    return tuple(shape), t.count


def _tensor_bytes(shape: tuple[int, ...], kind: str, fmt: str) -> int:
    numel = math.prod(shape)
    if kind == "fp32":
        return 4 * numel
    if fmt != "fp8":
        return numel * element_bytes(fmt)
    if kind == "plain":
        return 2 * numel
    tiles = math.prod(-(-n // FP8_TILE) for n in shape)  # one fp32 scale per 128x128 block of the slice
    return numel + 4 * tiles


def _per_rank(cfg: ModelConfig, par: Parallelism, mtp: bool, size) -> RankWeights:
    groups = {"replicated": 0, "sharded": 0, "experts": 0}
    for t in model_tensors(cfg, mtp):
        shape, count = _local(t, par)
        group = "replicated" if t.split == "replicated" else "experts" if t.split.startswith("expert") else "sharded"
        groups[group] += count * size(shape, t.kind)
    return RankWeights(**groups)


def weight_bytes_per_rank(cfg: ModelConfig, par: Parallelism, fmt: str, mtp: bool = False) -> RankWeights:
    """Bytes of weights one rank holds (every rank holds the same amount).

    `fmt` fp32 / bf16: every tensor in that dtype (as the engine loads them), except the router's
    correction bias and the indexer's weights_proj, kept in fp32. `fp8`: an FP8 release, e4m3 with one
    fp32 scale per 128x128 block of the rank's slice for the projections, experts and MLPs; bf16 for
    the embedding, lm_head, norms, router and MTP glue.
    """
    par.check(cfg)
    element_bytes(fmt)
    return _per_rank(cfg, par, mtp, lambda shape, kind: _tensor_bytes(shape, kind, fmt))


def params_per_rank(cfg: ModelConfig, par: Parallelism, mtp: bool = False) -> RankWeights:
    """Parameters one rank holds, split as in `weight_bytes_per_rank`."""
    par.check(cfg)
    return _per_rank(cfg, par, mtp, lambda shape, kind: math.prod(shape))


# ------------------------------------------------------------------ bytes each collective sends

def all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends to all-reduce `nbytes` over n ranks (ring: reduce-scatter + all-gather)."""
    return 2 * (n - 1) / n * nbytes


def all_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends to all-gather a whole of `nbytes` from n pieces of nbytes / n (ring)."""
    return (n - 1) / n * nbytes


def dispatch_combine_bytes(cfg: ModelConfig, n: int, act_bytes: int) -> float:
    """Expected bytes of an expert-parallel MoE layer per token, with all_to_all_single.

    Dispatch sends the token's hidden state to the rank of each of its k experts, combine sends the k
    weighted outputs back; with uniform routing (N - 1) / N of them are on another rank. Balanced
    ranks send in total what they receive, so this is also what one rank sends per token it holds.
    """
    return 2 * cfg.num_experts_per_tok * cfg.hidden_size * act_bytes * (n - 1) / n


def gather_scatter_bytes(cfg: ModelConfig, n: int, act_bytes: int) -> float:
    """The alternative to `dispatch_combine_bytes`: all-gather every rank's tokens, run local experts,
    reduce-scatter the outputs. Per token a rank holds: (N - 1) hidden states each way."""
    return 2 * (n - 1) * cfg.hidden_size * act_bytes


@dataclass(frozen=True)
class Collective:
    """One collective of a forward pass: bytes one rank sends for one token, `times` per token."""

    name: str
    op: str
    ranks: int
    times: int          # per token: once per layer of its kind, or once per forward pass
    per_token: float    # bytes one rank sends per token, per call
    formula: str

    @property
    def per_token_all(self) -> float:
        return self.per_token * self.times


def collectives(cfg: ModelConfig, par: Parallelism, act_fmt: str, logits_fmt: str = "fp32") -> list[Collective]:
    """The collectives one token's forward pass makes on a rank, for the layout above.

    Tensor parallelism: one all-reduce of the hidden state after attention and one after the FFN in
    every layer, one after the vocab-parallel embedding, and one all-gather of the lm_head's logits
    (fp32, one row per sampled position). Expert parallelism with dp > 1: the dp ranks' tokens meet at
    the MoE, dispatched and combined with all_to_all_single. With dp = 1 every rank already has every
    token, so each runs its own experts and the FFN all-reduce sums them: nothing extra.
    """
    h, tp, b = cfg.hidden_size, par.tp, element_bytes(act_fmt)
    L, n_moe = cfg.num_hidden_layers, cfg.mlp_layer_types.count("sparse")
    out = []
    if tp > 1:
        ar = all_reduce_bytes(h * b, tp)
        out += [Collective("attention output (o_proj)", "all_reduce", tp, L, ar, "2(N-1)/N x hidden x act"),
                Collective("FFN output (MLP / MoE)", "all_reduce", tp, L, ar, "2(N-1)/N x hidden x act"),
                Collective("embedding (vocab-parallel)", "all_reduce", tp, 1, ar, "2(N-1)/N x hidden x act"),
                Collective("lm_head logits (vocab-parallel)", "all_gather", tp, 1,
                           all_gather_bytes(cfg.vocab_size * element_bytes(logits_fmt), tp),
                           "(N-1)/N x vocab x fp32")]
    if par.ep and par.dp > 1 and n_moe:
        out.append(Collective("MoE dispatch + combine (EP)", "all_to_all", par.world, n_moe,
                              dispatch_combine_bytes(cfg, par.world, b), "2 x topk x hidden x act x (N-1)/N"))
    return out
