"""The GLM-5 / DeepSeek-V3.2 decoder assembled from checkpoint tensors.

Forward: h = embed(ids); per layer h += attn(norm(h)); h += ffn(norm(h));
logits = lm_head(norm(h)) for the rows the step samples from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..context import ForwardContext
from ..parallel.comm import SingleRank
from .attention import AttentionWeights, MLAttention
from .indexer import IndexerWeights, LightningIndexer, ScoreScratch
from .layers import MoE, DenseMLP, RotaryTable, gemm_layout, rms_norm


SINGLE_RANK = SingleRank()


class DecoderLayer:
    """`comm` sums the row-parallel partial outputs of attention and the FFN across tensor ranks."""

    def __init__(self, cfg: ModelConfig, attn: MLAttention, ffn, input_norm, post_norm, comm=SINGLE_RANK):
        self.cfg, self.attn, self.ffn, self.comm = cfg, attn, ffn, comm
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, h: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        return self.attended(h, self.attn.forward(self.attention_input(h), ctx, cache))

    def attention_input(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.input_norm, self.cfg.rms_norm_eps)

    def attended(self, h: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden states from its input `h` and its attention's output (this rank's
        partial sum under tensor parallelism): the residual, then the FFN's."""
        h = h + self.comm.all_reduce(attention_out)
        return h + self.comm.all_reduce(self.comm.ffn(self.ffn, rms_norm(h, self.post_norm, self.cfg.rms_norm_eps)))

    def idle(self) -> None:
        """This rank has no rows in a pass the others run: take part in its collectives that span
        data-parallel ranks (the MoE's token exchange), with nothing of its own."""
        self.comm.ffn(self.ffn, torch.zeros(0, self.cfg.hidden_size, dtype=self.post_norm.dtype,
                                            device=self.post_norm.device))


@dataclass
class MTPHead:
    """The NextN layer (`model.layers.{num_hidden_layers}`), kept for speculative decoding."""

    layer: DecoderLayer
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    head_norm: torch.Tensor
    embed: torch.Tensor | None = None     # DeepSeek carries layer-local copies; GLM ties to the main ones
    head: torch.Tensor | None = None


