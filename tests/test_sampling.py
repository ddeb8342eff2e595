"""Penalties, logit bias, min_tokens and min-p: against element-by-element references written from
vLLM's definitions, and end to end against a greedy loop over transformers' logits."""
from __future__ import annotations

import math

import pytest
import torch

from sparsekv import LLM, InvalidRequest, SamplingParams
from sparsekv.sampling import LogitAdjuster, filter_logits
from sparsekv.sampling_params import MAX_TEMPERATURE
from tolerances import logprob_tolerance

VOCAB = 40


def reference_adjust(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
                     stops: set[int]) -> list[float]:
    """One logit at a time, in vLLM's order: allowed tokens and bias, min_tokens, repetition, frequency,
    presence."""
    out = []
    for t, x in enumerate(logits):
        if params.allowed_token_ids and t not in params.allowed_token_ids:
            x = float("-inf")
        x += (params.logit_bias or {}).get(t, 0.0)
        if len(output) < params.min_tokens and t in stops:
            x = float("-inf")
        if t in prompt or t in output:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * output.count(t)
        x -= params.presence_penalty * (t in output)
        out.append(x)
    return out


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.7), dict(repetition_penalty=0.6), dict(frequency_penalty=0.8),
    dict(presence_penalty=-1.5), dict(logit_bias={3: 100.0, 7: -42.5}), dict(min_tokens=4),
    dict(allowed_token_ids=[2, 5, 17, 30], logit_bias={5: 3.0}, repetition_penalty=1.5),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=1.0, logit_bias={0: 5.0}, min_tokens=2),
], ids=["repetition", "repetition-below-1", "frequency", "presence-negative", "bias", "min_tokens", "allowed", "all"])
def test_adjuster_equals_the_reference_at_every_step(options):
    g = torch.Generator().manual_seed(0)
    prompt, stops = [1, 2, 2, 9, 30], {5, 11}
    params = SamplingParams(max_tokens=8, **options)
    adjust = LogitAdjuster(params, prompt, VOCAB, stops)
    output = []
    for token in [2, 5, 5, 17, 2, 39]:  # repeats, a prompt token and a stop token among them
        logits = torch.randn(VOCAB, generator=g) * 3
        want = torch.tensor(reference_adjust(logits.tolist(), params, prompt, output, stops))
        got = adjust(logits)
        # elementwise only (no reduction to regroup): a few correctly rounded float32 operations
        # against the reference's float64 ones rounded once, a few ulps of the largest value (a bias
        # of 100 included), the same on every CPU
        ulps = 4 * torch.finfo(torch.float32).eps * want[want.isfinite()].abs().max()
        assert torch.allclose(got, want, atol=float(ulps), rtol=0) and torch.equal(got.isinf(), want.isinf())
        adjust.note(token)
        output.append(token)


def test_min_p_keeps_tokens_within_min_p_of_the_top():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, 1.0])
    params = SamplingParams(temperature=0.5, min_p=0.2)
    probs = (logits / 0.5).softmax(-1)
    kept = filter_logits(logits, params).isfinite()
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist() and 1 < int(kept.sum()) < 5


