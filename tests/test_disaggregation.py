"""Prefill/decode disaggregation's core, in one process: a prefill engine computes a prompt, its named
KV pages (latents, indexer keys, the MTP layer's entries, the selector's per-page state) are exported
as plain rows, and a decode engine imports them: into its prefix cache's host tier, or with
kv_tiering into its pool (latents in the host store it decodes from, held once). The request then runs
as a prefix hit, computing only what was not sent (the last, partial page and on), whose rows' selections
warm its device working set. Greedy tokens and logprobs must be those of one colocated engine."""
import numpy as np
import pytest
import torch

from conftest import STARTUP_S
from sparsekv import LLM, SamplingParams
from sparsekv.config import ModelConfig
from sparsekv.outputs import FirstToken
from sparsekv.paths import default_model_path
from sparsekv.request import InvalidRequest
from tolerances import assert_logprobs_close, assert_same_greedy, logprob_tolerance

PAGE = 4
BASE = dict(kv_page_size=PAGE, max_model_len=128, num_threads=1)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
DECODE = dict(prefix_cache_host_bytes=1 << 24)


def _prompt(vocab: int, n: int = 41, seed: int = 3) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _disaggregated(path: str, prompt: list[int], prefill_options: dict, decode_options: dict):
    prefill = LLM(path, **BASE, **prefill_options)
    # with drafting a page is named once the MTP layer's entries for it exist: the MTP pass after the
    # first token writes them, and a request that ends at its first token skips that pass
    tokens = 3 if prefill_options.get("num_speculative_tokens") else 1
    prefill.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE, **decode_options)
    assert decode.engine.kv.import_prefix(pages, prompts=[prompt]) == len(pages)
    return pages, decode.generate([prompt], GREEDY)[0], decode


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "decode-tiered", "fp8"])
def test_a_prompt_prefilled_elsewhere_decodes_as_one_engine_would(family, options, glm_ckpt, ds_ckpt):
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    prefill_options = {k: v for k, v in options.items() if k == "kv_cache_dtype"}
    pages, got, decode = _disaggregated(path, prompt, prefill_options, options)
    assert len(pages) == (len(prompt) - 1) // PAGE  # every full page but the one holding the last token
    # the pages landed in the pool (tiered: whose latents are host rows), none in the host tier
    assert got.metrics["prefix_cached_tokens_device"] == got.num_cached_tokens == len(pages) * PAGE
    assert decode.stats()["prefix_host_pages"] == 0
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "decode-tiered", "fp8"])
@pytest.mark.parametrize("length", [41, 44])  # the last token alone in its page; its page full
def test_with_the_last_pages_rows_and_the_first_token_the_decode_side_computes_from_that_token(
        family, options, length, glm_ckpt, ds_ckpt):
    """The prefill engine's layer taps hand out the rows of the last token's page through that token
    (a tail); imported with the pages, the decode engine's hit takes them too for a request given the
    first token the prefill engine sampled, which computes that token alone and decodes as one engine
    would."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256, length)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    prefill = LLM(path, **BASE, **{k: v for k, v in options.items() if k == "kv_cache_dtype"})
    got_rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, got_rows.append)
    first = _first_token(prefill, prompt, GREEDY)
    num_kinds = len(prefill.engine.kv.page_tensors())
    by_kind = {k: r[0] for d in got_rows if d.tail for k, r in zip(d.kinds, d.ready())}
    assert sorted(by_kind) == list(range(num_kinds))
    assert {r.shape[0] for r in by_kind.values()} == {(len(prompt) - 1) % PAGE + 1}  # through the last token
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE, **options)
    tails = [[by_kind[k] for k in range(num_kinds)]]
    assert decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=tails) == len(pages)
    got = _generate_from(decode.engine, prompt, GREEDY, first)
    assert got.num_cached_tokens == len(prompt)  # the first token alone was computed
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()
    # a tail serves one request; the next hits the prompt's full pages, its last one too once the first named it
    again = _generate_from(decode.engine, prompt, GREEDY, first, "again")
    assert again.num_cached_tokens == len(prompt) // PAGE * PAGE and again.token_ids == got.token_ids
    again = decode.generate([prompt], GREEDY)[0]  # one that samples its first token computes the page
    assert again.num_cached_tokens == len(pages) * PAGE and again.token_ids == got.token_ids


def _first_token(engine: LLM, prompt: list[int], params: SamplingParams):
    """The first token a prefill worker would send: sampled with the request's own parameters."""
    from sparsekv.disagg.first_token import first_token_of, first_token_params
    engine.engine.add_request("p", prompt, first_token_params(params))
    outs = [out for _ in range(len(prompt)) if engine.engine.has_unfinished_requests() for out in engine.engine.step()]
    return first_token_of(outs[-1], params)


def _generate_from(engine, prompt: list[int], params: SamplingParams, first, request_id: str = "d"):
    """Run a request given its first token to its end: (its last output, the token ids of each output)."""
    engine.add_request(request_id, prompt, params, first_token=first)
    last, news = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
            news.append(out.new_token_ids)
    last.news = news
    return last


