"""`sparsekv bench batch`: continuous-batching decode of many requests, batched against one request
at a time (`batch_dense_decodes=False`, the baseline), both in the same run.

Dense regime (contexts below top-k, where DSA attends to every entry: most chat traffic): `--batch`
requests of `--prompt-tokens` random tokens each are prefilled, then `--steps` decode steps of the
whole batch are timed, twice per run and interleaved. Printed: ms per step, tokens/s, torch ops
dispatched per step (tools/op_count.py), the speed-up, achieved bandwidth (weights plus every
request's latents and indexer keys read per step, over the step time) against the machine's, and
whether the two paths produced the same greedy tokens and logprobs.

Sparse regime (`--sparse-prompt-tokens`, past top-k: selection, gather, tiers): torch ops per decode
step at batch 1 and `--sparse-batch`, untiered and tiered, for both paths, their ratio (what a per
request loop makes grow with the batch), ms per step and aggregate tokens/s; and the ops of one
batch-1 step by op kind. `--sparse-drafts K` runs them with MTP drafting (each step verifying up to K
drafts per request, the MTP passes counted in its ops; tokens/s from the tokens the timed steps
made), `--sparse-selector quest` with the Quest selector.

`--decode-graphs auto` (or `eager`) adds a third path in both regimes (and both caches in the sparse
one): the batched decode step as the decode graphs' fixed-shape pieces (model/decode_graphs.py; auto: replayed from CUDA graphs
on a CUDA device, the engine's path elsewhere; eager: the pieces uncaptured, to see what the padding
to buckets and to k costs), against the other two with the graphs off.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import report_console, run_bench

MODES = {"one request at a time": dict(batch_dense_decodes=False), "batched": {}}
GRAPHS = "batched, decode graphs"  # with --decode-graphs


def modes_of(args, base: dict = MODES) -> dict[str, dict]:
    """The decode paths compared, as engine options: `base` with the decode graphs off, and the batched
    path through them with --decode-graphs."""
    out = {name: dict(options, decode_graphs="off") for name, options in base.items()}
    if args.decode_graphs:
        out[GRAPHS] = {"decode_graphs": args.decode_graphs}
    return out


def decode_run(engine, args, path: str, run: int) -> dict:
    """Prefill the batch, time `--steps` decode steps, finish; ms/step and the outputs."""
    import torch
    from sparsekv import SamplingParams
    from .op_count import decode_step_ops
    g = torch.Generator().manual_seed(run)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = [f"{run}-{path}-{i}" for i in range(args.batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first token)
    assert len(engine.scheduler.running) == args.batch, "the whole batch decodes together"
    ops = decode_step_ops(engine).total  # one step counted, outside the timed ones
    launches = graph_launches(engine)
    outs, t0 = {}, time.perf_counter()
    for _ in range(args.steps):
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    ms = 1000 * (time.perf_counter() - t0) / args.steps
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return {"ms_per_step": ms, "ops_per_step": ops, "tokens": [outs[r].token_ids for r in ids],
            "logprobs": [outs[r].logprobs for r in ids], "graph_launches": launches}


def graph_launches(engine) -> int | None:
    """With the decode graphs on: what the next step launches once its pieces are replayed (the ops
    outside them, and a graph per piece); None without them."""
    from .op_count import decode_graph_step_ops
    if engine.executor.runner.graphs is None:
        return None
    return decode_graph_step_ops(engine).launches


SPARSE_PATHS = MODES
CACHES = {"untiered": {}, "tiered": {"kv_tiering": True}}


def _engine(args, batch: int, max_len: int, **options):
    from sparsekv import LLM
    from sparsekv.paths import default_model_path
    return LLM(args.model or default_model_path(), device=args.device, max_model_len=max_len, max_num_seqs=batch,
               max_num_batched_tokens=max(4096, max_len), enable_prefix_caching=False,
               num_kv_pages=batch * -(-max_len // 64),  # the whole batch
               **options).engine


def run(args) -> dict:
    import torch
    from .bench_tiers import device_bandwidth_gbps
    from .bench_worker import decode_bytes_per_step
    torch.set_num_threads(args.threads)
    max_len = args.prompt_tokens + args.steps + 8
    modes = modes_of(args)
    engines = {name: _engine(args, args.batch, max_len, **options) for name, options in modes.items()}
    engine = engines["batched"]
    topk = engine.model_config.index_topk
    if args.prompt_tokens + args.steps >= topk:  # the last timed step attends to prompt + steps + 1 entries
        raise ValueError(f"--prompt-tokens + --steps must stay below top-k ({topk}): the dense regime")
    if 0 < args.sparse_prompt_tokens <= topk:  # before any run: the dense one takes minutes at large batches
        raise ValueError(f"--sparse-prompt-tokens must be past top-k ({topk}): the sparse regime")
    runs = {name: [] for name in modes}
    for i in range(args.repeats):
        for name in modes:
            runs[name].append(decode_run(engines[name], args, name, i))
    context = args.prompt_tokens + args.steps // 2
    return {"runs": runs, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
            "step_bytes": decode_bytes_per_step(engine, context, args.batch),
            "machine_gbps": device_bandwidth_gbps(args),
            "sparse": sparse_runs(args) if args.sparse_prompt_tokens else None}


def _prefill_steps(batch: int, prompt_tokens: int, budget: int) -> int:
    """The most steps prefilling `batch` prompts takes, the first requests' decode tokens taking up to
    `batch` of each step's token budget."""
    return -(-batch * prompt_tokens // (budget - batch))


def sparse_decode(engine, args, batch: int) -> dict:
    """`batch` requests of --sparse-prompt-tokens random tokens decoding: one step's ops (by kind), then
    --sparse-steps timed steps; the greedy tokens."""
    import torch
    from sparsekv import SamplingParams
    from .op_count import decode_step_ops, fill_decoding
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(1, vocab, (args.sparse_prompt_tokens,), generator=g).tolist() for _ in range(batch)]
    # no request ends before the timed steps: the first ones decode while the last ones are prefilled
    prefill_steps = _prefill_steps(batch, args.sparse_prompt_tokens, engine.config.max_num_batched_tokens)
    per_step = 1 + engine.config.num_speculative_tokens  # the most tokens a step makes per request
    params = SamplingParams(max_tokens=per_step * (args.sparse_steps + prefill_steps + 4), temperature=0.0,
                            ignore_eos=True)
    ids = fill_decoding(engine, prompts, params)
    engine.step()  # the first decode step also promotes the prefill's last token into the working set
    ops = decode_step_ops(engine)
    launches = graph_launches(engine)
    made = -_tokens_made(engine)
    t0 = time.perf_counter()
    for _ in range(args.sparse_steps):
        engine.step()
    ms = 1000 * (time.perf_counter() - t0) / args.sparse_steps
    made += _tokens_made(engine)
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return {"ops": ops.total, "by_kind": dict(ops.by_kind), "ms_per_step": ms, "tokens": [tokens[r] for r in ids],
            "graph_launches": launches, "tokens_per_step": made / args.sparse_steps}