def test_min_p_is_relative_to_the_top_token():
    """A flat row (top probability ~0.1): min_p 0.5 keeps the tokens within half of the top's, where an
    absolute threshold of 0.5 would keep none."""
    logits = torch.tensor([0.0, -0.1, -0.2, -1.5, -3.0] + [-0.3] * 7)
    probs = logits.softmax(-1)
    assert probs.max() < 0.2
    kept = filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.5)).isfinite()
    assert kept.tolist() == (probs >= 0.5 * probs.max()).tolist() and 3 < int(kept.sum()) < len(logits)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_keeps_exactly_the_k_most_probable_and_ties_at_the_kth(k):
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0, 2.5, -2.0, 0.0])
    kept = filter_logits(logits.clone(), SamplingParams(temperature=1.0, top_k=k)).isfinite()
    assert kept.tolist() == [v in sorted(logits.tolist(), reverse=True)[:k] for v in logits.tolist()]
    tied = torch.tensor([1.0, 2.0, 2.0, 0.0])  # two tokens tie for the second place: both stay
    assert filter_logits(tied, SamplingParams(temperature=1.0, top_k=2)).isfinite().tolist() == [False, True, True, False]


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty="x"), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.5), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias=[3]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"), (dict(logits_processors=[3]), "logits_processors"),
])
def test_invalid_adjustments(kwargs, param):
    with pytest.raises(InvalidRequest, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param



@pytest.mark.parametrize("kwargs", [
    dict(top_p=1.0), dict(top_p=1e-9), dict(min_tokens=10, max_tokens=10), dict(repetition_penalty=2.0),
    dict(logit_bias={3: -100.0, 4: 100.0}), dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(temperature=MAX_TEMPERATURE),
], ids=["top_p-1", "top_p-tiny", "min_tokens-max_tokens", "repetition_penalty-2", "logit_bias-100",
        "min_p-1", "penalties-2", "temperature-max"])
def test_the_edges_of_each_range_are_valid(kwargs):
    """The last value inside each range (vLLM's bounds) is a valid request; one past it is not."""
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_p=0.0), "top_p"), (dict(logit_bias={3: -100.5}), "logit_bias"), (dict(top_k=-2), "top_k"),
    (dict(temperature=MAX_TEMPERATURE * 1.01), "temperature"),
])
def test_one_past_each_edge_is_invalid(kwargs, param):
    with pytest.raises(InvalidRequest, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_vllms_off_and_random_values_mean_the_defaults():
    """top_k=-1 is vLLM's "off" (0 here) and seed=-1 its "random" (None here), in a request and in each
    of its choices' seeds."""
    from sparsekv.sampling_params import choice_seed
    params = SamplingParams(top_k=-1, seed=-1)
    assert params.top_k == 0 and params.seed is None
    assert choice_seed(-1, 0) is None and choice_seed(-1, 3) is None and choice_seed(None, 1) is None


def test_choice_seeds_wrap_around_within_64_bits_and_never_reach_minus_one():
    """Choice i of a request seeded s is seeded s + i (s - i for a negative s), wrapping around the signed
    64-bit range, so every choice's seed is itself a valid seed and none is -1 ("random")."""
    from sparsekv.sampling_params import SEED_MAX, SEED_MIN, choice_seed
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert [choice_seed(-2, i) for i in range(3)] == [-2, -3, -4]
    assert [choice_seed(SEED_MAX, i) for i in range(3)] == [SEED_MAX, SEED_MIN, SEED_MIN + 1]
    assert [choice_seed(SEED_MIN, i) for i in range(3)] == [SEED_MIN, SEED_MAX, SEED_MAX - 1]
    for seed in (SEED_MAX, SEED_MIN, -2, 0):
        assert all(choice_seed(seed, i) != -1 and SamplingParams(seed=choice_seed(seed, i)).seed is not None
                   for i in range(4))

@pytest.fixture(scope="module")
def llm(glm_ckpt):  # no prefix cache: the same prompt's logprobs are compared bit for bit
    return LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40,
               enable_prefix_caching=False)


def _reference_greedy(model, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Greedy over transformers' logits, adjusted by the element-by-element reference each step."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        adjusted = reference_adjust(logits.tolist(), params, prompt, ids[len(prompt):], set())
        ids.append(max(range(len(adjusted)), key=adjusted.__getitem__))
    return ids[len(prompt):]


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=1.0)],
                         ids=["repetition", "frequency-presence"])
def test_penalised_greedy_equals_transformers_loop(llm, glm_ckpt, random_prompt, options):
    prompt = random_prompt(12, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **options)
    out = llm.generate([prompt], params)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == _reference_greedy(glm_ckpt[1], prompt, params, 16)
    assert out.token_ids != plain.token_ids  # the penalty changed what greedy picks
    llm.engine.check_integrity()