SAMPLED = [
    SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, logit_bias={7: 2.0}, min_tokens=3, logprobs=1),
    SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, prompt_logprobs=2),  # the decode side computes them
    SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1),  # echo's prompt-only scoring
]


@pytest.mark.parametrize("params", [GREEDY, *SAMPLED],
                         ids=["greedy", "seeded", "adjusted", "prompt-logprobs", "prompt-logprobs-one-token"])
def test_a_request_started_from_a_first_token_sampled_elsewhere_generates_what_one_engine_would(params, glm_ckpt):
    """The first token sampled by a prefill engine with the request's own parameters (seed, logprobs,
    penalties, bias, min_tokens), then given to a decode engine that computes the rest: the same
    tokens and logprobs as one engine, the first token output by a step of its own that computes nothing.
    A request with prompt logprobs computes every prompt row for them, so it samples its first token
    there (given one that ends it, it would end with none computed)."""
    path = glm_ckpt[0]
    prompt = _prompt(256, 43)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], params)[0]
    first = _first_token(LLM(path, **BASE), prompt, params)
    assert first.token_id == want.token_ids[0] and first.logprobs == want.logprobs[0]
    decode = LLM(path, **BASE)
    got = _generate_from(decode.engine, prompt, params, first)
    assert got.news[:2] == [[t] for t in want.token_ids[:2]]
    samples_first = params.prompt_logprobs is not None
    assert decode.engine.counters["steps"] == params.max_tokens - 1 + samples_first  # a compute step a token after the first
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert_logprobs_close(want.logprobs, got.logprobs, logprob_tolerance(colocated))
    if params.prompt_logprobs is not None:
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
        assert_logprobs_close(want.prompt_logprobs[1:], got.prompt_logprobs[1:], logprob_tolerance(colocated))
    decode.engine.check_integrity()


def test_a_first_token_under_a_grammar_and_stop_strings_continues_as_one_engine_would():
    """The bundled model (a tokenizer, so grammars and stop strings): a sampled, seeded request under a
    regex, cut by a stop string. The decode engine's grammar and text start from the given token."""
    path = default_model_path()
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=["-"], logprobs=1,
                            structured_output={"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"})
    prompt = "def fibonacci(n):"
    want = LLM(path, max_model_len=256, num_threads=1).generate([prompt], params)[0]
    assert want.finish_reason == "stop" and len(want.text) == 3 and want.text.isdigit()  # cut at the stop string
    first = _first_token(LLM(path, max_model_len=256, num_threads=1), prompt, params)
    assert first.token_id == want.token_ids[0]
    decode = LLM(path, max_model_len=256, num_threads=1)
    got = _generate_from(decode.engine, prompt, params, first)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    decode.engine.check_integrity()


def test_a_first_token_that_ends_its_request_is_output_without_a_step_and_a_bad_one_is_refused(glm_ckpt):
    path = glm_ckpt[0]
    prompt = _prompt(256, 43)
    engine = LLM(path, **BASE).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    first = _first_token(LLM(path, **BASE), prompt, params)
    for ending, reason in ((dict(max_tokens=1), "length"), (dict(stop_token_ids=[first.token_id]), "stop")):
        got = _generate_from(engine, prompt, SamplingParams(**{**vars(params), **ending}), first, reason)
        assert (got.token_ids, got.news, got.finish_reason) == ([first.token_id], [[first.token_id]], reason)
        assert got.logprobs == [first.logprobs] and engine.counters["steps"] == 0  # nothing computed
    engine.check_integrity()
    bad = [FirstToken(10 ** 6, first.logprobs), FirstToken(-1, {-1: -0.5}), FirstToken(first.token_id),
           FirstToken(first.token_id, {0: -1.0}), FirstToken(first.token_id, first.logprobs, [[0]])]
    for token in bad:  # outside the vocabulary (above, below); logprobs asked for and missing, or without the
        # token; experts unasked
        with pytest.raises(InvalidRequest, match="first token"):
            engine.add_request("bad", prompt, params, first_token=token)
    cfg = engine.model_config
    full, shared, k = cfg.full_layers[0], next(l for l in range(cfg.num_hidden_layers) if l not in cfg.full_layers), \
        cfg.index_topk
    bad_warm = [((shared, (0, 1), (1,)),), ((full, (0, len(prompt)), (0,)),), ((full, (2, 1), (1,)),),
                ((full, (0,), (0,)), (full, (0,), (0,))), ((full, tuple(range(k + 1)), tuple(range(k + 1))),)]
    for warm in bad_warm:  # a shared layer; past the prompt; not ascending; a layer twice; past top-k
        with pytest.raises(InvalidRequest, match="warm selections"):
            engine.add_request("bad", prompt, params, first_token=FirstToken(first.token_id, first.logprobs, warm=warm))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_a_first_token_that_is_a_stop_token_ends_its_request_once_min_tokens_are_out(glm_ckpt):
    """vLLM's min_tokens: no stop before min_tokens tokens are out, and a stop token that is the
    min_tokens-th ends the request. Sampled tokens cannot reach that boundary (stop tokens are masked
    while fewer than min_tokens are out); a carried first token is not sampled under that mask, so it
    pins the count: with min_tokens=1 it ends its request as "stop", with min_tokens=2 the request
    goes on past it."""
    path = glm_ckpt[0]
    prompt = _prompt(256, 43)
    engine = LLM(path, **BASE).engine
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = _first_token(LLM(path, **BASE), prompt, params)
    stop_at_first = {**vars(params), "stop_token_ids": [first.token_id]}
    ended = _generate_from(engine, prompt, SamplingParams(**{**stop_at_first, "min_tokens": 1}), first, "ended")
    assert (ended.token_ids, ended.finish_reason, ended.stop_reason) == ([first.token_id], "stop", first.token_id)
    held = _generate_from(engine, prompt, SamplingParams(**{**stop_at_first, "min_tokens": 2}), first, "held")
    assert held.token_ids[0] == first.token_id and len(held.token_ids) > 1
    engine.check_integrity()


