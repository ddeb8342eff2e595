"""Prefill and decode workers as servers (`--disaggregation-mode`), driven over plain HTTP the way
`sparsekv router` drives them: the same request to both with a `disaggregation` field. The decode
worker's greedy tokens and logprobs must be one colocated engine's, whatever the decode worker held
beforehand and whatever the prefill worker's prefix cache served; the transfer's figures (bytes,
pages sent and skipped, the time to first token split) reach the response and /metrics."""
from __future__ import annotations

import dataclasses
import json
import time

import httpx
import pytest
import torch

from conftest import STARTUP_FLAGS
from disagg_util import WorkerServer, assert_transfer_bytes, send_pair
from sparsekv import LLM, SamplingParams
from sparsekv.paths import default_model_path
from test_server_util import scrape, tiny_checkpoint
from tolerances import assert_clear_lead, assert_logprobs_close, logprob_tolerance

PAGE = 4
BASE = dict(kv_page_size=PAGE, max_model_len=128, num_threads=1)
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
BODY = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 3, "ignore_eos": True}


def assert_as_colocated(want, body: dict, server: WorkerServer, tol: float) -> None:
    """The decode worker's answer against one engine's output: the same greedy tokens (where they
    lead clearly) and logprobs within tol, keyed by token text as the API reports them."""
    assert_clear_lead(want, tol)
    assert body["sparsekv"]["choices"][0]["token_ids"] == want.token_ids
    text = server.state.token_text
    assert_logprobs_close([{text(t): v for t, v in lp.items()} for lp in want.logprobs],
                          body["choices"][0]["logprobs"]["top_logprobs"], tol)


def _prompt(vocab: int, n: int = 41, seed: int = 3) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(p: WorkerServer, d: WorkerServer, prompt: list[int], **extra) -> dict:
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt, **extra})
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    return rd.json()


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "decode-tiered", "fp8"])
def test_prefill_and_decode_workers_answer_as_one_engine(family, options, glm_ckpt, ds_ckpt):
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    prefill_options = {k: v for k, v in options.items() if k == "kv_cache_dtype"}
    with WorkerServer(path, "prefill", **BASE, **prefill_options) as p, WorkerServer(path, "decode", **BASE, **options) as d:
        body = _decode(p, d, prompt)
        assert_as_colocated(want, body, d, logprob_tolerance(colocated))
        figures = body["sparsekv"]["disaggregation"]
        assert figures["pages_sent"] == (len(prompt) - 1) // PAGE and figures["pages_skipped"] == 0
        # the first token came from the prefill worker, with the last page's rows through the prompt's end
        assert (figures["first_tokens"], figures["tail_tokens"]) == (1, len(prompt) - figures["pages_sent"] * PAGE)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        assert_transfer_bytes(figures, d.engine, PAGE)  # selections only for a tiered decode worker
        if options.get("kv_tiering"):  # the rows landed in the pool's host store only, not in the host tier too
            assert d.engine.stats()["prefix_host_pages"] == 0
            assert body["sparsekv"]["tiers"]["prefix_cached_tokens_device"] == len(prompt)
            cfg = d.engine.model_config  # the tail's selections warmed every layer before the first decode
            assert len(prompt) > cfg.index_topk
            assert body["sparsekv"]["tiers"]["tier_warmed"] == cfg.index_topk * cfg.num_hidden_layers
        p.check_clean()
        d.check_clean()


def test_with_mtp_drafting_on_both_sides():
    """The pages carry the MTP layer's entries; the prefill worker runs the tokens that name them,
    greedily. A greedy request's first token is that run's (sent), with the tail, whose MTP layer's
    rows that run's pass after its first token wrote: the decode side computes that token alone. A
    sampled one's is sampled on the decode side, which drafts from it as one engine does (the same
    seeded tokens): the tail goes short, less the prompt's last token, which the decode side computes
    alone (its MTP-layer entry depends on the token sampled after it)."""
    path, prompt = default_model_path(), _prompt(4096, 50)
    colocated = LLM(path, **BASE, num_speculative_tokens=2)
    want = colocated.generate([prompt], GREEDY)[0]
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True)
    want_sampled = colocated.generate([prompt], sampled)[0]
    with WorkerServer(path, "prefill", **BASE, num_speculative_tokens=2) as p, \
            WorkerServer(path, "decode", **BASE, num_speculative_tokens=2) as d:
        body = _decode(p, d, prompt)
        assert body["sparsekv"]["disaggregation"]["pages_sent"] == (len(prompt) - 1) // PAGE
        figures = body["sparsekv"]["disaggregation"]
        assert (figures["first_tokens"], figures["tail_tokens"]) == (1, len(prompt) - figures["pages_sent"] * PAGE)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        assert body["sparsekv"]["tiers"]["spec_decode_num_drafts"] > 0
        assert_as_colocated(want, body, d, logprob_tolerance(colocated, extra_layers=1))
        tail = figures["tail_tokens"]
        body = _decode(p, d, prompt, temperature=0.8, seed=5, logprobs=None)
        assert (body["sparsekv"]["disaggregation"]["first_tokens"], body["sparsekv"]["disaggregation"]["tail_tokens"]) \
            == (0, tail - 1)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert body["sparsekv"]["choices"][0]["token_ids"] == want_sampled.token_ids
        rows = d.engine.counters["prompt_tokens"]  # n = 2: the short tail serves both choices
        body = _decode(p, d, _prompt(4096, 47, seed=4), n=2, temperature=0.8, seed=7, logprobs=None)
        assert d.engine.counters["prompt_tokens"] - rows == 2  # each choice computed the last token alone
        params = [dataclasses.replace(sampled, seed=7 + i) for i in range(2)]
        want_n = colocated.generate([_prompt(4096, 47, seed=4)] * 2, params)
        assert [c["token_ids"] for c in body["sparsekv"]["choices"]] == [w.token_ids for w in want_n]
        d.check_clean()


