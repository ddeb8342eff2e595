"""Speculative decoding with the MTP layer: greedy output identical to plain decoding, drafts equal to
the MTP layer run over the whole sequence at once and every draft step to a reference chain
(mtp_reference.py), rejection sampling exact (statistically bounded), vLLM's counters, clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from sparsekv import LLM, ConfigError, SamplingParams
from sparsekv.paths import default_model_path
from sparsekv.sampling import draw, filter_logits
from sparsekv.speculative import Draft, verify_draft
from tolerances import assert_same_greedy, logit_tolerance, logprob_tolerance

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
# small chunks and token budget: prefill in several chunks, and steps where a draft does not fit
OPTIONS = dict(max_model_len=512, prefill_chunk_tokens=8, max_num_batched_tokens=20, max_num_seqs=3)


@pytest.fixture(scope="module")
def model():
    return default_model_path()


def _idle(llm):
    """No request left: every page free, and no drafts or per-request counters kept for a finished one."""
    llm.engine.check_integrity()
    s = llm.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and not llm.engine.speculator.drafts
    assert not llm.engine.speculator.counts


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_plain_greedy(model, k):
    plain = LLM(model, **OPTIONS).generate(PROMPTS, GREEDY)
    llm = LLM(model, num_speculative_tokens=k, **OPTIONS)
    spec = llm.generate(PROMPTS, GREEDY)
    # verification runs 1 + k rows where plain decoding runs 1: other row groups, other rounding
    assert_same_greedy(plain, spec, logprob_tolerance(llm))
    for a, b in zip(plain, spec):
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert b.metrics["spec_decode_num_draft_tokens"] > 0
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    _idle(llm)


def test_a_stop_inside_accepted_drafts_ends_the_output_there(model):
    """A stop token id or a stop string that an accepted draft completes ends the output where plain
    decoding ends it: the drafts accepted after it are not output."""
    plain_llm, llm = LLM(model, **OPTIONS), LLM(model, num_speculative_tokens=3, **OPTIONS)
    full = plain_llm.generate(PROMPTS, GREEDY)
    params = []
    for out in full:
        mid = out.token_ids[len(out.token_ids) // 2]
        params.append(SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[mid]))
        text = out.text[len(out.text) // 2:len(out.text) // 2 + 2]
        params.append(SamplingParams(max_tokens=32, temperature=0.0, stop=[text]))
    prompts = [p for p in PROMPTS for _ in range(2)]
    want, got = plain_llm.generate(prompts, params), llm.generate(prompts, params)
    assert all(w.finish_reason == "stop" for w in want)  # what makes this test one
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                           w.stop_reason)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    _idle(llm)


def _vllm_counters(steps: list[tuple[int, int]], k: int) -> dict:
    """vLLM's counters from (drafts fed to the target, drafts accepted) of each verification step."""
    return {"spec_decode_num_drafts": len(steps), "spec_decode_num_draft_tokens": sum(n for n, _ in steps),
            "spec_decode_num_accepted_tokens": sum(a for _, a in steps),
            "spec_decode_num_accepted_tokens_per_pos": [sum(a > i for _, a in steps) for i in range(k)]}


def test_counters_are_vllms(model):
    """spec_decode_* counted as vLLM counts them, from what the engine visibly did: per verification
    step, the drafts scheduled into it (all of them, also those after a rejection; fewer than proposed
    where the token budget cut the tail) and the tokens it emitted (accepted drafts + 1: no stop ends a
    step early here). Per request and in total."""
    k = 3  # three decodes of 1 + 3 rows in a budget of 10: some steps feed fewer drafts than proposed
    llm = LLM(model, num_speculative_tokens=k, **dict(OPTIONS, max_num_batched_tokens=10))
    engine, scheduled, real_schedule = llm.engine, [], llm.engine.scheduler.schedule
    budget_cut, steps, final = [], {str(i): [] for i in range(len(PROMPTS))}, {}

    def schedule():
        step = real_schedule()
        scheduled[:] = step.chunks
        for ch in scheduled:  # drafts the MTP layer proposed that did not fit in this step
            budget_cut.append(len(engine.speculator.drafts.get(ch.request_id, ())) - ch.num_draft_tokens)
        return step
    engine.scheduler.schedule = schedule
    for rid, prompt in zip(steps, PROMPTS):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = {o.request_id: o for o in engine.step()}
        for ch in scheduled:
            rid = ch.request.request_id
            if ch.samples_token and ch.num_draft_tokens:
                steps[rid].append((ch.num_draft_tokens, len(outputs[rid].new_token_ids) - 1))
        final.update({rid: o.metrics for rid, o in outputs.items() if o.finished})
    every_step = [step for per_request in steps.values() for step in per_request]
    assert any(n > 0 for n in budget_cut), "no step where the budget cut the drafts"
    assert any(a + 1 < n for n, a in every_step), "no step with drafts after its first rejection"
    for rid, expected in steps.items():
        assert {key: final[rid][key] for key in _vllm_counters(expected, k)} == _vllm_counters(expected, k)
    stats, expected = llm.stats(), _vllm_counters(every_step, k)
    assert {key: stats[key] for key in expected} == expected
    accepted, drafts = expected["spec_decode_num_accepted_tokens"], expected["spec_decode_num_drafts"]
    assert stats["spec_decode_acceptance_rate"] == accepted / expected["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_mean_acceptance_length"] == 1 + accepted / drafts
    _idle(llm)


