"""`sparsekv bench spec`: MTP speculative decoding against plain decoding, in the same run.

Prompts are the first `--prompt-tokens` tokens of held-out standard-library files (the model's
evaluation split), decoded one request at a time (latency, the case drafting is for). Printed per
mode: decode ms/token (median over prompts), target forward steps per generated token, the draft
acceptance rate and mean acceptance length (vLLM's definitions, speculative.py: accepted / draft
tokens verified, and 1 + accepted / verification steps), the acceptance rate of each draft position,
the megabytes a decoded token reads (its target steps', a drafting step's 1 + K rows touching more
experts, plus its MTP passes' weights, one row each: a lower bound), achieved bandwidth (those bytes
over the time per token), whether greedy outputs are identical, and the speed-up of drafting.

Then what each pass costs against a target decode step (plain decoding's, one request), in torch ops
(tools/op_count.py, counted on the first prompt) and in median time (over every decode step): the
verification step (1 + K rows), the MTP extend pass (the MTP cache over the step's final rows, and
draft 1) and a draft step (each of drafts 2..K); and the speed-up those op counts allow at the
measured acceptance length L: L x target / (verification + extend + (K - 1) x draft step).
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import report_console, run_bench


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    from ..train.data import read_split
    _, heldout = read_split()
    prompts = []
    for text in heldout:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def decode_one(engine, prompt: list[int], params, passes: list | None = None) -> dict:
    """Greedy decode of one prompt; decode time counts from the first token to the last. `passes`: the
    (name, seconds) a pass timer appends to, kept from the decode steps only (an extend over the
    prompt's rows is not a decode pass); each decode step's time less its passes' is its
    "verification" time (the target's pass and the step's bookkeeping)."""
    engine.add_request("p", prompt, params)
    steps, first, outs, emitted, mark, verification = 0, None, [], 0, None, []
    kept_before = len(passes or ())
    while engine.has_unfinished_requests():
        seen, start = len(passes or ()), time.perf_counter()
        outs = engine.step() or outs
        if first is None and passes is not None:
            del passes[seen:]   # a prompt step's passes
        if first is not None and passes is not None:
            verification.append(time.perf_counter() - start - sum(t for _, t in passes[seen:]))
        if outs and first is None:
            first, steps = time.perf_counter(), 0
        emitted += bool(outs)
        if emitted == 2 and mark is None:  # after the first decode step (the MTP layer's prompt pass is done)
            mark = (outs[-1].metrics.get("h2d_bytes", 0), len(outs[-1].token_ids))
        steps += 1
    end, out = time.perf_counter(), outs[-1]
    n = len(out.token_ids)
    mark = mark or (out.metrics.get("h2d_bytes", 0), n)
    return {"tokens": out.token_ids, "ms_per_token": (end - first) * 1000 / max(n - 1, 1),
            "steps_per_token": (steps - 1) / max(n - 1, 1), "decode_steps": steps - 1, "decode_tokens": n - 1,
            "metrics": out.metrics, "verification_s": verification,
            "mtp_passes": len(passes or ()) - kept_before,
            "decode_h2d_bytes": out.metrics.get("h2d_bytes", 0) - mark[0], "decode_h2d_tokens": n - mark[1]}


def run(args) -> dict:
    import torch
    from sparsekv import LLM, SamplingParams
    from sparsekv.paths import default_model_path
    from .bench import _machine_bandwidth
    from .bench_worker import decode_bytes_per_step, mtp_pass_weight_bytes
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    room = max(args.max_tokens, pass_ops_tokens(args.num_speculative_tokens))
    common = dict(max_model_len=args.prompt_tokens + room + 8, max_num_seqs=1)
    if args.kv_tiering:  # both modes tiered: drafting's cost and gain with the tiered cache
        common.update(kv_tiering=True, device_buffer_tokens=args.device_buffer_tokens)
    modes = {"plain": LLM(path, **common).engine,
             "MTP draft": LLM(path, num_speculative_tokens=args.num_speculative_tokens, **common).engine}
    prompts = held_out_prompts(modes["plain"].tokenizer, args.prompts, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs, passes = {name: [] for name in modes}, []
    modes["MTP draft"].speculator.add_pass_observer(_timer(passes))
    for prompt in prompts:  # interleaved, so machine noise hits both modes alike
        for name, engine in modes.items():
            runs[name].append(decode_one(engine, prompt, params, passes if name == "MTP draft" else None))
    context = args.prompt_tokens + args.max_tokens // 2
    bytes_per_step = decode_bytes_per_step(modes["plain"], context)
    verification_bytes = verification_bytes_per_step(modes["MTP draft"], context, 1 + args.num_speculative_tokens)
    pass_ms = {name: 1000 * statistics.median(t for n, t in passes if n == name) for name in ("extend", "draft step")
               if any(n == name for n, _ in passes)}
    pass_ms["verification"] = 1000 * statistics.median(t for r in runs["MTP draft"] for t in r["verification_s"])
    ops = pass_ops(modes["plain"], modes["MTP draft"], prompts[0])  # after the timing: counting slows ops
    return {"prompts": len(prompts), "kv_tiering": args.kv_tiering, "runs": runs, "bytes_per_step": bytes_per_step, "k": args.num_speculative_tokens,
            "verification_bytes_per_step": verification_bytes, "mtp_pass_bytes": mtp_pass_weight_bytes(modes["MTP draft"]),
            "machine_gbps": _machine_bandwidth(args.threads), "pass_ops": ops, "pass_ms": pass_ms}


def verification_bytes_per_step(engine, context: int, rows: int) -> int:
    """Bytes a verification step of one request reads: the weights its `rows` rows touch (the routed
    experts' expected union) and one request's selected latents and indexer keys."""
    from .bench_worker import _weight_bytes_per_step, decode_bytes_per_step
    one_row = decode_bytes_per_step(engine, context)
    return int(one_row - _weight_bytes_per_step(engine, 1) + _weight_bytes_per_step(engine, rows))


def bytes_per_token(result: dict, drafting: bool, steps_per_token: float, mtp_passes_per_token: float) -> dict:
    """Bytes a decoded token reads, by part: its target steps' (a drafting step verifies 1 + K rows) and
    its MTP passes' weights (one row each: a lower bound)."""
    step = result["verification_bytes_per_step"] if drafting else result["bytes_per_step"]
    return {"target": step * steps_per_token, "mtp": result.get("mtp_pass_bytes", 0) * mtp_passes_per_token}


def achieved_gbps(token_bytes: dict, ms_per_token: float) -> float:
    """Bytes per token over time per token (a drafting token's target steps and passes all share it)."""
    return sum(token_bytes.values()) / (ms_per_token / 1000) / 1e9


def _timer(passes: list):
    @contextmanager
    def observe(name: str):
        start = time.perf_counter()
        yield
        passes.append((name, time.perf_counter() - start))
    return observe


def pass_ops_tokens(k: int, steps: int = 6) -> int:
    """The tokens `pass_ops` decodes: every counted step runs while the request is unfinished."""
    return (steps + 2) * (k + 1)


def pass_ops(plain, drafting, prompt: list[int], steps: int = 6) -> dict:
    """Median torch ops over `steps` engine steps of `prompt`, one request: a target decode step
    ("target", the plain engine's step), and the drafting engine's "verification" step (its step less
    its MTP passes: the 1 + K rows and the step's bookkeeping), "extend" and "draft step" passes."""
    from sparsekv import SamplingParams
    from .op_count import OpCounter, decode_step_ops, fill_decoding
    params = SamplingParams(max_tokens=pass_ops_tokens(drafting.config.num_speculative_tokens, steps),
                            temperature=0.0, ignore_eos=True)
    fill_decoding(plain, [prompt], params)
    target = [decode_step_ops(plain).total for _ in range(steps)]
    counts, counting, kinds = {"step": [], "extend": [], "draft step": []}, [False], {}

    @contextmanager
    def count(name: str):
        if not counting[0]:
            yield
            return
        with OpCounter() as ops:
            yield
        counts[name].append(ops.total)
        kinds[name] = dict(ops.by_kind.most_common())
    drafting.speculator.add_pass_observer(count)
    fill_decoding(drafting, [prompt], params)
    counting[0] = True
    for _ in range(steps):
        counts["step"].append(decode_step_ops(drafting).total)
    counting[0] = False
    for engine in (plain, drafting):
        while engine.has_unfinished_requests():
            engine.step()
    per_step = len(counts["draft step"]) // steps
    verification = [total - e - sum(counts["draft step"][i * per_step:(i + 1) * per_step])
                    for i, (total, e) in enumerate(zip(counts["step"], counts["extend"]))]
    return {"target": statistics.median(target), "verification": statistics.median(verification),
            "extend": statistics.median(counts["extend"]),
            "draft step": statistics.median(counts["draft step"]) if counts["draft step"] else 0,
            "by_kind": kinds}


def acceptance(rs: list[dict]) -> dict:
    """vLLM's counters summed over the runs, with the rates they give (None without drafts)."""
    def total(key):
        return sum(r["metrics"].get(key, 0) for r in rs)
    drafts, tokens, accepted = (total(f"spec_decode_num_{x}") for x in ("drafts", "draft_tokens", "accepted_tokens"))
    per_pos = [sum(col) for col in zip(*(r["metrics"]["spec_decode_num_accepted_tokens_per_pos"] for r in rs
                                         if "spec_decode_num_accepted_tokens_per_pos" in r["metrics"]))]
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos, "acceptance": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_pos": [a / drafts for a in per_pos] if drafts else None}


def report(result: dict) -> dict:
    runs, summary = result["runs"], {}
    for name, rs in runs.items():
        ms = statistics.median(r["ms_per_token"] for r in rs)
        steps = statistics.median(r["steps_per_token"] for r in rs)
        passes = sum(r.get("mtp_passes", 0) for r in rs) / max(sum(r["decode_tokens"] for r in rs), 1)
        token_bytes = bytes_per_token(result, name == "MTP draft", steps, passes)
        summary[name] = {"ms_per_token": ms, "steps_per_token": steps, "mtp_passes_per_token": passes,
                         "target_mb_per_token": token_bytes["target"] / 1e6, "mtp_mb_per_token": token_bytes["mtp"] / 1e6,
                         "gbps": achieved_gbps(token_bytes, ms), **acceptance(rs),
                         "decode_steps": sum(r["decode_steps"] for r in rs),
                         "decode_tokens": sum(r["decode_tokens"] for r in rs)}
        if result.get("kv_tiering"):  # host -> device bytes per token, from the second decode step on
            summary[name]["h2d_mb_per_token"] = (sum(r["decode_h2d_bytes"] for r in rs) / 1e6
                                                 / max(sum(r["decode_h2d_tokens"] for r in rs), 1))
    identical = sum(a["tokens"] == b["tokens"] for a, b in zip(runs["plain"], runs["MTP draft"]))
    tiering = ", tiered KV cache" if result.get("kv_tiering") else ""
    table = Table(title=f"MTP speculative decoding ({result['k']} drafts per step{tiering}), {result['prompts']} "
                        "held-out prompts, greedy, one request at a time")
    for col in ("mode", "decode ms/token", "target steps/token", "draft acceptance", "mean acceptance length",
                "acceptance by position", "MB read per token (target + MTP)", "achieved bandwidth", "speed-up"):
        table.add_column(col)
    base = summary["plain"]["ms_per_token"]
    for name, s in summary.items():
        drafting = s["acceptance"] is not None
        acc = f"{100 * s['acceptance']:.1f}%" if drafting else "-"
        length = f"{s['mean_acceptance_length']:.2f}" if drafting else "-"
        by_position = " ".join(f"{100 * a:.0f}%" for a in s["acceptance_per_pos"]) if drafting else "-"
        table.add_row(name, f"{s['ms_per_token']:.2f}", f"{s['steps_per_token']:.2f}", acc, length, by_position,
                      f"{s['target_mb_per_token']:.1f} + {s['mtp_mb_per_token']:.1f}",
                      f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{base / s['ms_per_token']:.2f}x")
    report_console().print(table)
    print(f"greedy outputs identical to plain decoding: {identical} of {result['prompts']}")
    for name, s in summary.items():
        if "h2d_mb_per_token" in s:
            print(f"{name}: host -> device {s['h2d_mb_per_token']:.3f} MB per decoded token")
    passes = report_passes(result, summary)
    return {"summary": summary, "identical": identical, "prompts": result["prompts"], "k": result["k"],
            "kv_tiering": result.get("kv_tiering", False), "passes": passes}


def report_passes(result: dict, summary: dict) -> dict:
    """Each pass against a target decode step, in torch ops and in time (module docstring)."""
    ops, ms, k = result["pass_ops"], dict(result["pass_ms"]), result["k"]
    plain, spec = summary["plain"], summary["MTP draft"]
    # ms: medians over the timed decode steps; the verification step's is each step's time less its passes
    ms["target"] = plain["ms_per_token"] / plain["steps_per_token"]  # ms per plain decode step
    table = Table(title="each pass against a target decode step (plain decoding's, one request)")
    for col in ("pass", "torch ops", "of a target step", "ms", "of a target step "):
        table.add_column(col)
    names = {"target": "target decode step", "verification": f"verification step (1 + {k} rows, bookkeeping)",
             "extend": "MTP extend (its cache, and draft 1)", "draft step": "draft step (each of drafts 2..K)"}
    for key, label in names.items():
        if key == "draft step" and k < 2:
            continue
        table.add_row(label, f"{ops[key]:.0f}", f"{100 * ops[key] / ops['target']:.0f}%", f"{ms[key]:.2f}",
                      f"{100 * ms[key] / ms['target']:.0f}%")
    report_console().print(table)
    drafting = ops["extend"] + (k - 1) * ops["draft step"]
    length = spec["mean_acceptance_length"] or 1.0
    bound = length * ops["target"] / (ops["verification"] + drafting)
    for name, kinds in ops["by_kind"].items():
        print(f"{name} ops by kind (the last one counted): "
              + ", ".join(f"{kind} {n}" for kind, n in list(kinds.items())[:12]))
    step = f"draft step {ops['draft step'] / ops['target']:.2f}, " if k > 1 else ""
    print(f"draft/target torch ops: {step}extend {ops['extend'] / ops['target']:.2f}, all drafting per step "
          f"{drafting / ops['target']:.2f}; speed-up these op counts allow at L = {length:.2f}: {bound:.2f}x")
    return {"ops": ops, "ms": ms, "op_bound_speedup": bound}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench spec", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint with an MTP layer (default: the bundled model)")
    p.add_argument("--prompts", type=at_least(1), default=8)
    p.add_argument("--prompt-tokens", type=at_least(1), default=512)
    p.add_argument("--max-tokens", type=at_least(3), default=64,
                   help="at least 3: the passes are timed on decode steps that draft")
    p.add_argument("--num-speculative-tokens", type=at_least(1), default=3, help="MTP draft tokens per step")
    p.add_argument("--kv-tiering", action="store_true", help="both modes with the tiered KV cache")
    p.add_argument("--device-buffer-tokens", type=int, default=None, help="with --kv-tiering (default 2 x top-k)")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("prompts", "prompt_tokens", "max_tokens"), run, report)