def test_prefix_hits_on_either_side_and_pages_not_sent(glm_ckpt):
    """The decode worker's held pages are skipped (all, or the first few); the prefill worker's
    prefix cache serves a prompt it computed before. The tokens never change."""
    path, prompt = glm_ckpt[0], _prompt(256)
    full = (len(prompt) - 1) // PAGE
    want = LLM(path, **BASE).generate([prompt], GREEDY)[0]
    with WorkerServer(path, "prefill", **BASE) as p, WorkerServer(path, "decode", **BASE) as d:
        first = _decode(p, d, prompt[:21])["sparsekv"]["disaggregation"]  # the decode worker now holds 5 pages
        assert (first["pages_sent"], first["pages_skipped"]) == (5, 0)
        body = _decode(p, d, prompt)
        figures = body["sparsekv"]["disaggregation"]
        assert (figures["pages_sent"], figures["pages_skipped"]) == (full - 5, 5)
        assert body["sparsekv"]["choices"][0]["token_ids"] == want.token_ids
        again = _decode(p, d, prompt)  # it holds them all: only the last page's rows are sent
        figures = again["sparsekv"]["disaggregation"]
        row_bytes = d.engine.kv.prefix.tiers["host"].page_bytes // PAGE
        assert (figures["pages_sent"], figures["bytes"], figures["pages_skipped"]) == (0, row_bytes, full)
        assert again["sparsekv"]["choices"][0]["token_ids"] == want.token_ids
        httpx.post(d.url + "/reset_prefix_cache", timeout=5).raise_for_status()
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt})  # the prefill worker's cache serves it
        assert rp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full * PAGE
        assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == full
        assert rd.json()["sparsekv"]["choices"][0]["token_ids"] == want.token_ids
        p.check_clean()
        d.check_clean()


@pytest.fixture(scope="module")
def pair(glm_ckpt):
    keys = ["sk-alice:alice", "sk-bob:bob"]
    with WorkerServer(glm_ckpt[0], "prefill", api_keys=keys, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", api_keys=keys, **BASE) as d:
        yield p, d


def test_the_prefill_worker_counts_no_held_page_as_sent_layer_by_layer(pair):
    """The prefill worker computes the whole prompt again (its cache reset) while the decode worker holds
    its first 5 pages: the rows of those pages are taken from the engine but not sent, so neither worker
    counts them in `pages_by_layer` (pages whose rows went layer by layer, docs/disaggregation.md)."""
    p, d = pair
    prompt, alice = _prompt(256, 41, seed=33), {"Authorization": "Bearer sk-alice"}
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt[:21]}, headers=alice)
    assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
    httpx.post(p.url + "/reset_prefix_cache", headers=alice, timeout=5).raise_for_status()
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt}, headers=alice)
    assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
    sent, got = rp.json()["sparsekv"]["disaggregation"], rd.json()["sparsekv"]["disaggregation"]
    assert (sent["pages_sent"], sent["pages_skipped"]) == (got["pages_sent"], got["pages_skipped"]) == (5, 5)
    assert sent["pages_by_layer"] == got["pages_by_layer"] == 5
    p.check_clean()
    d.check_clean()


def test_each_worker_describes_its_role(pair):
    p, d = pair
    info = httpx.get(p.url + "/disaggregation", timeout=5).json()
    layout = p.worker.layout  # a page's rows, [shape, dtype] per kind: the same on both sides
    assert layout == d.worker.layout and all(kind[1] == "float32" for kind in layout)
    assert info == {"mode": "prefill", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.worker.store.port,
                    "transfer_backend": "torch", "kv_layout": layout, "num_running": 0, "num_waiting": 0}
    assert httpx.get(d.url + "/disaggregation", timeout=5).json() == {
        "mode": "decode", "bootstrap_host": "127.0.0.1", "bootstrap_port": None, "transfer_backend": "torch",
        "kv_layout": layout, "num_running": 0, "num_waiting": 0}


def test_a_colocated_server_describes_its_load_as_a_worker_would():
    """GET /disaggregation on a server without a role (mode "null"): its running and waiting requests,
    each from its own count, as a worker reports them (the router reads both)."""
    from types import SimpleNamespace
    from sparsekv.disagg.roles import describe
    state = SimpleNamespace(disagg=None, loop=SimpleNamespace(stats=lambda: {"running": 2, "waiting": 3}))
    assert describe(state) == {"mode": "null", "bootstrap_host": None, "bootstrap_port": None,
                               "transfer_backend": None, "num_running": 2, "num_waiting": 3}


@pytest.mark.parametrize("worker", [0, 1], ids=["prefill", "decode"])
def test_a_request_without_its_room_is_refused(pair, worker):
    url = pair[worker].url
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": [1, 2, 3]},
                   headers={"Authorization": "Bearer sk-alice"}, timeout=10)
    assert r.status_code == 400 and "disaggregation" in r.json()["error"]["message"]
    bad = {**BODY, "prompt": [1, 2, 3], "disaggregation": {"room": "a b", "bootstrap_host": "h", "bootstrap_port": 1}}
    r = httpx.post(url + "/v1/completions", json=bad, headers={"Authorization": "Bearer sk-alice"}, timeout=10)
    assert r.status_code == 400 and "disaggregation.room" in r.json()["error"]["message"]