def test_penalised_greedy_with_drafts_equals_plain(model):
    """Each verified row is adjusted with the tokens accepted before it: with penalties, a logit bias
    and min_tokens, drafting still gives plain decoding's tokens and logprobs."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias={11: 2.0}, min_tokens=20)
    plain = LLM(model, **OPTIONS).generate(PROMPTS, params)
    unpenalised = LLM(model, **OPTIONS).generate(PROMPTS, GREEDY)
    llm = LLM(model, num_speculative_tokens=3, **OPTIONS)
    spec = llm.generate(PROMPTS, params)
    # the logprobs are the raw model's while the penalised logits decide: no top-1 lead to check there
    assert_same_greedy(plain, spec, logprob_tolerance(llm), lead=False)
    assert [a.finish_reason for a in plain] == [b.finish_reason for b in spec]
    assert [o.token_ids for o in plain] != [o.token_ids for o in unpenalised]
    assert 0 < llm.stats()["spec_decode_num_accepted_tokens"]
    _idle(llm)


@pytest.mark.parametrize("repeat", [1, 20])  # 20: past index_topk (256), so the MTP indexer selects
def test_drafts_equal_the_mtp_layer_over_the_whole_sequence(model, repeat):
    """Each step's draft comes from the MTP cache built step by step; running the MTP layer over the
    finished sequence in one pass (its own fresh cache) must predict the same tokens."""
    from sparsekv.cache.pool import KVPool
    from sparsekv.context import ForwardContext, SeqSlice
    from sparsekv.speculative import MTPDrafter
    llm = LLM(model, num_speculative_tokens=2, **OPTIONS)
    drafts = []
    spec = llm.engine.speculator
    real = spec.draft

    def record(chunks, generators):
        real(chunks, generators)
        for ch in chunks:
            req = ch.request
            if req.draft_token_ids:  # the first draft: from the extend step's cache
                drafts.append((req.num_tokens, req.draft_token_ids[0]))  # (position drafted, token)
    spec.draft = record
    out = llm.generate([PROMPTS[1] * repeat], GREEDY)[0]
    assert (len(out.prompt_token_ids) > llm.engine.model.cfg.index_topk) == (repeat > 1)
    ids = out.prompt_token_ids + out.token_ids
    m, n = llm.engine.model, len(ids)
    cfg = m.cfg
    layers = list(range(cfg.num_hidden_layers + 1))
    cache = KVPool(cfg, -(-n // 64), 64, m.dtype, m.device, layers, cfg.full_layers + [cfg.num_hidden_layers])
    slots = torch.arange(n)

    def ctx_for(count, rows):
        seq = SeqSlice("x", 0, count, count, slots[:count], runs=((0, 0, count),))
        return ForwardContext(torch.tensor(ids[:count]), torch.arange(count), slots[:count], [seq], rows)
    with torch.inference_mode():
        hidden = m.hidden_states(ctx_for(n, torch.arange(n)), cache)
        ctx = ctx_for(n - 1, torch.arange(n - 1))
        logits, _ = MTPDrafter(m, None, None, 1).forward(hidden[:n - 1], torch.tensor(ids[1:n]), ctx, cache)
    predicted = {p + 2: int(logits[p].argmax()) for p in range(n - 1)}  # row p predicts token p + 2
    assert len(drafts) > 10
    for position, token in drafts:
        assert predicted[position] == token, f"draft for position {position}"


def _target_hidden(model, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states over the whole sequence, in one pass over a fresh cache."""
    from sparsekv.cache.pool import KVPool
    from sparsekv.context import ForwardContext, SeqSlice
    cfg, n = model.cfg, len(ids)
    cache = KVPool(cfg, -(-n // 64), 64, model.dtype, model.device, list(range(cfg.num_hidden_layers)),
                   cfg.full_layers)
    slots = torch.arange(n)
    seq = SeqSlice("x", 0, n, n, slots, runs=((0, 0, n),))
    with torch.inference_mode():
        return model.hidden_states(ForwardContext(torch.tensor(ids), torch.arange(n), slots, [seq], torch.arange(n)),
                                   cache)


# repeat 20: past index_topk (256), so the chain reuses a real top-k; K = 2: a single draft step, which
# computes its own rotary embedding (K >= 3 computes every step's at once)
@pytest.mark.parametrize("k, repeat", [(3, 1), (3, 20), (2, 1)])
def test_every_draft_step_equals_a_reference_mtp_chain(model, k, repeat):
    """Every position of the engine's K-step draft chain against tests/mtp_reference.py (transformers'
    modules for the MTP layer, attention written out over the extend row's selection): steps 2..K
    take the previous step's normed hidden and draft, sit one position further, and attend to the
    extend row's positions only (index reuse; no draft-made entries)."""
    from mtp_reference import ReferenceMTP
    llm = LLM(model, num_speculative_tokens=k, **OPTIONS)
    executor, chains = llm.engine.executor, []
    real_extend, real_step = executor.draft_extend, executor.draft_step

    def extend(plan):
        logits = real_extend(plan)
        if plan.drafting:
            _, _, start, next_tokens = plan.parts[plan.drafting[0]]
            chains.append((start + len(next_tokens), [logits[0].clone()]))
        return logits

    def step(index, tokens):
        logits = real_step(index, tokens)
        chains[-1][1].append(logits[0].clone())
        return logits
    executor.draft_extend, executor.draft_step = extend, step
    out = llm.generate([PROMPTS[1] * repeat], GREEDY)[0]
    ids = out.prompt_token_ids + out.token_ids
    assert (len(out.prompt_token_ids) > llm.engine.model.cfg.index_topk) == (repeat > 1)
    hidden, reference = _target_hidden(llm.engine.model, ids), ReferenceMTP(model)
    assert len(chains) > 8 and all(len(logits) == k for _, logits in chains)
    # the engine's target hidden states come from other row groups than the one-pass reference's, then
    # the MTP layer (its head norm is no larger than the final norm logit_scale uses)
    tol = logit_tolerance(llm, extra_layers=1)
    for known, logits in chains:
        drafts = [int(x.argmax()) for x in logits[:-1]]
        expected = reference.chain(ids, hidden, known, drafts)
        for step_index, (ours, ref) in enumerate(zip(logits, expected, strict=True)):
            err = float((ours - ref).abs().max())  # fp32 both; absorbed vs decompressed MLA: rounding only
            assert err < tol, f"draft step {step_index + 1} after {known} positions: logits differ by {err}"


# verify_draft's statistical check: a target p (the logits at temperature 0.8) and a draft q that
# disagree, so that acceptance (sum min(p, q) = 0.40) and the residual both matter.
TARGET_LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
TEMPERATURE = 0.8
DRAFT_Q = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
DRAWS = 20000
FAILURE = 5e-7  # per bound; two bounds: the check fails a correct verifier with probability <= 1e-6


def _tv_bound(draws: int, categories: int, failure: float) -> float:
    """eps with P(TV(empirical, true) >= eps) <= failure for `draws` i.i.d. draws over `categories`
    outcomes (Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= l) <= 2^m exp(-n l^2 / 2), TV = L1 / 2)."""
    return math.sqrt((categories * math.log(2) + math.log(1 / failure)) / (2 * draws))


def _rate_bound(draws: int, failure: float) -> float:
    """t with P(|rate_hat - rate| >= t) <= failure for a binomial rate (Hoeffding, two-sided)."""
    return math.sqrt(math.log(2 / failure) / (2 * draws))


def _rejection_sampling_errors(verify) -> list[str]:
    """What a verifier gets wrong, statistically: its emitted tokens must be distributed as p (TV
    bound) and it must accept the draft at rate sum_x min(p(x), q(x)) (binomial bound). Fixed seed."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=TEMPERATURE)
    p = (TARGET_LOGITS / TEMPERATURE).softmax(-1)
    counts, accepted = torch.zeros(len(p)), 0
    for d in torch.multinomial(DRAFT_Q, DRAWS, replacement=True, generator=g).tolist():
        token, ok = verify(TARGET_LOGITS, Draft(d, DRAFT_Q), params, g)
        assert token == d or not ok
        counts[token] += 1
        accepted += ok
    errors = []
    tv, tv_bound = 0.5 * float((counts / DRAWS - p).abs().sum()), _tv_bound(DRAWS, len(p), FAILURE)
    if tv >= tv_bound:
        errors.append(f"emitted tokens: TV {tv:.4f} from the target, bound {tv_bound:.4f}")
    rate, expected = accepted / DRAWS, float(torch.minimum(p, DRAFT_Q).sum())
    if abs(rate - expected) >= _rate_bound(DRAWS, FAILURE):
        errors.append(f"acceptance {rate:.4f}, expected {expected:.4f}")
    return errors


def test_rejection_sampling_accepts_min_p_q_and_emits_the_target_distribution():
    """Accept with min(1, p/q), else draw from normalise((p - q)+): tokens distributed as p, and the
    acceptance rate sum_x min(p, q) (Leviathan et al. 2023)."""
    assert _rejection_sampling_errors(verify_draft) == []


def _always_reject(target_logits, draft, params, generator):
    """Wrong: never accepts, draws from p (its tokens are still distributed as p)."""
    return draw(filter_logits(target_logits, params).softmax(-1), generator), False


def _no_residual(target_logits, draft, params, generator):
    """Wrong: accepts with min(1, p/q) but draws a rejected position from p, not from (p - q)+."""
    p, q = filter_logits(target_logits, params).softmax(-1), draft.probs
    if float(torch.rand((), generator=generator)) * float(q[draft.token]) < float(p[draft.token]):
        return draft.token, True
    return draw(p, generator), False


@pytest.mark.parametrize("verify, caught", [(_always_reject, "acceptance"), (_no_residual, "emitted tokens")],
                         ids=["always-reject", "no-residual"])
def test_rejection_sampling_check_catches_wrong_verifiers(verify, caught):
    """The check above can fail: each wrong verifier trips exactly the bound it breaks."""
    errors = _rejection_sampling_errors(verify)
    assert len(errors) == 1 and errors[0].startswith(caught), errors


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([0.1, 3.0, 0.2])
    g = torch.Generator()
    assert verify_draft(logits, Draft(1, None), SamplingParams(temperature=0.0), g) == (1, True)
    assert verify_draft(logits, Draft(2, None), SamplingParams(temperature=0.0), g) == (1, False)


def test_a_rejection_where_q_covers_p_everywhere_draws_from_p():
    """A draft whose q is at least p on every token (as where p == q up to rounding; here q's mass on
    the draft is doubled) leaves no residual mass (p - q)+: a rejection there draws from p itself, so
    the emitted token is always one p allows (top-k keeps 2 of 5 tokens here), never the token that
    a division by the zero residual would pick."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=2)
    p = filter_logits(logits, params).softmax(-1)
    q = p.clone()
    q[0] = 2 * p[0]  # p(d) / q(d) = 1/2: rejected about half the time, and q >= p everywhere
    support = set(p.nonzero()[:, 0].tolist())
    rejected = 0
    for seed in range(64):
        token, accepted = verify_draft(logits, Draft(0, q), params, torch.Generator().manual_seed(seed))
        assert token in support, (seed, token)
        rejected += not accepted
    assert rejected > 0  # what makes this test one


def test_seeded_sampling_with_drafts_is_reproducible_and_aborts_free_everything(model):
    llm = LLM(model, num_speculative_tokens=3, **OPTIONS)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    engine = llm.engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(6):
        engine.step()
    assert engine.abort("x")
    _idle(llm)


@pytest.mark.parametrize("budget", [6, 7])
def test_a_seeded_request_draws_the_same_whatever_shares_its_steps(model, budget):
    """`seed` makes a request reproducible whatever else shares the batch, with drafts too: a token
    budget that cannot fit every request's 1 + K rows defers a seeded request's drafts whole (they had
    been cut, and its verification then drew other numbers than alone)."""
    llm = LLM(model, num_speculative_tokens=3, max_model_len=512, prefill_chunk_tokens=8,
              max_num_batched_tokens=budget, max_num_seqs=4)
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i) for i in range(len(PROMPTS))]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert together == alone
    _idle(llm)


