"""`sparsekv bench kv-dtype`: FP8 latents (`--kv-cache-dtype fp8`) against the model dtype, in one run.

Three figures, each against latents in the model dtype (the baseline) measured in the same run:

* **capacity**: latent + indexer-key bytes per token, and the tokens a `--device-budget` holds, for
  this model and at GLM-5's geometry in bfloat16 (1,152 B -> 656 B of latents per token and layer);
* **quality**: the text's first `--context` tokens fed as a prompt with prompt logprobs (teacher
  forcing: every position scored against the file's own next token, through chunked prefill and the
  sparse regime past top-k): mean / p99 / max |Δ logprob| of the actual tokens, and how often the
  most probable next token agrees; then `--decode-steps` greedy tokens after it, and where (if
  anywhere) the two greedy continuations part;
* **speed**: decode ms per token at that context (medians of `--repeats`, interleaved), and the
  achieved bandwidth of a decode step (weights + the selected latents and the indexer keys read)
  against the machine's.

The default text is the interpreter's own `json/decoder.py` (any file: `--text-file`); a checkpoint
without a tokenizer (`sparsekv make-tiny-model`) gets seeded random tokens, which time the decode
but make the quality figures those of a random model.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time
from types import SimpleNamespace

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import _machine_bandwidth, report_console, run_bench

DTYPES = ("auto", "fp8")


def default_text() -> str:
    import json.decoder
    with open(inspect.getsourcefile(json.decoder)) as f:
        return f.read()


def compare_logprobs(base, other) -> dict:
    """Teacher-forced figures of two runs over the same prompt (RequestOutputs with prompt_logprobs)."""
    pairs = list(zip(base.prompt_logprobs[1:], other.prompt_logprobs[1:], base.prompt_token_ids[1:]))
    deltas = sorted(abs(a[t] - b[t]) for a, b, t in pairs)

    def top(entry: dict) -> int:
        return max(entry.items(), key=lambda kv: kv[1])[0]
    return {"positions": len(deltas), "mean_abs": statistics.fmean(deltas), "p99_abs": deltas[int(0.99 * (len(deltas) - 1))],
            "max_abs": deltas[-1], "top1_agreement": sum(top(a) == top(b) for a, b, _ in pairs) / len(pairs)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def capacity(engine, budget: int) -> dict:
    cache = engine.kv.pool
    per_token = cache.latent_bytes_per_token() + cache.index_bytes_per_token()
    return {"latent_bytes_per_token": cache.latent_bytes_per_token(), "index_bytes_per_token": cache.index_bytes_per_token(),
            "tokens_in_budget": budget // per_token}


def decode_ms(llm, ids: list[int], steps: int) -> tuple[float, list[int]]:
    """Prefill `ids`, then time `steps` greedy decode steps: (median ms per step, the tokens)."""
    from sparsekv import SamplingParams
    engine = llm.engine
    request = engine.add_request(None, ids, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    while request.is_prefilling or not request.output_token_ids:
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), list(request.output_token_ids)


def run(args) -> dict:
    import torch
    from sparsekv import LLM, SamplingParams
    from sparsekv.cache.latent_format import FP8Latent, PlainLatent
    from sparsekv.paths import default_model_path
    from .bench_worker import decode_bytes_per_step
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    text = default_text() if args.text_file is None else open(args.text_file).read()
    llms = {dt: LLM(model, kv_cache_dtype=dt, max_model_len=args.context + args.decode_steps + 8,
                    enable_prefix_caching=False, kv_tiering=args.kv_tiering) for dt in DTYPES}
    tokenizer = llms["auto"].engine.tokenizer
    if tokenizer is None:  # a checkpoint without one (make-tiny-model): seeded random tokens, for the timing
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, llms["auto"].engine.model_config.vocab_size, (args.context,), generator=g).tolist()
    else:
        ids = tokenizer.encode(text)[:args.context]
    if len(ids) < args.context:
        raise ValueError(f"the text has {len(ids)} tokens; --context {args.context} needs more")
    scored = {dt: llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
              for dt, llm in llms.items()}
    times = {dt: [] for dt in DTYPES}
    tokens = {}
    for _ in range(args.repeats):
        for dt, llm in llms.items():
            ms, tokens[dt] = decode_ms(llm, ids, args.decode_steps)
            times[dt].append(ms)
    geometry = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, latent_dim=576)  # GLM-5, DeepSeek-V3.2
    return {"model": model, "context": args.context, "decode_steps": args.decode_steps, "random_tokens": tokenizer is None,
            "kv_tiering": args.kv_tiering,
            "capacity": {dt: capacity(llm.engine, args.device_budget) for dt, llm in llms.items()},
            "device_budget": args.device_budget,
            "glm5_row_bytes": {"auto": PlainLatent(geometry, torch.bfloat16).row_bytes,
                               "fp8": FP8Latent(geometry, torch.bfloat16).row_bytes},
            "quality": compare_logprobs(scored["auto"], scored["fp8"]),
            "greedy_first_difference": first_difference(tokens["auto"], tokens["fp8"]),
            "decode_ms": {dt: statistics.median(v) for dt, v in times.items()},
            "decode_bytes": {dt: decode_bytes_per_step(llm.engine, args.context) for dt, llm in llms.items()},
            "machine_gbps": _machine_bandwidth(args.threads)}


def report(result: dict) -> dict:
    console = report_console()
    cap = result["capacity"]
    table = Table(title=f"capacity: bytes per token (every layer) and tokens in {result['device_budget'] / 2**30:g} GiB")
    for col in ("latents", "latent bytes / token", "indexer-key bytes / token", "tokens in the budget", "vs auto"):
        table.add_column(col)
    for dt in DTYPES:
        c = cap[dt]
        table.add_row(dt, f"{c['latent_bytes_per_token']:,}", f"{c['index_bytes_per_token']:,}",
                      f"{c['tokens_in_budget']:,}", f"{c['tokens_in_budget'] / cap['auto']['tokens_in_budget']:.2f}x")
    console.print(table)
    g = result["glm5_row_bytes"]
    console.print(f"GLM-5 geometry (kv_lora_rank 512, rope 64), per token and layer: bf16 {g['auto']:,} B, "
                  f"fp8 {g['fp8']:,} B: {g['auto'] / g['fp8']:.2f}x the tokens per byte of latents")
    q = result["quality"]
    if result["random_tokens"]:
        console.print("[bold]no tokenizer: random tokens through a checkpoint that may have random weights; the "
                      "quality figures below say nothing about a trained model[/bold]")
    console.print(f"quality, teacher-forced over {q['positions']:,} positions of a {result['context']:,}-token text: "
                  f"|Δ logprob| mean {q['mean_abs']:.4f}, p99 {q['p99_abs']:.4f}, max {q['max_abs']:.4f} nats; "
                  f"most probable next token agrees at {100 * q['top1_agreement']:.1f}% of positions")
    diff = result["greedy_first_difference"]
    console.print(f"greedy continuation, {result['decode_steps']} tokens: "
                  + ("identical" if diff is None else f"parts at token {diff}"))
    ms = result["decode_ms"]
    tiered = ", tiered" if result["kv_tiering"] else ""
    table = Table(title=f"decode at {result['context']:,} tokens{tiered} (medians)")
    for col in ("latents", "ms / token", "vs auto", "achieved bandwidth"):
        table.add_column(col)
    for dt in DTYPES:
        gbps = result["decode_bytes"][dt] / (ms[dt] / 1000) / 1e9
        table.add_row(dt, f"{ms[dt]:.2f}", f"{ms[dt] / ms['auto']:.3f}x",
                      f"{gbps:.2f} GB/s ({100 * gbps / result['machine_gbps']:.0f}%)")
    console.print(table)
    result["capacity_ratio"] = cap["fp8"]["tokens_in_budget"] / cap["auto"]["tokens_in_budget"]
    result["decode_ratio"] = ms["fp8"] / ms["auto"]
    return result


def build_parser() -> argparse.ArgumentParser:
    from ..units import parse_bytes
    from .plan_workload import parse_tokens
    p = argparse.ArgumentParser(prog="sparsekv bench kv-dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--text-file", default=None, help="text to score (default: the interpreter's json/decoder.py)")
    p.add_argument("--context", type=parse_tokens, default=parse_tokens("2K"))
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--device-budget", type=parse_bytes, default=parse_bytes("1G"))
    p.add_argument("--kv-tiering", action="store_true", help="both engines tiered (working sets + host store)")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("context", "decode_steps", "repeats"), run, report)
