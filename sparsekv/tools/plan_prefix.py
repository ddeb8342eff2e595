"""`sparsekv plan --prefix-cache-host-gb X --prefix-cache-disk-tb Y`: how many contexts the prefix
cache keeps warm in host DRAM and on disk, and what bringing one back costs against recomputing it.

A cached page holds every slot-indexed row of its tokens: the MLA latent of every layer and the
indexer keys of the layers that run an indexer (docs/prefix_cache.md), so a cached token costs what a
live one does. A hit copies those bytes back over the host link (host tier) or reads them from disk
first (disk tier); a miss recomputes the prompt: its prefill FLOPs on the deployment's GPUs (every
node's) at their peak, an ideal bound (a real prefill is slower, so the ratios understate what the
tiers save).
"""
from __future__ import annotations

from sparsekv.config import ModelConfig
from sparsekv.tools.plan_capacity import cache_sizes
from sparsekv.tools.plan_costs import flops_per_token
from sparsekv.tools.plan_workload import Deployment, Workload

DEFAULT_DISK_GBPS = 6.0  # one PCIe Gen4 NVMe drive's sequential read, roughly (a stated assumption)


def prefix_cache_section(cfg: ModelConfig, dep: Deployment, wl: Workload, host_gb: float, disk_tb: float,
                         disk_gbps: float) -> dict:
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    per_token = sizes.latent_per_token + sizes.indexer_per_token
    context = wl.mean_context
    per_context = per_token * context
    hw = dep.hardware
    variant = "dense-mla" if wl.attention_mode == "dense" else (
        "dsa-indexshare" if "shared" in cfg.indexer_types else "dsa-every-layer")
    prefill_flops = flops_per_token(cfg, context, variant, "prefill").total * context
    recompute_s = prefill_flops / (hw.matmul_flops(dep.weight_format) * dep.gpus)
    tiers = {}
    for name, capacity, bandwidth in (("host", host_gb * 1e9, hw.link_bw), ("disk", disk_tb * 1e12, disk_gbps * 1e9)):
        if capacity <= 0:
            continue
        restore_s = per_context / bandwidth
        tiers[name] = {"capacity_bytes": capacity, "bandwidth": bandwidth, "tokens": capacity / per_token,
                       "contexts": int(capacity // per_context), "restore_s": restore_s,
                       "speedup_vs_recompute": recompute_s / restore_s}
    return {"bytes_per_token": per_token, "context": context, "bytes_per_context": per_context,
            "recompute_s": recompute_s, "prefill_flops": prefill_flops, "tiers": tiers}
