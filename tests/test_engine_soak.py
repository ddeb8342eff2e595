"""Random workloads through the engine's step loop, the interleavings no hand-written test lists:
requests arriving between steps, aborts a random number of steps after a request arrived (queued,
prefilling or decoding by then), prompts sharing prefixes across tenants and salts, optimistic
admission on a small pool (preemption, and recomputation from the prefix cache's tiers), tiering, MTP
drafts, the decode graphs' pieces (eager: model/decode_graphs.py), and data- and tensor-parallel
engines of two processes.

After every step every pool's integrity holds (`LLMEngine.check_integrity`); at the end the engine
is idle with every page free. Each request not aborted ends as it must (its max_tokens, as
ignore_eos asks), and its tokens equal those of the same request alone in one process, untiered, with
a reserving pool and no prefix cache (greedy and seeded sampling alike), its logprobs within the
rounding bound of regrouped rows (tests/tolerances.py)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from sparsekv import LLM, SamplingParams
from tolerances import assert_clear_lead, assert_logprobs_close, logprob_tolerance

COMMON = dict(max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40, max_num_seqs=6,
              num_kv_pages=28)
CONFIGS = {"device": {}, "tiered": dict(kv_tiering=True, device_buffer_tokens=16),
           "bundled model, MTP drafts": dict(bundled=True, num_speculative_tokens=2),
           # the decode steps of at most 4 requests as the decode graphs' pieces (eager), the others not
           "decode graphs": dict(decode_graphs="eager", cuda_graph_max_bs=4),
           "tiered, decode graphs": dict(kv_tiering=True, device_buffer_tokens=16, decode_graphs="eager",
                                         cuda_graph_max_bs=4),
           # the tiny model with an MTP layer: past its top-k (8), so its working sets miss (3 x 8 entries)
           "tiered, MTP drafts, decode graphs": dict(mtp_layer=True, kv_tiering=True, device_buffer_tokens=24,
                                                     num_speculative_tokens=2, decode_graphs="eager",
                                                     cuda_graph_max_bs=4),
           # Quest's page bounds (pages of 4 tokens) rewound past rejected drafts before the pieces
           "Quest, MTP drafts, decode graphs": dict(mtp_layer=True, selector="quest", quest_page_tokens=4,
                                                    num_speculative_tokens=2, decode_graphs="eager",
                                                    cuda_graph_max_bs=4),
           "bundled model, MTP drafts, decode graphs": dict(bundled=True, num_speculative_tokens=2,
                                                            decode_graphs="eager", cuda_graph_max_bs=4),
           # two processes over gloo: requests routed to ranks (sent with the next step, aborted before or
           # after), each rank's own prefix cache and pool; the ranks' all-reduces and vocabulary shards
           "data parallel": dict(data_parallel_size=2), "tensor parallel": dict(tensor_parallel_size=2),
           # the ranks' tokens meeting at every MoE layer, each decode step through the pieces of the
           # bucket the ranks agree on where every rank with rows can (a rank without, over padding rows)
           "data parallel, expert parallel, decode graphs": dict(data_parallel_size=2, enable_expert_parallel=True,
                                                                 decode_graphs="eager", cuda_graph_max_bs=4)}
PARALLEL = ("data parallel", "tensor parallel", "data parallel, expert parallel, decode graphs")


@dataclass
class Planned:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant: str
    cache_salt: str | None
    arrives: int  # the step before which it is added
    aborted_after: int | None  # steps after its arrival at which it is aborted, if still running


def workload(seed: int, vocab: int) -> list[Planned]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(rng.randint(8, 40))] for _ in range(3)] + [[]]
    planned = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
        greedy = rng.random() < 0.7
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0 if greedy else 0.8,
                                seed=None if greedy else rng.randrange(1 << 16), logprobs=2, ignore_eos=True)
        planned.append(Planned(f"r{i}", prompt, params, rng.choice(["alice", "bob"]), rng.choice([None, "salt"]),
                               rng.randint(0, 8), rng.randint(0, 12) if rng.random() < 0.25 else None))
    return planned


def run(llm, planned: list[Planned]) -> tuple[dict, set, int]:
    """The workload through `llm`'s step loop, integrity checked after every step: (each finished
    request's final output, the requests aborted while unfinished, steps)."""
    engine, done, aborted, step = llm.engine, {}, set(), 0
    while step <= max(p.arrives for p in planned) or engine.has_unfinished_requests():
        for p in planned:
            if p.arrives == step:
                engine.add_request(p.request_id, p.prompt, p.params, tenant=p.tenant, cache_salt=p.cache_salt)
            if p.aborted_after is not None and step == p.arrives + p.aborted_after and p.request_id not in done:
                assert engine.abort(p.request_id)
                aborted.add(p.request_id)
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
        step += 1
        assert step < 2000, "the workload did not finish"
    return done, aborted, step


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_random_workload_keeps_every_pool_intact_and_every_output_exact(glm_ckpt, config, seed, tmp_path):
    from sparsekv.paths import default_model_path
    from test_batched_decode import with_mtp_layer
    if config in PARALLEL and seed == 2:
        pytest.skip("two seeds for a parallel layout: each starts two processes")
    options = dict(CONFIGS[config])
    bundled, mtp_layer = options.pop("bundled", False), options.pop("mtp_layer", False)
    path, vocab = (default_model_path(), 4096) if bundled else (glm_ckpt[0], 256)
    if mtp_layer:
        path = with_mtp_layer(path, str(tmp_path / "mtp"))
    planned = workload(seed, vocab)
    llm = LLM(path, kv_admission="optimistic", prefix_cache_host_bytes=1 << 24, **COMMON, **options)
    try:
        done, aborted, _ = run(llm, planned)
        stats = llm.stats()
    finally:
        llm.close()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert set(done) | aborted == {p.request_id for p in planned} and not set(done) & aborted
    # what the workload is for (its drafts' acceptance, so its schedule, depends on argmaxes without a
    # clear lead: with MTP only that it drafted)
    assert aborted and stats["prefix_cache_hits_device"] + stats["prefix_cache_hits_host"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 0 if "num_speculative_tokens" in options else stats["preemptions"] > 0
    assert stats.get("decode_graph_steps", 0) > 0 if "decode_graphs" in options else "decode_graph_steps" not in stats
    # one process, untiered, with the workload's selector; drafting too if the workload's engine drafts
    # (a seeded sampled request's draws are a drafting engine's rejection sampling there, not plain sampling)
    drafting = {key: options[key] for key in ("num_speculative_tokens", "selector", "quest_page_tokens")
                if key in options}
    alone = LLM(path, enable_prefix_caching=False, **{**COMMON, "num_kv_pages": None}, **drafting)
    tol = logprob_tolerance(alone)  # batches, prefix hits, recomputation and tensor shards group rows differently
    for p in planned:
        if p.request_id in aborted:
            continue
        got, want = done[p.request_id], alone.generate([p.prompt], p.params)[0]
        assert got.finish_reason == "length" and len(got.token_ids) == p.params.max_tokens
        if p.params.greedy:
            assert_clear_lead(want, tol)
        assert got.token_ids == want.token_ids, p.request_id
        assert_logprobs_close(want.logprobs, got.logprobs, tol)