LONG = [PROMPTS[1] * 24, PROMPTS[2] * 12]  # 384 and 300 tokens: past index_topk (256), so full layers select


SAMPLED = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=5, logprobs=2)


@pytest.mark.parametrize("selector, buffer", [("dsa", 256), ("dsa", 512), ("quest", 256)])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tiering_with_drafts_is_exact(model, params, selector, buffer, monkeypatch):
    """The tiered cache with speculative decoding computes what the device-only cache computes, bit for
    bit, with either selector (the MTP layer keeps its own DSA indexer under Quest). A verification
    step (the newest token and its drafts) resolves the union of its rows' selections in the working
    set, or streams from the host store when the union exceeds N (at N = top-k both happen); the MTP
    layer resolves in its own working set too."""
    from sparsekv.cache.tiers import TieredKVPool
    paths, plan = set(), TieredKVPool._plan

    def spy(self, leader, seq, positions, src, dst):
        rows = plan(self, leader, seq, positions, src, dst)
        paths.add(("mtp" if leader in self.mtp_layers else seq.num_new_tokens > 1, rows is not None))
        return rows
    monkeypatch.setattr(TieredKVPool, "_plan", spy)
    _check_tiered_drafting(model, params, selector, buffer, "cpu")
    assert (True, True) in paths and ("mtp", True) in paths
    if selector == "dsa":
        assert ((True, False) in paths) == (buffer == 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tiering_with_drafts_is_exact_on_cuda(model, params):
    """Sampled too: a rejected sampled draft compares the target's probabilities with the draft's."""
    _check_tiered_drafting(model, params, "dsa", 256, "cuda")


def test_tiering_with_drafts_is_exact_under_emulated_cuda_ordering(model, emulated_cuda):
    """The CUDA test above on this CPU: backups and shared layers' fetches land as late as CUDA allows
    (conftest.emulated_cuda), through verification chunks and the MTP layer's own pass."""
    _check_tiered_drafting(model, GREEDY, "dsa", 256, "cpu")
    assert emulated_cuda["backups"] > 0 and emulated_cuda["fetches"] > 0


def _check_tiered_drafting(model, params, selector, buffer, device):
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, selector=selector, device=device)
    ref = LLM(model, num_speculative_tokens=2, **options).generate(prompts, params)
    llm = LLM(model, num_speculative_tokens=2, kv_tiering=True, device_buffer_tokens=buffer, **options)
    outs = llm.generate(prompts, params)
    for a, b in zip(ref, outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                    "spec_decode_num_accepted_tokens_per_pos"):  # the same drafts, too
            assert a.metrics[key] == b.metrics[key]
        assert b.metrics["spec_decode_num_draft_tokens"] > 0 and b.metrics["d2h_bytes"] > 0
    stats, cache = llm.stats(), llm.engine.kv.pool
    assert min(len(outs[0].prompt_token_ids), len(outs[2].prompt_token_ids)) > llm.engine.model.cfg.index_topk
    assert stats["tier_misses"] > 0 and stats["h2d_bytes"] > 0 and cache.mtp_layers
    if params is GREEDY:  # and both equal plain decoding
        plain = LLM(model, **options).generate(prompts, params)
        assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    _idle(llm)
    cache.check_integrity(set())