def test_logit_bias_forces_and_bans_tokens(llm, random_prompt):
    prompt = random_prompt(9, seed=2)
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    forced = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.7, seed=1, logit_bias={17: 100.0}))[0]
    assert forced.token_ids == [17] * 6
    banned = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1,
                                                   logit_bias={plain.token_ids[0]: -100.0}))[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    assert banned.logprobs[0][plain.token_ids[0]] == plain.logprobs[0][plain.token_ids[0]]  # raw logprobs
    with pytest.raises(InvalidRequest, match="logit_bias token id 9999"):
        llm.generate([prompt], SamplingParams(logit_bias={9999: 1.0}))
    llm.engine.check_integrity()


def test_logits_processors_see_the_output_so_far_and_steer_sampling(llm, random_prompt):
    """A logits processor (vLLM's `f(output_token_ids, logits)`) that forces given tokens, as teacher
    forcing does: each call sees the tokens out so far, the output is the forced tokens, and the
    reported logprobs are the model's own (the raw row, left unchanged)."""
    prompt, forced, seen = random_prompt(9, seed=3), [11, 4, 11, 29], []

    def force(output_token_ids, logits):
        seen.append(list(output_token_ids))
        logits[:] = float("-inf")  # in place: the engine hands it a copy
        logits[forced[len(output_token_ids)]] = 0.0
        return logits
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], SamplingParams(**params, logits_processors=[force]))[0]
    assert out.token_ids == forced and seen == [forced[:i] for i in range(4)]
    assert all(lp[token] < 0.0 for lp, token in zip(out.logprobs, forced))  # the processed row would give 0.0
    free = llm.generate([prompt + forced[:1]], SamplingParams(**params))[0]  # the model's row after forced[0]
    assert max(out.logprobs[1].values()) == pytest.approx(max(free.logprobs[0].values()), abs=logprob_tolerance(llm))
    llm.engine.check_integrity()


def test_min_tokens_holds_back_stop_tokens(llm, random_prompt):
    prompt = random_prompt(10, seed=6)
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = plain.token_ids[0]
    early = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]))[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=3))[0]
    assert len(held.token_ids) >= 3 and stop not in held.token_ids[:3]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop
    llm.engine.check_integrity()
    assert not llm.engine.outputs._adjusters  # per-request state goes with the request


def test_min_tokens_holds_back_eos_with_ignore_eos_too(llm, random_prompt):
    """vLLM's min_tokens: EOS is not sampled before min_tokens tokens are out, ignore_eos or not (after
    them, with ignore_eos, it is a token like any other and the request runs on)."""
    from sparsekv.paths import default_model_path
    bundled = LLM(default_model_path(), max_model_len=256, num_threads=1)  # a model with an EOS
    eos = min(bundled.engine.eos_token_ids)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_tokens=3, logit_bias={eos: 100.0})
    out = bundled.generate([random_prompt(10, seed=7)], params)[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos] * 3 and out.finish_reason == "length"
    bundled.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_allowed_tokens_that_min_tokens_all_holds_back_end_the_request_with_no_token(llm, random_prompt, temperature):
    """allowed_token_ids that are all stop tokens, with min_tokens still holding stops back, leave no
    token that may come next: the request ends there, "stop", with the tokens it has, rather than
    emitting a token it forbade (a row of -inf logits has no argmax or distribution to draw from).
    A request beside it runs as usual."""
    prompt = random_prompt(10, seed=6)
    forbidding = SamplingParams(max_tokens=6, temperature=temperature, seed=3, allowed_token_ids=[5, 9],
                                stop_token_ids=[5, 9], min_tokens=2)
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate([prompt], free)[0]
    ended, beside = llm.generate([prompt, prompt], [forbidding, free])
    assert (ended.token_ids, ended.finish_reason) == ([], "stop")
    assert beside.token_ids == alone.token_ids and beside.finish_reason == "length"
    llm.engine.check_integrity()


@pytest.mark.parametrize("chunk", [16, 5], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers(glm_ckpt, random_prompt, chunk):
    from conftest import reference_logprobs
    llm = LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, prefill_chunk_tokens=chunk, max_num_batched_tokens=40)
    prompt = random_prompt(37, seed=8)
    out = llm.generate([prompt, [3]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    lp = reference_logprobs(glm_ckpt[1], prompt)
    entries = out[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None and out[1].prompt_logprobs == [None]
    for p, entry in enumerate(entries[1:], start=1):
        assert prompt[p] in entry and 2 <= len(entry) <= 3
        assert max(abs(v - lp[p - 1, t].item()) for t, v in entry.items()) <= logprob_tolerance(glm_ckpt[1])
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    llm.engine.check_integrity()


def test_prompt_logprobs_come_from_the_requests_own_rows_behind_another_prefill(glm_ckpt, random_prompt):
    """A step's hidden rows are every chunk's, in order, whether it samples a token or not: a request's
    prompt logprobs come from its own rows when another request's prefill chunk (no token sampled)
    comes before it in the step, not from that request's rows."""
    from conftest import reference_logprobs
    llm = LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, prefill_chunk_tokens=5, max_num_batched_tokens=40,
              enable_prefix_caching=False)
    other, prompt = random_prompt(37, seed=8), random_prompt(12, seed=2)
    out = llm.generate([other, prompt], [SamplingParams(max_tokens=2, temperature=0.0),
                                         SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)])[1]
    lp = reference_logprobs(glm_ckpt[1], prompt)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        assert prompt[p] in entry
        assert max(abs(v - lp[p - 1, t].item()) for t, v in entry.items()) <= logprob_tolerance(glm_ckpt[1])
    llm.engine.check_integrity()


def test_prompt_logprobs_skip_the_prefix_cache(glm_ckpt, random_prompt):
    llm = LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, enable_prefix_caching=True)
    prompt = random_prompt(30, seed=9)
    llm.generate([prompt], SamplingParams(max_tokens=2))
    again = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == 30
    assert llm.stats()["prefix_cache_queries"] == 30  # it was not looked up
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 28


