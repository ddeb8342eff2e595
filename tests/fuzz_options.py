"""Random combinations of engine options through the soak's random workload (tests/test_engine_soak.py),
each against one plain process: a developer's tool for the combinations no test lists, not a CI step.

    PYTHONPATH=tests python tests/fuzz_options.py --trials 40 [--first 0] [--parallel]

A trial draws a family (the tiny GLM or DeepSeek checkpoint, with an MTP layer), the scheduler's
budgets, the admission, Quest or DSA, tiering and its working set, MTP drafts, the decode graphs'
pieces, batched or one-at-a-time dense-regime decodes, the prefix cache's tiers and, with --parallel, a
two-process layout (TP, DP, either with expert parallelism). It runs the workload through the step loop,
every pool's integrity checked after each step, then compares every request not aborted with the same
request alone in one process (untiered, no prefix cache; drafting and the selector as the trial's): the
same tokens, logprobs within the rounding bound (tests/tolerances.py). Greedy requests whose reference
has a near-tie are skipped. A combination the configuration refuses is listed with its reason. Exits 1
if any trial failed or differed; a trial is reproduced by its number (`--first N --trials 1`).

FP8 latents are left out: a latent computed in other row groups can round a whole e4m3 step away, so
their runs are compared by the dedicated tests (docs/numerics.md), not token for token here.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import traceback

import torch

from sparsekv import LLM
from sparsekv.tools.tiny import save_reference_checkpoint
from test_batched_decode import with_mtp_layer
from test_engine_soak import run, workload
from tolerances import assert_clear_lead, assert_logprobs_close, logprob_tolerance

LAYOUTS = [dict(tensor_parallel_size=2), dict(data_parallel_size=2),
           dict(data_parallel_size=2, enable_expert_parallel=True),
           dict(tensor_parallel_size=2, enable_expert_parallel=True)]
ALONE = dict(max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40, max_num_seqs=6)


def checkpoints(root: str) -> dict[str, str]:
    """The tiny checkpoints of both families, each with an MTP layer (tests/conftest.py's)."""
    glm, ds = os.path.join(root, "glm"), os.path.join(root, "ds")
    save_reference_checkpoint(glm, "glm_moe_dsa")
    save_reference_checkpoint(
        ds, "deepseek_v32", n_group=2, topk_group=1, n_routed_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    return {"glm": with_mtp_layer(glm, os.path.join(root, "glm-mtp")),
            "ds": with_mtp_layer(ds, os.path.join(root, "ds-mtp"))}


def options(rng: random.Random, parallel: bool) -> dict:
    o = dict(max_model_len=256, kv_page_size=4, prefill_chunk_tokens=rng.choice([8, 16, 32]),
             max_num_seqs=rng.choice([2, 4, 6]), num_kv_pages=rng.choice([28, 40, 64]),
             kv_admission=rng.choice(["reserve", "optimistic"]))
    o["max_num_batched_tokens"] = rng.choice([o["prefill_chunk_tokens"] + 4, 40, 80])
    if rng.random() < 0.5:
        o.update(selector="quest", quest_page_tokens=rng.choice([1, 2, 4]))
    drafts = rng.choice([0, 0, 1, 2, 3])
    if drafts:
        o["num_speculative_tokens"] = drafts
    if rng.random() < 0.5:  # top-k 8: a working set under (1 + drafts) x 8 entries streams (or is refused)
        o.update(kv_tiering=True, device_buffer_tokens=rng.choice([8, 16, 24, 32]) if not drafts else
                 rng.choice([16, (1 + drafts) * 8, 40]))
    if rng.random() < 0.5:
        o.update(decode_graphs="eager", cuda_graph_max_bs=rng.choice([1, 2, 4, 8]))
    if rng.random() < 0.2:  # the dense regime's decodes one request at a time
        o["batch_dense_decodes"] = False
    if rng.random() < 0.3:
        o["enable_prefix_caching"] = False
    elif rng.random() < 0.5:
        o["prefix_cache_host_bytes"] = 1 << 24
    if parallel and rng.random() < 0.5:
        o.update(rng.choice(LAYOUTS))
    return o


def draw(number: int, parallel: bool) -> tuple[str, dict]:
    """Trial `number`'s family and options."""
    rng = random.Random(number)
    return rng.choice(["glm", "ds"]), options(rng, parallel)


def trial(path: str, opts: dict, number: int) -> str:
    """"ok", "refused: why", or what differed."""
    import multiprocessing
    import torch.distributed as dist
    planned = workload(number, 256)
    try:
        llm = LLM(path, num_threads=1, **opts)
    except ValueError as e:  # ConfigError included: a combination the configuration refuses
        assert not dist.is_initialized() and not multiprocessing.active_children(), "a refused start left ranks"
        return f"refused: {e}"
    try:
        done, aborted, _ = run(llm, planned)
        stats = llm.stats()
    finally:
        llm.close()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], "pages left held"
    drafting = {key: opts[key] for key in ("num_speculative_tokens", "selector", "quest_page_tokens") if key in opts}
    alone = LLM(path, num_threads=1, enable_prefix_caching=False, **ALONE, **drafting)
    tol, differ = logprob_tolerance(alone), []
    for p in planned:
        if p.request_id in aborted:
            continue
        got, want = done[p.request_id], alone.generate([p.prompt], p.params)[0]
        if p.params.greedy:
            try:
                assert_clear_lead(want, tol)
            except AssertionError:
                continue  # a near-tie: the two may choose either token
        if got.token_ids != want.token_ids:
            differ.append(p.request_id)
        else:
            assert_logprobs_close(want.logprobs, got.logprobs, tol)
    return f"tokens differ: {differ}" if differ else "ok"


def trial_args(doc: str, trials: int, parallel: str) -> argparse.Namespace:
    """A fuzzer's command line: --trials, --first (the first trial's number), --parallel (`parallel`: what it adds)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=trials)
    parser.add_argument("--first", type=int, default=0, help="the first trial's number (its seed)")
    parser.add_argument("--parallel", action="store_true", help=parallel)
    return parser.parse_args()


def main() -> int:
    args = trial_args(__doc__, 40, "two-process layouts too (gloo)")
    paths = checkpoints(tempfile.mkdtemp(prefix="fuzz-options-"))

    def one(number: int):
        family, opts = draw(number, args.parallel)
        return f"{family} {opts}", lambda: trial(paths[family], opts, number)
    return run_trials(range(args.first, args.first + args.trials), one)


def run_trials(numbers, one) -> int:
    """Each trial `one(number)` gives (what it draws, a call that runs it: "ok", "refused: ...", or what
    differed), one thread; each is printed as it ends. 1 if any failed or differed, else 0."""
    torch.set_num_threads(1)
    failed = 0
    for number in numbers:
        drawn, run_it = one(number)
        try:
            result = run_it()
        except Exception:  # noqa: BLE001 - a trial's failure is reported, and the next one runs
            result = "failed:\n" + traceback.format_exc()
        failed += not (result == "ok" or result.startswith("refused"))
        print(f"trial {number}: {result}  {drawn}", flush=True)
    print(f"{len(numbers)} trials, {failed} failed or differed")
    return 1 if failed else 0


if __name__ == "__main__":  # the ranks' processes start by importing this module again (spawn)
    sys.exit(main())