def test_quest_drafting_with_requests_left_out_of_steps_equals_plain_quest(model):
    """A token budget below the running requests' rows leaves drafting requests out of steps: each then
    goes on from a copy of its own rows' Quest bounds (not the step's tensors: its integrity check,
    after every step), and the tokens are plain Quest's."""
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=4, selector="quest")
    plain = LLM(model, **options).generate(prompts, GREEDY)
    llm = LLM(model, num_speculative_tokens=3, **options)
    engine, left_out = llm.engine, 0
    quest = engine.executor.runner.model.layers[0].attn.selector
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.check_integrity()
        latest = quest._holders.get(0, (None,))[0]
        left_out += sum(bool(layers.get(0)) and layers[0][0][3] is not latest for layers in quest._last.values())
    assert left_out > 0
    assert_same_greedy(plain, [done[str(i)] for i in range(len(prompts))], logprob_tolerance(llm))
    _idle(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_quest_with_drafts_equals_plain_quest(model, k):
    """Quest's page bounds are min/max accumulators: a rejected draft's latent must not stay in them.
    Past top-k (so Quest selects), drafting gives plain decoding's tokens, and keeps nothing after."""
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, selector="quest")
    plain = LLM(model, **options).generate(prompts, GREEDY)
    llm = LLM(model, num_speculative_tokens=k, **options)
    spec = llm.generate(prompts, GREEDY)
    assert_same_greedy(plain, spec, logprob_tolerance(llm))
    assert llm.stats()["spec_decode_num_draft_tokens"] > llm.stats()["spec_decode_num_accepted_tokens"] > 0
    _idle(llm)


