"""`sparsekv bench indexer`: the lightning indexer's prefill scan on its own, at long contexts.

The scan (every query of a prefill chunk scored against every earlier key, then top-k) is quadratic
in the context and most of a long prefill on a CPU. This times `LightningIndexer.select` for a
block of queries at the end of a T-key history (random keys and queries with the checkpoint's
indexer shape), with the engine's block policy and with a baseline policy in the same run, checks
that both select the same positions, and prints the scan's FLOP rate against the machine's measured
fp32 matmul rate. Baselines (`--baseline`) are earlier policies (`model.indexer.BlockPolicy`, the
indexer's constructor option): `small-tiles` (key tiles of 2^17 scores, 256 keys for 128 queries of 4
heads) and `small-blocks` (also blocks of at most 64 queries and a 128 MB score buffer, so 32 queries
at 1M keys).

`--decode` times one decode row instead (`select` of a single query at the end of the history: the
key scan every decode step makes in each full layer) in both layouts at every length: keys-major
(`decode_head_scores`, [T, D] x [D, H]) and query-major (`w @ ReLU(q @ K^T)`, [H, D] x [D, T], the
engine's earlier layout). It says which one the engine uses there on this device
(`keys_major`), checks both select the same positions, and prints the rate the key cache streams at
against the device's read bandwidth measured now. `--device cuda` runs it on an accelerator, where
the engine stays query-major until this has been measured (scripts/gpu_check.py runs it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..engine_args import at_least, output_path
from ..model.indexer import MODULE_POLICY, BlockPolicy, LightningIndexer, index_key_tile, index_query_block
from .bench import index_flops_per_pair, report_console
from .hardware import device_read_bandwidth
from .plan_workload import token_list_arg

BASELINES = {"small-tiles": BlockPolicy(tile_elements_cpu=1 << 17),
             "small-blocks": BlockPolicy(query_block_cpu_max=64, score_elements_cpu=1 << 25,
                                         tile_elements_cpu=1 << 17)}


def block_and_tile(indexer, inputs) -> tuple[int, int]:
    """(queries per block, keys per tile) `select` uses on these inputs under the indexer's policy: the
    block is the policy's, cut to the queries there are."""
    q, _, _, positions = inputs
    total = int(positions.max()) + 1
    block = min(index_query_block(q.device, indexer.n_heads, total, indexer.policy), q.shape[0])
    return block, index_key_tile(q.device, block, indexer.n_heads, total, indexer.policy)


def time_prefill_scan(indexers: list, inputs, k: int, repeats: int) -> list[tuple[float, torch.Tensor]]:
    """(median seconds, selection) of a prefill block's `select` by each indexer, timed as `time_decode`
    times (an untimed call each, then turns). Their shared score buffer is allocated first, at the
    largest block's size, so no timed call allocates it."""
    q, _, _, positions = inputs
    total = int(positions.max()) + 1
    scratch = indexers[0].scratch
    scratch.release()
    scratch.take(max(block_and_tile(indexer, inputs)[0] for indexer in indexers) * total, q.device)
    timed = time_decode(indexers, inputs, k, repeats)
    scratch.release()
    return timed


def random_inputs(cfg, context: int, queries: int, seed: int, device: torch.device | str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.index_n_heads, cfg.index_head_dim
    keys = torch.randn(context, d, generator=g).to(device)
    q, weights = torch.randn(queries, h, d, generator=g).to(device), torch.randn(queries, h, generator=g).to(device)
    return q, weights, [(0, keys)], torch.arange(context - queries, context, device=device)


LAYOUTS = {"keys-major": BlockPolicy(keys_major_min_keys=0), "query-major": BlockPolicy(keys_major_min_keys=1 << 62)}


def time_decode(indexers: list, inputs, k: int, repeats: int) -> list[tuple[float, torch.Tensor]]:
    """(median seconds, selection) of one `select` call (a decode row, or a prefill block) by each
    indexer (block policy); they take turns call by call (after one untimed call each), so drifts of a
    noisy machine hit them alike."""
    q, weights, segments, positions = inputs
    times, selected = [[] for _ in indexers], [None] * len(indexers)
    for repeat in range(repeats + 1):
        for i, indexer in enumerate(indexers):
            _sync(q.device)
            t0 = time.perf_counter()
            selected[i] = indexer.select(q, weights, segments, positions, k)
            _sync(q.device)
            if repeat:
                times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), sel) for t, sel in zip(times, selected)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_decode(args, cfg) -> list[dict]:
    from ..model.indexer import keys_major
    indexers = [LightningIndexer(cfg, None, policy=policy) for policy in LAYOUTS.values()]
    device = torch.device(args.device)
    read_bw = device_read_bandwidth(device, args.threads)
    rows, k = [], cfg.index_topk
    for context in args.contexts:
        inputs = random_inputs(cfg, context, 1, args.seed, device)
        (km_s, km_sel), (qm_s, qm_sel) = time_decode(indexers, inputs, k, args.repeats)
        key_bytes = context * cfg.index_head_dim * 4
        rows.append({"context": context, "device": device.type,
                     "engine_layout": "keys-major" if keys_major(device, 1, context) else "query-major",
                     "keys_major_ms": 1e3 * km_s, "query_major_ms": 1e3 * qm_s, "speedup": qm_s / km_s,
                     "keys_major_gb_per_s": key_bytes / km_s / 1e9, "query_major_gb_per_s": key_bytes / qm_s / 1e9,
                     "machine_gb_per_s": read_bw / 1e9, "identical": bool(torch.equal(km_sel.cpu(), qm_sel.cpu()))})
    return rows


