"""`sparsekv plan`: capacity planner and decode roofline for DSA models on real deployments.

Answers, on paper and from a config.json, the operator's question: which memory tier holds each
part of the KV cache, how many long sessions fit, and at what decode latency. The pieces:
plan_costs (per-token bytes, params, FLOPs), plan_capacity (memory), plan_decode (roofline and
`predict_decode_step_ms` for calibration against `sparsekv bench decode`), plan_compare
(published figures), plan_sweep (--sweep, --plot), plan_report (tables).

Exit status: 0 the workload fits, 1 it does not (the binding resource is printed), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..engine_args import output_path
from sparsekv.config import ConfigError, ModelConfig
from sparsekv.tools.hardware import PRESETS as HW_PRESETS
from sparsekv.tools.hardware import Hardware, load_hardware
from sparsekv.tools.plan_capacity import cache_sizes, capacity, capacity_limit, hot_buffer_bytes
from sparsekv.tools.plan_compare import published_comparisons
from sparsekv.tools.plan_costs import flop_table, param_counts
from sparsekv.tools.plan_parallel import parallel_section
from sparsekv.tools.plan_decode import FUSED, TORCH_EAGER, EngineProfile, estimate_step, predict_decode_step_ms
from sparsekv.tools.plan_presets import PRESETS as MODEL_PRESETS
from sparsekv.tools.plan_presets import load_model
from sparsekv.tools.plan_prefix import DEFAULT_DISK_GBPS, prefix_cache_section
from sparsekv.tools.plan_workload import Deployment, PlanError, Workload, parse_contexts

__all__ = ["main", "build_plan", "predict_decode_step_ms"]
PROFILES = {"fused": FUSED, "torch-eager": TORCH_EAGER}
FORMATS = ("fp8", "bf16", "fp32")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, from main, not SystemExit
        raise PlanError(message)


def _range_text(low: float, low_open: bool, high: float | None) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}]"


def float_flag(low: float, low_open: bool = False, high: float | None = None, unit: float = 1.0):
    """An argparse type for a finite number in range whose value in bytes (x `unit`) is finite too;
    anything else is a usage error naming the flag."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        in_range = (value > low if low_open else value >= low) and (high is None or value <= high)
        if not (math.isfinite(value * unit) and in_range):
            raise argparse.ArgumentTypeError(f"must be a finite number {_range_text(low, low_open, high)}, "
                                             f"got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sparsekv plan", description="Capacity planner and decode roofline for DSA models.")
    p.add_argument("model", help=f"preset ({', '.join(MODEL_PRESETS)}) or a config.json / checkpoint dir")
    p.add_argument("--hardware", default="h200", help=f"{', '.join(HW_PRESETS)}, this-cpu, or a JSON profile")
    p.add_argument("--nodes", type=int, default=1, help="nodes serving one model replica (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="default: the hardware preset's")
    p.add_argument("--host-dram-gb", type=float_flag(0, unit=1e9), help="host DRAM per node (default: the preset's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1); tp x dp = GPUs")
    p.add_argument("--dp", type=int, help="data-parallel attention ranks (default: GPUs / tp)")
    p.add_argument("--ep", action=argparse.BooleanOptionalAction, default=True,
                   help="expert parallelism: E / (tp x dp) whole routed experts per GPU (default on; "
                        "--no-ep splits every expert over tp)")
    p.add_argument("--weights", choices=FORMATS, help="default fp8 (fp32 on this-cpu)")
    p.add_argument("--latent-cache", choices=FORMATS, help="default fp8, FlashMLA's 656 B format (fp32 on this-cpu)")
    p.add_argument("--indexer-cache", choices=FORMATS, help="default fp8, 132 B (fp32 on this-cpu)")
    p.add_argument("--context", default="128K", help="tokens (131072, 128K, 1M) or a mix like 64K:0.5,1M:0.5")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent decoding requests per node")
    p.add_argument("--topk", type=int, help="tokens selected per query (default: the model's index_topk)")
    p.add_argument("--tiering", action=argparse.BooleanOptionalAction, default=False,
                   help="device hot buffer + host DRAM store (HiSparse)")
    p.add_argument("--device-buffer-tokens", type=int, help="hot-buffer slots per layer (default 2 x top-k)")
    p.add_argument("--miss-rate", type=float_flag(0, high=1), default=0.1, help="fraction of selected tokens not on the device")
    p.add_argument("--mem-fraction", type=float_flag(0, low_open=True, high=1), default=0.9, help="share of device memory for weights + cache")
    p.add_argument("--attention", choices=("sparse", "dense"), default="sparse")
    p.add_argument("--profile", choices=tuple(PROFILES), help="engine profile (default: torch-eager on this-cpu)")
    p.add_argument("--prefix-cache-host-gb", type=float_flag(0, unit=1e9), default=0.0,
                   help="host DRAM for the prefix cache's host tier: contexts kept warm, restore vs recompute")
    p.add_argument("--prefix-cache-disk-tb", type=float_flag(0, unit=1e12), default=0.0, help="disk for its disk tier")
    p.add_argument("--disk-gbps", type=float_flag(0, low_open=True, unit=1e9), default=DEFAULT_DISK_GBPS,
                   help=f"disk read bandwidth (default {DEFAULT_DISK_GBPS}, one PCIe Gen4 NVMe drive)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--parallel-only", action="store_true",
                   help="print only the parallel layout: weights and KV per GPU, requests per node, collectives")
    p.add_argument("--plot", type=output_path, metavar="PATH", help="write a PNG of the concurrency x context sweep")
    p.add_argument("--sweep", action="store_true", help="concurrency x context table, with and without tiering")
    return p


def _deployment(args, hw: Hardware) -> Deployment:
    hw = hw.with_node(args.gpus_per_node, args.host_dram_gb)
    default_fmt = "fp32" if hw.measured else "fp8"
    dep = Deployment(hw, tp=args.tp, dp=args.dp, ep=args.ep, nodes=args.nodes,
                     weight_format=args.weights or default_fmt,
                     latent_format=args.latent_cache or default_fmt,
                     indexer_format=args.indexer_cache or default_fmt, mem_fraction=args.mem_fraction)
    dep.validate()
    return dep


def _machine(dep: Deployment) -> str:
    node = f"{dep.gpus_per_node}x {dep.hardware.name}"
    return node if dep.nodes == 1 else f"{dep.nodes}x{node}"


def _workload(args, cfg: ModelConfig) -> Workload:
    wl = Workload(parse_contexts(args.context), concurrency=args.concurrency, topk=args.topk,
                  tiering=args.tiering, device_buffer_tokens=args.device_buffer_tokens,
                  miss_rate=args.miss_rate, attention_mode=args.attention)
    wl.validate()
    topk = wl.topk or cfg.index_topk
    if wl.device_buffer_tokens is not None and wl.device_buffer_tokens < topk:
        raise PlanError(f"--device-buffer-tokens {wl.device_buffer_tokens} must be >= top-k {topk} "
                        "(SGLang rejects it too)")
    return wl


def warnings(cfg: ModelConfig, wl: Workload) -> list[str]:
    longest = max(t for t, _ in wl.contexts)
    if longest > cfg.max_position_embeddings:
        return [f"context {longest:,} is beyond the model's max_position_embeddings "
                f"{cfg.max_position_embeddings:,}: a what-if, not a supported length"]
    return []


def notes(dep: Deployment) -> list[str]:
    if dep.engine_runs_layout:
        return []
    return [f"sparsekv's engine does not run TP {dep.tp} x DP {dep.dp} yet (DP > 1 only with TP 1, "
            "docs/parallel.md); planned for engines that do"]


def model_summary(name: str, cfg: ModelConfig) -> dict:
    counts = param_counts(cfg)
    return {"name": name, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
            "indexer_layers": len(cfg.full_layers), "index_topk": cfg.index_topk,
            "params_total": counts.total, "params_active": counts.active}


def memory_section(cfg: ModelConfig, dep: Deployment, wl: Workload) -> dict:
    sizes = cache_sizes(cfg, dep, wl.attention_mode)
    cap = capacity(cfg, dep, wl)
    return {"bytes_per_token_per_layer": {"latent": sizes.latent_per_layer, "indexer": sizes.indexer_per_layer},
            "layers": {"latent": sizes.num_layers, "indexer": sizes.num_indexer_layers},
            "bytes_per_token": {"latent": sizes.latent_per_token, "indexer": sizes.indexer_per_token,
                                "total": sizes.latent_per_token + sizes.indexer_per_token},
            "weights_per_gpu": cap.weights_per_gpu, "cache_budget_per_gpu": max(cap.usable_per_gpu, 0.0),
            "device_per_request": cap.device_per_request, "hot_buffer_per_request": hot_buffer_bytes(cfg, dep, wl),
            "host_per_request": cap.host_per_request, "max_requests_per_gpu": cap.per_gpu,
            "max_requests_per_node": cap.per_unit, "host_limit_requests": cap.host_limit,
            "host_needed": cap.host_needed if wl.tiering else 0.0,
            "host_available": dep.hardware.host_dram_bytes * dep.host_fraction}


def decode_section(cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile) -> dict:
    step = estimate_step(cfg, dep, wl, profile)
    by_stage = step.bytes_by_stage()
    return {"profile": profile.name, "requests_per_gpu": step.batch_per_gpu,
            "bytes_per_step_per_gpu": {"weights": by_stage["weights"] + by_stage["experts"],
                                       "weights_routed_experts": by_stage["experts"],
                                       "selected_kv": by_stage["attention"], "indexer_keys": by_stage["indexer"],
                                       "host_to_device": by_stage["host->device"]},
            "flops_per_step_per_gpu": sum(s.flops for s in step.stages),
            "tok_s_per_request": 1.0 / step.step_s,
            "tok_s_aggregate": wl.concurrency / step.step_s, **step.to_dict()}


def verdict(cfg: ModelConfig, dep: Deployment, wl: Workload, memory: dict, decode: dict) -> dict:
    cap = capacity(cfg, dep, wl)
    over = capacity_limit(cap, dep, wl)
    if over is None:
        return {"fits": True, "binding": decode["binding"],
                "message": f"fits: {wl.concurrency} requests per {dep.capacity_unit}; decode is bound by {decode['binding']}"}
    return {"fits": False, "binding": over, "message": _misfit_message(cap, dep, wl, over, memory)}


def _misfit_message(cap, dep: Deployment, wl: Workload, over: str, memory: dict) -> str:
    gb = 1e9
    if cap.usable_per_gpu <= 0:
        fp8 = "" if dep.weight_format == "fp8" else " or use --weights fp8"
        return (f"does not fit: weights need {cap.weights_per_gpu / gb:.1f} GB per GPU, only "
                f"{dep.hardware.device_mem_bytes * dep.mem_fraction / gb:.1f} GB usable; spread them over more "
                f"GPUs (--nodes, --gpus-per-node, --tp, --ep){fp8} (binding: HBM capacity)")
    if over == "host capacity":
        return (f"does not fit even with tiering: {wl.concurrency} requests per {dep.capacity_unit} need "
                f"{cap.host_needed / gb:.0f} GB of host DRAM per node, a node has "
                f"{memory['host_available'] / gb:.0f} GB usable; max "
                f"{cap.per_unit['tiering']} per {dep.capacity_unit} (binding: host capacity)")
    policy = "tiering" if wl.tiering else "no_tiering"
    need = dep.requests_per_rank(wl.concurrency)
    text = (f"{need} requests per GPU x {cap.device_per_request[policy] / gb:.2f} GB exceed the "
            f"{cap.usable_per_gpu / gb:.1f} GB cache budget; max {cap.per_unit[policy]} per {dep.capacity_unit}")
    if wl.tiering:
        return f"does not fit even with tiering: {text} (binding: HBM capacity; indexer keys stay on the device)"
    if wl.attention_mode == "dense":  # --tiering needs --attention sparse: no tiered max to point to
        return f"does not fit: {text} (binding: HBM capacity)"
    return f"does not fit: {text} (binding: HBM capacity; with --tiering max {cap.per_unit['tiering']})"


def build_plan(name: str, cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile) -> dict:
    """Everything the planner reports, as one JSON-ready dict."""
    memory = memory_section(cfg, dep, wl)
    decode = decode_section(cfg, dep, wl, profile)
    plan = {"model": model_summary(name, cfg), "hardware": dep.hardware.to_dict(),
            "deployment": {"nodes": dep.nodes, "gpus_per_node": dep.gpus_per_node, "tp": dep.tp, "dp": dep.dp,
                           "ep": dep.ep, "attention_ranks": dep.attention_ranks, "weights": dep.weight_format,
                           "latent_cache": dep.latent_format, "indexer_cache": dep.indexer_format,
                           "mem_fraction": dep.mem_fraction, "capacity_unit": dep.capacity_unit},
            "workload": {"contexts": [list(c) for c in wl.contexts], "mean_context": wl.mean_context,
                         "concurrency": wl.concurrency, "topk": wl.topk or cfg.index_topk,
                         "tiering": wl.tiering, "device_buffer_tokens": wl.device_buffer_tokens or
                         2 * (wl.topk or cfg.index_topk), "miss_rate": wl.miss_rate,
                         "attention": wl.attention_mode},
            "memory": memory, "parallel": parallel_section(cfg, dep, wl), "decode": decode,
            "verdict": verdict(cfg, dep, wl, memory, decode),
            "warnings": warnings(cfg, wl), "notes": notes(dep),
            "flops_per_token": flop_table(cfg), "published": published_comparisons(cfg, name)}
    if wl.attention_mode == "dense":
        _drop_tiered_figures(plan)
    return plan


def _drop_tiered_figures(plan: dict) -> None:
    """Tiering selects from the indexer's top-k, so dense attention (which `--tiering` refuses) has no
    tiered figure: its plan keeps the untiered ones only, in the tables and in `--json` alike."""
    w, mem = plan["workload"], plan["memory"]
    for key in ("device_buffer_tokens", "miss_rate"):
        del w[key]
    for key in ("hot_buffer_per_request", "host_per_request", "host_limit_requests", "host_needed",
                "host_available"):
        del mem[key]
    for key in ("device_per_request", "max_requests_per_gpu", "max_requests_per_node"):
        mem[key] = {"no_tiering": mem[key]["no_tiering"]}
    for row in plan["parallel"]["kv_per_gpu"]:
        del row["kv_per_request_tiering"], row["host_limit"]
        for key in ("per_gpu", "per_node"):
            row[key] = {"no_tiering": row[key]["no_tiering"]}


def main(argv: list[str]) -> int:
    try:
        return _run(build_parser().parse_args(argv))
    except (PlanError, ConfigError, ValueError) as e:
        print(f"sparsekv plan: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)


def _run(args) -> int:
    from sparsekv.tools import plan_report, plan_sweep
    name, cfg = load_model(args.model)
    hw = load_hardware(args.hardware)
    dep, wl = _deployment(args, hw), _workload(args, cfg)
    dep.parallelism.check(cfg)
    profile = PROFILES[args.profile] if args.profile else (TORCH_EAGER if hw.measured else FUSED)
    plan = build_plan(name, cfg, dep, wl, profile)
    if args.prefix_cache_host_gb or args.prefix_cache_disk_tb:
        plan["prefix_cache"] = prefix_cache_section(cfg, dep, wl, args.prefix_cache_host_gb,
                                                    args.prefix_cache_disk_tb, args.disk_gbps)
    points = plan_sweep.run_sweep(cfg, dep, wl, profile) if (args.sweep or args.plot) else None
    if args.sweep:
        plan["sweep"] = points
    if args.plot:
        plan_sweep.plot_sweep(points, args.plot, f"{name} on {_machine(dep)}")
    if args.json:
        print(json.dumps(plan, indent=1, default=float))
    elif args.parallel_only:
        plan_report.print_parallel(plan)
    else:
        plan_report.print_plan(plan, points if args.sweep else None)
    return 0 if plan["verdict"]["fits"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