def _tokens_made(engine) -> int:
    """The output tokens of the running requests."""
    return sum(r.num_output_tokens for r in engine.scheduler.running)


def sparse_options(args) -> dict[str, dict]:
    """The engine options of each cache of the sparse-regime runs: with --sparse-drafts K, MTP drafting
    and over the tiered cache working sets of (1 + K) x top-k entries (what a decode and its drafts may
    select: the decode graphs' pieces need them); with --sparse-selector, that selector."""
    from sparsekv.config import ModelConfig
    from sparsekv.paths import default_model_path
    common = dict(num_speculative_tokens=args.sparse_drafts) if args.sparse_drafts else {}
    if args.sparse_selector != "dsa":
        common["selector"] = args.sparse_selector
    out = {cache: {**options, **common} for cache, options in CACHES.items()}
    if args.sparse_drafts:
        topk = ModelConfig.from_json(args.model or default_model_path()).index_topk
        out["tiered"]["device_buffer_tokens"] = (1 + args.sparse_drafts) * topk
    return out


def sparse_runs(args) -> dict:
    """Every (cache, path) at batch 1 and --sparse-batch, one engine each."""
    prefill_steps = _prefill_steps(args.sparse_batch, args.sparse_prompt_tokens, max(4096, args.sparse_prompt_tokens))
    # see `sparse_decode`
    max_len = args.sparse_prompt_tokens + (1 + args.sparse_drafts) * (args.sparse_steps + prefill_steps + 4) + 4
    out = {}
    for cache, options in sparse_options(args).items():
        for name, path in modes_of(args, SPARSE_PATHS).items():
            engine = _engine(args, args.sparse_batch, max_len, **options, **path)
            out[f"{cache}/{name}"] = {b: _median_of(engine, args, b) for b in (1, args.sparse_batch)}
    return out


