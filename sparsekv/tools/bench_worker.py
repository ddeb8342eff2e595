"""One benchmark measurement, run in its own process: `python -m sparsekv.tools.bench_worker JOB THREADS`.

Prints one JSON line: ms (per decode step, or for the whole prefill), tokens_per_s, peak_rss_mb and,
for decode, bytes_per_step (bytes the step must read: weights touched, selected KV, indexer keys).
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time


WARMUP_STEPS = 2  # untimed-in-effect first decode steps of either engine: allocator and kernel warm-up


def peak_rss_mb() -> float:
    """This process's own peak resident set. Not getrusage's ru_maxrss: on Linux a child keeps its
    parent's peak across fork and exec, so a worker would report the bench's (which measured the
    machine first) instead of its own."""
    own = vm_hwm_mb()
    return own if own is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vm_hwm_mb(status_path: str = "/proc/self/status") -> float | None:
    """VmHWM (the resident high-water mark since this program's exec) in MB; None without /proc."""
    try:
        return _status_mb("VmHWM:", status_path)
    except OSError:
        return None


def rss_rise_mb(fn) -> tuple[object, float | None]:
    """(fn(), how far this process's resident set rose above where it stood before, at its peak while
    fn ran, in MB). Linux: the high-water mark is reset first (/proc/self/clear_refs); None elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_mb("VmRSS:")
    except OSError:
        return fn(), None
    out = fn()
    peak = vm_hwm_mb()
    return out, None if peak is None or before is None else peak - before


def _status_mb(field: str, status_path: str = "/proc/self/status") -> float | None:
    with open(status_path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return None


def steady_ms(step_seconds: list[float]) -> float:
    """Median ms of the steps after the warm-up ones (all of them when there are no more)."""
    return statistics.median(step_seconds[WARMUP_STEPS:] or step_seconds) * 1000


def _engine(job: dict, max_model_len: int):
    from sparsekv import LLM
    return LLM(job["ckpt"], device=job.get("device", "cpu"), max_model_len=max_model_len, max_num_seqs=1, kv_page_size=64,
               prefill_chunk_tokens=job.get("chunk", 4096), max_num_batched_tokens=job.get("chunk", 4096),
               attention=job.get("attention", "sparse"), hf_overrides=job.get("overrides")).engine


def synthetic_prefill(engine, req, num_tokens: int) -> None:
    """Fill the cache with `num_tokens` random entries and mark them computed (see bench.py docstring)."""
    import torch
    sched, alloc = engine.scheduler, engine.kv.allocator
    sched.waiting.remove(req)
    assert alloc.reserve(req.request_id, alloc.pages_for(req.max_total_tokens))
    req.status = req.status.RUNNING
    sched.running.append(req)
    req.page_ids = alloc.allocate(req.request_id, alloc.pages_for(num_tokens))
    slots = engine.executor.runner.slots_of(req.page_ids, num_tokens)
    g, cache = torch.Generator().manual_seed(0), engine.kv.pool
    for layer in cache.latent:  # through the pool's format (FP8 rows are encoded, not random bytes)
        latents = torch.randn(num_tokens, engine.model_config.latent_dim, generator=g)
        cache.write_latent(layer, slots, latents.to(engine.device, engine.dtype))
    for table in cache.index_keys.values():
        table[slots] = torch.randn(num_tokens, table.shape[1], generator=g).to(table.device, table.dtype)
    req.num_computed_tokens = num_tokens


def decode_bytes_per_step(engine, context: int, batch: int = 1) -> int:
    """Bytes a decode step of `batch` requests at `context` must read: dense weights and the routed
    experts the batch touches (expected union), then per request its selected latents and indexer keys."""
    cfg, cache = engine.model_config, engine.kv.pool
    k = context if engine.config.attention == "dense" else min(cfg.index_topk, context)
    latent = k * cache.latent_bytes_per_token()
    index_keys = context * cache.index_bytes_per_token()
    return int(_weight_bytes_per_step(engine, batch) + batch * (latent + index_keys))


def _weight_bytes_per_step(engine, batch: int) -> float:
    from .plan_decode import unique_experts
    cfg, m = engine.model_config, engine.model
    total = _bytes_of([m.embed, m.norm, m.lm_head, m.layers])
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * m.embed.element_size()
    moe_layers = cfg.mlp_layer_types.count("sparse")
    touched = unique_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch) if moe_layers else 0
    unused = moe_layers * (cfg.n_routed_experts - touched) * expert
    return total - unused - m.embed.numel() * m.embed.element_size() + batch * cfg.hidden_size * m.embed.element_size()


def mtp_pass_weight_bytes(engine) -> int:
    """Weight bytes one MTP pass (an extend or a draft step) reads for one row: the MTP decoder layer
    less the routed experts one row does not pick, its glue (enorm, hnorm, eh_proj, the head's norm) and
    the vocabulary head. A lower bound for an extend over several rows (they may pick more experts)."""
    cfg, m = engine.model_config, engine.model
    mtp = m.mtp
    head = mtp.head if mtp.head is not None else m.lm_head
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * m.embed.element_size()
    unpicked = (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert if cfg.n_routed_experts else 0
    return _bytes_of([mtp.layer]) - unpicked + _bytes_of([mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.head_norm, head])


def _bytes_of(roots: list) -> int:
    return sum(t.numel() * t.element_size() for t in _all_tensors(roots))


def _all_tensors(roots):
    """Every distinct tensor reachable from `roots` (a model's layers, norms, heads); not the MTP layer
    unless a root is it."""
    import torch
    seen = {}
    def walk(obj, depth=0):
        if depth > 6:
            return
        if isinstance(obj, torch.Tensor):
            seen[obj.data_ptr()] = obj
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k, v in vars(obj).items():
                if k not in ("cfg", "mtp"):
                    walk(v, depth + 1)
    walk(roots)
    return list(seen.values())


def sparsekv_decode(job: dict) -> dict:
    from sparsekv import SamplingParams
    ctx, steps, profiled = job["context"], job["steps"], job.get("profile", 0)
    engine = _engine(job, ctx + steps + profiled + 8)
    req = engine.add_request("bench", [1] * (ctx + 1),
                             SamplingParams(max_tokens=steps + profiled + 2, temperature=0.0, ignore_eos=True))
    synthetic_prefill(engine, req, ctx)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    ms = steady_ms(times)
    out = {"ms": ms, "tokens_per_s": 1000 / ms, "bytes_per_step": decode_bytes_per_step(engine, ctx)}
    if profiled:
        out["profile"] = profile_steps(engine, profiled)
    return out


def profile_steps(engine, steps: int) -> dict:
    """Where `steps` more decode steps spend their time, by torch op kind: each kind's self time (its
    own kernel, not the ops it calls) and calls per step, and the step's wall time under the profiler
    (its own overhead included); what the ops leave of it is Python and dispatch."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - t0) * 1000 / steps
    kinds = [(e.key, e.self_cpu_time_total / 1000 / steps, e.count / steps) for e in prof.key_averages()
             if e.key.startswith("aten::")]
    kinds.sort(key=lambda k: -k[1])
    return {"step_ms": wall_ms, "ops": kinds}


def sparsekv_prefill(job: dict) -> dict:
    """A real prefill of `context` tokens (time to first token); then `decode_steps` decode steps on
    the cache that prefill built (median ms/step), when asked."""
    from sparsekv import SamplingParams
    ctx, decode_steps = job["context"], job.get("decode_steps", 0)
    engine = _engine(job, ctx + decode_steps + 8)
    req = engine.add_request("bench", [(7 * i) % 1000 + 1 for i in range(ctx)],
                             SamplingParams(max_tokens=1 + decode_steps, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while not req.output_token_ids:
        engine.step()
    s = time.perf_counter() - t0
    out = {"ms": s * 1000, "tokens_per_s": ctx / s}
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if times:
        out["decode_ms"] = steady_ms(times)
    return out


def transformers_model(job: dict):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype="float32").eval()


def transformers_decode(job: dict) -> dict:
    import torch
    model = transformers_model(job)
    ids = torch.tensor([[(7 * i) % 1000 + 1 for i in range(job["context"])]])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(job["steps"]):
            t0 = time.perf_counter()
            out = model(tok, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t0)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    ms = steady_ms(times)
    return {"ms": ms, "tokens_per_s": 1000 / ms}


def transformers_prefill(job: dict) -> dict:
    import torch
    model = transformers_model(job)
    ids = torch.tensor([[(7 * i) % 1000 + 1 for i in range(job["context"])]])
    with torch.no_grad():
        t0 = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        s = time.perf_counter() - t0
    return {"ms": s * 1000, "tokens_per_s": job["context"] / s}


JOBS = {("decode", "sparsekv"): sparsekv_decode, ("prefill", "sparsekv"): sparsekv_prefill,
        ("decode", "transformers"): transformers_decode, ("prefill", "transformers"): transformers_prefill}


def main() -> None:
    import torch
    job, threads = json.loads(sys.argv[1]), int(sys.argv[2])
    if threads:  # 0: each engine at its own default (sparsekv's threads.py rule, torch's for transformers)
        torch.set_num_threads(threads)
    result = JOBS[(job["kind"], job["engine"])](job)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
