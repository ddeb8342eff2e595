"""`sparsekv bench serve [--url URL]`: a load generator for a running server, modelled on `vllm bench serve`.

Prompts are token-id lists (exact lengths whatever the tokenizer): `--dataset random` draws each
length uniformly from [L(1-r), L(1+r)], `--dataset fixed` makes every prompt exactly L tokens, and
`--dataset shared-prefix` makes each one of `--num-prefixes` shared prefixes of `--prefix-len` tokens
followed by L - prefix-len tokens of its own (system prompts, documents asked several questions): the
prefix cache's share of prompt tokens served from device, host and disk is then reported. Requests
arrive as a Poisson process at `--request-rate` (inf: all at once), optionally capped at
`--max-concurrency` in flight. Every request streams with `ignore_eos`, so it yields exactly
`--output-len` tokens. Printed: request and token throughput; mean, median and p99 of TTFT, TPOT
(decode time per token after the first), ITL (gap between stream chunks) and end-to-end latency; and
the server's tier figures from /metrics before and after the run. `--api-key` may repeat: each
request is sent with one of the keys, drawn with `--tenant-weights` (equal by default), and the
latencies are also reported per key (per tenant: "key 1" is the first `--api-key`), e.g. a noisy
tenant sending 90 % of the requests against a quiet one.

`--workload interference` (bench_serve_interference.py) is another workload: running streams, alone and
then while long prompts arrive at a steady rate, and their inter-token latency under that prefill load
against its value without it; for a colocated server and for `sparsekv router` alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from ..engine_args import above, at_least, output_path, positive_finite
from .serve_client import StreamError, server_model, stream_chunks

TIER_METRICS = ("num_requests_running", "num_requests_waiting", "kv_pages_free", "device_kv_bytes",
                "device_latent_bytes", "device_indexer_bytes", "host_kv_bytes", "host_kv_budget_bytes",
                "tier_hits_total", "tier_misses_total", "h2d_bytes_total", "d2h_bytes_total",
                "prefix_cache_hits_total", "prefix_cache_hits_total:device", "prefix_cache_hits_total:host",
                "prefix_cache_hits_total:disk", "prefix_disk_pages",
                "prefix_cache_queries_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                "requests_rejected_total")


@dataclass
class RequestResult:
    prompt_len: int
    key: int = 0  # which --api-key sent it
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default: http://127.0.0.1:8000, where `sparsekv serve` listens by default)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", action="append", default=None,
                   help="repeat for several tenants: each request uses one key, drawn by --tenant-weights")
    p.add_argument("--tenant-weights", type=float, nargs="+", default=None,
                   help="one weight per --api-key: the share of requests each sends (default equal)")
    p.add_argument("--dataset", choices=["random", "fixed", "shared-prefix"], default="random")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: tokens shared (default 3/4 of L)")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5, help="random dataset: lengths in [L(1-r), L(1+r)]")
    p.add_argument("--request-rate", type=above(0.0), default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=at_least(1), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive_finite, default=600.0, help="seconds per request")
    p.add_argument("--json", type=output_path, default=None, metavar="FILE", help="also write the results as JSON")
    w = p.add_argument_group("--workload interference (bench_serve_interference.py): --streams running streams of "
                             "--input-len + --output-len tokens, alone, then while long prompts arrive")
    w.add_argument("--workload", choices=["requests", "interference"], default="requests")
    w.add_argument("--streams", type=int, default=4, help="running streams")
    w.add_argument("--long-prompt-len", type=int, default=16384)
    w.add_argument("--long-prompt-rate", type=float, default=0.1, help="long prompts per second, evenly spaced")
    w.add_argument("--num-long-prompts", type=int, default=3)
    w.add_argument("--long-output-len", type=int, default=1, help="tokens each long prompt generates")
    w.add_argument("--long-prompt-url", default=None, metavar="URL",
                   help="send the long prompts to this server instead of --url (the streams see its load, not "
                        "its transfers)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        print("sparsekv bench serve: --num-prompts, --input-len, --output-len must be >= 1 and "
              "--range-ratio in [0, 1)", file=sys.stderr)
        return 2
    args.prefix_len = args.input_len * 3 // 4 if args.prefix_len is None else args.prefix_len
    if args.dataset == "shared-prefix" and not (0 < args.prefix_len < args.input_len and args.num_prefixes >= 1):
        print("sparsekv bench serve: shared-prefix needs 0 < --prefix-len < --input-len and --num-prefixes >= 1",
              file=sys.stderr)
        return 2
    if args.workload == "interference":
        return _interference(args)
    keys = args.api_key or [None]
    if args.tenant_weights is not None and (len(args.tenant_weights) != len(keys) or min(args.tenant_weights) < 0
                                            or not sum(args.tenant_weights) > 0):
        print("sparsekv bench serve: --tenant-weights needs one non-negative weight per --api-key, not all 0",
              file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run(args))
    except httpx.HTTPError as e:
        print(f"sparsekv bench serve: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["completed"] else 1


def _interference(args) -> int:
    from . import bench_serve_interference as bench
    if min(args.streams, args.num_long_prompts, args.long_prompt_len, args.long_output_len) < 1 or \
            not args.long_prompt_rate > 0:
        print("sparsekv bench serve: --streams, --num-long-prompts, --long-prompt-len, --long-output-len must be "
              ">= 1 and --long-prompt-rate > 0", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(bench.run(args))
    except httpx.HTTPError as e:
        print(f"sparsekv bench serve: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(bench.format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["loaded"]["streams_ok"] == args.streams and not report["loaded"]["errors"] else 1


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key[0]}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model, vocab = await server_model(client, args.model)
        prompts = make_prompts(args, vocab)
        before = await scrape_tiers(client)
        peak: dict[str, float] = {}
        sampler = asyncio.create_task(sample_peaks(client, peak))
        t0 = time.perf_counter()
        results = await send_all(client, model, prompts, args)
        duration = time.perf_counter() - t0
        sampler.cancel()
        after = await scrape_tiers(client)
    return summarize(results, duration, before, after, peak, args, model)


async def sample_peaks(client: httpx.AsyncClient, peak: dict, interval: float = 0.25) -> None:
    """Gauges such as device_kv_bytes read 0 before and after a run; keep their peak while it runs."""
    while True:
        await asyncio.sleep(interval)
        try:
            for name, value in (await scrape_tiers(client)).items():
                pick = min if name == "kv_pages_free" else max  # the peak of use is the low of free pages
                peak[name] = pick(peak.get(name, value), value)
        except httpx.HTTPError:
            pass


def make_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo = max(1, int(args.input_len * (1 - args.range_ratio)))
    hi = max(lo, int(args.input_len * (1 + args.range_ratio)))
    if args.dataset == "shared-prefix":
        prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
        return [rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(args.input_len - args.prefix_len)]
                for _ in range(args.num_prompts)]
    lengths = [args.input_len if args.dataset == "fixed" else rng.randint(lo, hi) for _ in range(args.num_prompts)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assign_keys(args, n: int) -> list[int]:
    """Which --api-key sends each of the n requests (seeded; by --tenant-weights)."""
    keys = len(args.api_key or [None])
    return random.Random(args.seed + 2).choices(range(keys), weights=args.tenant_weights, k=n)


async def send_all(client, model: str, prompts: list[list[int]], args) -> list[RequestResult]:
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed + 1)

    async def limited(prompt, key):
        async with gate:
            return await send_one(client, model, prompt, args.output_len, key, args.api_key)

    tasks = []
    for prompt, key in zip(prompts, assign_keys(args, len(prompts))):
        tasks.append(asyncio.create_task(limited(prompt, key)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    return list(await asyncio.gather(*tasks))


async def send_one(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, key: int = 0,
                   api_keys: list[str] | None = None) -> RequestResult:
    res = RequestResult(len(prompt), key)
    start = last = time.perf_counter()
    try:
        async for now, chunk in stream_chunks(client, model, prompt, output_len, api_keys[key] if api_keys else None):
            if chunk.get("choices"):
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except StreamError as e:
        res.error = str(e)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def scrape_tiers(client: httpx.AsyncClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    r = await client.get("/metrics")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            name = s.name.removeprefix("sparsekv:")
            if s.name.startswith("sparsekv:") and name in TIER_METRICS:
                values[name] = values.get(name, 0.0) + s.value
                if "tier" in s.labels:  # prefix-cache hits: also by tier
                    key = f"{name}:{s.labels['tier']}"
                    values[key] = values.get(key, 0.0) + s.value
    return values


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ms = sorted(v * 1000 for v in values)
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms),
            "p99": ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]}


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict, peak: dict, args,
              model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "model": model, "dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]), "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]), "e2e_ms": _stats_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "by_key": _by_key(results) if len(args.api_key or ()) > 1 else {},
        "prefix_reuse": _prefix_reuse(before, after),
        "tiers_before": before, "tiers_after": after, "tiers_peak": peak,
        "requests": [{k: v for k, v in asdict(r).items() if k != "itls"} for r in results],
    }


def _by_key(results: list[RequestResult]) -> dict:
    """Latencies of each --api-key's requests (its tenant's)."""
    out = {}
    for key in sorted({r.key for r in results}):
        mine = [r for r in results if r.key == key]
        ok = [r for r in mine if r.ok]
        out[f"key {key + 1}"] = {"requests": len(mine), "completed": len(ok), "ttft_ms": _stats_ms([r.ttft for r in ok]),
                                 "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
                                 "e2e_ms": _stats_ms([r.e2e for r in ok])}
    return out


def _prefix_reuse(before: dict, after: dict) -> dict:
    """Shares of the run's prompt tokens served by the prefix cache, from device, host and disk."""
    queried = after.get("prefix_cache_queries_total", 0.0) - before.get("prefix_cache_queries_total", 0.0)
    def served(tier: str) -> float:
        key = f"prefix_cache_hits_total:{tier}"
        return after.get(key, 0.0) - before.get(key, 0.0)
    share = {tier: served(tier) / queried if queried else 0.0 for tier in ("device", "host", "disk")}
    return {**share, "total": sum(share.values()), "prompt_tokens": queried}


