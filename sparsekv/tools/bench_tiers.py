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
import time
from datetime import date

from .bench import BENCH_PRESETS
from .bench_worker import decode_bytes_per_step
from .plan_workload import parse_tokens, token_list_arg

MB = 1e6


# -- engines and synthetic history ------------------------------------------------------------
DEVICE = {"device": "cpu"}  # set from --device



def interleaved_step_ms(engines: dict, steps: int) -> dict[str, list[float]]:
    """Step every engine round-robin, so load from other processes hits all configurations alike."""
    times = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - t0) * 1000)
    return times

def make_engine(ckpt: str, max_len: int, **options):
    from sparsekv import LLM
    base = dict(max_model_len=max_len, kv_page_size=64, prefill_chunk_tokens=4096, max_num_batched_tokens=4096,
                max_num_seqs=1, **DEVICE)
    return LLM(ckpt, **{**base, **options}).engine


def synthetic_admit(engine, request_id: str, context: int, max_tokens: int) -> bool:
    """Admit a request as the scheduler would (reserve prompt + max_tokens) and fill `context` entries."""
    import torch
    from sparsekv import SamplingParams
    sched, alloc = engine.scheduler, engine.allocator
    req = engine.add_request(request_id, [1] * (context + 1), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True))
    if len(sched.running) >= sched.max_num_seqs or not alloc.reserve(req.request_id, alloc.pages_for(req.max_total_tokens)):
        engine.abort(request_id)
        return False
    sched.waiting.remove(req)
    req.status = req.status.RUNNING
    sched.running.append(req)
    req.page_ids = alloc.allocate(req.request_id, alloc.pages_for(context))
    slots = engine.runner.slots_of(req.page_ids, context)
    _fill(engine, slots, torch.Generator().manual_seed(len(sched.running)))
    req.num_computed_tokens = context
    return True


def _fill(engine, slots, gen, chunk: int = 1 << 16) -> None:
    import torch
    cfg, cache = engine.model_config, engine.cache

    def rand(n: int, dim: int) -> torch.Tensor:
        return torch.randn(n, dim, generator=gen).to(engine.device)

    for i in range(0, slots.numel(), chunk):
        part = slots[i:i + chunk]
        for layer in range(cfg.num_hidden_layers):
            cache.write_latent(layer, part, rand(part.numel(), cfg.latent_dim))
            attn = engine.model.layers[layer].attn
            if attn.selector is not None and attn.selector.name == "dsa":
                cache.write_index_keys(layer, part, rand(part.numel(), cfg.index_head_dim))
            elif attn.selector is not None:
                ctx = argparse.Namespace(slot_mapping=part)
                attn.selector.prepare(layer, ctx, None, None, rand(part.numel(), cfg.latent_dim), cache)


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def miss_rate(before: dict, after: dict) -> float:
    misses, hits = delta(before, after, "tier_misses"), delta(before, after, "tier_hits")
    return misses / (misses + hits) if misses + hits else 0.0


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
    return {"context": context, "ms": statistics.median(times), "p99_ms": _p99(times),
            "device_kv_bytes": after["device_kv_bytes"], "device_latent_bytes": after["device_latent_bytes"],
            "device_indexer_bytes": after["device_indexer_bytes"], "host_kv_bytes": after.get("host_kv_bytes", 0),
            "miss_rate": miss_rate(before, after), "first_step_misses": before.get("tier_misses", 0),
            "transfer_mb_per_token": (delta(before, after, "h2d_bytes") + delta(before, after, "d2h_bytes")) / steps / MB}