def test_streaming_n_and_tenants_through_the_pair(pair):
    """The decode worker answers as the client asked (a stream of n choices); the tenant and
    cache_salt name the pages on both sides, so another tenant's request is sent every page again."""
    p, d = pair
    prompt = _prompt(256, 33, seed=5)
    alice = {"Authorization": "Bearer sk-alice"}
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt, "n": 2, "stream": True, "cache_salt": "s1",
                                      "stream_options": {"include_usage": True}}, headers=alice)
    assert rp.status_code == 200 and rd.status_code == 200
    chunks = [json.loads(line[6:]) for line in rd.text.splitlines() if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    usage = chunks[-1]
    assert usage["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    assert usage["sparsekv"]["tenant"] == "alice" and usage["sparsekv"]["disaggregation"]["pages_sent"] == 8
    assert rp.json()["sparsekv"]["tenant"] == "alice"
    bob = {"Authorization": "Bearer sk-bob"}
    _, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt, "cache_salt": "s1"}, headers=bob)
    assert rd.json()["sparsekv"]["disaggregation"]["pages_skipped"] == 0  # alice's pages are not bob's
    p.check_clean()
    d.check_clean()


def test_sampled_choices_start_from_the_first_tokens_the_prefill_worker_sampled(pair, glm_ckpt):
    """n = 2 seeded, sampled choices with logprobs: the prefill worker samples each choice's first token
    with its own parameters (seed + choice), and the decode worker continues each from it: the tokens
    of one engine given the same parameters. The prompt's tail serves both choices."""
    p, d = pair
    prompt = _prompt(256, 35, seed=8)
    extra = {"n": 2, "temperature": 0.9, "top_p": 0.95, "seed": 11, "logprobs": 2}
    prompt_rows = d.engine.counters["prompt_tokens"]
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt, **extra}, headers={"Authorization": "Bearer sk-alice"})
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=11 + i, logprobs=2,
                             ignore_eos=True) for i in range(2)]
    want = LLM(glm_ckpt[0], **BASE).generate([prompt, prompt], params)
    got = rd.json()
    assert [c["token_ids"] for c in got["sparsekv"]["choices"]] == [w.token_ids for w in want]
    assert want[0].token_ids != want[1].token_ids  # the choices differ, from their first tokens on
    assert got["sparsekv"]["disaggregation"]["first_tokens"] == 2
    assert d.engine.counters["prompt_tokens"] == prompt_rows  # the tail served both choices: no prompt row computed
    p.check_clean()
    d.check_clean()


def test_a_request_that_ends_at_its_first_token_is_answered_from_the_prefill_workers_token(pair, glm_ckpt):
    """max_tokens 1: the decode worker keeps the KV (its prefix cache), outputs the prefill worker's
    token, and computes nothing for the request."""
    p, d = pair
    prompt = _prompt(256, 37, seed=9)
    want = LLM(glm_ckpt[0], **BASE).generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0]
    steps = d.engine.counters["steps"]
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt, "max_tokens": 1}, headers={"Authorization": "Bearer sk-alice"})
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    got = rd.json()
    assert got["sparsekv"]["choices"][0]["token_ids"] == want.token_ids and got["choices"][0]["finish_reason"] == "length"
    assert got["sparsekv"]["disaggregation"]["first_tokens"] == 1 and d.engine.counters["steps"] == steps
    assert got["usage"]["completion_tokens"] == 1
    p.check_clean()
    d.check_clean()


@pytest.mark.parametrize("max_tokens", [2, 0], ids=["completion", "prompt-only"])
def test_echo_with_logprobs_answers_as_one_engine(pair, glm_ckpt, max_tokens):
    """echo with logprobs (lm-eval's loglikelihood request with max_tokens 0): the decode worker
    echoes the prompt with its logprobs, which it computes (the prefill worker's own answer echoes
    nothing, as it computes no prompt logprobs)."""
    p, d = pair
    prompt = _prompt(256, 26, seed=21)
    want = LLM(glm_ckpt[0], **BASE).generate([prompt], SamplingParams(max_tokens=max(1, max_tokens), temperature=0.0,
                                                                     logprobs=1, prompt_logprobs=1))[0]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 1}
    rp, rd = send_pair(p.url, d.url, body, headers={"Authorization": "Bearer sk-alice"})
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    lps = rd.json()["choices"][0]["logprobs"]
    generated = want.token_ids[:max_tokens]
    assert len(lps["tokens"]) == len(prompt) + len(generated) and lps["token_logprobs"][0] is None
    tol = logprob_tolerance(LLM(glm_ckpt[0], **BASE))
    text = d.state.token_text
    prompt_rows = [{text(t): v for t, v in row.items()} for row in want.prompt_logprobs[1:]]
    assert_logprobs_close(prompt_rows, lps["top_logprobs"][1:len(prompt)], tol)
    p.check_clean()
    d.check_clean()


def test_transfer_figures_reach_the_response_and_metrics(pair):
    p, d = pair
    before = {w: scrape(w.url) for w in pair}
    prompt = _prompt(256, 29, seed=7)
    _, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt}, headers={"Authorization": "Bearer sk-alice"})
    figures = rd.json()["sparsekv"]["disaggregation"]
    assert figures["role"] == "decode" and figures["pages_sent"] == 7
    assert figures["backend"] == "gloo"  # two CPU workers
    for key in ("queue_s", "prefill_s", "transfer_s", "decode_queue_s", "first_decode_s"):
        assert figures[key] >= 0, key
    for w in pair:
        after = scrape(w.url)
        assert after["sparsekv:disagg_transfer_bytes_total"] - before[w]["sparsekv:disagg_transfer_bytes_total"] \
            == figures["bytes"] > 0
        assert after["sparsekv:disagg_transfer_seconds_count"] - before[w]["sparsekv:disagg_transfer_seconds_count"] == 1
        assert after["sparsekv:disagg_transfers_failed_total"] == before[w]["sparsekv:disagg_transfers_failed_total"]
        assert after["sparsekv:disagg_transfers_in_flight"] == 0
    decode = {k: scrape(d.url)[k] - before[d][k] for k in (
        "sparsekv:prefix_cache_queries_total", "sparsekv:prefix_cache_hits_total",
        "sparsekv:request_queue_time_seconds_count")}
    # the prompt once (not the first token it came with), served whole from the pool: pages and the
    # imported tail (a fresh prompt: no host or disk tier holds it)
    assert decode["sparsekv:prefix_cache_queries_total"] == len(prompt)
    assert decode["sparsekv:prefix_cache_hits_total"] == rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] \
        == len(prompt)
    assert decode["sparsekv:request_queue_time_seconds_count"] == 1  # its first token came before it queued


