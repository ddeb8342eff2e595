"""`sparsekv bench tiers`: the tiered KV cache against tiering off, measured in the same run.

Three parts (docs/tiers.md records figures and the commands that made them):

  * sweep (default): for each context x device buffer (multiples of top-k), device and host bytes
    per request, miss rate, transfer MB per token and decode ms per token, each with tiering off as
    the baseline. The history is filled synthetically (random latents and indexer keys written
    through the pool's own write path): a real prefill at 128K-1M would dominate the run and decode
    cost does not depend on the cached values. Miss rates on a random history are a worst case.
  * natural continuation: a real prefill of the model on a token prompt, then greedy decode; the
    steady-state miss rate at N = 2 x top-k. With --teacher-forced each step is fed the prompt
    file's own next token instead (a small model's greedy text soon repeats itself, which flatters
    the cache). With --fp8 also the top-k overlap and logprob change of FP8 indexer keys.
  * --concurrency: a device budget that holds exactly 4 requests of the given context with tiering
    off; how many are admitted with tiering on, aggregate decode tokens/s, p99 per-token latency at
    concurrency 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from datetime import date

from ..engine_args import at_least, output_path
from .bench import BENCH_PRESETS
from .bench_tiers_natural import natural
from .bench_tiers_setup import MB, delta, interleaved_step_ms, make_engine, miss_rate, p99, synthetic_admit
from .bench_worker import decode_bytes_per_step
from .plan_workload import parse_tokens, token_list_arg


# -- the sweep ------------------------------------------------------------------------------------
def measure_together(ckpt: str, context: int, steps: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Decode with every config on the same history, steps interleaved round-robin, so that load from
    anything else on the machine hits all of them alike."""
    engines = {name: make_engine(ckpt, context + steps + 8, **opts) for name, opts in configs.items()}
    for engine in engines.values():
        synthetic_admit(engine, "bench", context, steps + 4)
        engine.step()  # the first decode step (cold working set) is reported apart
    cold = {name: e.stats() for name, e in engines.items()}
    times = interleaved_step_ms(engines, steps)
    rows = {name: {**_row(context, times[name], cold[name], e.stats(), steps),
                   "bytes_per_step": decode_bytes_per_step(e, context)} for name, e in engines.items()}
    del engines
    gc.collect()
    return rows


def _row(context: int, times: list[float], before: dict, after: dict, steps: int) -> dict:
    return {"context": context, "ms": statistics.median(times), "p99_ms": p99(times),
            "device_kv_bytes": after["device_kv_bytes"], "device_latent_bytes": after["device_latent_bytes"],
            "device_indexer_bytes": after["device_indexer_bytes"], "host_kv_bytes": after.get("host_kv_bytes", 0),
            "miss_rate": miss_rate(before, after), "first_step_misses": before.get("tier_misses", 0),
            "transfer_mb_per_token": (delta(before, after, "h2d_bytes") + delta(before, after, "d2h_bytes")) / steps / MB}


def sweep(args, ckpt: str, topk: int) -> list[dict]:
    rows, machine = [], device_bandwidth_gbps(args)
    print(f"device memory bandwidth {machine:.1f} GB/s")
    for context in args.contexts:
        configs = {"off": dict(selector=args.selector, device=args.device)}
        configs.update({m: dict(selector=args.selector, device=args.device, kv_tiering=True,
                                device_buffer_tokens=m * topk)
                        for m in args.buffers})
        measured = measure_together(ckpt, context, args.steps, configs)
        base = measured.pop("off")
        rows.append({**base, "tiering": "off", "buffer": None})
        _print_row(rows[-1], base, machine)
        for mult, row in measured.items():
            rows.append({**row, "tiering": "on", "buffer": mult * topk, "buffer_x_topk": mult})
            _print_row(rows[-1], base, machine)
    return rows


def _print_row(r: dict, base: dict, machine_gbps: float) -> None:
    label = "off" if r["tiering"] == "off" else f"N={r['buffer']}"
    gbps = r["bytes_per_step"] / (r["ms"] / 1000) / 1e9
    print(f"{r['context']:>8} {label:>7}  device {r['device_kv_bytes'] / MB:9.2f} MB "
          f"(latent {r['device_latent_bytes'] / MB:8.2f}, x{r['device_kv_bytes'] / base['device_kv_bytes']:.3f} of off)  "
          f"host {r['host_kv_bytes'] / MB:9.2f} MB  miss {100 * r['miss_rate']:5.1f}%  "
          f"{r['transfer_mb_per_token']:7.3f} MB/token  {r['ms']:8.2f} ms/token (x{r['ms'] / base['ms']:.2f} of off, "
          f"reads {gbps:.1f} GB/s = {100 * gbps / machine_gbps:.0f}%)",
          flush=True)