def _p99(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def sweep(args, ckpt: str, topk: int) -> list[dict]:
    rows, machine = [], device_bandwidth_gbps(args.threads)
    print(f"device memory bandwidth {machine:.1f} GB/s")
    for context in args.contexts:
        configs = {"off": dict(selector=args.selector)}
        configs.update({m: dict(selector=args.selector, kv_tiering=True, device_buffer_tokens=m * topk)
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


# -- natural continuation -------------------------------------------------------------------------
def natural(args, ckpt: str, topk: int) -> dict:
    from sparsekv.config import ModelConfig
    prompt, force = _prompt(args, ModelConfig.from_json(ckpt).vocab_size)
    steps = args.natural_steps
    on = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector, kv_tiering=True)
    off = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector)
    exact = on["tokens"] == off["tokens"] and on["logprobs"] == off["logprobs"] and on["greedy"] == off["greedy"]
    result = {"prompt_tokens": len(prompt), "steps": steps, "buffer": 2 * topk, "teacher_forced": bool(force),
              "exact": exact, "steady_miss_rate": on["steady_miss_rate"], "overall_miss_rate": on["miss_rate"]}
    fed = "the file's next tokens fed (teacher-forced)" if force else "greedy"
    print(f"natural continuation: {len(prompt)} prompt tokens, {steps} steps ({fed}), N = 2 x top-k = {2 * topk}: "
          f"steady-state miss rate {100 * on['steady_miss_rate']:.1f}% (after {args.warmup} steps), "
          f"overall {100 * on['miss_rate']:.1f}%; identical to tiering off: {result['exact']}")
    result["groups"] = miss_breakdown(on["selections"], ModelConfig.from_json(ckpt), 2 * topk, args.warmup)
    for g in result["groups"]:
        print(f"  index group of layer {g['layer']} (serves {g['serves']} layers): LRU {100 * g['lru_miss_rate']:.1f}%, "
              f"optimal replacement {100 * g['optimal_miss_rate']:.1f}%, first accesses {100 * g['compulsory_miss_rate']:.1f}%")
    result["miss_rate_by_buffer"] = {2: on["steady_miss_rate"]}
    for mult in (m for m in args.buffers if m != 2):
        run = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector, kv_tiering=True,
                        device_buffer_tokens=mult * topk)
        result["miss_rate_by_buffer"][mult] = run["steady_miss_rate"]
    print("natural continuation, steady-state miss rate by buffer: " +
          ", ".join(f"N = {m} x top-k: {100 * r:.1f}%" for m, r in sorted(result["miss_rate_by_buffer"].items())))
    if args.fp8:
        fp8 = _continue(ckpt, prompt, steps, args.warmup, force=on["tokens"], selector=args.selector,
                        kv_tiering=True, indexer_key_dtype="fp8_e4m3")
        result["fp8"] = _fp8_effect(on, fp8)
        print(f"fp8 indexer keys (teacher-forced on the same tokens): {result['fp8']}")
    return result


def miss_breakdown(selections: list, cfg, capacity: int, warmup: int) -> list[dict]:
    """Each index group's steady-state miss rate, replayed from the decode-step selections of a
    tiered run (`_continue`'s log), next to the offline optimum on the same trace (`lru.replay`):
    how far a better replacement policy could go at this buffer size. Lookups count as the engine
    counts them, per group: the step's new token is a hit on its own row, and each step first
    promotes the last step's token (a free insertion). The groups' rates, weighted by the layers each
    serves, give back the engine's steady-state rate."""
    from sparsekv.cache.lru import replay
    from sparsekv.train.stages import index_groups
    out = []
    for layer, served in index_groups(cfg.indexer_types).items():
        trace = [(c, s) for lay, c, s in selections if lay == layer]
        steps, new_hits = [], 0
        for i, (context, selected) in enumerate(trace):
            newest = context - 1
            if i:
                steps.append(([newest - 1], False))
            steady = i >= warmup - 1  # the engine's steady window: after `warmup` sampled tokens
            steps.append((sorted(p for p in selected if p < newest), steady))
            new_hits += steady and newest in selected
        counts = replay(steps, capacity)
        counts.lookups += new_hits  # hits on the new token's own row, as the engine counts them
        out.append({"layer": layer, "serves": len(served), **counts.rates()})
    return out


