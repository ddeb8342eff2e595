"""`sparsekv bench admission`: reserving admission against optimistic admission with preemption.

`--requests` requests of `--prompt-tokens` random tokens, all queued at once, each with `max_tokens`
`--max-tokens` but finishing after its own length, drawn uniformly from [max/8, max] (seeded): a stop
string or an end-of-text the engine cannot foresee, modelled by ending the request when it reaches
its length. The pool holds `--fit` requests at their full prompt + max_tokens. Both engines run the same
requests, interleaved `--repeats` times. Printed per mode: time until every request is done, output
tokens per second, requests running per step (mean), preemptions, achieved bandwidth (weights and the
KV read by the decode steps, over the time) against the machine's, the speed-up, and whether every
greedy output is identical.

"reserve" (the default) reserves pages for prompt + max_tokens at admission: with max_tokens well
above what requests use, most of the pool is promised and idle. "optimistic" (vLLM's way) reserves
as tokens come and preempts the newest requests when pages run out; its full pages stay in the prefix
cache (a host tier here) and it is recomputed from them.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import _machine_bandwidth, report_console, run_bench

MODES = ("reserve", "optimistic")


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    import random
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    return prompts, [rng.randint(max(1, args.max_tokens // 8), args.max_tokens) for _ in range(args.requests)]


def serve_all(engine, prompts, lengths, args) -> dict:
    """Queue every request, step until each has produced its length; time, mean running, outputs."""
    from sparsekv import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats()["preemptions"]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs, running, t0 = {}, [], time.perf_counter()
    while engine.has_unfinished_requests():
        running.append(len(engine.scheduler.running))
        for out in engine.step():
            i = int(out.request_id[1:])
            if len(out.token_ids) >= lengths[i] and not out.finished:
                engine.abort(out.request_id)  # its stop: the engine could not have known the length
            if len(out.token_ids) >= lengths[i] or out.finished:
                outputs[i] = out.token_ids[:lengths[i]]
    return {"seconds": time.perf_counter() - t0, "mean_running": statistics.fmean(running),
            "preemptions": engine.stats()["preemptions"] - before, "tokens": [outputs[i] for i in range(len(prompts))]}


def run(args) -> dict:
    import torch
    from sparsekv import LLM
    from sparsekv.paths import default_model_path
    from .bench_worker import decode_bytes_per_step
    torch.set_num_threads(args.threads)
    total = args.prompt_tokens + args.max_tokens
    pages = args.fit * -(-total // 64)
    common = dict(max_model_len=total, max_num_seqs=args.requests, max_num_batched_tokens=2048, num_kv_pages=pages,
                  prefix_cache_host_bytes=1 << 30)
    engines = {mode: LLM(args.model or default_model_path(), kv_admission=mode, **common).engine for mode in MODES}
    prompts, lengths = workload(args, engines["reserve"].model_config.vocab_size)
    runs = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            runs[mode].append(serve_all(engine, prompts, lengths, args))
    context = args.prompt_tokens + sum(lengths) // len(lengths) // 2
    return {"runs": runs, "output_tokens": sum(lengths), "requests": args.requests, "fit": args.fit,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "read_bytes": sum(lengths) * decode_bytes_per_step(engines["reserve"], context),
            "machine_gbps": _machine_bandwidth(args.threads)}


def report(result: dict) -> dict:
    runs, summary = result["runs"], {}
    for mode, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        summary[mode] = {"seconds": seconds, "tokens_per_s": result["output_tokens"] / seconds,
                         "mean_running": statistics.median(r["mean_running"] for r in rs),
                         "preemptions": statistics.median(r["preemptions"] for r in rs),
                         "gbps": result["read_bytes"] / seconds / 1e9}
    identical = all(a["tokens"] == b["tokens"] for a, b in zip(runs["reserve"], runs["optimistic"]))
    table = Table(title=f"{result['requests']} requests of {result['prompt_tokens']} prompt tokens, max_tokens "
                        f"{result['max_tokens']} (each stops at its own length), a pool that fits {result['fit']} at "
                        f"full length (medians of {len(runs['reserve'])})")
    for col in ("admission", "all done", "output tokens / s", "running per step", "preemptions",
                "achieved bandwidth", "speed-up"):
        table.add_column(col)
    base = summary["reserve"]["seconds"]
    for mode, s in summary.items():
        table.add_row(mode, f"{s['seconds']:.2f} s", f"{s['tokens_per_s']:.0f}", f"{s['mean_running']:.1f}",
                      f"{s['preemptions']:.0f}", f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{base / s['seconds']:.2f}x")
    console = report_console()
    console.print(table)
    console.print(f"greedy outputs identical: {identical}")
    return {"summary": summary, "identical": identical, **{k: result[k] for k in ("requests", "fit", "prompt_tokens",
                                                                                  "max_tokens", "output_tokens")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench admission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--fit", type=int, default=4, help="requests the pool holds at prompt + max_tokens")
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("requests", "prompt_tokens", "max_tokens", "fit", "repeats"), run, report)
