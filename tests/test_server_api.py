"""The OpenAI-compatible API against a live server on 127.0.0.1 (issue 4).

One server (in a thread of this process, so tests can slow its engine down) serves every test here:
the official `openai` client, greedy equality with `LLM.generate`, a table of bad requests, client
disconnects, a bounded load from a second process, and `sparsekv bench serve`.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from sparsekv.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from test_server_util import (MAX_MODEL_LEN, REPO, ThreadServer, pages_all_free, random_openai_body, scrape,
                              scrape_samples, tiny_checkpoint, wait_until)

KEY, KEY_PLAIN, KEY_METRICS = "sk-alice", "sk-plain", "sk-metrics"
PROMPT = "hello world, the rain in spain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPUs are shared; more threads only contend
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with ThreadServer(model, api_keys=[f"{KEY}:alice", KEY_PLAIN], max_queued=4, metrics_api_keys=[KEY_METRICS]) as srv:
        srv.model = model
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _ext(obj) -> dict:
    return obj.model_extra["sparsekv"]


# -- the openai client -------------------------------------------------------------------------

def test_completion_non_stream_shape(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, user="u1", best_of=1,
                                  extra_body={"cache_salt": "s1", "presence_penalty": 0.0, "no_such_field": 1,
                                              "response_format": {"type": "text"}, "tools": [], "suffix": None,
                                              "priority": 0, "detokenize": True, "truncation_side": "left",
                                              "kv_transfer_params": None, "add_special_tokens": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    ext = _ext(r)
    assert ext["tenant"] == "alice" and len(ext["choices"][0]["token_ids"]) == 8
    assert ext["tiers"]["device_kv_bytes"] > 0 and "device_indexer_bytes" in ext["tiers"]


def test_stream_matches_non_stream_with_usage(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    usage = chunks[-1].usage  # the second request with this prompt: its full pages hit the prefix cache
    assert usage.prompt_tokens_details.cached_tokens == 16 * ((usage.prompt_tokens - 1) // 16)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert _ext(chunks[-1])["tiers"]["device_kv_bytes"] > 0
    continuous = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in continuous if c.choices]  # vLLM's: usage so far in every chunk
    assert so_far == sorted(so_far) and so_far[-1] == 10 and continuous[-1].usage.completion_tokens == 10
    assert all(c.usage.prompt_tokens == usage.prompt_tokens for c in continuous)


def test_chat_non_stream_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.usage.completion_tokens == 6
    assert len(r.choices[0].logprobs.content) == 6 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=6,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == msg.content


def test_n_choices_and_seed_reproducible(client):
    def run(seed):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=3,
                                      extra_body={"ignore_eos": True})
        assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    first, again, other = run(1234), run(1234), run(99)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # seed + i per choice: the choices differ
    assert run(-2) == run(-2)  # a negative seed's choices count down, never onto -1 ("random")
    assert run(-2 ** 63) == run(-2 ** 63) and run(2 ** 63 - 1) == run(2 ** 63 - 1)  # choices wrap around, in range


def test_n_choices_stream(client):
    texts = {}
    for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7,
                                       n=2, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=2)
    assert texts == {c.index: c.text for c in r.choices}


def test_several_prompts_times_n_answer_in_prompt_order_and_count_each_prompt_once(server, client):
    """Choice i answers prompt i // n: its index, echoed prompt and tokens are that prompt's, in the
    response and the stream alike; usage counts each prompt once and every choice's tokens."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    args = dict(model="tiny", prompt=prompts, n=2, max_tokens=3, temperature=0, echo=True,
                extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [server.state.token_text.text(prompts[i // 2]) + alone[i // 2].choices[0].text for i in range(4)]
    assert [c.text for c in r.choices] == want
    assert [c["token_ids"] for c in _ext(r)["choices"]] == [_ext(alone[i // 2])["choices"][0]["token_ids"]
                                                             for i in range(4)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 12, 20)
    texts, events = {}, list(client.completions.create(**{**args, "echo": False}, stream=True,
                                                        stream_options={"include_usage": True}))
    for c in events:  # no echo in a stream (refused, as vLLM)
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {i: alone[i // 2].choices[0].text for i in range(4)}
    assert events[-1].choices == [] and events[-1].usage.model_dump() == r.usage.model_dump()


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.index(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], logprobs=1)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's: the stop string that matched
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True, logprobs=1))
    assert "".join(c.choices[0].text for c in chunks) == expected  # no stop-string prefix leaked mid-stream
    assert chunks[-1].choices[0].stop_reason == stop
    chat = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0)
    said = client.chat.completions.create(**chat).choices[0].message.content
    chat_stop = said[len(said) // 2:len(said) // 2 + 2]
    assert client.chat.completions.create(**chat, stop=[chat_stop]).choices[0].model_extra["stop_reason"] == chat_stop
    last = list(client.chat.completions.create(**chat, stop=[chat_stop], stream=True))[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == chat_stop
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == r.choices[0].logprobs.text_offset  # the tokens' offsets, though text was held back
    kept = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                extra_body={"include_stop_str_in_output": True})
    assert client.completions.create(**kept).choices[0].text == expected + stop
    assert "".join(c.choices[0].text for c in client.completions.create(**kept, stream=True)) == expected + stop


def test_completion_logprobs_and_token_prompt(client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 2 for t in lp.top_logprobs) and r.usage.prompt_tokens == 4


def test_logprobs_without_echo_still_hit_the_prefix_cache(client):
    """Only echo asks the engine for the prompt's logprobs (a request with them computes every prompt
    row, as in vLLM); logprobs of the generated tokens alone leave the prefix cache in use."""
    prompt = list(range(40, 80))
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 16 * ((len(prompt) - 1) // 16)


def test_greedy_matches_llm_generate(server, client):
    from sparsekv.llm import LLM
    from sparsekv.request import SamplingParams
    llm = LLM(server.model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
    for prompt in (PROMPT, [3, 1, 4, 1, 5, 9, 2, 6]):
        want = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert _ext(got)["choices"][0]["token_ids"] == want.token_ids
        assert got.choices[0].text == want.text


def test_penalties_and_logit_bias_reach_the_engine(server, client):
    """The OpenAI penalty fields and vLLM's extras mean what LLM.generate makes of them."""
    from sparsekv.llm import LLM
    from sparsekv.request import SamplingParams
    llm = LLM(server.model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
    fields = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.4, min_tokens=3, min_p=0.05)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, logit_bias={5: 3.5}, **fields))[0]
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"5": 3.5},
                                    extra_body={"repetition_penalty": 1.4, "min_tokens": 3, "min_p": 0.05})
    assert _ext(got)["choices"][0]["token_ids"] == want.token_ids != plain.token_ids
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"7": 100})
    assert _ext(chat)["choices"][0]["token_ids"] == [7] * 4
    allowed = client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=1, seed=2,
                                        extra_body={"allowed_token_ids": [11, 12], "truncate_prompt_tokens": 3})
    assert set(_ext(allowed)["choices"][0]["token_ids"]) <= {11, 12} and allowed.usage.prompt_tokens == 3


