"""Decode roofline: bytes, FLOPs and link traffic of one decode step on one GPU, and the step time.

The step is a sequence of stages (weights, routed experts, indexer, top-k, sparse attention,
host->device misses, dispatch overhead). Each stage takes max(FLOPs / peak, bytes / bandwidth),
as kernels run one after another; the host->device copy is added on top because HiSparse v1
swaps misses in on the compute stream between the indexer and attention (as HiSparse
does). The resource that accounts for the most time is the one that binds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sparsekv.cache.sizing import params_per_rank
from sparsekv.config import ModelConfig
from sparsekv.tools.hardware import Hardware
from sparsekv.tools.plan_capacity import buffer_tokens, cache_sizes, rank_weights, vocab_weight_format, weight_bytes
from sparsekv.tools.plan_costs import absorbed_attention_flops, attended_keys, indexer_flops, param_counts
from sparsekv.tools.plan_workload import Deployment, Workload

LOGIT_BYTES_PER_KEY = 8  # fp32 index score written by the indexer kernel, read back by top-k


@dataclass(frozen=True)
class EngineProfile:
    """How far an implementation is from ideal fused kernels; the knobs calibration adjusts.

    `ops_per_layer` / `ops_per_step`: eager kernel launches (each costs the hardware's
    op_overhead_s). `indexer_score_passes`: passes over an fp32 [H_I, T] score tensor that an
    unfused indexer materialises (scores, ReLU, weighting, head sum). `attention_score_passes`:
    the same over [H, keys] in attention. `gather_passes`: extra passes over the selected latent
    rows (gathering them into a dense tensor writes and re-reads them).
    """

    name: str = "fused"
    ops_per_layer: float = 0.0
    ops_per_step: float = 0.0
    indexer_score_passes: float = 0.0
    attention_score_passes: float = 0.0
    gather_passes: float = 0.0
    skip_indexer_below_topk: bool = True


FUSED = EngineProfile()
# Calibrated against sparsekv's engine (BENCHMARKS.md, "planner vs engine"): a decode step makes
# ~795 torch calls for 4 layers (~190 per layer, ~35 per step, counted with a TorchFunctionMode);
# each costs ~2.4x the probe's bare op once the Python around it is counted, hence 450 / 90.
TORCH_EAGER = EngineProfile("torch-eager", ops_per_layer=450, ops_per_step=90, indexer_score_passes=6,
                            attention_score_passes=6, gather_passes=2)


@dataclass
class Stage:
    name: str
    flops: float = 0.0
    bytes: float = 0.0
    link_bytes: float = 0.0
    fixed_s: float = 0.0


@dataclass
class StepEstimate:
    """One decode step on one GPU: stages, per-resource times, the binding resource."""

    stages: list[Stage]
    times: dict = field(default_factory=dict)   # compute / hbm / link / overhead seconds
    step_s: float = 0.0
    batch_per_gpu: float = 1.0

    @property
    def binding(self) -> str:
        names = {"compute": "compute", "hbm": "HBM bandwidth", "link": "link bandwidth",
                 "overhead": "dispatch overhead"}
        return names[max(self.times, key=self.times.get)]

    def bytes_by_stage(self) -> dict:
        return {s.name: s.bytes + s.link_bytes for s in self.stages}

    def to_dict(self) -> dict:
        return {"step_ms": self.step_s * 1e3, "binding": self.binding,
                "times_ms": {k: v * 1e3 for k, v in self.times.items()},
                "stages": [dict(s.__dict__) for s in self.stages]}


def unique_experts(n_routed: int, k: int, tokens: float) -> float:
    """Expected distinct routed experts hit by `tokens` tokens routing to k of E uniformly."""
    return n_routed * (1.0 - (1.0 - k / n_routed) ** tokens)


def weight_stages(cfg: ModelConfig, dep: Deployment, wl: Workload, batch_rank: float) -> list[Stage]:
    """One rank reads its replicated and tp-sharded weights (cache/sizing.py's split) but not the
    embedding, a lookup; dense attention runs no indexer, so its weights are not read either.
    Of the routed experts only the activated ones are read: one token reads k per layer, a batch
    their union. With EP every rank's tokens meet at the experts; without, a rank sees its own."""
    c, fmt = param_counts(cfg), dep.weight_format
    rank, params = rank_weights(cfg, dep), params_per_rank(cfg, dep.parallelism)
    lookup = c.embedding / dep.tp
    unread = c.indexer_per_full_layer * c.num_full if wl.attention_mode == "dense" else 0
    dense = Stage("weights", flops=2 * batch_rank * (params.replicated + params.sharded - lookup - unread),
                  bytes=(rank.replicated + rank.sharded - weight_bytes(lookup, vocab_weight_format(fmt))
                         - weight_bytes(unread, fmt)))
    tokens = dep.replica_requests(wl.concurrency) if dep.ep else batch_rank
    hit = unique_experts(c.n_routed, c.k_routed, tokens) / dep.expert_shards
    experts = Stage("experts", flops=2 * tokens * c.k_routed * c.expert * c.num_moe / dep.expert_shards,
                    bytes=weight_bytes(c.num_moe * hit * c.expert, fmt))
    return [dense, experts]


def cache_stages(cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile,
                 batch_rank: float) -> list[Stage]:
    """Per-request cache reads, averaged over the context distribution, times requests per rank."""
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    topk = (wl.topk or cfg.index_topk) if wl.attention_mode == "sparse" else None
    L, F = cfg.num_hidden_layers, sizes.num_indexer_layers
    heads = cfg.num_attention_heads / dep.tp
    attn, idx, sel, h2d = Stage("attention"), Stage("indexer"), Stage("top-k"), Stage("host->device")
    for T, p in wl.contexts:
        w = p * batch_rank
        n = attended_keys(T, topk)
        attn.flops += w * L * absorbed_attention_flops(cfg, n) / dep.tp
        attn.bytes += w * L * n * (sizes.latent_per_layer * (1 + profile.gather_passes)
                                   + 4 * heads * profile.attention_score_passes)
        if F and not (profile.skip_indexer_below_topk and T <= topk):
            idx.flops += w * F * indexer_flops(cfg, T)  # replicated on every tp rank
            idx.bytes += w * F * T * (sizes.indexer_per_layer + LOGIT_BYTES_PER_KEY
                                      + 4 * cfg.index_n_heads * profile.indexer_score_passes)
            sel.fixed_s += w * F * T * dep.hardware.topk_s_per_key
        if wl.tiering:
            misses = wl.miss_rate * n if T > buffer_tokens(cfg, wl) else 0.0
            # misses are fetched per layer (each layer caches different latents); the newest
            # token is backed up to the host every step.
            h2d.link_bytes += w * L * (misses + 1) * sizes.latent_per_layer
    return [attn, idx, sel, h2d]


def overhead_stage(cfg: ModelConfig, hw: Hardware, profile: EngineProfile) -> Stage:
    ops = profile.ops_per_layer * cfg.num_hidden_layers + profile.ops_per_step
    return Stage("overhead", fixed_s=ops * hw.op_overhead_s)


def estimate_step(cfg: ModelConfig, dep: Deployment, wl: Workload,
                  profile: EngineProfile = FUSED) -> StepEstimate:
    """Decode step for `wl.concurrency` requests per capacity unit spread over the attention ranks."""
    hw = dep.hardware
    batch_rank = dep.requests_per_rank(wl.concurrency)
    stages = (weight_stages(cfg, dep, wl, batch_rank)
              + cache_stages(cfg, dep, wl, profile, batch_rank) + [overhead_stage(cfg, hw, profile)])
    peak = hw.matmul_flops(dep.weight_format)
    times = {"compute": 0.0, "hbm": 0.0, "link": 0.0, "overhead": 0.0}
    for s in stages:
        t_compute, t_mem = s.flops / peak, s.bytes / hw.mem_bw
        times["compute" if t_compute > t_mem else "hbm"] += max(t_compute, t_mem)
        times["link"] += s.link_bytes / hw.link_bw
        times["overhead"] += s.fixed_s
    return StepEstimate(stages, times, sum(times.values()), batch_rank)


def predict_decode_step_ms(model_cfg: ModelConfig, context_len: int, hardware: Hardware,
                           attention_mode: str = "sparse", batch: int = 1, dtype: str = "float32",
                           cache_dtype: str | None = None, indexer_dtype: str | None = None,
                           profile: EngineProfile | None = None, topk: int | None = None,
                           tiering: bool = False, device_buffer_tokens: int | None = None,
                           miss_rate: float = 0.0) -> float:
    """Predicted wall time (ms) of one decode step of `batch` requests, each with `context_len`
    cached tokens, on one device (no TP/EP) -- the quantity `sparsekv bench decode` measures.

    `hardware` is normally `measure_this_cpu()`; `attention_mode` is the engine's ("sparse" runs
    the indexer and attends top-k, "dense" attends all keys and keeps no indexer keys). `dtype`
    is the engine's weight dtype ("float32", "bfloat16", or "fp8"); the latent cache defaults to it
    (`cache_dtype`: the engine's `kv_cache_dtype`), and so do the indexer keys, whatever the latent
    cache (`indexer_dtype`: the engine's `indexer_key_dtype`, as FP8 latents leave the keys alone).
    `profile` says how far the implementation is from fused kernels: it defaults to TORCH_EAGER
    on a measured machine and FUSED on a datasheet preset; calibrate by adjusting its fields
    (e.g. `dataclasses.replace(TORCH_EAGER, ops_per_layer=...)`) until measured and predicted
    agree, and keep the calibration table beside the benchmark.
    """
    hw = hardware.with_node(gpus_per_node=1)
    dep = Deployment(hw, tp=1, ep=False, weight_format=_fmt(dtype), latent_format=_fmt(cache_dtype or dtype),
                     indexer_format=_fmt(indexer_dtype or dtype))
    wl = Workload(((int(context_len), 1.0),), concurrency=batch, topk=topk, tiering=tiering,
            device_buffer_tokens=device_buffer_tokens, miss_rate=miss_rate, attention_mode=attention_mode)
    dep.validate()
    wl.validate()
    chosen = profile or (TORCH_EAGER if hardware.measured else FUSED)
    return estimate_step(model_cfg, dep, wl, chosen).step_s * 1e3


def _fmt(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