def test_without_the_prefill_workers_first_token_the_first_decode_step_is_timed_from_the_schedule():
    """`DecodeFigures`: a first token that came from the prefill worker is output with no step of this
    worker (its queue ends with that output, first_decode_s 0); one this worker samples itself (with MTP
    drafting and sampled choices) is timed from the request's first step: queue to it, step to output."""
    from types import SimpleNamespace
    from sparsekv.disagg.decode import DecodeFigures
    group, firsts = SimpleNamespace(first_scheduled=10.5), [12.0, 12.25]  # each choice's first output
    sampled_here = DecodeFigures({"first_tokens": 0}, group, 10.0)(firsts)
    assert (sampled_here["decode_queue_s"], sampled_here["first_decode_s"]) == (0.5, 1.5)
    came = DecodeFigures({"first_tokens": 1}, group, 10.0)(firsts)
    assert (came["decode_queue_s"], came["first_decode_s"]) == (2.0, 0.0)
    none_yet = DecodeFigures({"first_tokens": 0}, group, 10.0)([])
    assert none_yet["decode_queue_s"] == 0.5 and "first_decode_s" not in none_yet


def test_both_workers_report_the_pages_the_decode_worker_held_as_skipped_not_sent(pair):
    """The prefill worker computes the whole prompt again (its cache reset) while the decode worker holds
    its first pages: their rows go neither layer by layer nor by name, the prefill worker's own figures
    (its response's extension) and both workers' metrics count them as skipped, and only the others as
    sent."""
    p, d = pair
    prompt, alice = _prompt(256, 41, seed=31), {"Authorization": "Bearer sk-alice"}
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt[:21]}, headers=alice)  # the decode worker now holds 5 pages
    assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
    httpx.post(p.url + "/reset_prefix_cache", headers=alice, timeout=5).raise_for_status()
    before = {w: scrape(w.url)["sparsekv:disagg_pages_skipped_total"] for w in pair}
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt}, headers=alice)
    assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
    sent, got = rp.json()["sparsekv"]["disaggregation"], rd.json()["sparsekv"]["disaggregation"]
    assert (sent["pages_sent"], sent["pages_skipped"]) == (got["pages_sent"], got["pages_skipped"]) == (5, 5)
    assert got["pages_by_layer"] == 5  # the rows of the pages it held were not sent
    for w in pair:
        assert scrape(w.url)["sparsekv:disagg_pages_skipped_total"] - before[w] == 5
    p.check_clean()
    d.check_clean()


def test_pages_sent_after_the_prefill_go_in_one_batch_kept_at_once_and_none_streamed(pair, monkeypatch):
    """With one look after the prefill (the bench's transfer mode), every page goes in the last batch,
    which the decode worker keeps in one engine call with the tail (the request waits for it), however
    many pages a slice of an earlier batch holds; neither worker counts a page as streamed."""
    from sparsekv.disagg import decode as decode_module
    p, d = pair
    monkeypatch.setattr(decode_module, "KEEP_SLICE_PAGES", 1)
    calls, real = [], d.engine.kv.import_prefix
    monkeypatch.setattr(d.engine.kv, "import_prefix",
                        lambda pages, *a, **o: calls.append((len(pages), bool(o.get("tails")))) or real(pages, *a, **o))
    monkeypatch.setattr(p.worker, "stream_poll_s", None)
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256, 41, seed=32)},
                       headers={"Authorization": "Bearer sk-alice"})
    sent, got = rp.json()["sparsekv"]["disaggregation"], rd.json()["sparsekv"]["disaggregation"]
    assert (sent["pages_sent"], sent["batches"]) == (got["pages_sent"], got["batches"]) == (10, 1)
    assert calls == [(10, True)]
    assert sent["pages_streamed"] == got["pages_streamed"] == got["pages_kept_early"] == 0
    p.check_clean()
    d.check_clean()


def test_chat_through_the_pair(tmp_path_factory):
    """A chat request: both workers render the same template; the answer is one engine's."""
    path = tiny_checkpoint(tmp_path_factory.mktemp("chat"))
    messages = [{"role": "user", "content": "the rain in spain stays mainly in the plain"}]
    with WorkerServer(path, "prefill", **BASE) as p, WorkerServer(path, "decode", **BASE) as d:
        ids = httpx.post(d.url + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
        want = LLM(path, **BASE).generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                ignore_eos=True))[0]
        rp, rd = send_pair(p.url, d.url, {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                                          "ignore_eos": True}, path="/v1/chat/completions")
        assert (rp.status_code, rd.status_code) == (200, 200), rd.text
        body = rd.json()
        assert body["object"] == "chat.completion"
        assert body["sparsekv"]["choices"][0]["token_ids"] == want.token_ids
        assert body["sparsekv"]["disaggregation"]["pages_sent"] == (len(ids) - 1) // PAGE > 0
        d.check_clean()


def test_rooms_waiting_for_each_other_hold_no_transfer_thread(pair):
    """More rooms at once than transfer threads: a room waiting for its peer holds no thread, so
    rooms whose halves arrive in any order all complete (one thread per worker here)."""
    from concurrent.futures import ThreadPoolExecutor
    p, d = pair
    pools = p.worker.pool, d.worker.pool
    p.worker.pool, d.worker.pool = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    try:
        alice = {"Authorization": "Bearer sk-alice"}
        with ThreadPoolExecutor(4) as clients:
            answers = list(clients.map(lambda seed: send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256, 25, seed)},
                                                              headers=alice), range(10, 14)))
        assert all((rp.status_code, rd.status_code) == (200, 200) for rp, rd in answers)
        assert [rd.json()["sparsekv"]["disaggregation"]["pages_sent"] for _, rd in answers] == [6] * 4
    finally:
        p.worker.pool, d.worker.pool = pools
    p.check_clean()
    d.check_clean()