def _prompt(args, vocab_size: int) -> tuple[list[int], list[int] | None]:
    """The prompt's tokens, and with --teacher-forced the tokens that follow it in the file."""
    if args.prompt_file:
        from sparsekv.engine import load_tokenizer
        with open(args.prompt_file) as f:
            ids = load_tokenizer(args.model).encode(f.read(), add_special_tokens=False)
        n = args.natural_context
        if args.teacher_forced and len(ids) < n + args.natural_steps:
            raise SystemExit(f"sparsekv bench tiers: error: --teacher-forced needs {n + args.natural_steps} tokens "
                             f"in {args.prompt_file}, it has {len(ids)}")
        return ids[:n], ids[n:n + args.natural_steps] if args.teacher_forced else None
    if args.teacher_forced:
        raise SystemExit("sparsekv bench tiers: error: --teacher-forced needs --prompt-file")
    import random
    rng = random.Random(0)
    return [rng.randrange(1, min(1000, vocab_size)) for _ in range(args.natural_context)], None


def _continue(ckpt: str, prompt: list[int], steps: int, warmup: int, force: list[int] | None = None,
              **options) -> dict:
    """Greedy continuation; with `force`, each step's token is replaced by force[i] (teacher forcing).
    Records every decode-step selection and the logprob of the token that continues the sequence."""
    import torch
    from sparsekv import SamplingParams
    engine = make_engine(ckpt, len(prompt) + steps + 8, **options)
    log, logits = _record_selections(engine), []
    execute = engine.runner.execute

    def recording(chunks):
        out = execute(chunks)
        logits.append(out[0])
        return out
    engine.runner.execute = recording
    engine.add_request("nat", prompt, SamplingParams(max_tokens=steps, temperature=0.0, logprobs=0, ignore_eos=True))
    req, tokens, logprobs, mid = engine.scheduler.find("nat"), [], [], None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        token = force[len(tokens)] if force else outs[0].new_token_ids[0]
        req.output_token_ids[-1] = token
        tokens.append(token)
        logprobs.append({token: float(torch.log_softmax(logits[-1][0], -1)[token])})
        mid = engine.stats() if len(tokens) == warmup else mid
    greedy = [int(l[0].argmax()) for l in logits if l.shape[0]]
    return {"tokens": tokens, "logprobs": logprobs, "selections": log, "greedy": greedy,
            "steady_miss_rate": miss_rate(mid or {}, engine.stats()),
            "miss_rate": engine.stats().get("tier_miss_rate", 0.0)}


def _record_selections(engine) -> list:
    """Log each full layer's decode-step selections (layer, context, set)."""
    from sparsekv.model.selectors import observe_selections
    log = []

    def observe(layer, seq, positions, selected):
        if selected.shape[0] == 1:
            log.append((layer, seq.context_len, frozenset(selected[0].tolist())))
    observe_selections(engine.model, observe)
    return log


def _fp8_effect(ref: dict, fp8: dict) -> dict:
    """Top-k overlap, logprob change and greedy agreement on the same (teacher-forced) token sequence."""
    sel_ref = {(layer, c): s for layer, c, s in ref["selections"]}
    overlaps = [len(s & sel_ref[(layer, c)]) / len(s) for layer, c, s in fp8["selections"] if (layer, c) in sel_ref]
    dlp = [abs(next(iter(a.values())) - next(iter(b.values()))) for a, b in zip(ref["logprobs"], fp8["logprobs"])]
    agree = sum(a == b for a, b in zip(ref["greedy"], fp8["greedy"])) / max(len(ref["greedy"]), 1)
    return {"selections_compared": len(overlaps), "topk_overlap_mean": round(statistics.mean(overlaps), 4),
            "topk_overlap_min": round(min(overlaps), 4), "max_abs_logprob_change": max(dlp),
            "mean_abs_logprob_change": statistics.mean(dlp), "greedy_agreement": agree}