class DSAModel:
    """Weights plus forward. Holds no cache: the cache pool is passed in with each step.

    Under tensor parallelism `tensors` holds this rank's slices (parallel/layout.py) and `comm` the
    group's collectives; `cfg` stays the whole model's config. `release`: each layer's entries leave
    `tensors` once the layer is built (its fused and stacked weights are copies), so building never
    holds two copies of the whole model."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 comm=SINGLE_RANK, release: bool = False):
        self.cfg, self.dtype, self.device, self.comm = cfg, dtype, device, comm
        self.loaded_stamp: list | None = None  # the checkpoint's files as load_model found them before reading
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.embed, self.norm, self.lm_head = build_ends(tensors)
        self.index_scratch = ScoreScratch()   # shared by every indexer: layers run one at a time
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            self.layers.append(self.build_part(i, tensors, self.index_scratch))
            if release:
                _release_layer(tensors, i)
        self.mtp = self.build_part(MTP, tensors, self.index_scratch)
        self.rotary = RotaryTable(cfg, dtype, device)

    def build_part(self, part: int | str, tensors: dict[str, torch.Tensor], scratch: ScoreScratch | None = None):
        """One part of this model (`part_of`) built from `tensors` as a load builds it: decoder layer
        `part`, the MTP head (None without its tensors), or ENDS: (embedding, final norm, head). A weight
        update builds each part beside the running one and copies it in (weights.py)."""
        cfg = self.cfg
        local = replace(cfg, num_attention_heads=cfg.num_attention_heads // self.comm.tp_size)
        if part == ENDS:
            return build_ends(tensors)
        if part == MTP:
            return build_mtp(local, tensors, scratch, self.comm)
        return build_layer(local, part, tensors, cfg.indexer_types[part] == "full", cfg.mlp_layer_types[part], scratch,
                           self.comm)

    def part(self, part: int | str):
        """The running model's `part`, in the form `build_part` gives it."""
        if part == ENDS:
            return self.embed, self.norm, self.lm_head
        return self.mtp if part == MTP else self.layers[part]

    def hidden_states(self, ctx: ForwardContext, cache) -> torch.Tensor:
        ctx.cos, ctx.sin = self.rotary.cos_sin(ctx.positions)
        h = self.comm.embed(ctx.input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, ctx, cache)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def mtp_input(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input rows: each next token's embedding and each final hidden state, normed,
        concatenated and projected (eh_proj)."""
        mtp, eps = self.mtp, self.cfg.rms_norm_eps
        e = self.comm.embed(next_tokens, mtp.embed if mtp.embed is not None else self.embed)
        return F.linear(torch.cat([rms_norm(e, mtp.enorm, eps), rms_norm(hidden, mtp.hnorm, eps)], -1), mtp.eh_proj)

    def logits(self, h: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of final hidden states, by the lm_head (or another head: the MTP layer's own)."""
        return self.comm.vocab_logits(h, self.lm_head if head is None else head)

    def selectors(self) -> list:
        """The distinct token selectors of the full layers (and the MTP layer's)."""
        layers = list(self.layers) + ([self.mtp.layer] if self.mtp is not None else [])
        found = {id(l.attn.selector): l.attn.selector for l in layers if l.attn.selector is not None}
        return list(found.values())

    def forward(self, ctx: ForwardContext, cache) -> torch.Tensor:
        """Logits (fp32) for `ctx.logits_rows`."""
        return self.logits(self.hidden_states(ctx, cache)[ctx.logits_rows])


ENDS, MTP = "ends", "mtp"  # the parts of a model besides its decoder layers (`part_of`)


def part_of(name: str, num_layers: int) -> int | str:
    """The part of the model a checkpoint tensor builds: a decoder layer's index, MTP for the layer after
    the last (the NextN layer), ENDS for the rest (embedding, final norm, head)."""
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return MTP if i == num_layers else i
    return ENDS


def build_ends(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding, final norm, head): a tied head stays the embedding table (a copy in the GEMM's layout
    would double it)."""
    embed = tensors["model.embed_tokens.weight"]
    head = gemm_layout(tensors["lm_head.weight"]) if "lm_head.weight" in tensors else embed
    return embed, tensors["model.norm.weight"], head


def _release_layer(tensors: dict, i: int) -> None:
    prefix = f"model.layers.{i}."
    for name in [n for n in tensors if n.startswith(prefix)]:
        del tensors[name]


def _p(tensors: dict, prefix: str, name: str) -> torch.Tensor:
    return tensors[f"{prefix}.{name}"]


def build_layer(cfg: ModelConfig, i: int, tensors: dict, has_indexer: bool, mlp_type: str,
                scratch: ScoreScratch | None = None, comm=SINGLE_RANK) -> DecoderLayer:
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    attn_w = AttentionWeights(*(_p(tensors, a, n) for n in (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")))
    indexer = None
    if has_indexer:
        ix = f"{a}.indexer"
        indexer = LightningIndexer(cfg, IndexerWeights(
            gemm_layout(_p(tensors, ix, "wq_b.weight")), gemm_layout(_p(tensors, ix, "wk.weight")),
            _p(tensors, ix, "k_norm.weight"), _p(tensors, ix, "k_norm.bias"),
            gemm_layout(_p(tensors, ix, "weights_proj.weight").float())), scratch)
    ffn = build_ffn(cfg, f"{p}.mlp", tensors, mlp_type)
    return DecoderLayer(cfg, MLAttention(cfg, i, attn_w, indexer), ffn,
                        _p(tensors, p, "input_layernorm.weight"), _p(tensors, p, "post_attention_layernorm.weight"),
                        comm)


def _mlp(tensors: dict, prefix: str) -> DenseMLP:
    return DenseMLP(*(_p(tensors, prefix, f"{n}_proj.weight") for n in ("gate", "up", "down")))


def build_ffn(cfg: ModelConfig, prefix: str, tensors: dict, mlp_type: str):
    if mlp_type == "dense":
        return _mlp(tensors, prefix).laid_out()
    # None: an expert another rank computes (expert parallelism)
    experts = [_mlp(tensors, f"{prefix}.experts.{e}") if f"{prefix}.experts.{e}.down_proj.weight" in tensors else None
               for e in range(cfg.n_routed_experts)]
    return MoE(cfg, _p(tensors, prefix, "gate.weight"), _p(tensors, prefix, "gate.e_score_correction_bias"),
               experts, _mlp(tensors, f"{prefix}.shared_experts").laid_out())


def build_mtp(cfg: ModelConfig, tensors: dict, scratch: ScoreScratch | None = None, comm=SINGLE_RANK) -> MTPHead | None:
    i = cfg.num_hidden_layers
    p = f"model.layers.{i}"
    if f"{p}.eh_proj.weight" not in tensors:
        return None
    return MTPHead(build_layer(cfg, i, tensors, True, "sparse" if cfg.n_routed_experts else "dense", scratch, comm),
                   tensors[f"{p}.enorm.weight"], tensors[f"{p}.hnorm.weight"], gemm_layout(tensors[f"{p}.eh_proj.weight"]),
                   tensors[f"{p}.shared_head.norm.weight"], tensors.get(f"{p}.embed_tokens.weight"),
                   _optional_gemm_layout(tensors.get(f"{p}.shared_head.head.weight")))


def _optional_gemm_layout(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else gemm_layout(w)