def test_a_role_needs_the_prefix_cache_and_a_free_bootstrap_port(glm_ckpt, pair):
    with pytest.raises(ValueError, match="needs the prefix cache"):
        WorkerServer(glm_ckpt[0], "decode", enable_prefix_caching=False, prefix_cache_host_bytes=None, **BASE)
    taken = pair[0].worker.store.port
    with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {taken}: cannot listen"):
        WorkerServer(glm_ckpt[0], "prefill", bootstrap_port=taken, **BASE)


def test_the_transfer_backend_is_nccl_only_when_both_workers_run_on_cuda(monkeypatch):
    """NCCL moves CUDA tensors only: a pair with a CPU worker, an older decode worker that names no
    device, or a torch without NCCL takes gloo, and gloo's tensors are on the host."""
    import torch.distributed as dist
    from sparsekv.disagg.transfer import transfer_backend, transfer_device
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert transfer_backend("cuda", "cuda") == "nccl"
    for pair in [("cuda", "cpu"), ("cpu", "cuda"), ("cpu", "cpu"), ("cuda", None)]:
        assert transfer_backend(*pair) == "gloo", pair
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert transfer_backend("cuda", "cuda") == "gloo"
    gpu = torch.device("cuda", 1)
    assert transfer_device("nccl", gpu) == gpu
    assert transfer_device("gloo", gpu) == torch.device("cpu")