# -- fixed device budget --------------------------------------------------------------------------
def device_bandwidth_gbps(threads: int) -> float:
    """The bench device's memory bandwidth: stream-measured on the CPU; a device copy on CUDA."""
    import torch
    if DEVICE["device"] == "cpu":
        from .bench import _machine_bandwidth
        return _machine_bandwidth(threads)
    src = torch.empty(1 << 28, dtype=torch.float32, device=DEVICE["device"])
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9


def concurrency(args, ckpt: str) -> dict:
    from sparsekv.cache.lru import index_bytes_per_token, latent_bytes_per_token
    from sparsekv.config import ModelConfig
    cfg, context, steps, page = ModelConfig.from_json(ckpt), args.concurrency_context, args.steps, 64
    tokens = -(-(context + steps + 8) // page) * page
    budget = args.fit * tokens * (latent_bytes_per_token(cfg, 4) + index_bytes_per_token(cfg, 4))
    opts = dict(device_kv_budget_bytes=budget, max_num_seqs=args.max_requests, selector=args.selector)
    configs = {"off": opts, "on": dict(opts, kv_tiering=True)}
    # The batching ceiling: tiering off with device memory for every submitted request (no budget).
    unbounded = dict(opts, device_kv_budget_bytes=None, num_kv_pages=(args.max_requests + 1) * tokens // page)
    result = {"context": context, "device_kv_budget_bytes": budget, "submitted": args.max_requests}
    full = _interleaved(ckpt, context, steps, args.max_requests, {**configs, "off_unbounded": unbounded})
    single = _interleaved(ckpt, context, args.latency_steps, 1, configs)
    result["off_unbounded"] = full["off_unbounded"]
    result["machine_gbps"] = machine = device_bandwidth_gbps(args.threads)
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
                     "p99_ms": _p99(t), "median_ms": statistics.median(t), "device_kv_bytes": stats["device_kv_bytes"],
                     "host_kv_bytes": stats.get("host_kv_bytes", 0), "achieved_gbps": read / (sum(t) / 1000) / 1e9}
    del engines
    gc.collect()
    return out


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparsekv bench tiers")
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model, else a random --preset)")
    p.add_argument("--preset", default=None, choices=BENCH_PRESETS,
                   help="a random checkpoint of this shape instead of the bundled model")
    p.add_argument("--contexts", type=token_list_arg, default="8K,32K,128K", help="e.g. 8K,32K,128K,1M")
    p.add_argument("--buffers", default="1,2,4", help="device buffer sizes as multiples of top-k")
    p.add_argument("--selector", default="dsa", choices=["dsa", "quest"])
    p.add_argument("--steps", type=int, default=32, help="decode steps measured per figure")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--latency-steps", type=int, default=1000, help="--concurrency: steps for p99 at concurrency 1")
    p.add_argument("--natural-context", type=parse_tokens, default=parse_tokens("2K"))
    p.add_argument("--natural-steps", type=int, default=96)
    p.add_argument("--warmup", type=int, default=16, help="decode steps before the steady state")
    p.add_argument("--prompt-file", default=None, help="text for the natural continuation (needs a tokenizer)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="natural continuation: feed the prompt file's own next tokens instead of greedy ones")
    p.add_argument("--fp8", action="store_true", help="also measure FP8 indexer keys on the natural continuation")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-natural", action="store_true")
    p.add_argument("--concurrency", action="store_true", help="fixed device budget mode")
    p.add_argument("--concurrency-context", type=parse_tokens, default=parse_tokens("64K"))
    p.add_argument("--fit", type=int, default=4, help="requests the budget holds with tiering off")
    p.add_argument("--max-requests", type=int, default=32, help="requests submitted in --concurrency mode")
    p.add_argument("--plot-dir", default="bench_tiers_plots")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.buffers = [int(b) for b in args.buffers.split(",")]
    return args


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
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    DEVICE["device"] = args.device
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