def test_tiering_with_drafts_counts_the_mtp_layer(model):
    """Host, indexer and working-set bytes include the MTP layer's; a working set holds one more
    new-token row per draft."""
    plain = LLM(model, kv_tiering=True, max_model_len=512).engine.kv.pool
    spec = LLM(model, kv_tiering=True, num_speculative_tokens=1, max_model_len=512).engine.kv.pool
    cfg = spec.cfg
    row = cfg.latent_dim * spec.dtype.itemsize
    assert spec.latent_bytes_per_token() == plain.latent_bytes_per_token() + row
    assert spec.index_bytes_per_token() == plain.index_bytes_per_token() + cfg.index_head_dim * spec.dtype.itemsize
    assert plain.working_set_bytes() == (plain.device_buffer_tokens + 1) * row * cfg.num_hidden_layers
    assert spec.working_set_bytes() == (spec.device_buffer_tokens + 2) * row * (cfg.num_hidden_layers + 1)


def test_configuration_errors(model, glm_ckpt):
    with pytest.raises(ConfigError, match="needs a checkpoint with an MTP layer"):
        LLM(glm_ckpt[0], num_speculative_tokens=1)
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer in"):
        LLM(model, num_speculative_tokens=9)


@pytest.mark.parametrize("tiering", [[], ["--kv-tiering"]], ids=["device", "tiered"])
def test_bench_spec_reports_identical_greedy_outputs(tmp_path, capsys, tiering):
    import json
    from sparsekv.tools.bench_spec import main
    out = tmp_path / "spec.json"
    assert main(["--prompts", "2", "--prompt-tokens", "64", "--max-tokens", "8", "--json", str(out)] + tiering) == 0
    result = json.loads(out.read_text())
    assert result["kv_tiering"] == bool(tiering)
    assert ("h2d_mb_per_token" in result["summary"]["MTP draft"]) == bool(tiering)
    assert result["identical"] == result["prompts"] == 2
    s = result["summary"]["MTP draft"]
    # a decode step emits one token plus the drafts it accepted (ignore_eos, no stop: none is cut off)
    assert s["num_accepted_tokens"] == s["decode_tokens"] - s["decode_steps"] > 0
    assert s["num_drafts"] <= s["decode_steps"] and s["num_drafts"] < s["num_draft_tokens"] <= 3 * s["num_drafts"]
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
    assert s["acceptance"] == s["num_accepted_tokens"] / s["num_draft_tokens"]
    assert s["mean_acceptance_length"] == 1 + s["num_accepted_tokens"] / s["num_drafts"]
    assert result["summary"]["plain"]["acceptance"] is None and result["summary"]["plain"]["steps_per_token"] == 1
    assert "greedy outputs identical to plain decoding: 2 of 2" in capsys.readouterr().out


