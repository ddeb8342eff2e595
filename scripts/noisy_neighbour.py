#!/usr/bin/env python3
"""A quiet tenant's service while a noisy tenant floods the engine: two scenarios.

`prefix` (the default): the quiet tenant asks `--rounds` questions about one 2048-token document; before each, the noisy
tenant sends `--noisy` prompts with prefixes of the same length, all different. The KV pool holds one
request, so every prefix leaves it; the host tier holds `--host-prefixes` prefixes' pages. Printed per
mode: the quiet tenant's prompt tokens served by the cache (median after its first question), its
time to first token against no cache in the same run, and whether its greedy tokens are identical.

`kv`: the noisy tenant submits `--noisy` long requests (1,024-token prompts, 256 tokens each) at once,
twice as many as the KV pool holds; the quiet tenant's short request arrives once the pool is full
(at once when admission reserves prompt + max_tokens; with optimistic admission, once the running
requests have grown into it). Printed for reserving admission without a share and with
`tenant_kv_share=0.5` (a cap), and for optimistic admission (a prefix host tier) without and with it
(a guarantee: preemption): the quiet request's time to first token from its arrival, the time until
every request is done, preemptions, and whether every output is the same.

  python scripts/noisy_neighbour.py [--model CKPT] [--noisy 4] [--rounds 4] [--host-prefixes 2]
  python scripts/noisy_neighbour.py --scenario kv [--noisy 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from sparsekv import LLM, SamplingParams
from sparsekv.config import EngineConfig
from sparsekv.paths import default_model_path

PREFIX, SUFFIX, PAGE = 2048, 32, 64


def ask(engine, rid: str, prompt: list[int], tenant: str) -> dict:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), tenant=tenant)
    t0, ttft, out = time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs and ttft is None:
            ttft = time.perf_counter() - t0
        out = outs[-1] if outs else out
    return {"ttft_s": ttft, "cached": out.num_cached_tokens, "tokens": out.token_ids}


def modes(path: str, host_prefixes: float) -> dict:
    common = dict(max_model_len=PREFIX + SUFFIX + 8, max_num_seqs=1, prefill_chunk_tokens=512,
                  max_num_batched_tokens=512, num_kv_pages=(PREFIX + SUFFIX + 8) // PAGE + 2)
    probe = LLM(path, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 30, **common)
    host_bytes = int(host_prefixes * PREFIX // PAGE * probe.engine.kv.prefix.tiers["host"].page_bytes)
    probe.close()
    out = {"no cache": LLM(path, enable_prefix_caching=False, **common),
           "host tier": LLM(path, enable_prefix_caching=True, prefix_cache_host_bytes=host_bytes, **common)}
    if "prefix_cache_tenant_share" in {f.name for f in dataclasses.fields(EngineConfig)}:
        out["host tier, tenant share 0.5"] = LLM(path, enable_prefix_caching=True, prefix_cache_host_bytes=host_bytes,
                                                 prefix_cache_tenant_share=0.5, **common)
    return out


def kv_flood(path: str, share: float | None, noisy: int, admission: str = "reserve") -> dict:
    """The noisy tenant's long requests fill the pool; the quiet one's short request comes once it is full
    (at once with reserving admission; once the running requests have grown into it with optimistic)."""
    pages = noisy // 2 * (1024 + 256) // PAGE  # room for half the flood at once
    llm = LLM(path, max_model_len=1024 + 256, max_num_seqs=noisy + 1, max_num_batched_tokens=2048,
              num_kv_pages=pages, enable_prefix_caching=admission == "optimistic", tenant_kv_share=share,
              kv_admission=admission, prefix_cache_host_bytes=1 << 30 if admission == "optimistic" else None)
    engine, g = llm.engine, torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    for i in range(noisy):
        engine.add_request(f"noisy-{i}", torch.randint(1, vocab, (1024,), generator=g).tolist(), params, tenant="noisy")
    start, outs = time.perf_counter(), {}
    quiet_pages = engine.kv.allocator.pages_for(128 + 16) + 1
    while engine.kv.allocator.num_available >= quiet_pages and engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    t0, ttft = time.perf_counter(), None
    engine.add_request("quiet", torch.randint(1, vocab, (128,), generator=g).tolist(),
                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), tenant="quiet")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "quiet" and ttft is None:
                ttft = time.perf_counter() - t0
            if out.finished:
                outs[out.request_id] = out.token_ids
    preemptions = llm.stats()["preemptions"]
    llm.close()
    return {"ttft_s": ttft, "total_s": time.perf_counter() - start, "outputs": outs, "preemptions": preemptions}


def kv_scenario(args) -> None:
    path = args.model or default_model_path()
    runs = {"no share": kv_flood(path, None, args.noisy), "tenant_kv_share 0.5": kv_flood(path, 0.5, args.noisy),
            "optimistic, no share": kv_flood(path, None, args.noisy, "optimistic"),
            "optimistic, share 0.5": kv_flood(path, 0.5, args.noisy, "optimistic")}
    same = all(r["outputs"] == runs["no share"]["outputs"] for r in runs.values())
    print(f"{args.noisy} noisy requests (1024 + 256 tokens) filling a pool that holds half of them, then one quiet "
          f"request (128 + 16); outputs identical: {same}")
    for name, r in runs.items():
        print(f"  {name:22s} quiet TTFT {1000 * r['ttft_s']:8.1f} ms   all done {r['total_s']:6.2f} s"
              f"   preemptions {r['preemptions']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="prefix", choices=["prefix", "kv"])
    p.add_argument("--model", default=None)
    p.add_argument("--noisy", type=int, default=4, help="noisy prompts before each quiet question (kv: at once)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--host-prefixes", type=float, default=2.0, help="the host tier's budget, in prefixes")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.scenario == "kv":
        kv_scenario(args)
        return
    engines = modes(args.model or default_model_path(), args.host_prefixes)
    vocab = next(iter(engines.values())).engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    def prompt():
        return torch.randint(1, vocab, (PREFIX + SUFFIX,), generator=g).tolist()
    document = prompt()[:PREFIX]
    quiet = {name: [] for name in engines}
    for r in range(args.rounds):
        noisy = [prompt() for _ in range(args.noisy)]
        question = document + prompt()[:SUFFIX]
        for name, llm in engines.items():
            for i, n in enumerate(noisy):
                ask(llm.engine, f"noisy-{r}-{i}", n, "noisy")
            quiet[name].append(ask(llm.engine, f"quiet-{r}", question, "quiet"))
    base = statistics.median(q["ttft_s"] for q in quiet["no cache"][1:])
    print(f"quiet tenant, {args.rounds} questions on one {PREFIX}-token document, {args.noisy} noisy prompts before "
          f"each; host tier {args.host_prefixes} prefixes; medians after the first question")
    for name, runs in quiet.items():
        later = runs[1:]
        ttft = statistics.median(q["ttft_s"] for q in later)
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(quiet["no cache"], runs))
        by_tenant = engines[name].stats().get("prefix_cache_by_tenant", {})
        print(f"  {name:30s} cached {statistics.median(q['cached'] for q in later):6.0f} of {PREFIX + SUFFIX}  "
              f"TTFT {1000 * ttft:7.1f} ms  x{base / ttft:5.2f}  identical {same}/{len(runs)}  "
              f"held {({t: {k: v for k, v in f.items() if k.endswith('pages')} for t, f in by_tenant.items()})}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
