"""The parallel layout of a deployment per GPU: weights, KV cache and requests at 128K and 1M, and the
bytes each collective sends. Every byte count comes from cache/sizing.py, the engine's own split."""
from __future__ import annotations

from dataclasses import replace

from sparsekv.cache.sizing import collectives, element_bytes, gather_scatter_bytes, weight_bytes_per_rank
from sparsekv.config import ModelConfig
from sparsekv.tools.plan_capacity import capacity
from sparsekv.tools.plan_workload import Deployment, Workload

CONTEXTS = (128 * 1024, 1024 * 1024)


def weights_section(cfg: ModelConfig, dep: Deployment) -> dict:
    main = weight_bytes_per_rank(cfg, dep.parallelism, dep.weight_format)
    with_mtp = weight_bytes_per_rank(cfg, dep.parallelism, dep.weight_format, mtp=True)
    return {"replicated": main.replicated, "sharded": main.sharded, "routed_experts": main.experts,
            "total": main.total, "mtp_layer": with_mtp.total - main.total,
            "experts_per_gpu": cfg.n_routed_experts // dep.expert_shards if dep.ep else cfg.n_routed_experts}


def kv_rows(cfg: ModelConfig, dep: Deployment, wl: Workload) -> list[dict]:
    """Per GPU at each of CONTEXTS: one request's KV (whole, and with tiering), requests per GPU and node."""
    rows = []
    for tokens in CONTEXTS:
        cap = capacity(cfg, dep, replace(wl, contexts=((tokens, 1.0),)))
        rows.append({"context": tokens, "kv_per_request": cap.device_per_request["no_tiering"],
                     "kv_per_request_tiering": cap.device_per_request["tiering"],
                     "per_gpu": cap.per_gpu, "per_node": cap.per_unit, "host_limit": cap.host_limit,
                     "beyond_model": tokens > cfg.max_position_embeddings})
    return rows


def collective_rows(cfg: ModelConfig, dep: Deployment, wl: Workload) -> list[dict]:
    """Each collective per token, and per decode step on one rank at the workload's concurrency. The tp
    ranks of a dp rank hold the same tokens; each token is dispatched to the experts once, by one of them."""
    tokens = dep.requests_per_rank(wl.concurrency)
    rows = []
    for c in collectives(cfg, dep.parallelism, dep.activation_format):
        sent = tokens / dep.tp if c.op == "all_to_all" else tokens
        rows.append({"name": c.name, "op": c.op, "ranks": c.ranks, "times": c.times, "per_token": c.per_token,
                     "per_token_all": c.per_token_all, "per_step": c.per_token_all * sent, "formula": c.formula})
    return rows


def moe_meeting(cfg: ModelConfig, dep: Deployment, wl: Workload) -> dict | None:
    """With dp attention + EP the dp ranks' tokens meet at the experts: rows each rank's experts compute
    per MoE layer in one decode step (uniform routing), against its own requests."""
    if not (dep.ep and dep.dp > 1):
        return None
    own = dep.requests_per_rank(wl.concurrency)
    world = dep.tp * dep.dp
    return {"tokens_per_rank": own, "tokens_all_ranks": own * dep.dp,
            "expert_rows_per_rank": own * dep.dp * cfg.num_experts_per_tok / world,
            "gather_scatter_per_token": gather_scatter_bytes(cfg, world, element_bytes(dep.activation_format))}


def parallel_section(cfg: ModelConfig, dep: Deployment, wl: Workload) -> dict:
    return {"tp": dep.tp, "dp": dep.dp, "ep": dep.ep, "nodes": dep.nodes, "world": dep.tp * dep.dp,
            "activation_format": dep.activation_format, "weights_per_gpu": weights_section(cfg, dep),
            "kv_per_gpu": kv_rows(cfg, dep, wl), "collectives": collective_rows(cfg, dep, wl),
            "moe_meeting": moe_meeting(cfg, dep, wl)}