def test_two_workers_sharing_one_gpu_pair_over_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU: the claim names the decode worker's GPU (gpu_identity), and a
    prefill worker on the same one picks gloo; on different GPUs, or with a decode worker naming none,
    NCCL; NIXL is not concerned."""
    import torch.distributed as dist
    from sparsekv.disagg.transfer import gpu_identity, pair_backend
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    claim = {"transfer": "torch", "device": "cuda", "gpu": "GPU-1"}
    assert pair_backend("torch", "cuda", claim, "GPU-1") == "gloo"
    assert pair_backend("torch", "cuda", claim, "GPU-2") == "nccl"
    assert pair_backend("torch", "cuda", {"transfer": "torch", "device": "cuda"}, "GPU-1") == "nccl"
    assert pair_backend("nixl", "cuda", {**claim, "transfer": "nixl"}, "GPU-1") == "nixl"
    assert gpu_identity(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("transfer, options", [("torch", {}), ("torch", dict(kv_tiering=True, device_buffer_tokens=16)),
                                               ("nixl", {})], ids=["torch", "torch-decode-tiered", "nixl"])
def test_two_workers_sharing_one_gpu_answer_as_one_engine_on_cuda(transfer, options, glm_ckpt):
    """Both workers' engines on the one GPU (a development box): the pair takes gloo over NCCL (or
    NIXL), and the decode worker (untiered, or tiered: the rows land in its host store and device
    working set) answers as one engine on that GPU."""
    from sparsekv.disagg.nixl import nixl_available
    if transfer == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    path, prompt = glm_ckpt[0], _prompt(256)
    cuda = dict(device="cuda", dtype="float32")  # the tolerance is float32's
    colocated = LLM(path, **BASE, **options, **cuda)
    want = colocated.generate([prompt], GREEDY)[0]
    with WorkerServer(path, "prefill", transfer=transfer, **BASE, **cuda) as p, \
            WorkerServer(path, "decode", transfer=transfer, **BASE, **options, **cuda) as d:
        body = _decode(p, d, prompt)
        assert_as_colocated(want, body, d, logprob_tolerance(colocated))
        assert body["sparsekv"]["disaggregation"]["backend"] == ("gloo" if transfer == "torch" else "nixl")
        p.check_clean()
        d.check_clean()


def test_nixl_only_when_both_workers_say_so(monkeypatch):
    """The claim names the decode worker's --disaggregation-transfer-backend (a claim without one is
    torch's); the prefill worker takes NIXL when both say nixl, torch.distributed's backend when both
    say torch, and refuses a pair set differently."""
    import torch.distributed as dist
    from sparsekv.disagg.transfer import pair_backend
    from sparsekv.disagg.wire import TransferError
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert pair_backend("nixl", "cpu", {"transfer": "nixl", "device": "cpu"}) == "nixl"
    assert pair_backend("nixl", "cuda", {"transfer": "nixl", "device": "cuda"}) == "nixl"
    assert pair_backend("torch", "cuda", {"transfer": "torch", "device": "cuda"}) == "nccl"
    assert pair_backend("torch", "cpu", {"device": "cpu"}) == "gloo"
    for mine, theirs in [("nixl", {"device": "cpu"}), ("torch", {"transfer": "nixl"}), ("nixl", {"transfer": "torch"})]:
        with pytest.raises(TransferError, match="--disaggregation-transfer-backend"):
            pair_backend(mine, "cpu", theirs)


def test_a_nixl_worker_without_nixl_says_what_to_install(monkeypatch):
    import importlib

    from sparsekv.disagg import nixl

    def missing(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ValueError, match="needs NIXL, which is not installed: pip install nixl-cu12"):
        nixl.NixlAgent("decode")
    assert not nixl.nixl_available()


def test_a_weights_stamp_names_the_checkpoint_while_its_files_are_what_was_loaded(glm_ckpt, tmp_path):
    """The checkpoint's digest is compared only where both sides know it: once the directory changed
    on disk after the load, its files no longer say what was loaded, and only the version is compared."""
    import shutil
    from sparsekv.disagg.weights_stamp import WeightsStamp, check_same_weights
    from sparsekv.disagg.wire import TransferError
    from sparsekv.weights import files_stamp
    path = str(tmp_path / "ckpt")
    shutil.copytree(glm_ckpt[0], path)
    loaded = (0, path, files_stamp(path))
    known = WeightsStamp().stamp(loaded)
    original = WeightsStamp().stamp((0, glm_ckpt[0], files_stamp(glm_ckpt[0])))
    assert known == original and known["checkpoint"] is not None  # named by content, not by directory
    with open(f"{path}/config.json", "a") as f:
        f.write(" ")
    unknown = WeightsStamp().stamp(loaded)
    assert unknown == {"weights_version": 0, "checkpoint": None}
    check_same_weights(unknown, known)
    with pytest.raises(TransferError, match="weights_version 1, this decode worker holds weights_version 0"):
        check_same_weights({**unknown, "weights_version": 1}, known)
    with pytest.raises(TransferError, match="weights_version None"):
        check_same_weights(None, known)  # metadata without the field


def test_a_worker_reloading_a_rewritten_checkpoint_directory_stamps_the_new_weights(glm_ckpt, tmp_path):
    """One worker's stamps (each digest computed once): a checkpoint written again into the directory
    its weights came from, then loaded (an RL trainer's next update), is named by its own digest, not by
    the one computed for the directory's earlier contents."""
    import shutil
    from sparsekv.disagg.weights_stamp import WeightsStamp
    from sparsekv.tools.tiny import save_reference_checkpoint
    from sparsekv.weights import files_stamp
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    shutil.copytree(glm_ckpt[0], path)
    save_reference_checkpoint(other, "glm_moe_dsa", seed=1)
    stamps = WeightsStamp()
    first = stamps.stamp((0, path, files_stamp(path)))
    shutil.rmtree(path)
    shutil.copytree(other, path)
    second = stamps.stamp((1, path, files_stamp(path)))
    assert second == WeightsStamp().stamp((1, other, files_stamp(other)))  # the new contents' digest
    assert second["checkpoint"] is not None and second["checkpoint"] != first["checkpoint"]


def test_a_worker_keeps_the_stamps_of_its_last_weights_only_however_many_updates_it_loads(glm_ckpt, tmp_path,
                                                                                          monkeypatch):
    """An RL trainer updates a worker's weights from a new checkpoint at each step: one digest kept per
    update would grow for the worker's life. The last MAX_STAMPS are kept (the current weights' among
    them, computed once), and a stamp dropped and asked again is computed again, the same."""
    import shutil
    from sparsekv.disagg import weights_stamp
    from sparsekv.weights import files_stamp
    monkeypatch.setattr(weights_stamp, "MAX_STAMPS", 3, raising=False)
    stamps, computed, real = weights_stamp.WeightsStamp(), [], weights_stamp._checkpoint_digest
    monkeypatch.setattr(weights_stamp, "_checkpoint_digest", lambda path: computed.append(path) or real(path))
    paths = [str(tmp_path / f"step-{i}") for i in range(10)]
    first = None
    for version, path in enumerate(paths):
        shutil.copytree(glm_ckpt[0], path)
        loaded = (version, path, files_stamp(path))
        got = stamps.stamp(loaded)
        assert stamps.stamp(loaded) == got and got["checkpoint"] is not None  # the second from the cache
        first = first or got
    assert len(computed) == len(paths)  # each update's digest computed once
    assert len(stamps._digests) == 3
    assert stamps.stamp((0, paths[0], files_stamp(paths[0]))) == first  # dropped, computed again
    assert len(stamps._digests) == 3


@pytest.mark.parametrize("theirs", [[0, "c" * 64], "0", 0], ids=["list", "string", "number"])
def test_a_weights_stamp_that_is_no_object_is_refused_as_a_transfer_error(theirs):
    """The prefill worker's `weights` field, from its metadata, that is no JSON object: refused as the
    room's TransferError, which fails that request only, not an AttributeError the worker does not expect."""
    from sparsekv.disagg.weights_stamp import check_same_weights
    from sparsekv.disagg.wire import TransferError
    with pytest.raises(TransferError, match="weights_version None, this decode worker holds weights_version 0"):
        check_same_weights(theirs, {"weights_version": 0, "checkpoint": "c" * 64})


def test_a_worker_keeps_the_stamps_asked_for_last_not_those_computed_first(monkeypatch):
    """The stamps kept are those asked for last: a checkpoint loaded again (an RL trainer rolling back to
    it) is kept over one asked for since, so loading it once more reads none of its files again, where
    dropping the oldest computed would read them at every rollback."""
    from sparsekv.disagg import weights_stamp
    monkeypatch.setattr(weights_stamp, "MAX_STAMPS", 2, raising=False)
    monkeypatch.setattr(weights_stamp, "_stat_stamp", lambda path: [path, 1])
    computed = []
    monkeypatch.setattr(weights_stamp, "_checkpoint_digest", lambda path: computed.append(path) or path * 2)
    stamps = weights_stamp.WeightsStamp()
    for version, path in enumerate(["a", "b", "a", "c", "a"]):
        assert stamps.stamp((version, path, [path, 1])) == {"weights_version": version, "checkpoint": path * 2}
    assert computed == ["a", "b", "c"]
    assert list(stamps._digests) == [("c", json.dumps(["c", 1])), ("a", json.dumps(["a", 1]))]


@pytest.mark.parametrize("tp_side", ["prefill", "decode", "decode-tiered"])
def test_a_tensor_parallel_worker_on_either_side(tp_side, glm_ckpt, tmp_path):
    """A worker of two tensor-parallel ranks (`-tp 2`, a `sparsekv serve` process of its own: one
    process holds one torch.distributed world) pairs with a one-rank worker: the KV leaves from rank 0's
    pages, or lands in rank 0's host tier (tiered: its pool) and reaches every rank as a prefix hit's
    restored pages do; the answer is one colocated engine's. The last page's rows through the last token
    come too (from rank 0's taps; to every rank with the restored pages), with the first token: that
    token alone is computed."""
    from disagg_util import process_and_local_pair
    path, prompt = glm_ckpt[0], _prompt(256, 44)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], GREEDY)[0]
    tiered = ("--kv-tiering", "--device-buffer-tokens", "16") if tp_side == "decode-tiered" else ()
    args = ("-tp", "2", "--threads", "1", *tiered, *STARTUP_FLAGS)
    with process_and_local_pair(path, tp_side.split("-")[0], tmp_path, args, **BASE) as (p_url, d_url, local):
        rp, rd = send_pair(p_url, d_url, {**BODY, "prompt": prompt})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert_as_colocated(want, rd.json(), local, logprob_tolerance(colocated))
        assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == (len(prompt) - 1) // PAGE
        assert rd.json()["sparsekv"]["disaggregation"]["tail_tokens"] == PAGE  # the prompt's last page is full
        assert rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        local.check_clean()