def test_echo_scores_the_prompt_like_lm_eval_harness(server, client):
    """lm-evaluation-harness's loglikelihood requests: echo=true, max_tokens=0, logprobs=1. The
    response is the prompt with each token's logprob (the first null), as LLM.generate's prompt_logprobs."""
    from sparsekv.llm import LLM
    from sparsekv.request import SamplingParams
    llm = LLM(server.model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1))[0]
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0 and _ext(scored)["choices"][0]["token_ids"] == []
    lp = choice.logprobs
    assert len(lp.tokens) == len(want.prompt_token_ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e[t] for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, temperature=0)
    assert full.choices[0].text == PROMPT + want.text and full.usage.completion_tokens == 4
    assert len(full.choices[0].logprobs.tokens) == len(want.prompt_token_ids) + 4
    plain_echo = client.completions.create(model="tiny", prompt=[3, 1, 4], max_tokens=2, echo=True, temperature=0)
    assert plain_echo.choices[0].logprobs is None and plain_echo.choices[0].text.startswith(server.state.token_text.text([3, 1, 4]))


def test_structured_outputs_through_the_api(server, client):
    """guided_choice and guided_regex match. This test tokenizer has no '{' or '"': a JSON schema
    admits no first token, and the request ends at once ("stop", no text) with the server healthy."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=32,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": schema}})
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1, seed=4,
                                       extra_body={"guided_choice": ["red", "green"]})
    assert choice.choices[0].text in ("red", "green")
    digits = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", "".join(c.choices[0].text for c in digits))


def _tokenizer_adding_bos():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    inner = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", unk_token="[UNK]")


def test_a_text_prompt_gets_the_tokenizers_special_tokens_unless_asked_not_to():
    """vLLM's default for /v1/completions and LLM.generate: a tokenizer that adds BOS adds it; the
    request's add_special_tokens=false leaves it out, on the bounded path and the truncating one."""
    from sparsekv.input_processor import InputProcessor
    from sparsekv.request import SamplingParams
    from sparsekv.server.app import completion_prompt_ids
    from sparsekv.server.tokenizing import Encoder
    encoder = Encoder(_tokenizer_adding_bos())
    for truncate in (None, 100):
        assert completion_prompt_ids(encoder, ["a b", [2, 1]], 100, truncate) == [[0, 1, 2], [2, 1]]
        assert completion_prompt_ids(encoder, ["a b"], 100, truncate, add_special_tokens=False) == [[1, 2]]
    processor = InputProcessor(_tokenizer_adding_bos(), 4, 100, lambda *a: None, 20)
    assert processor.tokenize("b a") == [0, 2, 1]
    # truncated as a tokenizer truncates (vLLM's): the BOS kept, then the text's last tokens
    assert completion_prompt_ids(encoder, ["a b a b", [0, 1, 2]], 100, 2) == [[0, 2], [1, 2]]
    assert completion_prompt_ids(encoder, ["a b a b"], 100, 2, add_special_tokens=False) == [[1, 2]]
    assert processor.process("a b a b", SamplingParams(truncate_prompt_tokens=3)) == [0, 1, 2]
    assert processor.process([0, 1, 2, 1], SamplingParams(truncate_prompt_tokens=3)) == [1, 2, 1]


def test_a_prompt_of_exactly_the_limit_passes_and_truncation_to_minus_one_keeps_the_last_limit_tokens():
    """Only a prompt over the limit is refused here (one of exactly `limit` tokens is the engine's to
    weigh against max_tokens); truncate_prompt_tokens=-1 keeps the last `limit` tokens, and a text
    tokenized without special tokens has no BOS to keep, so its cut is the plain last tokens."""
    from sparsekv.request import InvalidRequest
    from sparsekv.server.app import completion_prompt_ids
    from sparsekv.server.tokenizing import Encoder
    encoder = Encoder(_tokenizer_adding_bos())
    assert completion_prompt_ids(encoder, ["a b", [5, 6, 7]], 3, None) == [[0, 1, 2], [5, 6, 7]]
    with pytest.raises(InvalidRequest, match="prompt has 4 tokens") as e:
        completion_prompt_ids(encoder, [[5, 6, 7, 8]], 3, None)
    assert e.value.param == "prompt"
    assert completion_prompt_ids(encoder, [[5, 6, 7, 8, 9], "a b a b"], 3, -1) == [[7, 8, 9], [0, 1, 2]]
    assert completion_prompt_ids(encoder, ["a b a b"], 3, -1, add_special_tokens=False) == [[2, 1, 2]]


def _routes_over(tokenizer, vocab_size: int, routes):
    """The app's `routes` over a stand-in for the server's state: the given tokenizer, no engine loop."""
    import types

    from fastapi import FastAPI

    from sparsekv.server.app import ServerSettings, ServerState
    from sparsekv.server.errors import APIError, error_response
    from sparsekv.server.tokenizing import TokenizerPool

    class State(ServerState):
        def __init__(self):  # only what tokenize and detokenize read
            self.tokenizer, self.tokenizing, self.max_model_len = tokenizer, TokenizerPool(tokenizer), 100
            self.settings = ServerSettings(served_model_names=["tiny"])
            self.engine = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=vocab_size))
    app = FastAPI()
    app.state.server = State()
    for path, fn in routes:
        app.add_api_route(path, fn, methods=["POST"])
    app.add_exception_handler(APIError, lambda req, exc: error_response(exc))
    return app


def test_tokenize_adds_the_special_tokens_by_default_and_detokenize_refuses_the_first_id_past_the_vocab():
    """vLLM's /tokenize: a prompt gets the tokenizer's special tokens (BOS) unless add_special_tokens
    is false; /detokenize takes ids in [0, vocab_size) and answers 400 for vocab_size itself."""
    import asyncio

    from sparsekv.server.app import detokenize, tokenize
    app = _routes_over(_tokenizer_adding_bos(), 4, [("/tokenize", tokenize), ("/detokenize", detokenize)])

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in [
                ("/tokenize", {"prompt": "a b"}), ("/tokenize", {"prompt": "a b", "add_special_tokens": False}),
                ("/detokenize", {"tokens": [0, 3]}), ("/detokenize", {"tokens": [1, 4]})]]
    try:
        bos, plain, last, past = asyncio.run(main())
    finally:
        app.state.server.tokenizing.close()
    assert bos.json() == {"count": 3, "max_model_len": 100, "tokens": [0, 1, 2]}
    assert plain.json()["tokens"] == [1, 2]
    assert last.status_code == 200
    _assert_envelope(past, 400, "tokens")
    assert "token id 4 is outside the vocabulary [0, 4)" in past.json()["error"]["message"]