def test_acceptance_counters_reach_prometheus_as_vllm_names():
    from sparsekv.server.metrics import ServerMetrics
    from sparsekv.speculative import SpecDecodingCounts
    counts = SpecDecodingCounts(3)
    for fed, accepted in ((3, 2), (3, 0), (2, 2)):
        counts.observe_step(fed)
        for position in range(accepted):
            counts.observe_accepted(position)
    text = ServerMetrics("m", counts.metrics, lambda: True).render().decode()
    for line in ('sparsekv:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'sparsekv:spec_decode_num_draft_tokens_total{model_name="m"} 8.0',
                 'sparsekv:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0',
                 'sparsekv:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
                 'sparsekv:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0',
                 'sparsekv:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 0.0',
                 'sparsekv:spec_decode_acceptance_rate{model_name="m"} 0.5',
                 'sparsekv:spec_decode_mean_acceptance_length{model_name="m"} 2.333'):
        assert line in text, line


def test_before_any_verification_step_every_figure_reads_zero():
    """No verification step yet: the counters are 0 and so are the rates (no acceptance length of 1 for
    steps that never ran), as the data-parallel engine's merge of its lanes reports them (parallel/lanes.py)."""
    from sparsekv.speculative import SpecDecodingCounts
    assert SpecDecodingCounts(2).metrics() == {
        "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
        "spec_decode_num_accepted_tokens_per_pos": [0, 0], "spec_decode_acceptance_rate": 0.0,
        "spec_decode_mean_acceptance_length": 0.0}


def test_server_streams_drafted_tokens_and_exports_acceptance(model):
    """Several tokens per engine step reach a streaming client in order, equal to plain greedy."""
    import json

    import httpx
    from test_server_util import ThreadServer, scrape, scrape_labelled, wait_until
    body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = LLM(model, max_model_len=256).generate([PROMPTS[2]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True))[0]
    with ThreadServer(model, num_speculative_tokens=2) as srv:
        text = ""
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        stats = srv.engine.stats()
        counters = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        assert wait_until(lambda: all(scrape(srv.url)[f"sparsekv:{key}_total"] == stats[key] for key in counters))
        per_position = scrape_labelled(srv.url, "position")["sparsekv:spec_decode_num_accepted_tokens_per_pos_total"]
    assert text == plain.text
    assert per_position == {str(i): a for i, a in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])}
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    srv.engine.check_integrity()