def _slowed(engine, monkeypatch, seconds: float = 0.1) -> None:
    """Each step of `engine` waits `seconds` first: a prefill of several chunks lasts long enough for
    the prefill worker to look for new pages between its steps."""
    real = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(seconds), real())[1])


class _StepGate:
    """Each step of the prefill worker's engine `prefill` after its first waits until the decode worker's
    engine `decode` kept the pages the steps before it named (`pages_per_step` a step, through step
    `steps - 1`): a prompt prefilled in chunks streams its pages whatever the speed of the transfer
    (the first send making the pair's group, a loaded machine), not because the steps are slow. A step
    that may not run yet returns no output and the engine loop's commands (the prefill worker's looks
    for pages) run meanwhile; a wait is bounded (`timeout_s`), and after one ran out the steps go
    ungated (pages that never stream early then fail the test's figures, not its time). `reset` before
    each request."""

    def __init__(self, prefill, decode, monkeypatch, steps: int, pages_per_step: int = 2, timeout_s: float = 20.0):
        self.limit, self.per, self.timeout_s, self.gave_up = steps, pages_per_step, timeout_s, False
        self.reset()
        step, keep = prefill.step, decode.kv.import_prefix

        def gated_step():
            if 0 < self.steps < self.limit and self.kept < self.per * self.steps and not self.gave_up:
                if time.monotonic() < self.deadline:
                    time.sleep(0.002)
                    return []
                self.gave_up = True
            self.steps += 1
            try:
                return step()
            finally:
                self.deadline = time.monotonic() + self.timeout_s

        def counted_keep(pages, *args, **options):
            out = keep(pages, *args, **options)
            self.kept += len(pages)
            return out
        monkeypatch.setattr(prefill, "step", gated_step)
        monkeypatch.setattr(decode.kv, "import_prefix", counted_keep)

    def reset(self) -> None:
        self.steps, self.kept, self.deadline = 0, 0, time.monotonic() + self.timeout_s


def test_pages_stream_while_the_prompt_is_computed(glm_ckpt, monkeypatch):
    """A prompt prefilled in chunks of 8 tokens (2 pages each): the pages of a chunk leave while the
    next one computes, in batches the decode worker checks one by one; the answer is one engine's."""
    path, prompt = glm_ckpt[0], _prompt(256, 47)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], GREEDY)[0]
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(path, "prefill", **BASE, **chunked) as p, WorkerServer(path, "decode", **BASE) as d:
        _StepGate(p.engine, d.engine, monkeypatch, steps=6)  # chunk c + 1 computes once chunk c's pages came
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        body = rd.json()
        assert_as_colocated(want, body, d, logprob_tolerance(colocated))
        sent, got = rp.json()["sparsekv"]["disaggregation"], body["sparsekv"]["disaggregation"]
        assert sent["pages_sent"] == got["pages_sent"] == (len(prompt) - 1) // PAGE
        assert got["batches"] == sent["batches"] >= 3  # six chunks, looked at between steps
        assert got["pages_streamed"] == sent["pages_streamed"] >= 4  # sent before the prefill ended
        p.check_clean()
        d.check_clean()


def test_a_batch_before_the_last_is_kept_a_slice_at_a_time_and_the_last_at_once(glm_ckpt, monkeypatch):
    """While the prompt is computed, each batch's pages are kept a few per engine call (a running
    request's step waits for one slice, not a batch), under page names hashed once for the room; the
    last batch, which the request waits for, at once with the tail. The answer is one engine's."""
    from sparsekv.disagg import decode as decode_module
    monkeypatch.setattr(decode_module, "KEEP_SLICE_PAGES", 1)
    path, prompt = glm_ckpt[0], _prompt(256, 47)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], GREEDY)[0]
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)  # 2 pages a chunk
    with WorkerServer(path, "prefill", **BASE, **chunked) as p, WorkerServer(path, "decode", **BASE) as d:
        _StepGate(p.engine, d.engine, monkeypatch, steps=6)  # chunk c + 1 computes once chunk c's pages came
        calls, real = [], d.engine.kv.import_prefix
        names = d.engine.kv.prefix.prompt_names(prompt, "default", None)

        def spy(pages, *args, **options):
            calls.append((len(pages), bool(options.get("tails")), options.get("chains")))
            return real(pages, *args, **options)
        monkeypatch.setattr(d.engine.kv, "import_prefix", spy)
        body = _decode(p, d, prompt)
        assert_as_colocated(want, body, d, logprob_tolerance(colocated))
        got = body["sparsekv"]["disaggregation"]
        assert sum(n for n, _, _ in calls) == got["pages_sent"] == (len(prompt) - 1) // PAGE
        assert all(chains == [names] for _, _, chains in calls)
        *early, last = calls
        assert [n for n, _, _ in early] == [1] * len(early) and len(early) >= 4  # two pages a chunk, one a call
        assert last[1] and got["tail_tokens"] == len(prompt) - PAGE * ((len(prompt) - 1) // PAGE)
        assert got["pages_kept_early"] == len(early)
        d.check_clean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_drafting_workers_on_one_gpu_answer_as_one_engine_greedy_and_seeded_on_cuda():
    """Drafting workers on the GPU: a greedy request gets its tail and first token (the MTP layer's rows
    copied off the device after the MTP pass), a seeded sampled one a short tail, whose last token
    the decode side computes and samples from: one engine's tokens on that GPU either way."""
    path, prompt = default_model_path(), _prompt(4096, 50)
    colocated = LLM(path, **BASE, num_speculative_tokens=2, device="cuda")
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True)
    want, want_sampled = (colocated.generate([prompt], params)[0] for params in (GREEDY, sampled))
    with WorkerServer(path, "prefill", **BASE, num_speculative_tokens=2, device="cuda") as p, \
            WorkerServer(path, "decode", **BASE, num_speculative_tokens=2, device="cuda") as d:
        body = _decode(p, d, prompt)
        tail = body["sparsekv"]["disaggregation"]["tail_tokens"]
        assert body["sparsekv"]["disaggregation"]["first_tokens"] == 1 and tail > 1
        assert_as_colocated(want, body, d, logprob_tolerance(colocated, extra_layers=1))
        body = _decode(p, d, prompt, temperature=0.8, seed=5, logprobs=None)
        assert body["sparsekv"]["disaggregation"]["tail_tokens"] == tail - 1
        assert body["sparsekv"]["choices"][0]["token_ids"] == want_sampled.token_ids
        p.check_clean()
        d.check_clean()


