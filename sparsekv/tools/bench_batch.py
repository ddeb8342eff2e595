"""`sparsekv bench batch`: continuous-batching decode of many short requests, the case most chat
traffic is in: contexts below top-k, where DSA attends to every entry (the dense regime).

`--batch` requests of `--prompt-tokens` random tokens each are prefilled, then `--steps` decode
steps of the whole batch are timed, twice per run and interleaved: with the dense-regime decodes
batched (`batch_dense_decodes`, the default) and one request at a time (the path before
it, the baseline). Printed: ms per step, tokens/s, the speed-up, achieved bandwidth (weights plus
every request's latents and indexer keys read per step, over the step time) against the machine's,
and whether the two paths produced the same greedy tokens and logprobs.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from .bench import report_console, run_bench

MODES = {"one request at a time": False, "batched": True}


def decode_run(engine, args, batched: bool, run: int) -> dict:
    """Prefill the batch, time `--steps` decode steps, finish; ms/step and the outputs."""
    import torch
    from sparsekv import SamplingParams
    g = torch.Generator().manual_seed(run)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = [f"{run}-{batched}-{i}" for i in range(args.batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first token)
    assert len(engine.scheduler.running) == args.batch, "the whole batch decodes together"
    outs, t0 = {}, time.perf_counter()
    for _ in range(args.steps):
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return {"ms_per_step": ms, "tokens": [outs[r].token_ids for r in ids], "logprobs": [outs[r].logprobs for r in ids]}


def run(args) -> dict:
    import torch
    from sparsekv import LLM
    from sparsekv.paths import default_model_path
    from .bench_tiers import device_bandwidth_gbps
    from .bench_worker import decode_bytes_per_step
    torch.set_num_threads(args.threads)
    max_len = args.prompt_tokens + args.steps + 8
    engines = {name: LLM(args.model or default_model_path(), device=args.device, max_model_len=max_len,
                         max_num_seqs=args.batch, max_num_batched_tokens=max(4096, args.prompt_tokens),
                         enable_prefix_caching=False, num_kv_pages=args.batch * -(-max_len // 64),  # the whole batch
                         batch_dense_decodes=batched).engine for name, batched in MODES.items()}
    engine = engines["batched"]
    topk = engine.model_config.index_topk
    if args.prompt_tokens + args.steps > topk:
        raise ValueError(f"--prompt-tokens + --steps must stay within top-k ({topk}): the dense regime")
    runs = {name: [] for name in MODES}
    for i in range(args.repeats):
        for name, batched in MODES.items():
            runs[name].append(decode_run(engines[name], args, batched, i))
    context = args.prompt_tokens + args.steps // 2
    return {"runs": runs, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
            "step_bytes": decode_bytes_per_step(engine, context, args.batch),
            "machine_gbps": device_bandwidth_gbps(args)}


def _logprob_gap(a: list, b: list) -> float:
    return max((abs(x[t] - y[t]) for ra, rb in zip(a, b) for x, y in zip(ra, rb) for t in x), default=0.0)


def report(result: dict) -> dict:
    runs, summary = result["runs"], {}
    for name, rs in runs.items():
        ms = statistics.median(r["ms_per_step"] for r in rs)
        summary[name] = {"ms_per_step": ms, "tokens_per_s": 1000 * result["batch"] / ms,
                         "gbps": result["step_bytes"] / ms / 1e6}
    base, new = runs["one request at a time"], runs["batched"]
    same_tokens = all(a["tokens"] == b["tokens"] for a, b in zip(base, new))
    gap = max(_logprob_gap(a["logprobs"], b["logprobs"]) for a, b in zip(base, new))
    table = Table(title=f"decode of {result['batch']} requests of {result['prompt_tokens']} prompt tokens "
                        f"(below top-k: every entry is read), {result['steps']} steps, medians of {len(base)} runs")
    for col in ("dense-regime decodes", "ms / step", "tokens / s", "achieved bandwidth", "speed-up"):
        table.add_column(col)
    ref = summary["one request at a time"]["ms_per_step"]
    for name, s in summary.items():
        table.add_row(name, f"{s['ms_per_step']:.2f}", f"{s['tokens_per_s']:.0f}",
                      f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{ref / s['ms_per_step']:.2f}x")
    console = report_console()
    console.print(table)
    console.print(f"greedy tokens identical: {same_tokens}; largest logprob difference: {gap:.2e}")
    return {"summary": summary, "batch": result["batch"], "prompt_tokens": result["prompt_tokens"],
            "steps": result["steps"], "identical_tokens": same_tokens, "max_logprob_diff": gap}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench batch", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda (on an accelerator the saving is in launches)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("batch", "prompt_tokens", "steps", "repeats"), run, report)