def test_device_budget_counts_the_mtp_layer(model):
    budget = 4 << 20
    plain = LLM(model, device_kv_budget_bytes=budget, max_model_len=256).engine
    spec = LLM(model, device_kv_budget_bytes=budget, max_model_len=256, num_speculative_tokens=1).engine
    for engine in (plain, spec):
        per_token = engine.kv.pool.latent_bytes_per_token() + engine.kv.pool.index_bytes_per_token()
        assert engine.kv.allocator.num_pages * engine.kv.page_size * per_token <= budget
    assert spec.kv.allocator.num_pages < plain.kv.allocator.num_pages


@pytest.mark.parametrize("tiering", [False, True])
def test_batched_selection_of_drafting_decodes_equals_per_request(model, tiering, monkeypatch):
    """Verification rows (the newest token and its drafts) join the accelerator's batched decode
    selection; forced on here, drafting gives the same tokens, logprobs and drafts bit for bit."""
    from sparsekv.model.selectors import DSASelector
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, num_speculative_tokens=2,
                   kv_tiering=tiering)
    ref = LLM(model, **options).generate(prompts, GREEDY)
    shapes, real = [], DSASelector.select_group

    def spy(self, layer, seqs, state, q, positions, k, cache, major):
        shapes.append(tuple(state[0].shape[:2]))
        return real(self, layer, seqs, state, q, positions, k, cache, major)
    monkeypatch.setattr(DSASelector, "select_group", spy)
    monkeypatch.setattr(DSASelector, "batch_decode", True)
    outs = LLM(model, **options).generate(prompts, GREEDY)
    for a, b in zip(ref, outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        key = "spec_decode_num_accepted_tokens_per_pos"
        assert a.metrics[key] == b.metrics[key]
    assert any(rows == 3 for _, rows in shapes), "no batch held a verification chunk"


def test_a_draft_step_dispatches_at_most_30_percent_of_a_target_steps_ops(model):
    """Counted, not timed (tools/op_count.py), on the bundled model with one request past top-k: a draft
    step (each of drafts 2..K) dispatches at most 30 % of the torch ops of a target decode step, and a
    step's whole drafting (the MTP extend pass and K - 1 draft steps) at most 30 % per draft token."""
    from sparsekv.tools.bench_spec import pass_ops
    k, options = 3, dict(max_model_len=1024, max_num_seqs=1)
    plain, drafting = LLM(model, **options).engine, LLM(model, num_speculative_tokens=k, **options).engine
    prompt = [5 + (7 * i) % 4000 for i in range(600)]
    assert len(prompt) > plain.model_config.index_topk
    ops = pass_ops(plain, drafting, prompt, steps=3)
    assert 0 < ops["draft step"] <= 0.30 * ops["target"], ops
    assert ops["extend"] + (k - 1) * ops["draft step"] <= k * 0.30 * ops["target"], ops


def test_a_batch_of_drafts_is_each_requests_own_draft():
    """draft_rows decides a step's drafts at once (one argmax; one filter, softmax and draw for the
    sampled rows): each row's token and q are what that request would draw alone with its generator."""
    from types import SimpleNamespace
    from sparsekv.sampling import draw, make_generator
    from sparsekv.speculative import draft_rows
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=10, seed=1),
              SamplingParams(temperature=1.3, top_p=0.8, seed=2), SamplingParams(temperature=1.0, min_p=0.1, seed=3)]
    reqs = [SimpleNamespace(request_id=str(i), params=p) for i, p in enumerate(params)]
    for trial in range(20):
        batch = draft_rows(logits, reqs, {str(i): make_generator(100 * trial + i) for i in range(4)})
        assert batch[0].token == int(logits[0].argmax()) and batch[0].probs is None
        for i in range(1, 4):
            q = filter_logits(logits[i], params[i]).softmax(-1)
            assert torch.equal(batch[i].probs, q)
            assert batch[i].token == draw(q, make_generator(100 * trial + i))


def test_sampled_verification_with_a_one_hot_target_gives_greedys_tokens(model):
    """top_k=1 makes a sampled request's target distribution p one-hot on its (adjusted) argmax, so
    rejection sampling must emit exactly plain greedy decoding's tokens whatever the drafts and the
    draws: a draft is accepted iff it is the argmax, and a rejected position and the bonus token are
    drawn from p (the argmax). Exercises the sampled path (p from the verified row after penalties, a
    logit bias and min_tokens, as the MTP drafts are not adjusted; the token at a rejection; the bonus
    row) with greedy's exact oracle."""
    adjust = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={11: 2.0},
                  min_tokens=20)
    plain, llm = LLM(model, **OPTIONS), LLM(model, num_speculative_tokens=3, **OPTIONS)
    for extra in ({}, adjust):
        greedy = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, **extra)
        one_hot = SamplingParams(max_tokens=32, temperature=0.9, top_k=1, seed=3, logprobs=2, **extra)
        before = llm.stats()
        want, got = plain.generate(PROMPTS, greedy), llm.generate(PROMPTS, one_hot)
        # penalised: the logprobs are the raw model's while the adjusted logits decide (no lead to check)
        assert_same_greedy(want, got, logprob_tolerance(llm), lead=not extra)
        assert [w.finish_reason for w in want] == [g.finish_reason for g in got]
        stats = {key: llm.stats()[key] - before[key] for key in ("spec_decode_num_accepted_tokens",
                                                                  "spec_decode_num_draft_tokens")}
        # drafts both accepted and rejected, the rejections not only at the first position
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        per_pos = "spec_decode_num_accepted_tokens_per_pos"
        assert llm.stats()[per_pos][1] > before[per_pos][1]
    _idle(llm)


