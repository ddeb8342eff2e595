"""`sparsekv bench tiers`, natural continuation: a real prefill of the model on a token prompt, then
greedy (or, with --teacher-forced, the prompt file's own next tokens) decode with tiering on and off;
the steady-state miss rate per buffer size, each index group's rate next to the offline optimum, and
with --fp8 what FP8 indexer keys do to top-k overlap and logprobs."""
from __future__ import annotations

import statistics

from .bench_tiers_setup import make_engine, miss_rate


def natural(args, ckpt: str, topk: int) -> dict:
    from sparsekv.config import ModelConfig
    prompt, force = _prompt(args, ckpt, ModelConfig.from_json(ckpt).vocab_size)
    steps = args.natural_steps
    on = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector, device=args.device,
                   kv_tiering=True)
    off = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector, device=args.device)
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
        run = _continue(ckpt, prompt, steps, args.warmup, force, selector=args.selector, device=args.device,
                        kv_tiering=True, device_buffer_tokens=mult * topk)
        result["miss_rate_by_buffer"][mult] = run["steady_miss_rate"]
    print("natural continuation, steady-state miss rate by buffer: " +
          ", ".join(f"N = {m} x top-k: {100 * r:.1f}%" for m, r in sorted(result["miss_rate_by_buffer"].items())))
    if args.fp8:
        fp8 = _continue(ckpt, prompt, steps, args.warmup, force=on["tokens"], selector=args.selector,
                        device=args.device, kv_tiering=True, indexer_key_dtype="fp8_e4m3")
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


def _prompt(args, ckpt: str, vocab_size: int) -> tuple[list[int], list[int] | None]:
    """The prompt's tokens, and with --teacher-forced the tokens that follow it in the file."""
    if args.prompt_file:
        from sparsekv.input_processor import load_tokenizer
        with open(args.prompt_file) as f:
            ids = load_tokenizer(ckpt).encode(f.read(), add_special_tokens=False)
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
    """Greedy continuation; with `force`, step i emits force[i] (teacher forcing, by a logits processor).
    Records every decode-step selection and the logprob of the token that continues the sequence."""
    import torch
    from sparsekv import SamplingParams
    engine = make_engine(ckpt, len(prompt) + steps + 8, **options)
    log, logits = _record_selections(engine), []
    engine.executor.add_observer(lambda step, out: logits.append(out.logits))
    engine.add_request("nat", prompt, SamplingParams(max_tokens=steps, temperature=0.0, logprobs=0, ignore_eos=True,
                                                     logits_processors=[_forcing(force)] if force else None))
    tokens, logprobs, mid = [], [], None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        token = outs[0].new_token_ids[0]
        tokens.append(token)
        logprobs.append({token: float(torch.log_softmax(logits[-1][0], -1)[token])})
        mid = engine.stats() if len(tokens) == warmup else mid
    greedy = [int(l[0].argmax()) for l in logits if l.shape[0]]
    return {"tokens": tokens, "logprobs": logprobs, "selections": log, "greedy": greedy,
            "steady_miss_rate": miss_rate(mid or {}, engine.stats()),
            "miss_rate": engine.stats().get("tier_miss_rate", 0.0)}


def _forcing(tokens: list[int]):
    """A logits processor that leaves only `tokens[i]` possible for the i-th output token."""
    def force(output_token_ids: list[int], logits):
        only = logits.new_full(logits.shape, float("-inf"))
        only[tokens[len(output_token_ids)]] = 0.0
        return only
    return force


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
