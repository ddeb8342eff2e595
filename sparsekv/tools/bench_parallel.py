"""`sparsekv bench parallel`: the same workload on one rank, at tensor parallelism 2, and at tensor
parallelism 2 with expert parallelism (torch.distributed, gloo on CPU).

`--batch` requests of `--prompt-tokens` random tokens are prefilled, then `--steps` decode steps are
timed. Each layout runs in a fresh process (peak memory is per process). Printed per layout: ms per
decode step against the one-rank run, the bytes each rank all-reduced and all-gathered per token
next to the planner's prediction (cache/sizing.py `collectives`), the weight bytes and peak RSS of
each rank, and whether the greedy tokens equal the one-rank run's.

On a CPU with two cores no speed-up is expected: the figures that matter are the communication
volume matching the model, and each rank's weights being about 1/N of the sharded part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from rich.table import Table

from .bench import report_console, run_bench

LAYOUTS = {"1 rank": {}, "tp 2": dict(tensor_parallel_size=2),
           "tp 2 + ep": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


def run_layout(args) -> dict:
    """One layout in this process: prefill, timed decode steps, per-rank figures."""
    import torch
    from sparsekv import LLM, SamplingParams
    from sparsekv.paths import default_model_path
    torch.set_num_threads(args.threads)
    max_len = args.prompt_tokens + args.steps + 8
    llm = LLM(args.model or default_model_path(), max_model_len=max_len, max_num_seqs=args.batch,
              num_kv_pages=args.batch * -(-max_len // 64), enable_prefix_caching=False, num_threads=args.threads,
              **LAYOUTS[args.layout])  # pages for the whole batch: it decodes together
    engine = llm.engine
    try:
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        for i in range(args.batch):
            engine.add_request(f"r{i}", torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist(), params)
        outs = {}
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        ms = 1000 * (time.perf_counter() - t0) / args.steps
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        ranks = engine.executor.rank_stats()
    finally:
        llm.close()
    fed = args.batch * (args.prompt_tokens + args.steps)  # rows the model ran (the last token is never fed)
    sampled = args.batch * (args.steps + 1)
    return {"ms_per_step": ms, "tokens": [outs[f"r{i}"].token_ids for i in range(args.batch)], "ranks": ranks,
            "rows_fed": fed, "rows_sampled": sampled}


def _predicted(model: str, layout: dict) -> dict:
    """The planner's bytes per token per rank (all-reduces per fed row, the all-gather per sampled row)."""
    from sparsekv.cache.sizing import Parallelism, collectives
    from sparsekv.config import ModelConfig
    cfg = ModelConfig.from_json(model)
    par = Parallelism(tp=layout.get("tensor_parallel_size", 1), dp=1, ep=layout.get("enable_expert_parallel", False))
    out = {"all_reduce": 0.0, "all_gather": 0.0}
    for c in collectives(cfg, par, "fp32"):
        out[c.op] += c.per_token_all
    return out


def run(args) -> dict:
    from sparsekv.paths import default_model_path
    model = args.model or default_model_path()
    results = {}
    for name in LAYOUTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "sparsekv", "bench", "parallel", "--layout", name, "--json", f.name,
                   "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps),
                   "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            results[name] = json.load(open(f.name))
        results[name]["predicted"] = _predicted(model, LAYOUTS[name])
    return {"layouts": results, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "steps": args.steps}


def report(result: dict) -> dict:
    if "layouts" not in result:  # one layout, run by `run` in a child process
        return result
    layouts, base = result["layouts"], result["layouts"]["1 rank"]
    table = Table(title=f"{result['batch']} requests x {result['prompt_tokens']} prompt tokens, "
                        f"{result['steps']} decode steps timed")
    for col in ("layout", "ms / step", "vs 1 rank", "all-reduce B/token (planner)", "all-gather B/sampled row "
                "(planner)", "weights per rank", "peak RSS per rank", "same tokens"):
        table.add_column(col)
    summary = {}
    for name, r in layouts.items():
        sent = r["ranks"][0]["bytes_sent"]
        ar = sent.get("all_reduce", 0) / r["rows_fed"]
        ag = sent.get("all_gather", 0) / r["rows_sampled"]
        same = r["tokens"] == base["tokens"]
        summary[name] = {"ms_per_step": r["ms_per_step"], "all_reduce_per_token": ar, "all_gather_per_row": ag,
                         "predicted": r["predicted"], "weight_bytes": [x["weight_bytes"] for x in r["ranks"]],
                         "peak_rss_bytes": [x["peak_rss_bytes"] for x in r["ranks"]], "identical_tokens": same}
        table.add_row(name, f"{r['ms_per_step']:.1f}", f"{base['ms_per_step'] / r['ms_per_step']:.2f}x",
                      f"{ar:,.0f} ({r['predicted']['all_reduce']:,.0f})", f"{ag:,.0f} ({r['predicted']['all_gather']:,.0f})",
                      " / ".join(f"{x['weight_bytes'] / 1e6:.1f} MB" for x in r["ranks"]),
                      " / ".join(f"{x['peak_rss_bytes'] / 1e6:.0f} MB" for x in r["ranks"]), str(same))
    report_console().print(table)
    return {"summary": summary, "batch": result["batch"], "prompt_tokens": result["prompt_tokens"],
            "steps": result["steps"]}


def _run_or_layout(args) -> dict:
    return run_layout(args) if args.layout else run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--batch", type=int, default=4, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--layout", default=None, choices=list(LAYOUTS), help=argparse.SUPPRESS)  # one layout, in-process
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("batch", "prompt_tokens", "steps"), _run_or_layout, report)
