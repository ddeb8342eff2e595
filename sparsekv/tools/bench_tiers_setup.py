"""The engines `sparsekv bench tiers` measures: built on one checkpoint, filled with a synthetic history
(random latents and indexer keys written through the pool's own write path), stepped round-robin."""
from __future__ import annotations

import argparse
import time

MB = 1e6


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
    """An engine for one configuration; `options` are LLM's (device included)."""
    from sparsekv import LLM
    base = dict(max_model_len=max_len, kv_page_size=64, prefill_chunk_tokens=4096, max_num_batched_tokens=4096,
                max_num_seqs=1)
    return LLM(ckpt, **{**base, **options}).engine


def synthetic_admit(engine, request_id: str, context: int, max_tokens: int) -> bool:
    """Admit a request as the scheduler would (reserve prompt + max_tokens) and fill `context` entries."""
    import torch
    from sparsekv import SamplingParams
    sched, alloc = engine.scheduler, engine.kv.allocator
    req = engine.add_request(request_id, [1] * (context + 1), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True))
    if len(sched.running) >= sched.max_num_seqs or not alloc.reserve(req.request_id, alloc.pages_for(req.max_total_tokens)):
        engine.abort(request_id)
        return False
    sched.waiting.remove(req)
    req.status = req.status.RUNNING
    sched.running.append(req)
    req.page_ids = alloc.allocate(req.request_id, alloc.pages_for(context))
    slots = engine.executor.runner.slots_of(req.page_ids, context)
    _fill(engine, slots, torch.Generator().manual_seed(len(sched.running)))
    req.num_computed_tokens = context
    return True


def _fill(engine, slots, gen, chunk: int = 1 << 16) -> None:
    import torch
    cfg, cache = engine.model_config, engine.kv.pool

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


def p99(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
