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
import os
import statistics
import tempfile
import time

from rich.table import Table

from ..engine_args import at_least, output_path
from ..units import parse_bytes
from .bench import report_console, run_bench


def workload(engine, args) -> list[list[int]]:
    """`--requests` prompts: prefix i % rotate, then a suffix of their own."""
    import torch
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    if engine.tokenizer is not None:
        from .bench_spec import held_out_prompts
        prefixes = held_out_prompts(engine.tokenizer, args.rotate, args.prefix_tokens)
    else:
        prefixes = [torch.randint(1, vocab, (args.prefix_tokens,), generator=g).tolist() for _ in range(args.rotate)]
    if len(prefixes) < args.rotate:
        raise ValueError(f"--rotate {args.rotate}: only {len(prefixes)} held-out files have "
                         f"{args.prefix_tokens} tokens")
    return [prefixes[i % args.rotate] + torch.randint(1, vocab, (args.suffix_tokens,), generator=g).tolist()
            for i in range(args.requests)]


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


def engines(path: str, args, disk_dir: str) -> dict:
    """No cache, the prefix cache, and with --rotate > 1 (a pool that holds one prefix, so each request's
    prefix was evicted by the one before) the prefix cache with its host tier, and with its disk tier
    (no host tier: every evicted page is written to `disk_dir` and read back from there). --restart:
    also a new engine on a disk tier an earlier engine filled with the prefixes."""
    from sparsekv import LLM, SamplingParams
    tokens = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    common = dict(max_model_len=tokens + 8, max_num_seqs=1, prefill_chunk_tokens=args.chunk,
                  max_num_batched_tokens=args.chunk, kv_tiering=args.kv_tiering)
    if args.rotate > 1:  # room for one request and a page to spare
        pages = -(-tokens // 64) + 1
        common["num_kv_pages"] = pages
    modes = {"no cache": LLM(path, enable_prefix_caching=False, **common).engine,
             "prefix cache": LLM(path, enable_prefix_caching=True, **common).engine}
    if args.restart:  # another engine ran each prefix once and closed, saving its pages to the disk tier
        restart_dir = os.path.join(disk_dir, "restart")
        with LLM(path, enable_prefix_caching=True, prefix_cache_disk_path=restart_dir,
                 prefix_cache_disk_bytes=args.disk_bytes, **common) as filler:
            for prefix in {tuple(p[:args.prefix_tokens]) for p in workload(filler.engine, args)}:
                filler.generate([list(prefix) + [1]], SamplingParams(max_tokens=1, temperature=0.0))
        modes["disk tier, after a restart"] = LLM(path, enable_prefix_caching=True, prefix_cache_disk_path=restart_dir,
                                                  prefix_cache_disk_bytes=args.disk_bytes, **common).engine
    if args.rotate > 1:
        modes["prefix cache + host tier"] = LLM(path, enable_prefix_caching=True,
                                                prefix_cache_host_bytes=args.host_bytes, **common).engine
        modes["prefix cache + disk tier"] = LLM(path, enable_prefix_caching=True, prefix_cache_disk_path=disk_dir,
                                                prefix_cache_disk_bytes=args.disk_bytes, **common).engine
    return modes


def run(args) -> dict:
    import torch
    from sparsekv.paths import default_model_path
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="sparsekv-bench-prefix-") as disk_dir:
        modes = engines(args.model or default_model_path(), args, disk_dir)
        try:
            return measure(modes, args)
        finally:
            for engine in modes.values():
                engine.close()