def format_report(rep: dict) -> str:
    def row(label, value):
        return f"{label:<40} {value}"

    rate = "inf" if rep["request_rate"] == float("inf") else f"{rep['request_rate']:g}"
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             row("Model:", rep["model"]),
             row("Dataset:", f"{rep['dataset']} (input {rep['input_len']}, output {rep['output_len']} tokens)"),
             row("Request rate (req/s):", rate), row("Max concurrency:", rep["max_concurrency"] or "none"),
             row("Successful requests:", rep["completed"]), row("Failed requests:", rep["failed"]),
             row("Benchmark duration (s):", f"{rep['duration_s']:.2f}"),
             row("Total input tokens:", rep["total_input_tokens"]),
             row("Total generated tokens:", rep["total_output_tokens"]),
             row("Request throughput (req/s):", f"{rep['request_throughput']:.2f}"),
             row("Output token throughput (tok/s):", f"{rep['output_throughput']:.2f}"),
             row("Total token throughput (tok/s):", f"{rep['total_token_throughput']:.2f}")]
    for key, title, name in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"), ("e2e_ms", "End-to-end Latency", "E2E")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        lines += [row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms):", f"{rep[key][stat]:.2f}")
                  for stat in ("mean", "median", "p99")]
    if rep["by_key"]:
        lines.append("{s:{c}^50}".format(s="Per tenant (--api-key)", c="-"))
        lines.append(f"{'key':<8} {'done':>9} {'TTFT median / p99 (ms)':>26} {'TPOT median / p99':>20} {'E2E p99':>10}")
        for name, k in rep["by_key"].items():
            lines.append(f"{name:<8} {k['completed']:>4}/{k['requests']:<4} "
                         f"{k['ttft_ms']['median']:>12.1f} / {k['ttft_ms']['p99']:<11.1f} "
                         f"{k['tpot_ms']['median']:>8.2f} / {k['tpot_ms']['p99']:<9.2f} {k['e2e_ms']['p99']:>10.1f}")
    lines.append("{s:{c}^50}".format(s="Tier figures from /metrics", c="-"))
    before, after, peak = rep["tiers_before"], rep["tiers_after"], rep["tiers_peak"]
    shown = [name for name in TIER_METRICS if name in before or name in after]
    width = max([36] + [len("sparsekv:" + name) + 1 for name in shown])
    lines.append(f"{'metric':<{width}} {'before':>13} {'after':>13} {'delta':>13} {'peak in run':>13}")
    for name in shown:
        b, a = before.get(name, 0.0), after.get(name, 0.0)
        p = f"{peak[name]:>13.0f}" if name in peak else f"{'-':>13}"
        lines.append(f"{'sparsekv:' + name:<{width}} {b:>13.0f} {a:>13.0f} {a - b:>+13.0f} {p}")
    reuse = rep["prefix_reuse"]
    if reuse["prompt_tokens"]:
        lines.append(row("Prefix reuse, device / host / disk / total:", f"{100 * reuse['device']:.1f}% / "
                         f"{100 * reuse['host']:.1f}% / {100 * reuse['disk']:.1f}% / "
                         f"{100 * reuse['total']:.1f}% of prompt tokens"))
    for err in rep["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 50)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