def test_a_first_token_is_checked_against_the_vocabulary_at_both_ends():
    """A first token's id is one of 0 .. vocab_size - 1: both ends are taken, and one past either end
    (vocab_size itself included, one past the embedding's last row) is refused."""
    from sparsekv.output_processor import OutputProcessor
    vocab = 8
    outputs = OutputProcessor(None, set(), vocab, 64, 0, lambda req: {})
    for token in (0, vocab - 1):
        outputs.check_first(SamplingParams(), FirstToken(token))
    for token in (-1, vocab):
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            outputs.check_first(SamplingParams(), FirstToken(token))


def test_a_first_token_of_other_weights_is_dropped_and_the_request_samples_its_own(glm_ckpt):
    """A decode engine whose weights changed since the KV was kept (a weight update between the import
    and the request's add) does not trust the token: it computes the prompt's last row and samples."""
    path = glm_ckpt[0]
    prompt = _prompt(256, 43)
    want = LLM(path, **BASE).generate([prompt], GREEDY)[0]
    first = _first_token(LLM(path, **BASE), prompt, GREEDY)
    engine = LLM(path, **BASE).engine
    stale = FirstToken(want.token_ids[1], {want.token_ids[1]: -0.5}, None, weights_version=engine.weights_version + 1)
    got = _generate_from(engine, prompt, GREEDY, stale)
    assert got.news[0] == [want.token_ids[0]] and got.token_ids == want.token_ids  # its own first token, computed
    assert engine.counters["steps"] == GREEDY.max_tokens
    current = FirstToken(first.token_id, first.logprobs, None, weights_version=engine.weights_version)
    assert _generate_from(engine, prompt, GREEDY, current, "current").token_ids == want.token_ids


def test_first_tokens_given_before_every_step_do_not_stall_the_running_requests(glm_ckpt):
    """A step that only outputs given first tokens computes nothing, and the step after it computes
    whatever first tokens arrived meanwhile. A decode worker handed a new first token before every
    step so still advances its running requests every other step: the arrivals cannot starve them."""
    engine = LLM(glm_ckpt[0], **BASE).engine
    running = engine.add_request("running", _prompt(256, 9), SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True))
    engine.step()
    assert running.num_output_tokens == 1
    steps_before, token = engine.counters["steps"], running.output_token_ids[0]
    for i in range(6):
        engine.add_request(f"given-{i}", _prompt(256, 9, seed=i), SamplingParams(max_tokens=4, temperature=0.0),
                           first_token=FirstToken(token))
        outs = engine.step()
        assert f"given-{i}" in {o.request_id for o in outs}  # each given token is out at once
    assert engine.counters["steps"] - steps_before == 3
    assert running.num_output_tokens == 1 + 3
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_a_tail_that_does_not_fit_refuses_the_import_whole(glm_ckpt):
    path = glm_ckpt[0]
    prompt = _prompt(256, 43)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE)
    tensors = [t for t, _ in decode.engine.kv.page_tensors()]
    for bad in ([t[:3, :1] for t in tensors], [t[:PAGE] for t in tensors], [t[:3] for t in tensors[:1]]):
        # a row's width, a whole page (not this prompt's last), a kind missing
        with pytest.raises(ValueError, match="tail 0"):
            decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=[bad])
        assert decode.engine.kv.held_prefix(prompt) == 0
    decode.engine.check_integrity()


