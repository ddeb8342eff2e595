#!/usr/bin/env python3
"""The largest gap between a running request's tokens while another request's 8K-token prefix comes
back from the prefix cache's disk tier: reads at admission ("sync") against reads ahead of admission
("ahead", the default), three runs each, interleaved.

  python scripts/prefix_read_ahead.py bundled|CHECKPOINT   (BENCHMARKS.md, "Prefix cache disk tier")
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from sparsekv import LLM, SamplingParams
from sparsekv.paths import default_model_path

PREFIX_TOKENS = 8192


def largest_gap(path: str, opts: dict, prefix: list[int]) -> tuple[float, int]:
    """Seconds of the longest wait for the running request's next token until the hit finishes."""
    llm = LLM(path, **opts)
    engine = llm.engine
    engine.add_request("run", [5, 6, 7] * 10, SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.add_request("hit", prefix + [9] * 16, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    last, gaps, cached = time.perf_counter(), [], None
    while cached is None:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "run" for o in outs):
            gaps.append(now - last)
            last = now
        cached = next((o.metrics["prefix_cached_tokens_disk"] for o in outs if o.request_id == "hit" and o.finished),
                      None)
    engine.abort("run")
    llm.close()
    return max(gaps), cached


def main() -> None:
    torch.set_num_threads(1)
    path = default_model_path() if sys.argv[1] == "bundled" else sys.argv[1]
    opts = dict(max_model_len=PREFIX_TOKENS + 800, max_num_seqs=2, prefill_chunk_tokens=512,
                max_num_batched_tokens=512, prefix_cache_disk_path=tempfile.mkdtemp(),
                prefix_cache_disk_bytes=16 << 30)
    with LLM(path, **opts) as filler:  # fills the disk tier, saved at close
        vocab = filler.engine.model_config.vocab_size
        prefix = torch.randint(1, vocab, (PREFIX_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
        filler.generate([prefix + [1]], SamplingParams(max_tokens=1))
        page_kib = filler.engine.kv.prefix.tiers["disk"].page_bytes / 1024
    results = {"sync": [], "ahead": []}
    for mode in ["sync", "ahead"] * 3:
        gap, cached = largest_gap(path, {**opts, "prefix_cache_disk_read_ahead": mode == "ahead"}, prefix)
        results[mode].append(gap)
        print(f"{mode}: largest gap {1000 * gap:.1f} ms; disk hit {cached} tokens", flush=True)
    print(f"pages of {page_kib:.0f} KiB; median largest gap: sync {1000 * statistics.median(results['sync']):.1f} ms, "
          f"ahead {1000 * statistics.median(results['ahead']):.1f} ms")


if __name__ == "__main__":
    main()