def _median_of(engine, args, batch: int) -> dict:
    """`sparse_decode` --repeats times: the first run's ops and tokens, the median ms and tokens per step."""
    runs = [sparse_decode(engine, args, batch) for _ in range(args.repeats)]
    return {**runs[0], "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in runs)}


def _logprob_gap(a: list, b: list) -> float:
    return max((abs(x[t] - y[t]) for ra, rb in zip(a, b) for x, y in zip(ra, rb) for t in x), default=0.0)


def report(result: dict) -> dict:
    runs, summary = result["runs"], {}
    for name, rs in runs.items():
        ms = statistics.median(r["ms_per_step"] for r in rs)
        summary[name] = {"ms_per_step": ms, "tokens_per_s": 1000 * result["batch"] / ms,
                         "gbps": result["step_bytes"] / ms / 1e6, "ops_per_step": rs[0]["ops_per_step"],
                         "graph_launches": rs[0].get("graph_launches")}
    base = runs["one request at a time"]
    others = [rs for name, rs in runs.items() if name != "one request at a time"]
    same_tokens = all(a["tokens"] == b["tokens"] for rs in others for a, b in zip(base, rs))
    gap = max(_logprob_gap(a["logprobs"], b["logprobs"]) for rs in others for a, b in zip(base, rs))
    table = Table(title=f"decode of {result['batch']} requests of {result['prompt_tokens']} prompt tokens "
                        f"(below top-k: every entry is read), {result['steps']} steps, medians of {len(base)} runs")
    for col in ("dense-regime decodes", "ms / step", "tokens / s", "ops / step", "achieved bandwidth", "speed-up"):
        table.add_column(col)
    ref = summary["one request at a time"]["ms_per_step"]
    for name, s in summary.items():
        table.add_row(name, f"{s['ms_per_step']:.2f}", f"{s['tokens_per_s']:.0f}", _ops(s['ops_per_step'], s['graph_launches']),
                      f"{s['gbps']:.2f} GB/s ({100 * s['gbps'] / result['machine_gbps']:.0f}%)",
                      f"{ref / s['ms_per_step']:.2f}x")
    console = report_console()
    console.print(table)
    console.print(f"greedy tokens identical: {same_tokens}; largest logprob difference: {gap:.2e}")
    out = {"summary": summary, "batch": result["batch"], "prompt_tokens": result["prompt_tokens"],
           "steps": result["steps"], "identical_tokens": same_tokens, "max_logprob_diff": gap}
    if result["sparse"]:
        out["sparse"] = report_sparse(result["sparse"], console)
    return out


def report_sparse(sparse: dict, console) -> dict:
    b = max(next(iter(sparse.values())))
    table = Table(title=f"sparse-regime decode step (past top-k): torch ops and time (median ms), batch 1 and {b}")
    for col in ("cache / decode path", "ops / step, batch 1", f"ops / step, batch {b}", f"ops ratio {b} / 1",
                "ms / step, batch 1", f"ms / step, batch {b}", f"tokens / step, batch 1 / {b}",
                "aggregate tokens/s ratio"):
        table.add_column(col)
    summary = {}
    for name, r in sparse.items():
        one, many = r[1], r[b]
        made_1, made_b = one.get("tokens_per_step", 1), many.get("tokens_per_step", b)  # drafting: as they came
        summary[name] = {"ops_1": one["ops"], f"ops_{b}": many["ops"], "ops_ratio": many["ops"] / one["ops"],
                         "graph_launches_1": one.get("graph_launches"), f"graph_launches_{b}": many.get("graph_launches"),
                         "ms_1": one["ms_per_step"], f"ms_{b}": many["ms_per_step"],
                         "tokens_per_step_1": made_1, f"tokens_per_step_{b}": made_b,
                         "throughput_ratio": made_b * one["ms_per_step"] / (made_1 * many["ms_per_step"])}
        s = summary[name]
        table.add_row(name, _ops(one["ops"], one.get("graph_launches")), _ops(many["ops"], many.get("graph_launches")),
                      f"{s['ops_ratio']:.2f}", f"{s['ms_1']:.2f}",
                      f"{s[f'ms_{b}']:.2f}", f"{made_1:.2f} / {made_b:.2f}", f"{s['throughput_ratio']:.2f}x")
    console.print(table)
    same = all(r[n]["tokens"] == sparse[f"{name.split('/')[0]}/one request at a time"][n]["tokens"]
               for name, r in sparse.items() for n in (1, b))
    console.print(f"greedy tokens identical (every path / one request at a time): {same}")
    kinds = sorted(sparse["untiered/batched"][1]["by_kind"].items(), key=lambda kv: -kv[1])
    console.print(ops_by_kind_table(kinds, "ops of one batch-1 decode step by kind (untiered, batched)"))
    return {"paths": summary, "identical_tokens": same, "ops_by_kind_batch_1": dict(kinds)}


def _ops(ops: int, launches: int | None) -> str:
    """Ops per step, and what the step launches with its decode pieces replayed from CUDA graphs."""
    return f"{ops:,}" if launches is None else f"{ops:,} ({launches:,} with graphs)"


def ops_by_kind_table(kinds: list[tuple[str, int]], title: str, rows: int = 16) -> Table:
    """The `rows` most frequent op kinds with their count and share, then the rest together."""
    total = sum(n for _, n in kinds)
    table = Table(title=f"{title}: {total:,} ops")
    for col in ("op kind", "ops", "share"):
        table.add_column(col)
    rest = kinds[rows:]
    for kind, n in kinds[:rows] + ([(f"{len(rest)} other kinds", sum(n for _, n in rest))] if rest else []):
        table.add_row(kind, f"{n:,}", f"{100 * n / total:.1f}%")
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=at_least(1), default=32, help="decode steps timed")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--sparse-prompt-tokens", type=at_least(0), default=0,
                   help="prompt tokens of the sparse-regime runs, past top-k (e.g. 1024); 0 (default) skips them")
    p.add_argument("--sparse-batch", type=int, default=32, help="concurrent requests of the sparse-regime runs")
    p.add_argument("--sparse-steps", type=int, default=8, help="decode steps timed in the sparse-regime runs")
    p.add_argument("--sparse-drafts", type=at_least(0), default=0, metavar="K",
                   help="MTP drafts per step in the sparse-regime runs (the model needs an MTP layer; the bundled "
                        "one has it); over the tiered cache, working sets of (1 + K) x top-k entries (default 0)")
    p.add_argument("--sparse-selector", choices=["dsa", "quest"], default="dsa",
                   help="the token selector of the sparse-regime runs (default dsa)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on an accelerator the saving is in launches)")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--decode-graphs", choices=["auto", "eager"], default=None,
                   help="add the batched path through the decode graphs (auto: CUDA graphs on a CUDA device; "
                        "eager: their pieces uncaptured)")
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    positive = ("batch", "prompt_tokens", "steps", "repeats", "sparse_batch", "sparse_steps")
    return run_bench(build_parser(), argv, positive, run, report)