def test_a_tiered_decode_side_holds_the_imported_rows_once(glm_ckpt):
    """The rows land in pool pages (their latents in the host store the request decodes from), not in
    the prefix cache's host tier as well; they are the bytes sent, and stay so after the request."""
    path, prompt = glm_ckpt[0], _prompt(256)
    tiered = dict(kv_tiering=True, device_buffer_tokens=16)
    pages, out, decode = _disaggregated(path, prompt, {}, tiered)
    stats = decode.stats()
    assert stats["prefix_host_pages"] == stats["prefix_host_bytes"] == 0
    assert stats["prefix_cached_pages"] >= len(pages) and stats["prefix_cache_hits_host"] == 0
    assert out.metrics["prefix_cached_tokens_device"] == len(pages) * PAGE
    held = decode.engine.kv.export_prefix(prompt)[:len(pages)]  # read back from the pool
    assert [name for name, _ in held] == [name for name, _ in pages]
    assert all(torch.equal(a, b) for (_, x), (_, y) in zip(held, pages) for a, b in zip(x, y, strict=True))
    decode.engine.check_integrity()


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["plain", "decode-tiered"])
def test_with_mtp_drafting_on_both_sides(options):
    """The pages carry the MTP layer's entries: drafting on the decode side reads them (tiered: from the
    pool pages they landed in)."""
    path, prompt = default_model_path(), _prompt(4096, 50)
    colocated = LLM(path, **BASE, num_speculative_tokens=2, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    pages, got, decode = _disaggregated(path, prompt, dict(num_speculative_tokens=2),
                                        dict(num_speculative_tokens=2, **options))
    assert got.num_cached_tokens == len(pages) * PAGE > 0
    assert got.metrics["spec_decode_num_drafts"] > 0
    assert decode.stats()["prefix_host_pages"] == 0
    assert_same_greedy([want], [got], logprob_tolerance(colocated, extra_layers=1))


def _mtp_prefill(path: str, prompt: list[int], logprobs: int | None = None):
    """A drafting prefill engine's run of `prompt` as the prefill worker runs it (greedily, for the MTP
    pass after the first token): (the tail's deliveries, the prompt's pages, the number of kinds of
    row, the run's last output)."""
    prefill = LLM(path, **BASE, num_speculative_tokens=2)
    rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, rows.append)
    prefill.engine.add_request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                           logprobs=logprobs))
    outs = [out for _ in range(8) if prefill.engine.has_unfinished_requests() for out in prefill.engine.step()]
    return ([d for d in rows if d.tail], prefill.engine.kv.export_prefix(prompt),
            len(prefill.engine.kv.page_tensors()), outs[-1])


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["plain", "decode-tiered"])
def test_with_mtp_drafting_a_tail_carries_the_mtp_layers_rows_and_the_decode_side_computes_the_first_token_alone(
        options):
    """With drafting, the prefill engine's greedy run writes the MTP layer's entries of its last rows
    in the MTP pass after its first token (the last one from that token); the taps hand them out with
    the tail, so the tail holds every kind and a request given that first token computes it alone,
    then drafts, as one engine would."""
    path, prompt = default_model_path(), _prompt(4096, 50)  # 12 full pages and a 2-row tail
    colocated = LLM(path, **BASE, num_speculative_tokens=2, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    tails, pages, num_kinds, last = _mtp_prefill(path, prompt, GREEDY.logprobs)
    first = FirstToken(last.token_ids[0], last.logprobs[0])
    mtp_layer = colocated.engine.model_config.num_hidden_layers
    assert [d.layer for d in tails][-1] == mtp_layer and {d.tail for d in tails} == {(len(prompt) - 1) % PAGE + 1}
    by_kind = {k: r[0] for d in tails for k, r in zip(d.kinds, d.ready())}
    assert sorted(by_kind) == list(range(num_kinds))
    decode = LLM(path, **BASE, **DECODE, num_speculative_tokens=2, **options)
    decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=[[by_kind[k] for k in range(num_kinds)]])
    got = _generate_from(decode.engine, prompt, GREEDY, first)
    assert got.num_cached_tokens == len(prompt)  # the first token alone was computed
    assert got.metrics["spec_decode_num_drafts"] > 0
    assert_same_greedy([want], [got], logprob_tolerance(colocated, extra_layers=1))
    decode.engine.check_integrity()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED[0]], ids=["greedy", "seeded"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["plain", "decode-tiered"])
def test_with_mtp_drafting_and_no_first_token_a_short_tail_leaves_the_last_token_to_the_decode_side(params, options):
    """Choices whose first token the prefill side does not sample (MTP drafting, sampled choices) get
    the tail less its last row, whose MTP-layer entry depends on the token after it: the decode side
    computes the prompt's last token alone, samples the first token from it with the request's seed,
    and drafts, as one engine would."""
    from sparsekv.disagg.layers import short_tail
    path, prompt = default_model_path(), _prompt(4096, 50)  # 12 full pages and a 2-row tail
    colocated = LLM(path, **BASE, num_speculative_tokens=2, **options)
    want = colocated.generate([prompt], params)[0]
    tails, pages, num_kinds, _ = _mtp_prefill(path, prompt)
    by_kind = {k: r[0] for d in tails for k, r in zip(d.kinds, short_tail(d.ready(), d.tail))}
    assert sorted(by_kind) == list(range(num_kinds)) and {r.shape[0] for r in by_kind.values()} == {1}
    decode = LLM(path, **BASE, **DECODE, num_speculative_tokens=2, **options)
    decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=[[by_kind[k] for k in range(num_kinds)]])
    got = _generate_from(decode.engine, prompt, params, None)
    assert got.num_cached_tokens == len(prompt) - 1  # the last token alone was computed
    assert got.metrics["spec_decode_num_drafts"] > 0
    assert got.token_ids == want.token_ids
    assert_same_greedy([want], [got], logprob_tolerance(colocated, extra_layers=1), lead=params.greedy)
    decode.engine.check_integrity()