def test_allowed_token_ids_and_prompt_truncation(llm, random_prompt):
    prompt = random_prompt(30, seed=12)
    allowed = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[4, 9]))[0]
    assert set(allowed.token_ids) <= {4, 9}
    cut = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=10))[0]
    tail = llm.generate([prompt[-10:]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.token_ids == tail.token_ids
    with pytest.raises(InvalidRequest, match="allowed_token_ids token id 5000"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[1, 5000]))
    llm.engine.check_integrity()


def test_filtering_a_batch_of_rows_equals_each_row_alone():
    """filter_logits_rows, each row with its own temperature, min-p, top-k and top-p (ties included:
    logits rounded to a coarse grid), gives every row exactly what filter_logits gives it alone."""
    from sparsekv.sampling import filter_logits_rows
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 300, generator=g) * 4).round() / 2  # many exact ties
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.5, min_p=0.05), SamplingParams(temperature=2.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=300, top_p=0.999)]
    batched = filter_logits_rows(logits.clone(), params)
    for i, p in enumerate(params):
        assert torch.equal(batched[i], filter_logits(logits[i], p)), i


def reference_nucleus(probs: list[float], top_p: float) -> set[int]:
    """The fewest most probable tokens whose probability reaches top_p, then every token tied with the
    least of them: one token at a time, from the definition."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept, total = [], 0.0
    for t in order:
        if total >= top_p:
            break
        kept.append(t)
        total += probs[t]
    return {t for t in range(len(probs)) if probs[t] >= probs[kept[-1]]}


@pytest.mark.parametrize("candidates", [64, 8])
def test_top_p_keeps_the_nucleus_of_the_definition(monkeypatch, candidates):
    """outside_nucleus against the one-token-at-a-time reference, on peaked, flat and tied rows (ties
    straddling the cut are kept whole). Rows whose nucleus fits the candidates take the partial sort,
    the others the whole-row sort: both paths run. Sums run in float64 in the reference, as torch's CPU cumsum
    accumulates: the same sets."""
    import sparsekv.sampling as sampling
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(6, 300, generator=g) * 4, torch.randn(4, 300, generator=g) * 0.3,
                      (torch.randn(6, 300, generator=g) * 4).round() / 2])  # peaked, flat, tied
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999] * 2)[:, None]
    drop = sampling.outside_nucleus(rows, top_p)
    probs = rows.softmax(-1)
    for i in range(len(rows)):
        kept = set((~drop[i]).nonzero()[:, 0].tolist())
        assert kept == reference_nucleus(probs[i].double().tolist(), float(top_p[i])), i
        assert probs[i, sorted(kept)].sum() >= top_p[i] - 1e-6
    sizes = (~drop).sum(-1)
    assert (sizes < candidates).any() and (sizes >= candidates).any()


def test_a_nucleus_reached_exactly_stops_there():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32, and their sums): a top_p the first tokens'
    mass equals exactly is reached by them, so the nucleus stops there (vLLM's: the tail whose mass is
    at most 1 - top_p goes); at 7/8 the third token is needed, and its tie with the fourth keeps both.
    Given as probabilities: a softmax of their logarithms is exact only where exp rounds exactly,
    which depends on the CPU's kernels."""
    import sparsekv.sampling as sampling
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    for top_p, kept in ((0.5, [0]), (0.75, [0, 1]), (0.875, [0, 1, 2, 3])):
        drop = sampling.outside_nucleus_of(probs, torch.tensor([[top_p]]))
        assert (~drop[0]).nonzero()[:, 0].tolist() == kept, top_p


