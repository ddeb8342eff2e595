"""`sparsekv bench prefix`: the prefix cache against no cache, in the same run.

The workload shares a long prefix, as a system prompt or a document asked several questions does:
each request is `--prefix-tokens` tokens of one held-out standard-library file (the bundled model's
evaluation split; random token ids with `--model` on a checkpoint without a tokenizer), then a
`--suffix-tokens` question of its own, then `--max-tokens` greedy tokens. Requests run one at a time,
both engines interleaved so machine noise hits both alike. Printed per mode: time to first token
(median), prompt tokens computed per request, prefix-cache hit rate, achieved bandwidth (bytes a
prefill step reads: weights and the KV at the prompt's length, over its time) against the machine's,
the speed-up, and whether greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from .bench import report_console, run_bench


def workload(engine, args) -> list[list[int]]:
    import torch
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    if engine.tokenizer is not None:
        from .bench_spec import held_out_prompts
        prefix = held_out_prompts(engine.tokenizer, 1, args.prefix_tokens)[0]
    else:
        prefix = torch.randint(1, vocab, (args.prefix_tokens,), generator=g).tolist()
    return [prefix + torch.randint(1, vocab, (args.suffix_tokens,), generator=g).tolist() for _ in range(args.requests)]


def first_token(engine, rid: str, prompt: list[int], params) -> dict:
    """Run one request; time to its first token, prefill steps, the output."""
    engine.add_request(rid, prompt, params)
    t0, ttft, steps, out = time.perf_counter(), None, 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += ttft is None
        if outs and ttft is None:
            ttft = time.perf_counter() - t0
        out = outs[-1] if outs else out
    return {"ttft_s": ttft, "prefill_steps": steps, "cached": out.num_cached_tokens, "tokens": out.token_ids}


def run(args) -> dict:
    import torch
    from sparsekv import LLM, SamplingParams
    from sparsekv.paths import default_model_path
    from .bench import _machine_bandwidth
    from .bench_worker import decode_bytes_per_step
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    common = dict(max_model_len=args.prefix_tokens + args.suffix_tokens + args.max_tokens + 8, max_num_seqs=1,
                  prefill_chunk_tokens=args.chunk, max_num_batched_tokens=args.chunk)
    if args.kv_tiering:
        common["kv_tiering"] = True
    modes = {"no cache": LLM(path, enable_prefix_caching=False, **common).engine,
             "prefix cache": LLM(path, enable_prefix_caching=True, **common).engine}
    prompts = workload(modes["no cache"], args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs = {name: [] for name in modes}
    for i, prompt in enumerate(prompts):
        for name, engine in modes.items():
            runs[name].append(first_token(engine, f"r{i}", prompt, params))
    step_bytes = decode_bytes_per_step(modes["no cache"], len(prompts[0]))
    stats = modes["prefix cache"].stats()
    return {"requests": len(prompts), "prompt_tokens": len(prompts[0]), "runs": runs, "step_bytes": step_bytes,
            "hit_rate": stats["prefix_cache_hit_rate"], "machine_gbps": _machine_bandwidth(args.threads),
            "kv_tiering": args.kv_tiering}


def report(result: dict) -> dict:
    runs, summary, n = result["runs"], {}, result["prompt_tokens"]
    for name, rs in runs.items():
        warm = rs[1:] if len(rs) > 1 else rs  # the first request fills the cache: the steady state is after it
        ttft = statistics.median(r["ttft_s"] for r in warm)
        steps = statistics.median(r["prefill_steps"] for r in warm)
        summary[name] = {"ttft_ms": 1000 * ttft, "computed_tokens": n - statistics.median(r["cached"] for r in warm),
                         "gbps": result["step_bytes"] * steps / ttft / 1e9}
    identical = sum(a["tokens"] == b["tokens"] for a, b in zip(runs["no cache"], runs["prefix cache"]))
    tiering = ", tiered KV cache" if result["kv_tiering"] else ""
    table = Table(title=f"prefix cache: {result['requests']} requests of {n} prompt tokens sharing a prefix, one at a "
                        f"time{tiering} (medians after the first request)")
    for col in ("mode", "time to first token", "prompt tokens computed", "achieved bandwidth", "speed-up"):
        table.add_column(col)
    base = summary["no cache"]["ttft_ms"]
    for name, s in summary.items():
        table.add_row(name, f"{s['ttft_ms']:.1f} ms", f"{s['computed_tokens']:.0f} of {n}",
                      f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{base / s['ttft_ms']:.2f}x")
    report_console().print(table)
    print(f"prefix-cache hit rate (all requests, the first included): {100 * result['hit_rate']:.1f}%; "
          f"greedy outputs identical: {identical} of {result['requests']}")
    return {"summary": summary, "identical": identical, "requests": result["requests"], "prompt_tokens": n,
            "hit_rate": result["hit_rate"], "kv_tiering": result["kv_tiering"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparsekv bench prefix", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    p.add_argument("--kv-tiering", action="store_true", help="both modes with the tiered KV cache")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return run_bench(p, argv, ("requests", "prefix_tokens", "suffix_tokens", "max_tokens", "chunk"), run, report)