def _tokenizer_adding_bos_and_eos():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    inner = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3, "</s>": 4}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 4)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def test_left_truncation_keeps_the_special_tokens_at_both_ends():
    """A tokenizer that adds BOS and EOS: truncating to n tokens keeps both and the text's last
    n - 2 tokens (as the tokenizer truncates), n tokens in all; truncate_prompt_tokens=-1 is
    max_model_len (vLLM's), so a prompt cut to max_model_len leaves no room for max_tokens."""
    from sparsekv.input_processor import InputProcessor, special_token_ends, truncate_left
    from sparsekv.request import InvalidRequest, SamplingParams
    tokenizer = _tokenizer_adding_bos_and_eos()
    assert special_token_ends(lambda text, special: tokenizer.encode(text, add_special_tokens=special)) == (1, 1)
    assert special_token_ends(lambda text, special: _tokenizer_adding_bos().encode(text, add_special_tokens=special)) \
        == (1, 0)
    assert truncate_left([0, 1, 2, 1, 2, 4], 4, (1, 1)) == [0, 1, 2, 4]
    assert truncate_left([0, 1, 2, 1, 2, 4], 2, (1, 1)) == [0, 4]
    processor = InputProcessor(tokenizer, 5, 6, lambda *a: None, 20)
    assert processor.process("a b a b", SamplingParams(max_tokens=1, truncate_prompt_tokens=4)) == [0, 1, 2, 4]
    assert processor.process("a a b", SamplingParams(max_tokens=1, truncate_prompt_tokens=-1)) == [0, 1, 1, 2, 4]
    with pytest.raises(InvalidRequest, match=r"prompt \(6 tokens\) plus max_tokens \(1\)") as e:
        processor.process("a b a b a b a", SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert e.value.param == "max_tokens"


def test_models_tokenize_detokenize(server):
    h = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(server.url + "/v1/models", headers=h).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()["prompt"]
    assert text == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert chat.json()["count"] > 0


def test_plain_key_gets_its_own_tenant(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_PLAIN, max_retries=0)
    tenant = _ext(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1))["tenant"]
    assert tenant.startswith("key-") and KEY_PLAIN not in tenant


def test_health_and_metrics_are_public(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)  # figures to read, run alone too
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200  # load balancers' probes may send HEAD
    assert httpx.get(server.url + "/ping").json() == httpx.post(server.url + "/ping").json() == {"status": "ok"}  # vLLM's (SageMaker's)
    assert httpx.get(server.url + "/version").json()["version"] == __import__("importlib.metadata").metadata.version(
        "sparsekv")
    m = scrape(server.url)
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "request_time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "num_requests_running", "num_requests_waiting",
                 "device_kv_bytes", "device_latent_bytes", "device_indexer_bytes", "host_kv_bytes",
                 "host_kv_budget_bytes", "tier_hits_total", "tier_misses_total", "h2d_bytes_total",
                 "d2h_bytes_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        assert "sparsekv:" + name in m, name
    assert m["sparsekv:time_to_first_token_seconds_count"] > 0 and m["sparsekv:generation_tokens_total"] > 0


def test_per_tenant_metrics_need_the_metrics_key(server, client):
    """A tenant's prompt lengths and cache hits are nobody else's business: the public /metrics (and a
    tenant's own API key) gets the aggregate series only; --metrics-api-key gets the per-tenant ones too."""
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)

    def tenant_series(key):
        return {s.name for s in scrape_samples(server.url, key) if "tenant" in s.labels or "tenant" in s.name}
    for key in (None, KEY, "wrong"):
        assert not tenant_series(key), key
    assert {"sparsekv:prefix_cache_tenant_queries_total", "sparsekv:prefix_cache_tenant_hits_total",
            "sparsekv:tenant_time_to_first_token_seconds_count"} <= tenant_series(KEY_METRICS)
    public = {s.name for s in scrape_samples(server.url)}
    assert {"sparsekv:prefix_cache_queries_total", "sparsekv:time_to_first_token_seconds_count"} <= public


