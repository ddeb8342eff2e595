"""Memory: what each cache kind costs per token, per request on the device (with and without a
tiered cache), in host DRAM, and how many requests a GPU and a node (or a replica whose TP groups
span nodes) can hold."""
from __future__ import annotations

import math
from dataclasses import dataclass

from sparsekv.cache.sizing import (RankWeights, element_bytes, indexer_bytes_per_token_layer,
                                   latent_bytes_per_token_layer, weight_bytes_per_rank)
from sparsekv.config import ModelConfig
from sparsekv.tools.plan_costs import FP8_WEIGHT_TILE
from sparsekv.tools.plan_workload import Deployment, Workload


def weight_bytes(params: float, fmt: str) -> float:
    """FP8 checkpoints store e4m3 values plus one fp32 scale per 128x128 tile."""
    if fmt == "fp8":
        return params * (1 + 4 / FP8_WEIGHT_TILE)
    return params * element_bytes(fmt)


def vocab_weight_format(fmt: str) -> str:
    """Embedding and lm_head stay bf16 in FP8 releases."""
    return "bf16" if fmt == "fp8" else fmt


def rank_weights(cfg: ModelConfig, dep: Deployment) -> RankWeights:
    """What one GPU holds of the main model (cache/sizing.py, the engine's own split)."""
    return weight_bytes_per_rank(cfg, dep.parallelism, dep.weight_format)


@dataclass(frozen=True)
class CacheSizes:
    """Bytes per token per layer and per token over all layers, for each cache kind."""

    latent_per_layer: int
    indexer_per_layer: int
    num_layers: int
    num_indexer_layers: int

    @property
    def latent_per_token(self) -> int:
        return self.latent_per_layer * self.num_layers

    @property
    def indexer_per_token(self) -> int:
        return self.indexer_per_layer * self.num_indexer_layers


def cache_sizes(cfg: ModelConfig, dep: Deployment, attention_mode: str = "sparse") -> CacheSizes:
    """Dense attention keeps no indexer keys; DSA keeps them only in layers that run an indexer."""
    n_idx = len(cfg.full_layers) if attention_mode == "sparse" else 0
    return CacheSizes(latent_bytes_per_token_layer(cfg, dep.latent_format),
                      indexer_bytes_per_token_layer(cfg, dep.indexer_format),
                      cfg.num_hidden_layers, n_idx)


def hot_buffer_slots(context: int, buffer_tokens: int, page_size: int) -> int:
    """Device latent slots a tiered request holds per layer: it grows page by page up to the
    buffer, then owns buffer + one extra page whose first slot takes the newest token (SGLang)."""
    if context <= buffer_tokens:
        return math.ceil(context / page_size) * page_size
    return buffer_tokens + page_size


def buffer_tokens(cfg: ModelConfig, wl: Workload) -> int:
    """SGLang's default device_buffer_size is 2 x top_k."""
    return wl.device_buffer_tokens or 2 * (wl.topk or cfg.index_topk)


def device_bytes_per_request(cfg: ModelConfig, dep: Deployment, wl: Workload, tiered: bool) -> float:
    """Expected device bytes of one request over the context distribution."""
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    total = 0.0
    for T, p in wl.contexts:
        latent_tokens = hot_buffer_slots(T, buffer_tokens(cfg, wl), dep.page_size) if tiered else T
        total += p * (latent_tokens * sizes.latent_per_token + T * sizes.indexer_per_token)
    return total


def hot_buffer_bytes(cfg: ModelConfig, dep: Deployment, wl: Workload) -> float:
    """Latent part of a tiered request's device footprint at a long context (buffer + page)."""
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    return (buffer_tokens(cfg, wl) + dep.page_size) * sizes.latent_per_token


def host_bytes_per_request(cfg: ModelConfig, dep: Deployment, wl: Workload) -> float:
    """Host bytes of one request on a node that holds it: with tiering the host pool holds every
    request's full latent history (no host eviction), one copy per TP rank of its attention rank on
    that node (each rank's cache is whole)."""
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    return wl.mean_context * sizes.latent_per_token * dep.host_copies


@dataclass(frozen=True)
class Capacity:
    """Request counts per capacity unit (`Deployment.capacity_unit`: a node, or the replica where a
    TP group spans nodes); host figures are per node."""

    weights_per_gpu: float
    usable_per_gpu: float           # device memory left for the cache
    device_per_request: dict        # {"no_tiering": bytes, "tiering": bytes}
    host_per_request: float
    per_gpu: dict                   # max requests per GPU (per attention rank), by policy
    per_unit: dict                  # max requests per capacity unit, by policy (host-limited with tiering)
    host_limit: int                 # requests per capacity unit that host DRAM can back with tiering
    host_needed: float              # per node for the workload's concurrency, with tiering

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def capacity(cfg: ModelConfig, dep: Deployment, wl: Workload) -> Capacity:
    hw = dep.hardware
    w = rank_weights(cfg, dep).total
    usable = hw.device_mem_bytes * dep.mem_fraction - w
    dev = {"no_tiering": device_bytes_per_request(cfg, dep, wl, tiered=False),
           "tiering": device_bytes_per_request(cfg, dep, wl, tiered=True)}
    per_gpu = {k: _fit(usable, v) for k, v in dev.items()}
    host_req = host_bytes_per_request(cfg, dep, wl)
    host_limit = dep.per_unit_from_node(_fit(hw.host_dram_bytes * dep.host_fraction, host_req))
    per_unit = {"no_tiering": dep.per_unit(per_gpu["no_tiering"]),
                "tiering": min(dep.per_unit(per_gpu["tiering"]), host_limit)}
    return Capacity(w, usable, dev, host_req, per_gpu, per_unit, host_limit,
                    dep.requests_on_node(wl.concurrency) * host_req)


def _fit(budget: float, per_item: float) -> int:
    if budget <= 0:
        return 0
    return int(budget // per_item) if per_item > 0 else 10 ** 9


def capacity_limit(cap: Capacity, dep: Deployment, wl: Workload) -> str | None:
    """The capacity that the workload exceeds ("HBM capacity", "host capacity"), or None."""
    policy = "tiering" if wl.tiering else "no_tiering"
    if dep.requests_per_rank(wl.concurrency) > cap.per_gpu[policy]:
        return "HBM capacity"
    if wl.tiering and wl.concurrency > cap.host_limit:
        return "host capacity"
    return None
