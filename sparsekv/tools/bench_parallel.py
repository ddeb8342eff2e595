"""`sparsekv bench parallel`: the same workload on one rank, at tensor parallelism 2 (with and without
expert parallelism), and with data-parallel attention on 2 ranks with expert parallelism
(torch.distributed, gloo on CPU).

`--batch` requests of `--prompt-tokens` random tokens are prefilled, then `--steps` decode steps are
timed. Each layout runs in a fresh process (peak memory is per process). Printed per layout: ms per
decode step against the one-rank run, the bytes each rank sent per token it ran (all-reduces; the MoE's
all-gather and reduce-scatter with data parallelism) and per sampled row (the lm_head's all-gather),
next to the planner's prediction (cache/sizing.py), the weight bytes and peak RSS of each rank, and
whether the greedy tokens equal the one-rank run's.

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

from ..engine_args import at_least, output_path
from .bench import report_console, run_bench

LAYOUTS = {"1 rank": {}, "tp 2": dict(tensor_parallel_size=2),
           "tp 2 + ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "dp 2 + ep": dict(data_parallel_size=2, enable_expert_parallel=True)}


def run_layout(args) -> dict:
    """One layout in this process: prefill, timed decode steps, per-rank figures (public calls only:
    a data-parallel engine answers the same ones)."""
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
        ids = [f"r{i}" for i in range(args.batch)]
        for rid in ids:
            engine.add_request(rid, torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist(), params)
        outs, started = {}, set()
        while len(started) < args.batch:  # every prompt prefilled, its first token out
            for o in engine.step():
                started.add(o.request_id)
                outs[o.request_id] = o
        t0 = time.perf_counter()
        for _ in range(args.steps):
            outs.update({o.request_id: o for o in engine.step()})
        ms = 1000 * (time.perf_counter() - t0) / args.steps
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        ranks = llm.stats()["ranks"]
    finally:
        llm.close()
    fed = args.batch * (args.prompt_tokens + args.steps)  # rows the model ran (the last token is never fed)
    sampled = args.batch * (args.steps + 1)
    return {"ms_per_step": ms, "tokens": [outs[r].token_ids for r in ids], "ranks": ranks,
            "rows_fed": fed, "rows_sampled": sampled}


def _predicted(model: str, layout: dict) -> dict:
    """The planner's bytes per rank: per token fed (all-reduces; with data parallelism the MoE's
    all-gather + reduce-scatter, the exchange this engine uses), and per sampled row (the lm_head's
    all-gather)."""
    from sparsekv.cache.sizing import Parallelism, collectives, gather_scatter_bytes
    from sparsekv.config import ModelConfig
    cfg = ModelConfig.from_json(model)
    dp = layout.get("data_parallel_size", 1)
    par = Parallelism(tp=layout.get("tensor_parallel_size", 1), dp=dp, ep=layout.get("enable_expert_parallel", False))
    out = {"per_token": 0.0, "per_sampled_row": 0.0}
    for c in collectives(cfg, par, "fp32"):
        if c.op == "all_reduce":
            out["per_token"] += c.per_token_all
        elif c.op == "all_gather":
            out["per_sampled_row"] += c.per_token_all
    if dp > 1 and par.ep:
        out["per_token"] += gather_scatter_bytes(cfg, dp, 4) * cfg.mlp_layer_types.count("sparse")
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
    for col in ("layout", "ms / step", "vs 1 rank", "sent per token run (planner)", "sent per sampled row (planner)",
                "weights per rank", "peak RSS per rank", "same tokens"):
        table.add_column(col)
    summary = {}
    for name, r in layouts.items():
        sent = r["ranks"][0]["bytes_sent"]
        held = r["rows_fed"] / LAYOUTS[name].get("data_parallel_size", 1)  # rows rank 0 ran (equal shares)
        per_token = sum(v for k, v in sent.items() if k != "all_gather") / held
        per_row = sent.get("all_gather", 0) / r["rows_sampled"]
        same = r["tokens"] == base["tokens"]
        summary[name] = {"ms_per_step": r["ms_per_step"], "sent_per_token": per_token, "sent_per_sampled_row": per_row,
                         "predicted": r["predicted"], "weight_bytes": [x["weight_bytes"] for x in r["ranks"]],
                         "peak_rss_bytes": [x["peak_rss_bytes"] for x in r["ranks"]], "identical_tokens": same}
        table.add_row(name, f"{r['ms_per_step']:.1f}", f"{base['ms_per_step'] / r['ms_per_step']:.2f}x",
                      f"{per_token:,.0f} ({r['predicted']['per_token']:,.0f})",
                      f"{per_row:,.0f} ({r['predicted']['per_sampled_row']:,.0f})",
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
    p.add_argument("--steps", type=at_least(1), default=32, help="decode steps timed")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads per rank")
    p.add_argument("--layout", default=None, choices=list(LAYOUTS), help=argparse.SUPPRESS)  # one layout, in-process
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("batch", "prompt_tokens", "steps"), _run_or_layout, report)
