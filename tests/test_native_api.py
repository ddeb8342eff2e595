"""SGLang's native POST /generate (server/native.py) against a live server on the bundled model: the
answers of `LLM.generate`, SGLang's shapes (finish reasons, [logprob, id, text] entries, batches and n,
streams), its sampling parameter names, aborts by `rid`, and bad requests."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from test_server_util import MAX_MODEL_LEN, ThreadServer, pages_all_free, scrape, wait_until
from tolerances import assert_same_greedy, logprob_tolerance

OPTIONS = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
PROMPT = [(7 * i) % 250 + 1 for i in range(30)]


@pytest.fixture(scope="module")
def server():
    from sparsekv.paths import default_model_path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ThreadServer(default_model_path(), **OPTIONS) as srv:
        srv.model = default_model_path()
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(server):
    from sparsekv import LLM
    return LLM(server.model, **OPTIONS)


def _generate(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=60)


def test_greedy_answers_are_llm_generates_with_sglangs_logprob_entries(server, llm):
    """Token ids in, SGLang's answer out: the tokens and logprobs of `LLM.generate`, each output token as
    [logprob, id, text], its `top_logprobs_num` best in order, and from `logprob_start_len` the
    prompt's tokens (the first one's logprob null)."""
    from sparsekv import SamplingParams
    want = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, prompt_logprobs=2))[0]
    answer = _generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0},
                       return_logprob=True, top_logprobs_num=2, logprob_start_len=0,
                       return_text_in_logprobs=True).json()
    meta = answer["meta_info"]
    assert answer["output_ids"] == want.token_ids and answer["text"] == want.text
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 8)
    got = [{token: lp for lp, token, _ in top} for top in meta["output_top_logprobs"]]
    assert_same_greedy([want], [_Got(answer["output_ids"], got)], logprob_tolerance(llm))
    for (lp, token, text), top, wanted in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                              want.logprobs):
        assert token in wanted and lp == pytest.approx(wanted[token], abs=logprob_tolerance(llm))
        assert text == llm.engine.tokenizer.decode([token])
        assert len(top) == 2 and top[0][0] >= top[1][0] and top[0][1] == token  # greedy: the best is taken
    inputs = meta["input_token_logprobs"]
    assert [token for _, token, _ in inputs] == PROMPT and inputs[0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp, _, _ in inputs[1:])


class _Got:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


def test_a_batch_with_n_answers_in_prompt_major_order_and_a_seed_repeats(server):
    """Two prompts x n = 2 sampled choices: four answers, each prompt's two together; a seeded request
    answers the same again, and a prompt's choices draw with seeds of their own."""
    body = dict(input_ids=[PROMPT, PROMPT[:7]], sampling_params={"max_new_tokens": 6, "n": 2, "temperature": 1.0,
                                                                  "sampling_seed": 11})
    first, again = _generate(server, **body).json(), _generate(server, **body).json()
    assert len(first) == 4 and [a["output_ids"] for a in first] == [a["output_ids"] for a in again]
    assert len({a["meta_info"]["id"] for a in first + again}) == 2  # each request's own id
    assert [a["meta_info"]["prompt_tokens"] for a in first] == [len(PROMPT), len(PROMPT), 7, 7]
    assert first[0]["output_ids"] != first[1]["output_ids"]
    one = _generate(server, input_ids=[PROMPT], sampling_params={"max_new_tokens": 2}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch


def test_finish_reasons_name_what_matched(server, llm):
    """SGLang's finish reasons: the stop token id or the stop string that matched, the length reached."""
    from sparsekv import SamplingParams
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    stop_token = _generate(server, input_ids=PROMPT, sampling_params={
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [tokens[2]]}).json()
    assert stop_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokens[2]}
    assert stop_token["output_ids"] == tokens[:3]
    text = llm.engine.tokenizer.decode(tokens[3:5])
    stop_text = _generate(server, input_ids=PROMPT, sampling_params={
        "max_new_tokens": 6, "temperature": 0, "stop": [text]}).json()
    assert stop_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": text}
    kept = _generate(server, input_ids=PROMPT, sampling_params={
        "max_new_tokens": 6, "temperature": 0, "stop": [text], "no_stop_trim": True}).json()
    assert kept["text"] == stop_text["text"] + text


def test_a_stream_sends_each_answer_so_far_then_done(server):
    """Each event is the choice's answer so far (cumulative text and ids, as SGLang streams) with its
    index; the last is the non-streamed answer; then [DONE]."""
    body = dict(text="def fibonacci(n):", sampling_params={"max_new_tokens": 5, "temperature": 0})
    whole = _generate(server, **body).json()
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(events) == 5 and {e["index"] for e in events} == {0}
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5]
    assert all(whole["text"].startswith(e["text"]) for e in events)
    assert {k: v for k, v in events[-1].items() if k != "index"} == {
        **whole, "meta_info": {**whole["meta_info"], "id": events[-1]["meta_info"]["id"]}}