def test_min_p_of_one_keeps_exactly_the_most_probable_tokens():
    """min_p drops the tokens less probable than min_p x the top's probability (vLLM's `<`): at
    min_p = 1 the most probable tokens, ties included, stay and every other goes."""
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    got = filter_logits(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert got.isfinite().tolist() == [False, True, True, False]


def test_bench_sampling_times_both_and_reports_agreement(tmp_path, capsys):
    """`sparsekv bench sampling`: both filters on the same rows; a peaked spread gives a small nucleus
    on which they agree, a flat one a nucleus wider than the partial sort (the whole-row path)."""
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "sampling.json"
    assert main(["sampling", "--rows", "4", "--vocab", "3000", "--spreads", "8", "0.5", "--repeats", "1",
                 "--json", str(out)]) == 0
    peaked, flat = json.loads(out.read_text())["results"]
    assert peaked["nucleus"] < 64 and peaked["agree"] == 4 and flat["nucleus"] > 1024
    assert flat["most_apart"] <= 3 and peaked["speedup"] > 0 and json.loads(out.read_text())["draws"]["speedup"] > 0
    assert "rows agreeing" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sampling", "--rows", "0"])


def test_draw_rows_matches_one_row_at_a_time_and_the_distribution():
    """Each row drawn with its own generator gets the token it gets alone (a seeded request does not
    depend on its batch); draws follow the distribution (zero-probability tokens never drawn); a pick
    past the end moves to the row's last token of non-zero probability."""
    from sparsekv.sampling import draw, draw_rows, inside_support, make_generator
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(5, 50, generator=g).softmax(-1)
    probs[:, 40:] = 0.0                                         # a filtered tail
    batched = draw_rows(probs, [make_generator(s) for s in range(5)])
    assert batched.tolist() == [draw(probs[i], make_generator(i)) for i in range(5)]
    gens = [make_generator(100 + i) for i in range(4000)]
    row = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    counts = torch.bincount(draw_rows(row.expand(4000, -1), gens), minlength=5).tolist()
    assert counts[1] == counts[4] == 0
    for token, p in ((0, 0.5), (2, 0.3), (3, 0.2)):             # within 4 standard deviations
        assert abs(counts[token] / 4000 - p) < 4 * (p * (1 - p) / 4000) ** 0.5
    over = inside_support(torch.tensor([5, 2]), torch.stack([row, row]))
    assert over.tolist() == [3, 2]


def test_seeds_differing_above_bit_31_sample_differently_and_small_seeds_keep_theirs():
    from sparsekv.sampling import generator_seed, make_generator
    def draws(seed):
        return torch.rand(8, generator=make_generator(seed)).tolist()
    assert draws(5) == torch.rand(8, generator=torch.Generator().manual_seed(5)).tolist()
    assert draws(5) != draws(5 + 2 ** 32) and draws(-1 - 2 ** 32) != draws(-1)
    assert len({generator_seed(s) for s in [*range(-300, 300), *(2 ** 32 + i for i in range(300))]}) == 900
    assert all(0 <= generator_seed(s) < 2 ** 32 for s in (-(2 ** 63), 2 ** 63 - 1, -5, 2 ** 40))


def test_seeds_at_the_32_bit_boundary_sample_as_the_rule_says():
    """Seeds in [0, 2**32) are kept as they are, 0 and 2**32 - 1 too; 2**32, the first seed mixed
    down, must not sample as seed 0 (its low 32 bits, all that a CPU generator reads of it)."""
    from sparsekv.sampling import generator_seed, make_generator
    assert generator_seed(0) == 0 and generator_seed(2 ** 32 - 1) == 2 ** 32 - 1
    assert torch.rand(8, generator=make_generator(2 ** 32)).tolist() != \
        torch.rand(8, generator=make_generator(0)).tolist()


def test_a_uniform_of_zero_never_draws_a_leading_zero_probability_token(monkeypatch):
    """draw_rows searches u x total in the cumulative sum: a uniform of exactly 0 (torch.rand's
    smallest value) must still pick the first token of non-zero probability, not a filtered-out
    token before it."""
    from sparsekv.sampling import draw_rows
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.75], [0.0, 0.5, 0.5, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(1))
    assert draw_rows(probs, [torch.Generator(), torch.Generator()]).tolist() == [2, 1]


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1, 2 ** 64])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequest, match="seed"):
        SamplingParams(seed=seed)