def measure(modes: dict, args) -> dict:
    from sparsekv import SamplingParams
    from .bench import _machine_bandwidth
    from .bench_worker import decode_bytes_per_step
    prompts = workload(modes["no cache"], args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs = {name: [] for name in modes}
    for i, prompt in enumerate(prompts):
        for name, engine in modes.items():
            runs[name].append(first_token(engine, f"r{i}", prompt, params))
    hits = {name: {k: v for k, v in e.stats().items() if k.startswith("prefix_cache_hit")} for name, e in modes.items()}
    return {"requests": len(prompts), "prompt_tokens": len(prompts[0]), "rotate": args.rotate, "runs": runs,
            "step_bytes": decode_bytes_per_step(modes["no cache"], len(prompts[0])), "hits": hits,
            "machine_gbps": _machine_bandwidth(args.threads), "kv_tiering": args.kv_tiering}


def report(result: dict) -> dict:
    runs, summary, n, warmup = result["runs"], {}, result["prompt_tokens"], result["rotate"]
    for name, rs in runs.items():
        warm = rs[warmup:] if len(rs) > warmup else rs  # the first requests fill the cache
        ttft = statistics.median(r["ttft_s"] for r in warm)
        steps = statistics.median(r["prefill_steps"] for r in warm)
        hits = result["hits"][name]
        first = statistics.median(r["ttft_s"] for r in rs[:warmup])
        summary[name] = {"ttft_ms": 1000 * ttft, "first_ttft_ms": 1000 * first, "computed_tokens": n - statistics.median(r["cached"] for r in warm),
                         "gbps": result["step_bytes"] * steps / ttft / 1e9,
                         "hit_rate": hits.get("prefix_cache_hit_rate", 0.0),
                         "hit_tokens_device": hits.get("prefix_cache_hits_device", 0),
                         "hit_tokens_host": hits.get("prefix_cache_hits_host", 0),
                         "hit_tokens_disk": hits.get("prefix_cache_hits_disk", 0),
                         "identical": sum(a["tokens"] == b["tokens"] for a, b in zip(runs["no cache"], rs))}
    tiering = ", tiered KV cache" if result["kv_tiering"] else ""
    shared = f"{result['rotate']} prefixes in turn, a pool that holds one" if warmup > 1 else "one shared prefix"
    table = Table(title=f"prefix cache: {result['requests']} requests of {n} prompt tokens, {shared}, one at a "
                        f"time{tiering} (medians after the first {warmup}; first sighting: of the first {warmup})")
    for col in ("mode", "time to first token", "first sighting", "prompt tokens computed", "hits device / host / disk (tokens)",
                "achieved bandwidth", "speed-up", "greedy identical"):
        table.add_column(col)
    base = summary["no cache"]["ttft_ms"]
    for name, s in summary.items():
        table.add_row(name, f"{s['ttft_ms']:.1f} ms", f"{s['first_ttft_ms']:.1f} ms", f"{s['computed_tokens']:.0f} of {n}",
                      f"{s['hit_tokens_device']} / {s['hit_tokens_host']} / {s['hit_tokens_disk']}",
                      f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{base / s['ttft_ms']:.2f}x", f"{s['identical']} of {result['requests']}")
    report_console().print(table)
    return {"summary": summary, "requests": result["requests"], "prompt_tokens": n, "rotate": result["rotate"],
            "kv_tiering": result["kv_tiering"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench prefix", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunk", type=at_least(1), default=512, help="prefill chunk tokens")
    p.add_argument("--rotate", type=int, default=1,
                   help="prefixes taken in turn, with a pool that holds one (> 1 also measures the host tier)")
    p.add_argument("--host-bytes", type=parse_bytes, default=1 << 30, help="the host tier's budget with --rotate")
    p.add_argument("--disk-bytes", type=parse_bytes, default=1 << 30,
                   help="the disk tier's budget with --rotate (a temporary directory)")
    p.add_argument("--restart", action="store_true",
                   help="also a fresh engine on a disk tier an earlier engine filled: its first requests hit disk")
    p.add_argument("--kv-tiering", action="store_true", help="both modes with the tiered KV cache")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("requests", "prefix_tokens", "suffix_tokens", "max_tokens", "chunk", "rotate"), run,
                     report)
