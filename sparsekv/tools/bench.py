"""`sparsekv bench decode | prefill | modes`, and the other benchmarks, each in its own module with its
own options (SUB_BENCHMARKS: `sparsekv bench NAME --help`).

Every figure is measured in a fresh subprocess (clean peak RSS, no allocator carry-over) and every
table prints its ratio against the baseline measured in the same run, plus achieved bandwidth.

Decode at a context T is measured on a cache filled with T random entries ("synthetic prefill"):
a real prefill at 128K would dominate the run, and the cost of a decode step does not depend on
the cached values. transformers has no such entry point, so its decode is measured after a real
prefill (which is why it stops at 16-32K here).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from ..config import ConfigError
from ..engine_args import at_least, engine_error, output_path
from .plan_workload import parse_tokens, token_list_arg

BENCH_PRESETS = ("tiny-bench", "glm5-geometry", "glm5.2-proportions")


def report_console() -> Console:
    """The console result tables print to: a log or a pipe gets 160 columns (rich assumes 80 there and
    cuts every header), a terminal its own width."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def run_bench(p: argparse.ArgumentParser, argv: list[str] | None, positive: tuple[str, ...], run, report) -> int:
    """A sub-benchmark's main: parse, check that `positive` flags are >= 1, run, report, --json."""
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for flag in positive:
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    out = report(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _worker(job: dict, threads: int) -> dict:
    cmd = [sys.executable, "-m", "sparsekv.tools.bench_worker", json.dumps(job), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_runs(job: dict, threads: int, repeats: int) -> dict:
    runs = [_worker(job, threads) for _ in range(repeats)]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key in ("ms", "peak_rss_mb", "bytes_per_step", "decode_ms"):
        if key in out:
            out[key] = statistics.median(r[key] for r in ok)
    out["tokens_per_s"] = tokens_timed(ok[0]) / (out["ms"] / 1000)
    return out


def tokens_timed(run: dict) -> float:
    """Tokens one timed `ms` covers (1 for a decode step, the context for a prefill). The median run's
    rate is derived from the median ms: medians taken apart disagree with an even number of runs."""
    return run["tokens_per_s"] * run["ms"] / 1000


def _fmt(r: dict, key: str, spec: str = ".2f") -> str:
    return r.get("error", "")[:40] if "error" in r else format(r[key], spec)


def _ratio(base: dict, new: dict, key: str = "ms") -> str:
    if "error" in base or "error" in new or not new.get(key):
        return "-"
    return f"{base[key] / new[key]:.1f}x"


def _bandwidth(r: dict, machine_gbps: float) -> str:
    if "error" in r or not r.get("bytes_per_step"):
        return "-"
    gbps = r["bytes_per_step"] / (r["ms"] / 1000) / 1e9
    return f"{gbps:.1f} GB/s ({100 * gbps / machine_gbps:.0f}%)"


def _machine_bandwidth(threads: int) -> float:
    from .hardware import measure_this_cpu
    return measure_this_cpu(quick=True, threads=threads).mem_bw / 1e9


def _planner(args, ckpt: str):
    """`sparsekv plan`'s decode-step prediction for this checkpoint on this CPU (issue 6 calibration)."""
    from ..config import ModelConfig
    from .hardware import measure_this_cpu
    from .plan_decode import predict_decode_step_ms
    cfg, hw = ModelConfig.from_json(ckpt), measure_this_cpu(threads=args.threads)
    return lambda ctx: predict_decode_step_ms(cfg, ctx, hw, attention_mode=args.attention)


def _against_transformers(args, job: dict) -> tuple[dict, dict]:
    """sparsekv (median of --repeats) and transformers (one run) on the same job: the same decode steps,
    of which both drop the same warm-up (bench_worker.steady_ms)."""
    ours = _median_runs({**job, "engine": "sparsekv", "attention": args.attention}, args.threads, args.repeats)
    if job["context"] > args.transformers_max_context:
        return ours, {"error": "skipped"}
    return ours, _worker({**job, "engine": "transformers"}, args.threads)  # the same steps and warm-up


def bench_decode(args, ckpt: str) -> list[dict]:
    console, bw = report_console(), _machine_bandwidth(args.threads)
    predict = _planner(args, ckpt)
    threads = f"{args.threads} threads" if args.threads else "each engine's default threads"
    table = Table(title=f"decode, {args.preset}, {threads} (machine stream bandwidth {bw:.1f} GB/s)")
    for col in ("context", "sparsekv ms/token", "tokens/s", "peak RSS MB", "achieved bandwidth",
                "transformers ms/token", "transformers RSS MB", "speed-up", "plan ms (measured/plan)"):
        table.add_column(col)
    rows = []
    for ctx in args.contexts:
        ours, ref = _against_transformers(args, {"kind": "decode", "ckpt": ckpt, "context": ctx, "steps": args.steps})
        plan_ms = predict(ctx)
        rows.append({"context": ctx, "sparsekv": ours, "transformers": ref, "plan_ms": plan_ms})
        vs_plan = "-" if "error" in ours else f"{plan_ms:.2f} ({ours['ms'] / plan_ms:.2f})"
        table.add_row(str(ctx), _fmt(ours, "ms"), _fmt(ours, "tokens_per_s", ".1f"), _fmt(ours, "peak_rss_mb", ".0f"),
                      _bandwidth(ours, bw), _fmt(ref, "ms"), _fmt(ref, "peak_rss_mb", ".0f"), _ratio(ref, ours), vs_plan)
    console.print(table)
    ok = [r for r in rows if "error" not in r["sparsekv"]]
    for r in ok[1:]:
        console.print(f"flat decode: step time at {r['context']} / at {ok[0]['context']} = "
                      f"{r['sparsekv']['ms'] / ok[0]['sparsekv']['ms']:.2f}x")
    if args.profile:
        rows.append(profile_decode(args, ckpt, args.contexts[-1], console))
    return rows


PROFILE_KINDS = 12


def profile_decode(args, ckpt: str, context: int, console: Console) -> dict:
    """The decode step at `context` by torch op kind (bench_worker.profile_steps): the PROFILE_KINDS
    costliest, the rest summed in one row, and what the ops leave of the step: Python and dispatch."""
    job = {"kind": "decode", "engine": "sparsekv", "ckpt": ckpt, "context": context, "steps": 4,
           "attention": args.attention, "profile": args.profile}
    r = _worker(job, args.threads)
    if "error" in r:
        console.print(f"profile at {context}: {r['error']}")
        return {"context": context, "profile": r}
    step, ops = r["profile"]["step_ms"], r["profile"]["ops"]
    table = Table(title=f"decode step at {context} by op kind ({args.profile} steps under the profiler: "
                        f"{step:.2f} ms/step, its overhead included; {r['ms']:.2f} ms without)")
    for col in ("op kind", "self ms / step", "share of the step", "calls / step"):
        table.add_column(col)
    shown, rest = ops[:PROFILE_KINDS], ops[PROFILE_KINDS:]
    for name, ms, calls in shown:
        table.add_row(name, f"{ms:.3f}", f"{100 * ms / step:.1f} %", f"{calls:.0f}")
    table.add_row(f"{len(rest)} other kinds", f"{sum(o[1] for o in rest):.3f}",
                  f"{100 * sum(o[1] for o in rest) / step:.1f} %", f"{sum(o[2] for o in rest):.0f}")
    outside = step - sum(o[1] for o in ops)
    table.add_row("outside torch ops (Python, dispatch, profiler)", f"{outside:.3f}", f"{100 * outside / step:.1f} %", "")
    console.print(table)
    return {"context": context, "profile": r["profile"]}


def index_flops_per_pair(cfg) -> int:
    """FLOPs of one (query, key) q.k product of one lightning indexer: 2 x H_I x D_I."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim


def indexer_pair_flops(cfg, context: int) -> int:
    """FLOPs of the lightning indexer's q.k products over the causal (query, key) pairs of a prefill of
    `context` tokens, in each full layer. The quadratic part of a sparse prefill."""
    return len(cfg.full_layers) * context * (context + 1) // 2 * index_flops_per_pair(cfg)


def _compute_rate(r: dict, flops: int, machine_flops: float) -> str:
    if "error" in r:
        return "-"
    rate = flops / (r["ms"] / 1000)
    return f"{rate / 1e9:.1f} ({100 * rate / machine_flops:.0f}%)"


def bench_prefill(args, ckpt: str) -> list[dict]:
    """A prefill is compute-bound, so its roofline is the machine's fp32 matmul rate (measured now, same
    threads): the indexer's causal q.k FLOPs over the whole prefill time is a lower bound on how fast
    the scan runs, since that time also holds every other part of the prefill."""
    from ..config import ModelConfig
    from .hardware import measure_this_cpu
    console, cfg = report_console(), ModelConfig.from_json(ckpt)
    machine = measure_this_cpu(threads=args.threads).matmul_flops("float32")   # measured fp32 rate
    table = Table(title=f"prefill, {args.preset}, {args.threads} threads, chunk {args.chunk} "
                        f"(machine fp32 matmul {machine / 1e9:.0f} GFLOP/s)")
    for col in ("context", "sparsekv ms", "tokens/s", "peak RSS MB", "indexer GFLOP/s (of machine)",
                "then decode ms/token", "transformers ms", "tokens/s ", "RSS MB", "speed-up"):
        table.add_column(col)
    rows = []
    for ctx in args.contexts:
        job = {"kind": "prefill", "ckpt": ckpt, "context": ctx, "chunk": args.chunk, "decode_steps": args.decode_steps}
        ours, ref = _against_transformers(args, job)
        flops = indexer_pair_flops(cfg, ctx)
        rows.append({"context": ctx, "sparsekv": ours, "transformers": ref, "indexer_flops": flops,
                     "machine_flops": machine})
        decode = f"{ours['decode_ms']:.2f}" if "decode_ms" in ours else "-"
        table.add_row(str(ctx), _fmt(ours, "ms", ".0f"), _fmt(ours, "tokens_per_s", ".0f"), _fmt(ours, "peak_rss_mb", ".0f"),
                      _compute_rate(ours, flops, machine), decode, _fmt(ref, "ms", ".0f"), _fmt(ref, "tokens_per_s", ".0f"),
                      _fmt(ref, "peak_rss_mb", ".0f"), _ratio(ref, ours))
    console.print(table)
    return rows


MODES = {"dense MLA": ({"index_topk_pattern": "FFFF"}, "dense"),
         "DSA every layer": ({"index_topk_pattern": "FFFF"}, "sparse"),
         "DSA + IndexShare (FSSS)": ({"index_topk_pattern": "FSSS"}, "sparse")}


def bench_modes(args, ckpt: str) -> list[dict]:
    """Dense MLA vs DSA in every layer vs DSA + IndexShare, on one checkpoint with an indexer per layer."""
    console = report_console()
    table = Table(title=f"{args.kind} by attention mode, {args.preset}, {args.threads} threads")
    for col in ("context", "mode", "ms" if args.kind == "decode" else "ms (prefill)", "peak RSS MB",
                "vs dense MLA", "vs DSA every layer"):
        table.add_column(col)
    rows = []
    for ctx in args.contexts:
        res = {}
        for name, (override, attention) in MODES.items():
            if args.kind == "prefill" and attention == "dense" and not args.include_dense_prefill:
                res[name] = {"error": "skipped (use --include-dense-prefill)"}
                continue
            job = {"kind": args.kind, "engine": "sparsekv", "ckpt": ckpt, "context": ctx, "steps": args.steps,
                   "chunk": args.chunk, "attention": attention, "overrides": override}
            res[name] = _median_runs(job, args.threads, args.repeats)
        for name, r in res.items():
            table.add_row(str(ctx), name, _fmt(r, "ms"), _fmt(r, "peak_rss_mb", ".0f"),
                          _ratio(res["dense MLA"], r), _ratio(res["DSA every layer"], r))
        rows.append({"context": ctx, **res})
    console.print(table)
    return rows


def make_checkpoint(preset: str, directory: str, indexer_in_every_layer: bool = False) -> str:
    """The preset's checkpoint (tiny-bench: FSSS). `modes` needs an indexer in every layer and drops
    three of four with hf_overrides for its IndexShare run."""
    from .tiny import PRESETS, save_reference_checkpoint
    opts = dict(PRESETS[preset])
    if indexer_in_every_layer:
        opts["index_topk_pattern"] = "FFFF"
    save_reference_checkpoint(directory, "glm_moe_dsa", seed=0, **opts)
    return directory


def transformers_limit_arg(text: str) -> int:
    """`--transformers-max-context`: a token count (16K, 131072), or 0 for no transformers baseline at all."""
    if text.strip() == "0":
        return 0
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


KINDS = ("decode", "prefill", "modes")  # the benchmarks of this parser; SUB_BENCHMARKS have their own


def benchmark_names() -> list[str]:
    """Every `sparsekv bench NAME`."""
    return [*KINDS, *SUB_BENCHMARKS]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench", epilog="other benchmarks, each with its own options "
                                f"(sparsekv bench NAME --help): {', '.join(SUB_BENCHMARKS)}")
    p.add_argument("kind", metavar="BENCHMARK", choices=benchmark_names(),
                   help=f"{', '.join(KINDS)} (the options below), or one of the others, named first, each with "
                        f"its own options: {', '.join(SUB_BENCHMARKS)}")
    p.add_argument("--preset", default="tiny-bench", choices=BENCH_PRESETS)
    p.add_argument("--mode-kind", dest="mode_kind", default="decode", choices=["decode", "prefill"],
                   help="for `modes`: compare decode or prefill")
    p.add_argument("--contexts", type=token_list_arg, default="4K,16K", help="comma-separated token counts, e.g. 4K,16K,128K,1M")
    p.add_argument("--steps", type=at_least(1), default=16, help="decode steps measured per run")
    p.add_argument("--chunk", type=at_least(1), default=4096, help="prefill chunk tokens")
    p.add_argument("--decode-steps", type=at_least(0), default=0,
                   help="for `prefill`: then decode this many tokens on the prefilled cache (median ms/token)")
    p.add_argument("--attention", default="sparse", choices=["sparse", "dense"])
    p.add_argument("--repeats", type=at_least(1), default=3, help="runs per figure; the median is reported")
    p.add_argument("--threads", type=at_least(0), default=2,
                   help="torch threads of every run (0: each engine at its defaults, as LLM(path) and transformers)")
    p.add_argument("--transformers-max-context", type=transformers_limit_arg, default=parse_tokens("16K"),
                   help="run the transformers baseline up to this context (default 16K; 0: never)")
    p.add_argument("--include-dense-prefill", action="store_true")
    p.add_argument("--profile", type=at_least(0), default=0, metavar="STEPS",
                   help="for `decode`: profile this many steps at the largest context and print their time by op kind")
    p.add_argument("--json", type=output_path, default=None, help="also write the results to this JSON file")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


SUB_BENCHMARKS = {"tiers": "bench_tiers", "spec": "bench_spec", "indexer": "bench_indexer", "serve": "bench_serve",
                  "prefix": "bench_prefix", "batch": "bench_batch", "sampling": "bench_sampling",
                  "admission": "bench_admission", "kv-dtype": "bench_kv_dtype", "parallel": "bench_parallel",
                  "transfer": "bench_transfer", "weight-sync": "bench_weight_sync"}


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser `sparsekv bench ARGV` parses with, and the arguments it gets (a sub-benchmark's own
    parser without its name, else decode | prefill | modes's); nothing runs."""
    if argv and argv[0] in SUB_BENCHMARKS:
        return importlib.import_module(f".{SUB_BENCHMARKS[argv[0]]}", __package__).build_parser(), argv[1:]
    return build_parser(), argv


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUB_BENCHMARKS:
        module = importlib.import_module(f".{SUB_BENCHMARKS[argv[0]]}", __package__)
        try:
            return module.main(argv[1:])
        except (FileNotFoundError, ConfigError, ValueError) as e:   # e.g. --model pointing at no checkpoint
            print(f"sparsekv bench {argv[0]}: error: {engine_error(e, module.build_parser())}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kind in SUB_BENCHMARKS:  # after an option: its own parser never saw the arguments
        parser.error(f"{args.kind} takes its own options: put its name first, sparsekv bench {args.kind} [options]")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(args.preset, tmp, indexer_in_every_layer=args.kind == "modes")
        if args.kind == "modes":
            args.kind = args.mode_kind
            rows = bench_modes(args, ckpt)
        else:
            rows = (bench_decode if args.kind == "decode" else bench_prefill)(args, ckpt)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