def test_adjustments_apply_to_raw_logits_before_temperature():
    """Bias and penalties are added to the raw logits (vLLM's order), then the row is divided by the
    temperature: the adjusted row does not depend on the temperature, and the sampled distribution is
    softmax((raw + bias - penalties) / T). Small exact values (powers of two): every step exact."""
    raw = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.0, -2.0])
    for temperature in (0.5, 2.0):
        params = SamplingParams(temperature=temperature, logit_bias={3: 2.0}, frequency_penalty=0.5,
                                presence_penalty=0.25)
        adjust = LogitAdjuster(params, [0, 2], len(raw), set())
        for token in (1, 1, 4):
            adjust.note(token)
        # token 1 twice: 2 - 2 x 0.5 - 0.25; token 4 once: 0 - 0.5 - 0.25; token 3 biased; prompt not counted
        want = torch.tensor([1.0, 0.75, -1.0, 2.5, -0.75, -2.0])
        got = adjust(raw)
        assert torch.equal(got, want), temperature
        assert torch.equal(filter_logits(got, params), want / temperature)


def test_logit_bias_cannot_reopen_a_token_outside_allowed_token_ids():
    """vLLM masks every token outside allowed_token_ids, then adds the bias: a biased token outside the
    allowed set stays -inf, an allowed one gets its bias."""
    params = SamplingParams(allowed_token_ids=[1, 3], logit_bias={3: 1.5, 4: 100.0})
    got = LogitAdjuster(params, [0], 6, set())(torch.zeros(6))
    assert got.tolist() == [float("-inf"), 0.0, float("-inf"), 1.5, float("-inf"), float("-inf")]


def test_batched_logprobs_are_each_rows_own_from_the_raw_log_softmax():
    """token_logprobs_rows, rows asking for different numbers of alternatives (or none): each row gets
    what token_logprobs gives it alone: the sampled token's log_softmax value, even outside the top n,
    plus exactly its own top n."""
    from sparsekv.sampling import token_logprobs, token_logprobs_rows
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    tokens, tops = [4, 0, 0], [1, 3, None]
    got = token_logprobs_rows(logits, tokens, tops)
    assert got[2] is None
    assert set(got[0]) == {4, 0} and set(got[1]) == {0, 4, 3, 2}  # the sampled token and its own top n
    # float32 log_softmax of 5 logits (a max, 5 exps, a sum, a log, a subtraction) computed two ways:
    # the chain bound of tests/tolerances.py on terms of magnitude |logit| + logsumexp <= 4 + 4.5
    from tolerances import chain_tolerance
    tol = chain_tolerance(8.5, 5 + 4)
    for i in (0, 1):
        alone = token_logprobs(torch.log_softmax(logits[i], -1), tokens[i], tops[i])
        assert got[i].keys() == alone.keys()
        assert all(got[i][t] == pytest.approx(alone[t], abs=tol) for t in alone)
        # log_softmax of 5 logits spaced by 1: log(e^-k / sum e^-j)
        exact = math.log(sum(math.exp(-k) for k in range(5)))
        assert all(v == pytest.approx(-(4.0 - float(logits[i, t])) - exact, abs=tol) for t, v in got[i].items())
    assert token_logprobs_rows(logits, tokens, [None] * 3) == [None] * 3


def test_sampled_logprobs_are_the_raw_distribution_in_a_batch(llm, glm_ckpt, random_prompt):
    """Two sampled requests decoding together (the batched plain-row path), temperature 0.5: every
    reported logprob is the model's raw log_softmax (vLLM's default), not the tempered distribution's."""
    from conftest import reference_logprobs
    prompts = [random_prompt(9, seed=21), random_prompt(11, seed=22)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.5, seed=5, logprobs=2))
    tol = logprob_tolerance(glm_ckpt[1])
    for prompt, out in zip(prompts, outs):
        lp = reference_logprobs(glm_ckpt[1], prompt + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert token in entry and len(entry) in (2, 3)
            assert max(abs(v - lp[len(prompt) - 1 + j, t].item()) for t, v in entry.items()) <= tol
    llm.engine.check_integrity()


def test_adjustments_hold_for_requests_decoding_together(llm, random_prompt):
    """Several biased requests in one batch (plus a plain one): each biased row still gets its bias,
    whatever the batch (the batched plain-row path is for rows with nothing to adjust)."""
    prompts = [random_prompt(9, seed=31), random_prompt(10, seed=32), random_prompt(8, seed=33)]
    forced = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={17: 100.0})
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [forced, forced, plain])
    assert outs[0].token_ids == outs[1].token_ids == [17] * 4
    assert len(outs[2].token_ids) == 4
    llm.engine.check_integrity()