def test_sampled_tokens_with_drafts_follow_the_target_distribution(model):
    """End to end, rejection sampling keeps every emitted token distributed as the target's: each
    draft verified against the q it was drawn from and the target row of its position. 1000 unseeded
    requests (the engine's seed: a fixed sample) of 3 tokens after the prompt at top_k=2, K = 2
    (max_tokens 4 leaves room for both drafts after the first token), against the exact joint
    distribution of those 3 tokens from plain decoding's logprobs (TV bound as above)."""
    draws, temperature, top_k = 1000, 1.0, 2
    options = dict(max_model_len=64, max_num_seqs=256, max_num_batched_tokens=2048, prefill_chunk_tokens=2048)
    llm = LLM(model, num_speculative_tokens=2, **options)
    outs = llm.generate([PROMPTS[0]] * draws, SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k,
                                                             ignore_eos=True))
    stats = llm.stats()
    # the second draft (the one the third token's verification judges) is accepted in some steps
    assert stats["spec_decode_num_accepted_tokens_per_pos"][1] > draws // 10
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    plain = LLM(model, **options)
    prompt = outs[0].prompt_token_ids

    def target(prefixes):  # p of the token after each prefix: temperature and top-k over the raw logprobs
        rows = plain.generate([prompt + list(p) for p in prefixes],
                              SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k))
        dists = []
        for row in rows:
            lp = row.logprobs[0]
            tokens = sorted(lp, key=lp.get, reverse=True)[:top_k]
            dists.append(dict(zip(tokens, (torch.tensor([lp[t] for t in tokens]) / temperature).softmax(-1).tolist())))
        return dists
    exact = {(): 1.0}
    for _ in range(3):
        prefixes = list(exact)
        exact = {prefix + (t,): p * q for prefix, dist in zip(prefixes, target(prefixes)) for t, q in dist.items()
                 for p in [exact[prefix]]}
    counts = {}
    for out in outs:
        counts[tuple(out.token_ids[:3])] = counts.get(tuple(out.token_ids[:3]), 0) + 1
    tv = 0.5 * sum(abs(counts.get(seq, 0) / draws - exact.get(seq, 0.0)) for seq in set(exact) | set(counts))
    bound = _tv_bound(draws, len(exact) + 1, FAILURE)  # + 1: any sequence outside the target's support
    assert tv < bound, f"3-token sequences: TV {tv:.4f} from the target, bound {bound:.4f}"
    _idle(llm)


def test_a_seeded_request_whose_drafts_waited_goes_first(model):
    """A seeded, sampled request's drafts are verified whole: where they do not fit in what the
    requests before it left of the token budget, it waits a step, and then goes first. Two greedy
    decodes of 1 + 3 rows fill a budget of 8 every step: the seeded request must not wait behind them
    step after step (it would stall until they finish)."""
    llm = LLM(model, num_speculative_tokens=3, max_model_len=512, prefill_chunk_tokens=8, max_num_batched_tokens=8,
              max_num_seqs=3)
    engine, real_schedule, waits = llm.engine, llm.engine.scheduler.schedule, []

    def schedule():
        step = real_schedule()
        seeded = engine.scheduler.find("seeded")
        if seeded is not None and not seeded.is_prefilling and seeded.num_output_tokens:
            waits.append(all(ch.request_id != "seeded" for ch in step.chunks))
        return step
    engine.scheduler.schedule = schedule
    prompt = engine.inputs.tokenize(PROMPTS[0])[:3]  # 3 + 3 + 2 prompt tokens: one step prefills all three
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    engine.add_request("seeded", prompt[:2], SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert any(waits), "the seeded request never waited"  # what makes this test one
    assert not any(a and b for a, b in zip(waits, waits[1:])), f"waited two steps in a row: {waits}"
    assert len(outputs["seeded"].token_ids) == 24
    _idle(llm)