# -- bad requests: each a 4xx with the OpenAI envelope -----------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = list(range(1, 9)) * 25  # 200 tokens
VOCAB = 256  # the tiny checkpoint's
BAD = [  # (id, path, body (dict, or raw bytes), status, param)
    ("max_tokens-str", C, {**OK, "max_tokens": "16"}, 400, "max_tokens"),
    ("max_tokens-negative", C, {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens-zero", C, {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens-float", C, {**OK, "max_tokens": 1.5}, 400, "max_tokens"),
    ("temperature-str", C, {**OK, "temperature": "hot"}, 400, "temperature"),
    ("temperature-negative", C, {**OK, "temperature": -0.5}, 400, "temperature"),
    ("temperature-huge", C, {**OK, "temperature": 1000}, 400, "temperature"),
    ("top_p-zero", C, {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p-above-1", C, {**OK, "top_p": 1.5}, 400, "top_p"),
    ("top_k-negative", C, {**OK, "top_k": -2}, 400, "top_k"),
    ("top_k-float", C, {**OK, "top_k": 1.5}, 400, "top_k"),
    ("n-zero", C, {**OK, "n": 0}, 400, "n"),
    ("n-str", C, {**OK, "n": "2"}, 400, "n"),
    ("n-huge", C, {**OK, "n": 1000}, 400, "n"),
    ("seed-str", C, {**OK, "seed": "abc"}, 400, "seed"),
    ("seed-over-int64", C, {**OK, "seed": 2 ** 64}, 400, "seed"),
    ("stop-int", C, {**OK, "stop": 5}, 400, "stop"),
    ("stop-empty", C, {**OK, "stop": [""]}, 400, "stop"),
    ("stop_token_ids-str", C, {**OK, "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("stream-str", C, {**OK, "stream": "yes"}, 400, "stream"),
    ("stream_options-without-stream", C, {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("ignore_eos-str", C, {**OK, "ignore_eos": "no"}, 400, "ignore_eos"),
    ("logprobs-too-many", C, {**OK, "logprobs": 50}, 400, "logprobs"),
    ("logprobs-negative", C, {**OK, "logprobs": -1}, 400, "logprobs"),
    ("cache_salt-empty", C, {**OK, "cache_salt": ""}, 400, "cache_salt"),
    ("presence_penalty-over-2", C, {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty-str", C, {**OK, "frequency_penalty": "0.5"}, 400, "frequency_penalty"),
    ("repetition_penalty-zero", C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p-above-1", C, {**OK, "min_p": 1.5}, 400, "min_p"),
    ("min_tokens-over-max_tokens", C, {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("logit_bias-key-not-a-token-id", C, {**OK, "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("logit_bias-key-a-superscript-digit", C, {**OK, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # int() fails: was a 500
    ("logit_bias-key-a-non-ascii-digit", C, {**OK, "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),  # was taken as token 3
    ("logit_bias-over-100", C, {**OK, "logit_bias": {"3": 150}}, 400, "logit_bias"),
    ("logit_bias-outside-vocab", C, {**OK, "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("chat-logit_bias-over-100", CHAT, {**MSG, "logit_bias": {"3": -101}}, 400, "logit_bias"),
    ("echo-with-stream", C, {**OK, "echo": True, "stream": True}, 400, "echo"),
    ("response_format-unknown-type", CHAT, {**MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("response_format-and-guided_regex", C, {**OK, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     400, "response_format"),
    ("guided_regex-does-not-compile", C, {**OK, "guided_regex": "(ab"}, 400, "guided_regex"),
    ("tools-on-completions", C, {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("tools-malformed", CHAT, {**MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("tool_choice-required-without-tools", CHAT, {**MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice-unknown-name", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice"),
    ("tool_choice-malformed", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": {"name": "f"}}, 400, "tool_choice"),
    ("tool_choice-unknown-string", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": "any"}, 400, "tool_choice"),
    ("tool_choice-forced-and-response_format", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "tool_choice"),
    ("best_of-3", C, {**OK, "best_of": 3}, 400, "best_of"),
    ("chat-echo", CHAT, {**MSG, "echo": True}, 400, "echo"),
    ("return_tokens_as_token_ids", C, {**OK, "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ("spaces_between_special_tokens-off", C, {**OK, "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens"),
    ("skip_special_tokens-str", C, {**OK, "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("suffix", C, {**OK, "suffix": "end"}, 400, "suffix"),
    ("priority", C, {**OK, "priority": 1}, 400, "priority"),
    ("detokenize-off", C, {**OK, "detokenize": False}, 400, "detokenize"),
    ("truncation_side-right", C, {**OK, "truncate_prompt_tokens": 2, "truncation_side": "right"}, 400, "truncation_side"),
    ("kv_transfer_params", C, {**OK, "kv_transfer_params": {"do_remote_decode": True}}, 400, "kv_transfer_params"),
    ("vllm_xargs", C, {**OK, "vllm_xargs": {"a": 1}}, 400, "vllm_xargs"),
    ("logits_processors", C, {**OK, "logits_processors": ["p"]}, 400, "logits_processors"),
    ("prompt_embeds", C, {**OK, "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("chat-documents", CHAT, {**MSG, "documents": [{"title": "t", "text": "x"}]}, 400, "documents"),
    ("chat-add_special_tokens", CHAT, {**MSG, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("tokenize-chat-add_special_tokens", "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                                       "add_special_tokens": True}, 400, "add_special_tokens"),
    ("guided_grammar", C, {**OK, "guided_grammar": "root ::= 'a'"}, 400, "guided_grammar"),
    ("include_stop_str_in_output-str", C, {**OK, "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output"),
    ("allowed_token_ids-outside-vocab", C, {**OK, "allowed_token_ids": [1, 999]}, 400, "allowed_token_ids"),
    ("truncate_prompt_tokens-zero", C, {**OK, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("max_tokens-zero-without-echo", C, {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("prompt-missing", C, {"model": "tiny", "max_tokens": 2}, 400, "prompt"),
    ("prompt-int", C, {**OK, "prompt": 123}, 400, "prompt"),
    ("prompt-empty-list", C, {**OK, "prompt": []}, 400, "prompt"),
    ("prompt-mixed-list", C, {**OK, "prompt": [1, "a"]}, 400, "prompt"),
    ("prompt-token-outside-vocab", C, {**OK, "prompt": [1, 999]}, 400, "prompt"),
    ("prompt-over-max-model-len", C, {**OK, "prompt": LONG + LONG}, 400, "prompt"),
    ("prompt-plus-max_tokens-over-context", C, {**OK, "prompt": LONG, "max_tokens": 100}, 400, "max_tokens"),
    ("stream-over-context", C, {**OK, "prompt": LONG, "max_tokens": 100, "stream": True}, 400, "max_tokens"),
    ("malformed-json", C, b'{"prompt": "hi",', 400, None),
    ("json-array", C, b'[1, 2]', 400, None),
    ("empty-body", C, b'', 400, None),
    ("unknown-model", C, {**OK, "model": "gpt-4"}, 404, "model"),
    ("chat-messages-empty", CHAT, {**MSG, "messages": []}, 400, "messages"),
    ("chat-messages-missing", CHAT, {"model": "tiny"}, 400, "messages"),
    ("chat-content-int", CHAT, {**MSG, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat-image-part", CHAT, {**MSG, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("chat-top_logprobs-without-logprobs", CHAT, {**MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-top_logprobs-over-20", CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat-stream-top_logprobs-over-20", CHAT, {**MSG, "logprobs": True, "top_logprobs": 21, "stream": True}, 400,
     "top_logprobs"),
    ("logprobs-over-20", C, {**OK, "logprobs": 21}, 400, "logprobs"),
    ("echo-logprobs-over-20", C, {**OK, "logprobs": 21, "echo": True}, 400, "logprobs"),
    ("chat-continue_final_message-with-add_generation_prompt", CHAT, {**MSG, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("chat-max_completion_tokens-negative", CHAT, {**MSG, "max_completion_tokens": -5}, 400, "max_tokens"),
    ("chat-stream_options-without-stream", CHAT, {**MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat-unknown-model", CHAT, {**MSG, "model": "nope"}, 404, "model"),
    ("tokenize-nothing", "/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("detokenize-str", "/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("unknown-route", "/v1/nope", {}, 404, None),
    # an outside probe's cases (issue 29)
    ("chat-role-unknown", CHAT, {**MSG, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("stop_token_ids-negative", C, {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stop_token_ids-outside-vocab", C, {**OK, "stop_token_ids": [3, VOCAB]}, 400, "stop_token_ids"),
    ("prompt-batch-over-cap", C, {**OK, "prompt": ["hi"] * 2000}, 400, "prompt"),
    ("prompt-token-batch-over-cap", C, {**OK, "prompt": [[1, 2]] * 129}, 400, "prompt"),
    ("nested-5000-deep", C, b'{"prompt": "x", "foo": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("nested-100-deep", C, b'{"prompt": "x", "foo": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}", 400, "foo"),
    ("guided_json-nested-deep", C, {**OK, "guided_json": json.loads('{"a": ' * 80 + "1" + "}" * 80)}, 400,
     "guided_json"),
    ("guided_regex-unbalanced", C, {**OK, "guided_regex": "a(b"}, 400, "guided_regex"),
    ("guided_json-a-string-that-is-not-json", C, {**OK, "guided_json": "{not json"}, 400, "guided_json"),
    ("json_schema-unknown-type", CHAT, {**MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("forced-tool-schema-does-not-compile", CHAT, {**MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": "required"}, 400, "tools"),
    ("tool-name-not-a-string", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": 123}}]}, 400,
     "tools[0].function.name"),
    ("tool-name-with-spaces", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "has space"}}]}, 400,
     "tools[0].function.name"),
    ("tool-names-twice", CHAT, {**MSG, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400,
     "tools[1].function.name"),
    ("tool-parameters-not-an-object", CHAT, {**MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "abc"}}]}, 400, "tools[0].function.parameters"),
    ("prompt-lone-surrogate", C, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("prompt-batch-lone-surrogate", C, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "prompt"),
    ("chat-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ("tokenize-lone-surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("stop-lone-surrogate", C, b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', 400, "stop"),
    ("body-over-cap", C, {**OK, "prompt": "a" * DEFAULT_MAX_REQUEST_BODY_BYTES}, 413, None),
]
INTERNALS = re.compile(r"\.(cc|cpp|h|py):\d+|\[\d\d:\d\d:\d\d\]|Traceback|TextEncodeInput|Union\[|Check failed")


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, name, path, body, status, param):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers=h, timeout=30)
    _assert_envelope(r, status, param)
    assert not INTERNALS.search(r.json()["error"]["message"]), r.json()  # the details go to the log
    if name == "prompt-plus-max_tokens-over-context":
        assert "200" in r.json()["error"]["message"] and "100" in r.json()["error"]["message"]


def test_random_requests_get_an_answer_or_a_clear_4xx_never_a_500(server):
    """Seeded random requests (odd values in any field, streamed or not): each is answered, or refused
    with the error envelope and a message free of internals; never a 5xx, nor an error event in a
    stream; and the server is healthy with every page free after them."""
    import random
    rng = random.Random(5)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    answered = refused = 0
    for _ in range(120):
        path = rng.choice([C, CHAT])
        content = random_openai_body(rng, path == CHAT, MSG if path == CHAT else OK)
        with httpx.stream("POST", server.url + path, content=content, headers=h, timeout=60) as r:
            text = r.read().decode()
        assert r.status_code < 500 and "Internal Server Error" not in text, (content[:300], text[:300])
        if r.status_code == 200:
            answered += 1
            assert '"error"' not in text or '"code": 5' not in text.replace('":5', '": 5'), (content[:300], text[:300])
        else:
            refused += 1
            err = json.loads(text)["error"]
            assert err["code"] == r.status_code and err["message"] and not INTERNALS.search(err["message"]), err
    assert answered > 20 and refused > 20  # both kinds exercised
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert wait_until(lambda: pages_all_free(server.url), 10)


def test_a_forced_tool_call_needs_no_call_parser(server, monkeypatch):
    """A model type without a tool-call parser: tools left to the model are a 400, but a forced call
    (tool_choice "required" or a named function) is JSON under the tools' schemas and is served."""
    monkeypatch.setattr("sparsekv.server.app.TOOL_CALL_FORMATS", {})
    h = {"Authorization": f"Bearer {KEY}"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    _assert_envelope(httpx.post(server.url + CHAT, json={**MSG, "tools": tools}, headers=h, timeout=30), 400, "tools")
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = httpx.post(server.url + CHAT, json={**MSG, "tools": tools, "tool_choice": choice}, headers=h, timeout=30)
        assert r.status_code == 200, r.text


def test_null_is_the_default_for_fields_openai_types_as_nullable(server):
    """Clients that send every field send null for those they leave unset: n, stream, echo, logprobs,
    parallel_tool_calls answer as if left out."""
    h = {"Authorization": f"Bearer {KEY}"}
    for path, body, nulls in [(C, {**OK, "max_tokens": 3, "temperature": 0}, ("n", "stream", "echo", "logprobs")),
                              (CHAT, {**MSG, "max_tokens": 3, "temperature": 0},
                               ("n", "stream", "logprobs", "parallel_tool_calls"))]:
        plain = httpx.post(server.url + path, json=body, headers=h, timeout=30)
        given = httpx.post(server.url + path, json={**body, **dict.fromkeys(nulls)}, headers=h, timeout=30)
        assert plain.status_code == given.status_code == 200, given.text
        assert [c.get("text", c.get("message")) for c in given.json()["choices"]] == \
            [c.get("text", c.get("message")) for c in plain.json()["choices"]]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", KEY])
def test_bad_key(server, auth):
    h = {"Authorization": auth} if auth else {}
    _assert_envelope(httpx.post(server.url + C, json=OK, headers=h), 401, None)
    _assert_envelope(httpx.get(server.url + "/v1/models", headers=h), 401, None)


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer wrong", f"Bearer {KEY_PLAIN}"])
def test_two_authorization_headers_are_refused(server, second):
    """Not the first, not the last: a proxy and this server could each take a different one."""
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", second)]
    _assert_envelope(httpx.post(server.url + C, json=OK, headers=headers), 400, None)
    _assert_envelope(httpx.get(server.url + "/metrics", headers=headers), 400, None)


def test_wrong_method(server):
    _assert_envelope(httpx.get(server.url + C, headers={"Authorization": f"Bearer {KEY}"}), 405, None)


def _assert_envelope(r: httpx.Response, status: int, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_a_chunked_body_over_the_cap_is_refused(server):
    """No Content-Length: the body is counted as it comes, and refused once it passes the cap."""
    piece = b'{"prompt": "' + b"a" * (DEFAULT_MAX_REQUEST_BODY_BYTES // 4)

    def chunks():
        yield from (piece,) * 5

    r = httpx.post(server.url + C, content=chunks(), headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert "content-length" not in r.request.headers
    _assert_envelope(r, 413, None)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def _max_size_body(fields: dict, text_at: tuple) -> bytes:
    """`fields` with filler text at path `text_at`, the JSON exactly DEFAULT_MAX_REQUEST_BODY_BYTES long."""
    def with_text(text):
        body = json.loads(json.dumps(fields))
        *outer, last = text_at
        target = body
        for key in outer:
            target = target[key]
        target[last] = text
        return json.dumps(body).encode()
    room = DEFAULT_MAX_REQUEST_BODY_BYTES - len(with_text(""))
    raw = with_text(("hello world, the rain in spain " * (room // 31 + 1))[:room])
    assert len(raw) == DEFAULT_MAX_REQUEST_BODY_BYTES
    return raw


def test_max_size_requests_are_tokenized_off_the_engine_and_the_event_loop(server, monkeypatch):
    """The largest bodies the server takes, as a completion and a chat whose prompts are over
    max_model_len and as a /tokenize, and a body one byte over the cap, while a stream runs: each gets
    its answer, and every big text is tokenized on the tokenizer pool's threads, never on the engine
    thread (that stalled running streams for seconds) nor the event loop (that stalled /health). The
    thread is checked rather than the stream's gaps: a count, not a time on a shared CPU."""
    from sparsekv.server.tokenizing import Encoder
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = [(C, _max_size_body(OK, ("prompt",)), 400), (CHAT, _max_size_body(MSG, ("messages", 0, "content")), 400),
           ("/tokenize", _max_size_body({"prompt": ""}, ("prompt",)), 200),
           (C, _max_size_body(OK, ("prompt",)) + b" ", 413)]
    big_text_threads = []
    for name in ("encode", "ids_within"):
        real = getattr(Encoder, name)

        def spy(self, text, *args, _real=real, **kwargs):
            if len(text) > 100_000:
                big_text_threads.append(threading.current_thread().name)
            return _real(self, text, *args, **kwargs)
        monkeypatch.setattr(Encoder, name, spy)
    chunks, started, stop = [], threading.Event(), threading.Event()

    def stream():
        body = {**OK, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + C, json=body, headers=h, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line)
                    started.set()
                if stop.is_set():
                    return

    server.delay[0] = 0.1  # the stream runs for longer than the big requests take
    streamer = threading.Thread(target=stream)
    try:
        streamer.start()
        assert started.wait(30)
        answers = [httpx.post(server.url + path, content=raw, headers=h, timeout=120) for path, raw, _ in big]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        stop.set()
        streamer.join(60)
        server.delay[0] = 0.0
    assert [r.status_code for r in answers] == [status for _, _, status in big], [r.content[:200] for r in answers]
    assert b'"count":' in answers[2].content
    assert len(big_text_threads) >= 3, big_text_threads  # the completion, the chat, /tokenize (not the 413)
    assert all(name.startswith("sparsekv-tokenize") for name in big_text_threads), big_text_threads
    assert chunks and not streamer.is_alive()
    assert wait_until(lambda: pages_all_free(server.url), 10)


# -- disconnects and load ----------------------------------------------------------------------

def _aborted(url: str) -> float:
    return scrape(url).get("sparsekv:requests_aborted_total", 0.0)


def test_stream_disconnect_frees_pages(server):
    server.delay[0] = 0.02
    try:
        before = _aborted(server.url)
        body = {**OK, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + C, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data:"))
            assert scrape(server.url)["sparsekv:num_requests_running"] == 1
        assert wait_until(lambda: pages_all_free(server.url), 5)
        assert _aborted(server.url) == before + 1
    finally:
        server.delay[0] = 0.0
    server.engine.check_integrity()


def test_non_stream_disconnect_frees_pages(server):
    server.delay[0] = 0.02
    try:
        before = _aborted(server.url)
        body = {**OK, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + C, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
        assert wait_until(lambda: pages_all_free(server.url), 5)
        assert _aborted(server.url) == before + 1
    finally:
        server.delay[0] = 0.0
    server.engine.check_integrity()


# -- /abort_request ------------------------------------------------------------------------------

def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _abort(server, key: str, **body) -> httpx.Response:
    return httpx.post(server.url + "/abort_request", json=body, headers=_auth(key), timeout=30)


def _in_background(fn) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    return thread, box


def _aborted_by(url: str, reason: str) -> float:
    from test_server_util import scrape_labelled
    return scrape_labelled(url, "reason").get("sparsekv:requests_aborted_total", {}).get(reason, 0.0)


def test_abort_request_ends_a_stream_with_what_it_generated_and_frees_its_pages(server):
    """SGLang's /abort_request by the id the request gave (`rid`): the stream ends at once with
    finish_reason "abort" and the greedy tokens generated so far (the same text as a request for that
    many tokens), its pages are freed, and the abort is counted under its own reason."""
    before, chunks, started = _aborted_by(server.url, "abort_request"), [], threading.Event()
    latencies = ("sparsekv:time_to_first_token_seconds_count", "sparsekv:inter_token_latency_seconds_count")
    counts_before = [scrape(server.url)[name] for name in latencies]

    def stream():
        body = {**OK, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0,
                "rid": "rollout-7", "logprobs": 1}
        with httpx.stream("POST", server.url + C, json=body, headers=_auth(KEY), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 3:
                        started.set()
        return r.status_code
    server.delay[0] = 0.05
    try:
        thread, status = _in_background(stream)
        assert started.wait(30)
        answer = _abort(server, KEY, rid="rollout-7")
        thread.join(30)
    finally:
        server.delay[0] = 0.0
    assert answer.status_code == 200 and answer.json() == {"success": True, "aborted": 1}
    assert status == [200] and {c["id"] for c in chunks} == {"rollout-7"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks)
    assert 3 <= tokens < 200
    # the abort's own output carries no token: one first token, and a latency between each two tokens
    assert [scrape(server.url)[name] - n for name, n in zip(latencies, counts_before)] == [1, tokens - 1]
    plain = httpx.post(server.url + C, json={**OK, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
                                             "temperature": 0}, headers=_auth(KEY), timeout=30).json()
    assert plain["choices"][0]["text"] == text
    assert _aborted_by(server.url, "abort_request") == before + 1
    assert wait_until(lambda: pages_all_free(server.url), 5)
    server.engine.check_integrity()


def test_abort_all_ends_the_callers_tenants_requests_only(server):
    """`abort_all` and a `rid` both act within the caller's tenant: alice's abort of an id that only the
    other tenant's request holds ends nothing; the other tenant's abort_all ends its own request (a 200
    with finish_reason "abort") and leaves alice's to finish."""
    def complete(key):
        body = {**OK, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "rid": "same-id"}
        return httpx.post(server.url + C, json=body, headers=_auth(key), timeout=60)
    server.delay[0] = 0.05
    try:
        alice, alice_box = _in_background(lambda: complete(KEY))
        plain, plain_box = _in_background(lambda: complete(KEY_PLAIN))
        assert wait_until(lambda: scrape(server.url)["sparsekv:num_requests_running"] == 2, 30)
        assert _abort(server, KEY, rid="not-in-flight").json()["aborted"] == 0
        assert _abort(server, KEY_PLAIN, abort_all=True).json()["aborted"] == 1
        plain.join(30)
        assert scrape(server.url)["sparsekv:num_requests_running"] == 1
    finally:
        server.delay[0] = 0.0
    alice.join(60)
    mine, theirs = alice_box[0].json(), plain_box[0].json()
    assert theirs["choices"][0]["finish_reason"] == "abort" and theirs["usage"]["completion_tokens"] < 40
    assert mine["choices"][0]["finish_reason"] == "length" and mine["usage"]["completion_tokens"] == 40
    assert mine["id"] == theirs["id"] == "same-id"
    assert wait_until(lambda: pages_all_free(server.url), 5)


def _stream_in_background(server, body: dict) -> tuple[threading.Thread, threading.Event]:
    """A stream of `body` (alice's) on a thread of its own, and an event set at its first chunk."""
    started = threading.Event()

    def stream():
        with httpx.stream("POST", server.url + C, json={**body, "stream": True}, headers=_auth(KEY), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()
    thread = threading.Thread(target=stream)
    thread.start()
    return thread, started


@pytest.mark.parametrize("echo", [False, True])
def test_a_request_aborted_while_it_waits_ends_empty(server, echo):
    """A request still queued (every sequence slot taken) has no output yet: aborted, it answers 200
    with no tokens and finish_reason "abort", and leaves the queue. With echo, its prompt with no
    logprob known for any of its tokens."""
    server.delay[0] = 0.05
    try:
        running = [_stream_in_background(server, {**OK, "prompt": [5 + i, 6, 7], "max_tokens": 200, "ignore_eos": True})
                   for i in range(4)]  # max_num_seqs 4
        streams = [thread for thread, _ in running]
        assert all(started.wait(30) for _, started in running)
        waiting, box = _in_background(lambda: httpx.post(
            server.url + C, json={**OK, "prompt": PROMPT, "request_id": "queued", "logprobs": 2, "echo": echo},
            headers=_auth(KEY), timeout=60))
        assert wait_until(lambda: scrape(server.url)["sparsekv:num_requests_waiting"] == 1, 30)
        assert scrape(server.url)["sparsekv:num_requests_running"] == 4
        assert _abort(server, KEY, rid="queued").json()["aborted"] == 1
        waiting.join(30)
        assert scrape(server.url)["sparsekv:num_requests_waiting"] == 0
        assert _abort(server, KEY, abort_all=True).json()["aborted"] == 4
        for thread in streams:
            thread.join(30)
    finally:
        server.delay[0] = 0.0
    assert box[0].status_code == 200, box[0].text
    answer = box[0].json()
    choice, prompt_tokens = answer["choices"][0], answer["usage"]["prompt_tokens"]
    assert answer["id"] == "queued" and choice["finish_reason"] == "abort"
    assert choice["text"] == (PROMPT if echo else "") and answer["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == [None] * (prompt_tokens if echo else 0)
    assert wait_until(lambda: pages_all_free(server.url), 5)
    server.engine.check_integrity()


def test_request_ids_in_use_and_bad_abort_bodies_are_refused(server):
    """An id the tenant's request in flight holds is refused to its next request (another tenant may
    use it); a bad id, two different ids, and an abort naming neither or both are 400s."""
    server.delay[0] = 0.05
    try:
        thread, started = _stream_in_background(server, {**OK, "prompt": PROMPT, "max_tokens": 200,
                                                         "ignore_eos": True, "rid": "dup"})
        assert started.wait(30)
        again = httpx.post(server.url + CHAT, json={**MSG, "request_id": "dup"}, headers=_auth(KEY), timeout=30)
        elsewhere = httpx.post(server.url + C, json={**OK, "rid": "dup"}, headers=_auth(KEY_PLAIN), timeout=30)
    finally:
        assert _abort(server, KEY, rid="dup").json()["aborted"] == 1
        server.delay[0] = 0.0
        thread.join(30)
    _assert_envelope(again, 400, "rid")
    assert "already in use" in again.json()["error"]["message"]
    assert elsewhere.status_code == 200 and elsewhere.json()["id"] == "dup"
    for body in ({**OK, "rid": "has space"}, {**OK, "request_id": ""}, {**OK, "rid": "a", "request_id": "b"},
                 {**OK, "rid": "x" * 257}):
        r = httpx.post(server.url + C, json=body, headers=_auth(KEY), timeout=30)
        _assert_envelope(r, 400, "request_id" if "request_id" in body and "rid" not in body else "rid")
    assert httpx.post(server.url + C, json={**OK, "rid": "a", "request_id": "a"}, headers=_auth(KEY),
                      timeout=30).json()["id"] == "a"
    for body in ({}, {"rid": "x", "abort_all": True}, {"abort_all": False}, {"rid": "two words"}):
        _assert_envelope(_abort(server, KEY, **body), 400, "rid")
    assert wait_until(lambda: pages_all_free(server.url), 5)


def test_server_info_reports_the_settings_and_live_state_to_a_key_holder(server):
    """SGLang's /server_info (and /get_server_info): the model, limits, cache layout and the live state
    in `internal_states`; it tells the server's configuration, so it needs a key like the /v1 routes."""
    assert httpx.get(server.url + "/server_info", timeout=30).status_code == 401
    info = httpx.get(server.url + "/server_info", headers=_auth(KEY), timeout=30).json()
    assert httpx.get(server.url + "/get_server_info", headers=_auth(KEY), timeout=30).json()["model_path"] == \
        info["model_path"] == server.model
    assert info["max_model_len"] == MAX_MODEL_LEN and info["served_model_names"] == ["tiny"]
    assert info["disaggregation_mode"] == "null" and info["num_speculative_tokens"] == "0"
    assert info["block_size"] == "16" and info["version"]
    live = info["internal_states"][0]
    assert live["avg_spec_accept_length"] == 0.0 and live["num_running_reqs"] == 0 and live["kv_cache_usage"] == 0.0


# -- /health_generate ---------------------------------------------------------------------------

def test_health_generate_generates_one_token_when_idle(server):
    """An idle server answers /health_generate (public, as /health) by generating a token, which stays
    out of the latency metrics and frees its pages."""
    probe = server.state.probe
    ttft = scrape(server.url)["sparsekv:time_to_first_token_seconds_count"]
    before = probe.generations
    assert httpx.get(server.url + "/health_generate", timeout=30).json() == {"status": "ok"}
    assert probe.generations == before + 1
    assert scrape(server.url)["sparsekv:time_to_first_token_seconds_count"] == ttft
    assert wait_until(lambda: pages_all_free(server.url), 5)


def test_health_generate_is_ok_without_generating_while_the_engine_steps(server):
    """A busy server is healthy when it is stepping: the probe does not queue behind the load."""
    probe = server.state.probe
    server.delay[0] = 0.05
    try:
        thread, started = _stream_in_background(server, {**OK, "prompt": PROMPT, "max_tokens": 30, "ignore_eos": True})
        assert started.wait(30)
        before = probe.generations
        assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
        assert probe.generations == before
    finally:
        server.delay[0] = 0.0
        thread.join(30)


def test_health_generate_is_503_when_no_token_comes_within_its_timeout(server, monkeypatch):
    """An engine whose step outlasts the probe's timeout (a stuck engine) is unhealthy: 503 with the error
    envelope, while /health, which only sees the thread alive, still says 200. Probes that come
    together share one generation, so a public endpoint cannot pile requests onto a stuck engine."""
    probe = server.state.probe
    monkeypatch.setattr(probe, "timeout_s", 0.3)
    before, loop = probe.generations, server.state.loop
    # the engine has not stepped for longer than the timeout (a step newer than that reads as progress)
    assert wait_until(lambda: loop.last_step_end is None or time.monotonic() - loop.last_step_end > 0.5, 5)
    server.delay[0] = 1.5
    try:
        probes = [_in_background(lambda: httpx.get(server.url + "/health_generate", timeout=30)) for _ in range(3)]
        for thread, _ in probes:
            thread.join(30)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.delay[0] = 0.0
    assert probe.generations == before + 1
    r = probes[0][1][0]
    assert {box[0].status_code for _, box in probes} == {503}
    _assert_envelope(r, 503, None)
    assert r.json()["status"] == "not_generating" and "no token within 0.3 s" in r.json()["error"]["message"]
    assert wait_until(lambda: pages_all_free(server.url), 10)


LOAD_SCRIPT = r"""
import json, sys, threading, httpx
url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
results = [None] * n
def one(i):
    body = {"model": "tiny", "prompt": [1 + i, 2, 3, 4], "max_tokens": 12, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer " + key},
                      timeout=60) as r:
        if r.status_code != 200:
            r.read()
            results[i] = {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "body": r.json()}
            return
        events = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
        usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
        results[i] = {"status": 200, "done": events[-1] == "[DONE]", "usage": usage[-1] if usage else None}
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(results))
"""


def test_bounded_load_from_second_process(server):
    server.delay[0] = 0.01
    try:
        out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, server.url, KEY, "16"], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
    finally:
        server.delay[0] = 0.0
    results = json.loads(out.stdout)
    assert all(r is not None for r in results), out.stderr
    ok = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] != 200]
    for r in ok:  # every admitted stream completes in full
        assert r["done"] and r["usage"]["completion_tokens"] == 12
    for r in rejected:  # every other one is a clean 503 with Retry-After
        assert r["status"] == 503 and r["retry_after"] and r["body"]["error"]["code"] == 503
    assert ok and rejected, results
    assert wait_until(lambda: pages_all_free(server.url), 5)
    assert scrape(server.url)["sparsekv:requests_rejected_total"] >= len(rejected)
    server.engine.check_integrity()


def test_bench_serve_runs(server, capsys):
    from sparsekv.tools.bench_serve import main
    rc = main(["--url", server.url, "--api-key", KEY, "--num-prompts", "6", "--input-len", "16",
               "--output-len", "6", "--max-concurrency", "2", "--model", "tiny"])
    out = capsys.readouterr().out
    assert rc == 0
    for line in ("Successful requests:", "Output token throughput", "Mean TTFT (ms)", "P99 ITL (ms)",
                 "Median TPOT (ms)", "Mean E2E (ms)", "sparsekv:generation_tokens_total"):
        assert line in out, out
    assert re.search(r"Successful requests:\s+6\n", out) and re.search(r"Failed requests:\s+0\n", out)


def test_bench_serve_reports_latency_per_tenant_key(server, capsys):
    """Two --api-key (two tenants), weighted 3:1: every request is sent with one of them, the per-key
    counts follow the seeded draw, and each key's latencies are reported; bad weights are refused."""
    import json

    from sparsekv.tools.bench_serve import assign_keys, build_parser, main
    argv = ["--url", server.url, "--api-key", KEY, "--api-key", KEY_PLAIN, "--tenant-weights", "3", "1",
            "--num-prompts", "8", "--input-len", "16", "--output-len", "3", "--max-concurrency", "4", "--model", "tiny"]
    out_file = server.model + "-bench.json"
    assert main(argv + ["--json", out_file]) == 0
    out = capsys.readouterr().out
    assert "Per tenant (--api-key)" in out and "key 1" in out and "key 2" in out
    by_key = json.load(open(out_file))["by_key"]
    drawn = assign_keys(build_parser().parse_args(argv), 8)
    assert [by_key[f"key {k + 1}"]["requests"] for k in (0, 1)] == [drawn.count(0), drawn.count(1)]
    assert all(k["completed"] == k["requests"] and k["ttft_ms"]["p99"] > 0 for k in by_key.values())
    assert main(argv[:4] + ["--tenant-weights", "1", "1", "1"]) == 2


def test_bench_serve_shared_prefix_reports_reuse_by_tier(server, capsys):
    from sparsekv.tools.bench_serve import main
    rc = main(["--url", server.url, "--api-key", KEY, "--num-prompts", "6", "--input-len", "48", "--prefix-len", "40",
               "--num-prefixes", "2", "--dataset", "shared-prefix", "--output-len", "2", "--max-concurrency", "1",
               "--model", "tiny"])
    out = capsys.readouterr().out
    assert rc == 0
    device, host, disk, total = map(float, re.search(r"Prefix reuse, device / host / disk / total:\s+([\d.]+)% / "
                                                     r"([\d.]+)% / ([\d.]+)% / ([\d.]+)%", out).groups())
    assert device > 0 and host == disk == 0 and total == device   # the server has no host or disk tier
    rows = [line for line in out.splitlines() if line.startswith("sparsekv:")]
    assert any("prefix_cache_hits_total:device" in r for r in rows) and len({len(r) for r in rows}) == 1  # aligned
    assert main(["--url", server.url, "--dataset", "shared-prefix", "--input-len", "8", "--prefix-len", "8"]) == 2


def test_continue_final_message_ends_the_prompt_inside_the_assistants_message(server, client):
    """vLLM's assistant prefill: with add_generation_prompt false and continue_final_message true the prompt
    ends with the assistant's text, which the model continues (the field was ignored: a closed message, or
    a new assistant turn after it); both true, a last message not the assistant's, or a request-supplied
    chat_template are 400s."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the rain in"}]
    auth = {"Authorization": f"Bearer {KEY}"}

    def tokens(**fields):
        r = httpx.post(server.url + "/tokenize", json={"messages": messages, **fields}, headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    continued = tokens(add_generation_prompt=False, continue_final_message=True)
    closed = tokens(add_generation_prompt=False)
    decode = server.engine.tokenizer.decode
    assert decode(continued).endswith("the rain in") and not decode(closed).endswith("the rain in")
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == len(continued)
    for fields, param in (({"continue_final_message": True}, "continue_final_message"),
                          ({"chat_template": "{{ messages }}"}, "chat_template")):
        r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=10,
                       json={"model": "tiny", "messages": messages, "max_tokens": 2, **fields})
        assert r.status_code == 400 and param in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=10,
                   json={"model": "tiny", "messages": messages[:1], "max_tokens": 2, "add_generation_prompt": False,
                         "continue_final_message": True})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]


def test_a_model_is_retrieved_by_its_name(client):
    """OpenAI's retrieve-a-model (`client.models.retrieve`): the served name's card, 404 for another."""
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