def test_a_json_schema_constrains_the_output(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    answer = _generate(server, text="The number:", sampling_params={
        "max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}).json()
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(answer["text"])["n"], int)


def test_abort_request_ends_a_generate_named_by_its_rid(server):
    """An RL trainer ends a rollout it no longer needs: /abort_request with the rid /generate was given
    ends it with SGLang's {"type": "abort"} and the tokens so far; its pages are freed."""
    box = []
    server.delay[0] = 0.05
    try:
        thread = threading.Thread(target=lambda: box.append(_generate(
            server, input_ids=PROMPT, rid="rollout-9", sampling_params={"max_new_tokens": 80, "ignore_eos": True})))
        thread.start()
        assert wait_until(lambda: scrape(server.url)["sparsekv:num_requests_running"] == 1, 30)
        aborted = httpx.post(server.url + "/abort_request", json={"rid": "rollout-9"}, timeout=30).json()
        thread.join(30)
    finally:
        server.delay[0] = 0.0
    answer = box[0].json()
    assert aborted["aborted"] == 1 and answer["meta_info"]["id"] == "rollout-9"
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and len(answer["output_ids"]) < 80
    assert wait_until(lambda: pages_all_free(server.url), 10)


def test_a_batch_given_a_rid_per_prompt_answers_and_aborts_each_by_its_own(server):
    """A batch with a `rid` list (SGLang's form): each answer's id is its prompt's, choices included, and
    /abort_request naming one prompt's rid ends that prompt's choices only; the other prompt runs to its
    length. Each id is held while its prompt runs."""
    box = []
    server.delay[0] = 0.05
    try:
        thread = threading.Thread(target=lambda: box.append(_generate(
            server, input_ids=[PROMPT, PROMPT[:20]], rid=["keep-1", "stop-2"],
            sampling_params=[{"max_new_tokens": 24, "ignore_eos": True},
                             {"max_new_tokens": 80, "ignore_eos": True, "n": 2}])))
        thread.start()
        assert wait_until(lambda: scrape(server.url)["sparsekv:num_requests_running"] == 3, 30)
        taken = [_generate(server, text="a", rid="keep-1"),  # each prompt's id is held while it runs
                 _generate(server, text=["a", "b"], rid=["other", "stop-2"])]
        aborted = httpx.post(server.url + "/abort_request", json={"rid": "stop-2"}, timeout=30).json()
        thread.join(60)
    finally:
        server.delay[0] = 0.0
    answers = box[0].json()
    for refused in taken:
        assert refused.status_code == 400 and "already in use" in refused.json()["error"]["message"]
    assert aborted["aborted"] == 1
    assert [a["meta_info"]["id"] for a in answers] == ["keep-1", "stop-2", "stop-2"]
    assert answers[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert len(answers[0]["output_ids"]) == 24
    for answer in answers[1:]:
        assert answer["meta_info"]["finish_reason"]["type"] == "abort" and len(answer["output_ids"]) < 80
    assert wait_until(lambda: pages_all_free(server.url), 10)


def test_abort_all_counts_each_prompt_of_a_batch_given_a_rid_per_prompt(server):
    """/abort_request with abort_all counts what it ended as the clients name it: each prompt of a batch
    given a `rid` per prompt (its choices once), and a request with one id once, whatever its size."""
    boxes = [[], []]
    server.delay[0] = 0.05
    try:
        threads = [threading.Thread(target=lambda: boxes[0].append(_generate(
                       server, input_ids=[PROMPT, PROMPT[:20]], rid=["all-1", "all-2"],
                       sampling_params=[{"max_new_tokens": 80, "ignore_eos": True},
                                        {"max_new_tokens": 80, "ignore_eos": True, "n": 2}]))),
                   threading.Thread(target=lambda: boxes[1].append(_generate(
                       server, input_ids=PROMPT[:10], sampling_params={"max_new_tokens": 80, "ignore_eos": True})))]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: scrape(server.url)["sparsekv:num_requests_running"] == 4, 30)
        aborted = httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=30).json()
        for thread in threads:
            thread.join(60)
    finally:
        server.delay[0] = 0.0
    assert aborted["aborted"] == 3, aborted
    batch, single = boxes[0][0].json(), boxes[1][0].json()
    assert [a["meta_info"]["id"] for a in batch] == ["all-1", "all-2", "all-2"]
    for answer in [*batch, single]:
        assert answer["meta_info"]["finish_reason"]["type"] == "abort" and len(answer["output_ids"]) < 80
    assert wait_until(lambda: pages_all_free(server.url), 10)


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1], []]}, "input_ids"),
    ({"text": "a", "sampling_params": {"max_new_token": 3}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"json_schema": "{nope"}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a"}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": False}}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "rid": "two words"}, "rid"),
    ({"text": "a", "rid": ["a"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["a"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["a", "a"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["a", "two words"]}, "rid"),
    ({"input_ids": [1, 10 ** 9]}, "input_ids"),
    ({"text": "a", "sampling_params": {"sampling_seed": [1]}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"sampling_seed": 2 ** 63}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": True}}, "sampling_params"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = _generate(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_random_bodies_get_an_answer_or_a_clear_400_never_a_500(server):
    """Seeded random /generate bodies (odd values in SGLang's fields and sampling parameters): each gets
    a 200 or a 400 in the error envelope, and every page is free afterwards."""
    import random

    from sparsekv.server.native import SAMPLING_NAMES
    from test_server_util import ODD_VALUES
    fields = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
              "top_logprobs_num", "return_text_in_logprobs", "stream")
    rng, statuses = random.Random(7), []
    for _ in range(80):
        params = {"max_new_tokens": rng.randint(1, 4)}
        for _ in range(rng.randint(0, 2)):
            params[rng.choice(list(SAMPLING_NAMES))] = rng.choice(ODD_VALUES)
        body = {**rng.choice(({"text": "def f(x):"}, {"input_ids": PROMPT[:5]})), "sampling_params": params}
        if rng.random() < 0.5:
            body[rng.choice(fields)] = rng.choice(ODD_VALUES)
        r = httpx.post(server.url + "/generate", content=json.dumps(body), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["code"] == 400
        statuses.append(r.status_code)
    assert 5 < statuses.count(200) < 75  # both kinds exercised
    assert wait_until(lambda: pages_all_free(server.url), 10)