def report_decode(rows: list[dict], args) -> None:
    from rich.table import Table
    machine = rows[0]["machine_gb_per_s"] if rows else 0.0
    table = Table(title=f"indexer decode row (1 query, fp32 keys) on {args.device}, {args.threads} threads "
                        f"(read bandwidth measured now: {machine:.1f} GB/s)")
    for col in ("context", "engine uses", "keys-major ms/row", "GB/s (of machine)", "query-major ms/row",
                "GB/s (of machine)", "keys-major speed-up", "same selection"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["context"]), r["engine_layout"], f"{r['keys_major_ms']:.2f}",
                      f"{r['keys_major_gb_per_s']:.1f} ({100 * r['keys_major_gb_per_s'] / machine:.0f}%)",
                      f"{r['query_major_ms']:.2f}",
                      f"{r['query_major_gb_per_s']:.1f} ({100 * r['query_major_gb_per_s'] / machine:.0f}%)",
                      f"{r['speedup']:.2f}x", "yes" if r["identical"] else "NO")
    report_console().print(table)


def bench(args) -> list[dict]:
    from ..config import ModelConfig
    from ..paths import default_model_path
    from .hardware import measure_this_cpu
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_json(args.model or default_model_path())
    if args.decode:
        return bench_decode(args, cfg)
    ours = LightningIndexer(cfg, None, policy=MODULE_POLICY)
    baseline = LightningIndexer(cfg, None, ours.scratch, BASELINES[args.baseline])  # one score buffer, as before
    machine = measure_this_cpu(threads=args.threads).matmul_flops("float32")
    rows = []
    for context in args.contexts:
        inputs = random_inputs(cfg, context, args.queries, args.seed)
        flops = index_flops_per_pair(cfg) * args.queries * context
        (ours_s, ours_sel), (base_s, base_sel) = time_prefill_scan([ours, baseline], inputs, cfg.index_topk,
                                                                  args.repeats)
        (ours_rows, ours_tile), (base_rows, base_tile) = block_and_tile(ours, inputs), block_and_tile(baseline, inputs)
        rows.append({"context": context, "queries": args.queries, "block": ours_rows, "tile": ours_tile,
                     "ms_per_query": 1e3 * ours_s / args.queries, "gflops": flops / ours_s / 1e9,
                     "baseline": args.baseline, "baseline_block": base_rows, "baseline_tile": base_tile,
                     "baseline_ms_per_query": 1e3 * base_s / args.queries, "speedup": base_s / ours_s,
                     "identical": bool(torch.equal(ours_sel, base_sel)), "machine_gflops": machine / 1e9})
    return rows


def report(rows: list[dict], args) -> None:
    from rich.table import Table
    machine = rows[0]["machine_gflops"] if rows else 0.0
    table = Table(title=f"indexer prefill scan, {args.queries} queries at the end of the context, "
                        f"{args.threads} threads (machine fp32 matmul {machine:.0f} GFLOP/s)")
    for col in ("context", "block x tile", "ms/query", "GFLOP/s (of machine)", f"{args.baseline}: block x tile",
                "baseline ms/query", "speed-up", "same selection"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["context"]), f"{r['block']} x {r['tile']}", f"{r['ms_per_query']:.2f}",
                      f"{r['gflops']:.1f} ({100 * r['gflops'] / r['machine_gflops']:.0f}%)",
                      f"{r['baseline_block']} x {r['baseline_tile']}",
                      f"{r['baseline_ms_per_query']:.2f}", f"{r['speedup']:.2f}x", "yes" if r["identical"] else "NO")
    report_console().print(table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench indexer")
    p.add_argument("model", nargs="?", default=None, help="checkpoint whose indexer shape to use (default: bundled)")
    p.add_argument("--contexts", type=token_list_arg, default="256K,1M", help="keys in the history, e.g. 64K,256K,1M")
    p.add_argument("--queries", type=int, default=512, help="queries scored (the end of a prefill chunk)")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed calls per policy; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=sorted(BASELINES), default="small-tiles",
                   help="earlier block policy timed in the same run (see the module docstring)")
    p.add_argument("--decode", action="store_true",
                   help="time one decode row in both score layouts instead of a prefill block")
    p.add_argument("--device", default="cpu", help="with --decode: cpu or cuda")
    p.add_argument("--json", type=output_path, default=None)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.decode:
        if any(c <= 1 for c in args.contexts):
            p.error("--decode needs contexts of at least 2 keys")
        return args
    if args.device != "cpu":
        p.error("--device is for --decode (the prefill scan is timed on this CPU)")
    if args.queries < 2 or any(c < args.queries for c in args.contexts):
        p.error("--queries must be at least 2 and at most every context")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rows = bench(args)
    (report_decode if args.decode else report)(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1
