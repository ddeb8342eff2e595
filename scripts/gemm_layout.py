#!/usr/bin/env python3
"""Decode time with the projection weights in the GEMM's layout on a CPU (`model.layers.gemm_layout`:
column-major, the default) against the checkpoint's row-major layout, in the same process, the two
engines taking turns on each prompt: plain decoding one request at a time, MTP drafting (`--k`), and
`--batch` requests decoded together.

  python scripts/gemm_layout.py [--k 3] [--batch 16] [--rounds 3]   (BENCHMARKS.md, "Weights laid out for the GEMM")
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import sparsekv.model.attention
import sparsekv.model.layers
import sparsekv.model.model
from sparsekv import LLM, SamplingParams
from sparsekv.input_processor import load_tokenizer
from sparsekv.paths import default_model_path
from sparsekv.tools.bench_spec import held_out_prompts

CLOCK = time.perf_counter  # --cpu-time: time.process_time (this process's CPU time: other jobs' share of the core left out)
LAYOUT_USERS = (sparsekv.model.layers, sparsekv.model.attention, sparsekv.model.model)


def engine(path: str, laid_out: bool, **opts):
    """An engine built with the GEMM layout, or with every projection left as the checkpoint stores it."""
    kept = sparsekv.model.layers.gemm_layout
    if not laid_out:
        for module in LAYOUT_USERS:
            module.gemm_layout = lambda w: w
    try:
        return LLM(path, **opts).engine
    finally:
        for module in LAYOUT_USERS:
            module.gemm_layout = kept


def decode(engine, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    """ms per generated token of every request together (decode steps only) and the tokens."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):   # the prompts' steps, up to every request's first token
        started.update(out.request_id for out in engine.step())
    done, start = {}, CLOCK()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    tokens = sum(len(t) - 1 for t in done.values())
    return (CLOCK() - start) * 1000 / tokens, [done[str(i)] for i in range(len(prompts))]


def compare(name: str, path: str, prompts: list[list[int]], batch: int, rounds: int, **opts) -> None:
    engines = {"column-major": engine(path, True, **opts), "row-major": engine(path, False, **opts)}
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    times, same, total = {k: [] for k in engines}, 0, 0
    for e in engines.values():
        decode(e, groups[0][:1], params)   # warm-up
    for _ in range(rounds):
        for group in groups:
            tokens = {}
            for layout, e in engines.items():
                ms, tokens[layout] = decode(e, group, params)
                times[layout].append(ms)
            same += sum(a == b for a, b in zip(*tokens.values()))
            total += len(group)
    new, old = (statistics.median(times[k]) for k in engines)
    print(f"{name:28s} column-major {new:6.2f} ms/token  row-major {old:6.2f} ms/token  "
          f"ratio {new / old:.3f}  identical greedy tokens {same} of {total}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=3, help="MTP drafts per step")
    p.add_argument("--batch", type=int, default=16, help="requests decoded together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true", help="time by this process's CPU time, not wall time")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    path = default_model_path()
    common = dict(max_model_len=512 + 80, max_num_seqs=args.batch)
    prompts = held_out_prompts(load_tokenizer(path), args.batch, 512)
    compare("plain, one request", path, prompts[:4], 1, args.rounds, **common)
    compare(f"MTP K = {args.k}, one request", path, prompts[:4], 1, args.rounds, num_speculative_tokens=args.k, **common)
    compare(f"plain, {args.batch} requests", path, prompts, args.batch, args.rounds, **common)


if __name__ == "__main__":
    main()