# -- fixed device budget --------------------------------------------------------------------------
def concurrency(args, ckpt: str) -> dict:
    from sparsekv.cache.sizing import index_bytes_per_token, latent_bytes_per_token
    from sparsekv.config import ModelConfig
    cfg, context, steps, page = ModelConfig.from_json(ckpt), args.concurrency_context, args.steps, 64
    tokens = -(-(context + steps + 8) // page) * page
    budget = args.fit * tokens * (latent_bytes_per_token(cfg, cfg.latent_dim * 4) + index_bytes_per_token(cfg, "fp32"))
    opts = dict(device_kv_budget_bytes=budget, max_num_seqs=args.max_requests, selector=args.selector,
                device=args.device)
    configs = {"off": opts, "on": dict(opts, kv_tiering=True)}
    # The batching ceiling: tiering off with device memory for every submitted request (no budget).
    unbounded = dict(opts, device_kv_budget_bytes=None, num_kv_pages=(args.max_requests + 1) * tokens // page)
    result = {"context": context, "device_kv_budget_bytes": budget, "submitted": args.max_requests}
    full = _interleaved(ckpt, context, steps, args.max_requests, {**configs, "off_unbounded": unbounded})
    single = _interleaved(ckpt, context, args.latency_steps, 1, configs)
    result["off_unbounded"] = full["off_unbounded"]
    result["machine_gbps"] = machine = device_bandwidth_gbps(args)
    for name in configs:
        result[name] = {**full[name], "c1": single[name]}
        r = result[name]
        print(f"tiering {name}: {r['admitted']} admitted, {r['tokens_per_s']:.1f} decode tokens/s aggregate "
              f"(p99 step {r['p99_ms']:.1f} ms; reads {r['achieved_gbps']:.1f} GB/s, "
              f"{100 * r['achieved_gbps'] / machine:.0f}% of the device's {machine:.1f}), "
              f"device {r['device_kv_bytes'] / MB:.1f} MB, host "
              f"{r['host_kv_bytes'] / MB:.1f} MB; concurrency 1: p99 {r['c1']['p99_ms']:.2f} ms/token, "
              f"median {r['c1']['median_ms']:.2f}", flush=True)
    on, off = result["on"], result["off"]
    result["admitted_ratio"] = on["admitted"] / off["admitted"]
    result["throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    result["p99_ratio_c1"] = on["c1"]["p99_ms"] / off["c1"]["p99_ms"]
    result["ceiling_ratio"] = result["off_unbounded"]["tokens_per_s"] / off["tokens_per_s"]
    print(f"tiering on / off: admitted x{result['admitted_ratio']:.2f}, aggregate decode tokens/s "
          f"x{result['throughput_ratio']:.2f}, p99 per-token latency at concurrency 1 x{result['p99_ratio_c1']:.3f}")
    print(f"batching ceiling: tiering off with unbounded device memory, {result['off_unbounded']['admitted']} requests: "
          f"{result['off_unbounded']['tokens_per_s']:.1f} tokens/s (reads {result['off_unbounded']['achieved_gbps']:.1f} GB/s), "
          f"x{result['ceiling_ratio']:.2f} of the budgeted "
          f"baseline; tiering reaches {100 * result['throughput_ratio'] / result['ceiling_ratio']:.0f}% of it")
    return result


def _interleaved(ckpt: str, context: int, steps: int, submit: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Admit up to `submit` requests per config, then decode all configs with interleaved steps."""
    engines, admitted = {}, {}
    for name, opts in configs.items():
        engines[name] = make_engine(ckpt, context + steps + 8, **opts)
        admitted[name] = sum(synthetic_admit(engines[name], f"r{i}", context, steps + 4) for i in range(submit))
        engines[name].step()  # first decode step: cold working sets
    times = interleaved_step_ms(engines, steps)
    out = {}
    for name, engine in engines.items():
        stats, t = engine.stats(), times[name]
        read = decode_bytes_per_step(engine, context, admitted[name]) * steps
        out[name] = {"admitted": admitted[name], "tokens_per_s": admitted[name] * steps / (sum(t) / 1000),
                     "p99_ms": p99(t), "median_ms": statistics.median(t), "device_kv_bytes": stats["device_kv_bytes"],
                     "host_kv_bytes": stats.get("host_kv_bytes", 0), "achieved_gbps": read / (sum(t) / 1000) / 1e9}
    del engines
    gc.collect()
    return out


def device_bandwidth_gbps(args) -> float:
    import torch
    from .hardware import device_read_bandwidth
    return device_read_bandwidth(torch.device(args.device), args.threads, quick=True) / 1e9


# -- plots and entry point ------------------------------------------------------------------------
def plot(rows: list[dict], out_dir: str, natural: dict | None = None) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    on = [r for r in rows if r["tiering"] == "on"]
    paths = [os.path.join(out_dir, "tiers_miss_rate.png"), os.path.join(out_dir, "tiers_device_bytes.png")]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for context in sorted({r["context"] for r in on}):
        pts = sorted((r["buffer_x_topk"], 100 * r["miss_rate"]) for r in on if r["context"] == context)
        ax.plot(*zip(*pts), marker="o", label=f"{context // 1024}K")
    if natural:
        pts = sorted((m, 100 * r) for m, r in natural["miss_rate_by_buffer"].items())
        ax.plot(*zip(*pts), marker="s", linestyle="--", label=f"natural, {natural['prompt_tokens']} prompt")
    ax.set(xlabel="device buffer N / top-k", ylabel="miss rate (%)", title="decode miss rate vs device buffer")
    ax.legend(title="context")
    fig.tight_layout(), fig.savefig(paths[0], dpi=120), plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, sel in [("off", lambda r: r["tiering"] == "off"), ("on, 2x top-k", lambda r: r.get("buffer_x_topk") == 2)]:
        pts = sorted((r["context"], r["device_kv_bytes"] / MB) for r in rows if sel(r))
        lat = sorted((r["context"], r["device_latent_bytes"] / MB) for r in rows if sel(r))
        if pts:
            ax.loglog(*zip(*pts), marker="o", label=f"tiering {label}: latent + indexer")
            ax.loglog(*zip(*lat), marker="x", linestyle="--", label=f"tiering {label}: latent")
    ax.set(xlabel="context (tokens)", ylabel="device MB per request", title="device KV bytes vs context")
    ax.legend(fontsize=7)
    fig.tight_layout(), fig.savefig(paths[1], dpi=120), plt.close(fig)
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench tiers")
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model, else a random --preset)")
    p.add_argument("--preset", default=None, choices=BENCH_PRESETS,
                   help="a random checkpoint of this shape instead of the bundled model")
    p.add_argument("--contexts", type=token_list_arg, default="8K,32K,128K", help="e.g. 8K,32K,128K,1M")
    p.add_argument("--buffers", type=multiples_arg, default="1,2,4",
                   help="device buffer sizes as multiples of top-k (each >= 1: N >= top-k)")
    p.add_argument("--selector", default="dsa", choices=["dsa", "quest"])
    p.add_argument("--steps", type=at_least(1), default=32, help="decode steps measured per figure")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--latency-steps", type=at_least(1), default=1000, help="--concurrency: steps for p99 at concurrency 1")
    p.add_argument("--natural-context", type=parse_tokens, default=parse_tokens("2K"))
    p.add_argument("--natural-steps", type=at_least(1), default=96)
    p.add_argument("--warmup", type=at_least(0), default=16,
                   help="decode steps before the steady state (fewer than --natural-steps)")
    p.add_argument("--prompt-file", default=None, help="text for the natural continuation (needs a tokenizer)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="natural continuation: feed the prompt file's own next tokens instead of greedy ones")
    p.add_argument("--fp8", action="store_true", help="also measure FP8 indexer keys on the natural continuation")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-natural", action="store_true")
    p.add_argument("--concurrency", action="store_true", help="fixed device budget mode")
    p.add_argument("--concurrency-context", type=parse_tokens, default=parse_tokens("64K"))
    p.add_argument("--fit", type=at_least(1), default=4, help="requests the budget holds with tiering off")
    p.add_argument("--max-requests", type=at_least(1), default=32, help="requests submitted in --concurrency mode")
    p.add_argument("--plot-dir", default="bench_tiers_plots")
    p.add_argument("--json", type=output_path, default=None)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def multiples_arg(text: str) -> list[int]:
    """`--buffers 1,2,4`: positive whole multiples of top-k (a buffer below top-k is a configuration error)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"each multiple of top-k must be >= 1, got {text!r}")
    return values


def _checkpoint(args, tmp: str) -> str:
    """--model, else a random --preset checkpoint, else the bundled model (tiny-bench if none)."""
    if args.model:
        return args.model
    if args.preset is None:
        try:
            from sparsekv.paths import default_model_path
            return default_model_path()
        except FileNotFoundError:
            args.preset = "tiny-bench"
            print("(no bundled model: using a random tiny-bench checkpoint)")
    from .bench import make_checkpoint
    return make_checkpoint(args.preset, tmp)


def main(argv: list[str] | None = None) -> int:
    import torch
    from sparsekv.config import ModelConfig
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.concurrency or args.skip_natural) and args.warmup >= args.natural_steps:
        parser.error(f"--warmup ({args.warmup}) must be below --natural-steps ({args.natural_steps}): "
                     "the steady-state miss rate is measured after the warm-up")
    torch.set_num_threads(args.threads)
    report = {"command": "sparsekv bench tiers " + " ".join(argv), "date": date.today().isoformat(),
              "threads": args.threads, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(args, tmp)
        topk = ModelConfig.from_json(ckpt).index_topk
        report["model"], report["index_topk"] = args.model or args.preset or ckpt, topk
        if args.concurrency:
            report["concurrency"] = concurrency(args, ckpt)
        else:
            if not args.skip_natural:
                report["natural"] = natural(args, ckpt, topk)
            if not args.skip_sweep:
                report["sweep"] = sweep(args, ckpt, topk)
                report["plots"] = plot(report["sweep"], args.plot_dir, report.get("natural"))
                print("plots:", ", ".join(report["plots"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