def test_a_tail_fits_only_the_requests_it_was_cut_for(glm_ckpt):
    """A whole tail serves a request given its first token, a short one a request without: each
    other request computes the last page, and the tail's uses are not spent on it."""
    path, prompt = glm_ckpt[0], _prompt(256, 43)  # a 3-row tail
    prefill = LLM(path, **BASE)
    rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, rows.append)
    first = _first_token(prefill, prompt, GREEDY)
    whole = {k: r[0] for d in rows if d.tail for k, r in zip(d.kinds, d.ready())}
    pages = prefill.engine.kv.export_prefix(prompt)
    num_kinds = len(prefill.engine.kv.page_tensors())
    for tail, given, cached in [(whole, None, 40), ({k: r[:2] for k, r in whole.items()}, first, 40),
                                ({k: r[:2] for k, r in whole.items()}, None, 42), (whole, first, 43)]:
        decode = LLM(path, **BASE, **DECODE)
        decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=[[tail[k] for k in range(num_kinds)]])
        got = _generate_from(decode.engine, prompt, GREEDY, given)
        assert got.num_cached_tokens == cached
        decode.engine.check_integrity()
    with pytest.raises(ValueError, match="not the 3 \\(or 2\\)"):
        decode.engine.kv.import_prefix([], prompts=[prompt], tails=[[whole[k][:1] for k in range(num_kinds)]])