@pytest.mark.parametrize("send", ["layers", "chunks"])
def test_a_prefill_workers_next_prompt_waits_for_the_pages_a_room_has_not_named_yet(glm_ckpt, monkeypatch, send):
    """A prefill worker's pool holds one prompt: the next one, admitted as the first ends, would evict
    the pages the first's room names in its last look, after the prefill. Kept until the room ends,
    they are not evicted (the next prompt waits for them): both requests are answered whole, and every
    page is free again after."""
    import asyncio
    import concurrent.futures
    with WorkerServer(glm_ckpt[0], "prefill", send=send, num_kv_pages=16, max_num_seqs=1, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        real = p.worker._export

        async def late(*args, **kwargs):  # each look waits: the engine steps meanwhile
            await asyncio.sleep(0.3)
            return await real(*args, **kwargs)
        monkeypatch.setattr(p.worker, "_export", late)
        prompts = [_prompt(256, 41, seed=40), _prompt(256, 41, seed=41)]  # 11 pages each (10 named) of 16
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda prompt: send_pair(p.url, d.url, {**BODY, "prompt": prompt}), prompts))
        for rp, rd in answers:
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == 10
        p.check_clean()
        d.check_clean()
        stats = p.on_engine(p.engine.stats)
        assert stats["kv_pages_kept"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_pages_a_room_named_whole_and_its_request_computes_again_go_once(glm_ckpt):
    """A waiting request's room names the pages another request computes (its prompt's prefix), whole;
    a third prompt then evicts most of them, so the waiting request, once admitted, computes them
    again, and its layer taps hand their rows out: they are not sent a second time (the decode worker
    refuses rows of a page already named). Both rooms of the shared prefix are answered whole."""
    import concurrent.futures
    import time
    from test_server_util import slow_steps
    shared = _prompt(256, 40, seed=50)
    x, w, z = shared + [7], _prompt(256, 41, seed=51), shared + [9]  # x and z: 10 full pages alike
    with WorkerServer(glm_ckpt[0], "prefill", num_kv_pages=16, max_num_seqs=1, prefill_chunk_tokens=8, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", **BASE) as d, WorkerServer(glm_ckpt[0], "decode", **BASE) as d2:
        slow_steps(p.engine)[0] = 0.03  # x computes while z's room looks

        def send(prompt_wait_decode):  # z to a decode worker of its own, which holds none of x's pages
            prompt, wait, decode = prompt_wait_decode
            time.sleep(wait)
            return send_pair(p.url, decode.url, {**BODY, "prompt": prompt})
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # in this order: x runs, w waits, z waits
            answers = list(pool.map(send, [(x, 0.0, d), (w, 0.05, d), (z, 0.1, d2)]))
        for rp, rd in answers:
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        figures = answers[2][0].json()["sparsekv"]["disaggregation"]
        assert figures["pages_sent"] == 10 and figures["pages_streamed"] == 10  # named while x computed them
        for worker in (p, d, d2):
            worker.check_clean()


def test_a_choice_that_ended_lets_go_of_its_kept_pages_while_the_prompts_other_choices_run(glm_ckpt):
    """Two choices of a prompt are two requests on the prefill worker, the first tapped and kept: a look
    lets go of its pages once it ended, while the second still runs (held to the room's last look,
    they could keep the second, or a prompt queued before it, out of a small pool for good)."""
    from test_server_util import slow_steps
    with WorkerServer(glm_ckpt[0], "prefill", max_num_seqs=1, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        slow_steps(p.engine)[0] = 0.02
        calls, real = [], p.engine.kv.release_pages

        def release(request_ids, ended_only=False):
            kept = p.engine.kv.stats()["kv_pages_kept"]
            real(request_ids, ended_only=ended_only)
            calls.append((ended_only, kept, p.engine.kv.stats()["kv_pages_kept"], p.engine.has_unfinished_requests()))
        p.engine.kv.release_pages = release
        body = {**BODY, "prompt": _prompt(256, 41, seed=60), "n": 2, "temperature": 0.8, "seed": 3}
        rp, rd = send_pair(p.url, d.url, body)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert any(ended_only and before > 0 and after == 0 and running for ended_only, before, after, running in calls)
        p.check_clean()
        d.check_clean()