def test_a_prompts_pages_imported_a_few_at_a_time_under_its_chains_land_as_one_import(glm_ckpt):
    """The decode worker keeps a batch a slice at a time, naming the prompt's page chain it hashed once:
    the hit is the whole prompt's, as after one import; chains that do not match the prompts are refused."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE)
    chains = decode.engine.kv.prompt_chains([prompt])
    assert chains == [[name for name, _ in pages]]
    with pytest.raises(ValueError, match="2 chains of page names for 1 prompts"):
        decode.engine.kv.import_prefix(pages[:1], prompts=[prompt], chains=chains * 2)
    for start in range(0, len(pages), 3):
        assert decode.engine.kv.import_prefix(pages[start:start + 3], prompts=[prompt], chains=chains) == \
            len(pages[start:start + 3])
    out = decode.generate([prompt], GREEDY)[0]
    assert out.metrics["prefix_cached_tokens_device"] == len(pages) * PAGE
    decode.engine.check_integrity()


def test_pages_the_decode_side_holds_are_not_sent_again(glm_ckpt):
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    decode = LLM(path, **BASE, **DECODE)
    decode.generate([prompt[:21]], SamplingParams(max_tokens=1))  # the first 5 pages are in its pool
    held = decode.engine.kv.held_prefix(prompt)
    assert held == 5
    pages = prefill.engine.kv.export_prefix(prompt, skip=held)
    assert len(pages) == (len(prompt) - 1) // PAGE - held
    assert decode.engine.kv.import_prefix(pages) == len(pages)
    out = decode.generate([prompt], GREEDY)[0]
    assert out.metrics["prefix_cached_tokens_device"] == (held + len(pages)) * PAGE


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16)], ids=["plain", "tiered"])
def test_rows_that_do_not_fit_the_decode_cache_are_refused_whole(options, glm_ckpt):
    """A corrupted layer (a row of the wrong shape): nothing is imported, in any tier."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    name, rows = pages[3]
    bad = pages[:3] + [(name, [rows[0][:, :-1]] + rows[1:])] + pages[4:]
    decode = LLM(path, **BASE, **DECODE, **options)
    with pytest.raises(ValueError, match="page 3"):
        decode.engine.kv.import_prefix(bad, prompts=[prompt])
    stats = decode.stats()
    assert stats["prefix_host_pages"] == stats["prefix_cached_pages"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    decode.engine.check_integrity()
    out = decode.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0


def test_pages_land_in_the_pool_without_a_host_tier_and_in_the_host_tier_when_the_pool_has_no_room(
        glm_ckpt, monkeypatch):
    """Pages land in the pool's pages, no host tier needed. When the pool has no room (its pages held
    by running requests) they go to the host tier; an import the host tier cannot hold whole would push
    its first pages out with its last (the hit would be empty, the transfer wasted): refused, naming
    the option to raise; nothing kept."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    in_pool = LLM(path, **BASE)  # no prefix_cache_host_bytes
    assert in_pool.engine.kv.import_prefix(pages, prompts=[prompt]) == len(pages)
    assert in_pool.engine.kv.held_prefix(prompt) == len(pages)
    page_bytes = sum(r.numel() * r.element_size() for r in pages[0][1])
    decode = LLM(path, **BASE, prefix_cache_host_bytes=(len(pages) - 1) * page_bytes)
    monkeypatch.setattr(decode.engine.kv.prefix, "_land", lambda *args: False)  # no room in the pool
    with pytest.raises(ValueError, match="prefix-cache-host-bytes"):
        decode.engine.kv.import_prefix(pages, prompts=[prompt])
    assert decode.stats()["prefix_host_pages"] == 0
    assert decode.engine.kv.import_prefix(pages[:-1], prompts=[prompt]) == len(pages) - 1  # what fits is kept
    decode.engine.check_integrity()


def test_the_decode_side_starts_decoding_warm(monkeypatch):
    """A tiered decode side computes only the page holding the last token; placing every position its
    rows selected in the working set (rows read for that chunk anyway) makes its first decode step miss
    far fewer entries than from the last row's selections alone, and than from an empty working set.
    The bundled model, past top-k (256): the sparse regime. Placement never changes outputs."""
    from sparsekv.cache.tiers import TieredKVPool
    from sparsekv.tools.bench_kv_dtype import default_text
    path = default_model_path()
    prefill = LLM(path, max_model_len=1024)
    prompt = prefill.engine.tokenizer.encode(default_text())[:600]  # a last chunk of 600 - 9 * 64 = 24 rows
    prefill.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    pages = prefill.engine.kv.export_prefix(prompt)

    def first_decode_misses():
        decode = LLM(path, max_model_len=1024, kv_tiering=True, prefix_cache_host_bytes=1 << 28)
        engine = decode.engine
        engine.kv.import_prefix(pages, prompts=[prompt])
        req = engine.add_request(None, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while req.is_prefilling or not req.output_token_ids:
            engine.step()
        assert req.num_cached_tokens == len(pages) * 64
        before = engine.stats()["tier_misses"]
        engine.step()
        misses = engine.stats()["tier_misses"] - before
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
        return misses, list(req.output_token_ids)
    warm, tokens = first_decode_misses()
    monkeypatch.setattr(TieredKVPool, "_prime_block", lambda self, layer, seq, positions, distinct, inverse, stored:
                        self._prime(layer, seq, positions[-1], stored.index_select(0, inverse[-positions.shape[1]:])))
    last_row, last_row_tokens = first_decode_misses()
    monkeypatch.setattr(TieredKVPool, "_prime", lambda *args: None)
    cold, cold_tokens = first_decode_misses()
    assert cold > 250 * 4  # nearly every one of the 256 selected positions, in each layer
    assert warm < last_row / 4 and last_row < cold
    assert tokens == last_row_tokens == cold_tokens


def _tapped_prefill_with_a_tail(max_tokens: int):
    """The bundled model's prefill of a 600-token prompt (a tail of 600 - 9 * 64 = 24 rows) with its
    layers tapped, as a prefill worker sends it: (model path, prompt, greedy params, the first token,
    each full layer's (layer, union of the tail rows' selections, the last row's), the exported pages,
    the tail's rows by kind)."""
    from sparsekv.tools.bench_kv_dtype import default_text
    path = default_model_path()
    prefill = LLM(path, max_model_len=1024)
    prompt = prefill.engine.tokenizer.encode(default_text())[:600]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, rows.append)
    first = _first_token(prefill, prompt, params)
    tails = [d for d in rows if d.tail]
    assert [d.layer for d in tails if d.selected is not None] == prefill.engine.model_config.full_layers
    warm = tuple((d.layer, tuple(d.selected[0].tolist()), tuple(d.selected[1].tolist())) for d in tails
                 if d.selected is not None)
    pages = prefill.engine.kv.export_prefix(prompt)
    num_kinds = len(prefill.engine.kv.page_tensors())
    tail = [{k: r[0] for d in tails for k, r in zip(d.kinds, d.ready())}[k] for k in range(num_kinds)]
    return path, prompt, params, first, warm, pages, tail


def test_a_tail_completed_by_a_one_row_chunk_still_hands_out_its_selections():
    """A prompt whose last prefill chunk is a single row past top-k (601 tokens in chunks of 40: 15 x 40
    + 1) runs that row as a sparse decode row (decode_plan.py): its full layers' tail selections are
    handed out all the same, each with the last row's k positions among the tail rows' union."""
    from sparsekv.tools.bench_kv_dtype import default_text
    prefill = LLM(default_model_path(), max_model_len=1024, prefill_chunk_tokens=40)
    prompt = prefill.engine.tokenizer.encode(default_text())[:601]
    assert len(prompt) == 601
    rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, rows.append)
    _first_token(prefill, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    cfg = prefill.engine.model_config
    selected = [d for d in rows if d.tail and d.selected is not None]
    assert [d.layer for d in selected] == cfg.full_layers
    for d in selected:
        union, last = d.selected
        assert len(last) == cfg.index_topk and set(last.tolist()) <= set(union.tolist())

def test_a_tail_warms_the_working_set_with_the_prefill_sides_selections(monkeypatch):
    """With a tail the decode side computes no prompt row: the prefill engine's taps hand out, with a
    full layer's tail rows, the positions those rows selected (their union, and the last row's), and a
    tiered decode engine given them with the first token (FirstToken.warm) places exactly the union in
    each group's working set before the first decode, as computing that page there would. That step
    then misses a handful of entries instead of nearly every selected one; outputs are unchanged. The
    bundled model, past top-k (256): the sparse regime."""
    import dataclasses

    from sparsekv.cache.tiers import TieredKVPool
    path, prompt, params, first, warm, pages, tail = _tapped_prefill_with_a_tail(max_tokens=4)
    held, groups = {}, {}
    warm_of = TieredKVPool._warm

    def watched(self, ch):  # each group's residents right after the warm
        warm_of(self, ch)
        groups.update(self.groups)
        held.update({g: set(np.flatnonzero(lru.slots_of(np.arange(len(prompt))) >= 0).tolist())
                     for g, lru in self._resident[ch.request_id].lrus.items()})
    monkeypatch.setattr(TieredKVPool, "_warm", watched)

    def first_decode(selections, **options):
        decode = LLM(path, max_model_len=1024, kv_tiering=True, prefix_cache_host_bytes=1 << 28, **options)
        try:
            engine = decode.engine
            engine.kv.import_prefix(pages, prompts=[prompt], tails=[tail])
            req = engine.add_request("d", prompt, params, first_token=dataclasses.replace(first, warm=selections))
            engine.step()  # the first token's output, no compute
            engine.step()  # the first decode
            stats = engine.stats()
            while engine.has_unfinished_requests():
                engine.step()
            assert req.num_cached_tokens == len(prompt)
            engine.check_integrity()
        finally:
            decode.close()
        return stats, list(req.output_token_ids)
    warmed, tokens = first_decode(warm)
    union = {layer: set(u) for layer, u, _ in warm}
    assert all(len(u) <= 512 for u in union.values())  # the default working set holds each union
    assert held == union  # the union, the last row's among it (only full layers' groups: no MTP layer)
    cold, cold_tokens = first_decode(())
    assert warmed["tier_warmed"] == sum(len(union[g]) * len(groups[g]) for g in union) and cold["tier_warmed"] == 0
    assert cold["tier_misses"] > 250 * ModelConfig.from_json(path).num_hidden_layers  # nearly every one of the 256 selected, in each layer
    assert warmed["tier_misses"] < cold["tier_misses"] / 10
    assert tokens == cold_tokens
    # a tensor-parallel decode side (the tail's page copied to every rank at that step, each rank
    # warming from the same chunk): rank 0 warms the same entries, misses as many, same tokens
    held.clear()
    parallel, parallel_tokens = first_decode(warm, tensor_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    assert held == union and parallel_tokens == tokens
    assert (parallel["tier_warmed"], parallel["tier_misses"]) == (warmed["tier_warmed"], warmed["tier_misses"])


def test_a_warmed_working_set_keeps_the_last_rows_selections_as_the_most_recently_used(monkeypatch):
    """`_warm` places the union of the tail's selections, then the last row's again, as a prefill
    block primes: the last row's selections (what the first decode will mostly select) are the most
    recently used entries of each group's working set, so they are evicted last; the rest of the
    union comes before them."""
    import dataclasses

    from sparsekv.cache.tiers import TieredKVPool
    path, prompt, params, first, warm, pages, tail = _tapped_prefill_with_a_tail(max_tokens=2)
    orders, warm_of = {}, TieredKVPool._warm

    def watched(self, ch):  # each group's recency order right after the warm
        warm_of(self, ch)
        orders.update({g: lru.lru_order() for g, lru in self._resident[ch.request_id].lrus.items()})
    monkeypatch.setattr(TieredKVPool, "_warm", watched)
    decode = LLM(path, max_model_len=1024, kv_tiering=True, prefix_cache_host_bytes=1 << 28)
    try:
        engine = decode.engine
        engine.kv.import_prefix(pages, prompts=[prompt], tails=[tail])
        engine.add_request("d", prompt, params, first_token=dataclasses.replace(first, warm=warm))
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
    finally:
        decode.close()
    assert sorted(orders) == sorted(layer for layer, _, _ in warm)
    for layer, union, last in warm:
        assert len(set(union)) > len(last)  # the tail's rows select more than the last row does
        order = orders[layer]
        assert sorted(order) == sorted(union)
        assert sorted(order[-len(last):]) == sorted(last)


def test_landed_pages_serve_only_their_tenant_and_salt(glm_ckpt):
    """Pages that landed in a tiered decode side's pool keep their names: another tenant, or the same
    tenant with another cache_salt, computes the prompt; the tenant and salt they were sent for hit them."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.engine.add_request(None, prompt, SamplingParams(max_tokens=1), tenant="a", cache_salt="s")
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    pages = prefill.engine.kv.export_prefix(prompt, "a", "s")
    decode = LLM(path, **BASE, **DECODE, kv_tiering=True, device_buffer_tokens=16)
    decode.engine.kv.import_prefix(pages, "a", [prompt], "s")
    assert decode.stats()["prefix_cached_pages"] == len(pages) > 0
    cached = {}
    for tenant, salt in (("b", "s"), ("a", None), ("a", "s")):
        req = decode.engine.add_request(None, prompt, SamplingParams(max_tokens=2), tenant=tenant, cache_salt=salt)
        while decode.engine.has_unfinished_requests():
            decode.engine.step()
        cached[tenant, salt] = req.num_cached_tokens
    assert cached == {("b", "s"): 0, ("a", None): 0, ("a", "s"): len(pages) * PAGE}
    decode.engine.check_integrity()


def _run_to_end(engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def test_an_ended_requests_kept_pages_outlive_the_next_allocation_until_released(glm_ckpt):
    """A prefill worker names a prompt's last pages after its request ended (the room's last look): kept
    (`kv.keep_pages`), the next request cannot evict them before, and waits for the pages instead;
    released, they are cached pages as any ended request's, the next request's to evict."""
    a, b = _prompt(256, 41, seed=3), _prompt(256, 41, seed=4)  # 11 pages each, 10 of them full (named)
    engine = LLM(glm_ckpt[0], **BASE, num_kv_pages=16, max_num_seqs=1).engine
    kv = engine.kv
    kv.keep_pages(["a", "never-added"])
    _run_to_end(engine, "a", a)
    assert engine.stats()["kv_pages_kept"] == 11 and engine.stats()["kv_pages_free"] == 16 - 11
    engine.add_request("b", b, SamplingParams(max_tokens=1, temperature=0.0))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert engine.stats()["waiting"] == 1  # 5 pages free, 11 wanted: b waits for a's
    assert len(kv.export_prefix(a)) == 10
    kv.release_pages(["a", "never-added"])
    assert engine.stats()["kv_pages_kept"] == 0 and engine.stats()["kv_pages_free"] == 16
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert len(kv.export_prefix(a)) < 10  # b took the pages a left: evicted now
    _run_to_end(engine, "never-added", a)  # its wish to be kept was released with it: nothing is kept
    assert engine.stats()["kv_pages_kept"] == 0 and engine.stats()["kv_pages_free"] == 16
    # a look lets go of the requests that ended (`ended_only`), and the others stay to be kept
    kv.keep_pages(["c", "d"])
    _run_to_end(engine, "c", a)
    kv.release_pages(["c", "d"], ended_only=True)
    assert engine.stats()["kv_pages_kept"] == 0
    _run_to_end(engine, "d", b)
    assert engine.stats()["kv_pages_kept"] == 11
    kv.release_pages(["c", "d"])
    assert engine.stats()["kv_pages_kept"] == 0 and engine.stats()["kv_pages_free"] == 16
    with pytest.raises(RuntimeError, match="not owned"):
        kv.allocator.add_owner("kept:x", [0])


@pytest.mark.parametrize("decode_options", [{}, dict(kv_tiering=True, device_buffer_tokens=16)], ids=["plain", "tiered"])
def test_quest_pages_move_from_an_untiered_prefill_engine_to_either_decode_engine(decode_options, glm_ckpt, tmp_path):
    """Quest reads no indexer keys: no pool keeps them for the full layers (the MTP layer's own indexer
    keeps its), so tiered or not a Quest engine's pages have one layout and move between the two."""
    from sparsekv.disagg.worker import page_layout
    quest = dict(selector="quest", quest_page_tokens=4)
    from test_batched_decode import with_mtp_layer
    path, prompt = glm_ckpt[0], _prompt(256)
    mtp_path = with_mtp_layer(path, str(tmp_path / "mtp"))
    engines = [LLM(mtp_path, **BASE, **quest, **tiers, **drafts).engine
               for tiers in ({}, dict(kv_tiering=True, device_buffer_tokens=32))
               for drafts in ({}, dict(num_speculative_tokens=1))]
    untiered, untiered_mtp, tiered, tiered_mtp = [page_layout(e) for e in engines]
    index_head_dim = engines[0].model_config.index_head_dim
    assert not any(shape[-1] == index_head_dim for shape, _ in untiered)  # latents and Quest's bounds alone
    assert [shape[-1] for shape, _ in untiered_mtp].count(index_head_dim) == 1  # the MTP layer's keys
    assert untiered == tiered and untiered_mtp == tiered_mtp
    colocated = LLM(path, **BASE, **quest, **decode_options)
    want = colocated.generate([prompt], GREEDY)[0]
    pages, got, decode = _disaggregated(path, prompt, quest, {**quest, **decode_options})
    assert got.num_cached_tokens == len(pages) * PAGE == 40
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()
