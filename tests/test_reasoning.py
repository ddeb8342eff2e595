"""Reasoning models in chat: the bundled DeepSeek-V3.2 chat template, `chat_template_kwargs`, and
`--reasoning-parser` splitting `<think>...</think>` into `reasoning_content`, whole and streamed."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from sparsekv.request import RequestOutput
from sparsekv.server.app import bundled_chat_template
from sparsekv.server.reasoning import prompt_opens_reasoning, split_reasoning
from sparsekv.server.responses import ChoiceState, Reasoning
from sparsekv.server.tool_calls import DSML, GLM, parse_tool_calls

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def render():
    from transformers import AutoTokenizer

    from sparsekv.paths import default_model_path
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = bundled_chat_template("deepseek_v32")

    def render(messages, tools=None, **kwargs):
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    return render


def test_deepseek_v32_template_chat_and_thinking_modes(render):
    """DeepSeek's own example (encoding_dsv32.py's README): earlier turns close their think block and
    drop their reasoning; the last user turn opens one only in thinking mode."""
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
                {"role": "user", "content": "1+1=?"}]
    assert render(messages, thinking=True) == (f"{BOS}{USER}hello{ASSISTANT}</think>Hello! I am DeepSeek.{EOS}"
                                               f"{USER}1+1=?{ASSISTANT}<think>")
    assert render([{"role": "system", "content": "Be brief."}] + messages) == (
        f"{BOS}Be brief.{USER}hello{ASSISTANT}</think>Hello! I am DeepSeek.{EOS}{USER}1+1=?{ASSISTANT}</think>")
    answered = messages + [{"role": "assistant", "content": "2", "reasoning_content": "one plus one"}]
    assert render(answered, thinking=True).endswith(f"{USER}1+1=?{ASSISTANT}<think>one plus one</think>2{EOS}")


def test_deepseek_v32_template_tools_calls_and_results(render):
    """Tools as a system block of JSON schemas; an assistant's calls written back in DSML (string
    values raw, others JSON) that our DSML parser reads back; results in <function_results>."""
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": {"city": "Paris", "days": 3}}},
             {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]
    messages = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "sunny", "tool_call_id": "a"},
                {"role": "tool", "content": "12:00", "tool_call_id": "b"}]
    text = render(messages, [WEATHER], thinking=True)
    preamble, _, rest = text.partition("</functions>\n")
    assert preamble.startswith(BOS + "\n\n## Tools\nYou have access to a set of tools")
    assert preamble.endswith("<functions>\n" + json.dumps(WEATHER["function"], ensure_ascii=False) + "\n")
    dsml = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    assert rest == (f"Sys.{USER}Paris?{ASSISTANT}<think></think>\n\n{dsml}{EOS}"
                    "\n\n<function_results>\n<result>sunny</result>\n<result>12:00</result>\n</function_results>"
                    "\n\n<think>")
    _, parsed = parse_tool_calls(dsml, DSML)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert render(messages[1:]).endswith("</function_results>\n\n</think>")  # chat mode: no think block


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "must follow an assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]},
      {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], "more tool messages"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "needs reasoning_content"),
    ([{"role": "narrator", "content": "x"}], "unknown role"),
    ([{"role": "developer", "content": ""}], "developer message needs content"),
], ids=["tool-without-call", "too-many-results", "thinking-without-reasoning", "unknown-role", "empty-developer"])
def test_deepseek_v32_template_refuses_malformed_conversations(render, messages, error):
    with pytest.raises(Exception, match=error):
        render(messages, thinking=True)


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("plain answer", False, None, "plain answer"),
    ("\n<think>hmm</think>answer", False, "hmm", "answer"),
    ("hmm</think>answer", True, "hmm", "answer"),
    ("still thinking", True, "still thinking", ""),
    ("answer <think>not a block</think>", False, None, "answer <think>not a block</think>"),
])
def test_split_reasoning(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning(f"{USER}q{ASSISTANT}<think>") and prompt_opens_reasoning("<|assistant|><think>\n")
    assert not prompt_opens_reasoning(f"{USER}q{ASSISTANT}</think>") and not prompt_opens_reasoning("<think></think>")


def _streamed(text: str, reasoning: Reasoning, stops=(), tools=None, step: int = 1) -> tuple[str, str, list]:
    """(reasoning, content, tool-call deltas) a client receives when `text` is generated `step`
    characters at a time."""
    from sparsekv.server.responses import ResponseBuilder, TokenText
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=tools, reasoning=reasoning)
    state, got_reasoning, got_content, calls = builder.choice_state(0, list(stops)), "", "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        state.update(RequestOutput("r", [1], [], text[:end], None, "stop" if end == len(text) else None))
        delta = builder.chunk(state, end == step, False)["choices"][0]["delta"]
        got_reasoning += delta.get("reasoning_content") or ""
        got_content += delta.get("content") or ""
        calls += delta.get("tool_calls") or []
    return got_reasoning, got_content, calls


@pytest.mark.parametrize("text, opened", [
    ("<think>a < b, so </th is not the end</think>The answer.", False),
    ("  <thinking aloud is not a block", False),
    ("reasoning</think>\n\nanswer", True),
    ("cut off while thinking </thi", True),
    ("<thi", False),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_reasoning_joins_to_the_whole_response(text, opened, step):
    """Written a character at a time or whole: the reasoning and content deltas join to exactly what
    the unstreamed response gives, and no piece of `<think>`/`</think>` leaks into either."""
    reasoning, content = split_reasoning(text, opened)
    assert _streamed(text, Reasoning(opened), step=step)[:2] == (reasoning or "", content)


def test_tool_calls_are_read_from_the_content_only():
    """A call written while thinking is thought, not a call; the one after the block is a call."""
    call = "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    text = f"maybe {call}?</think>Calling. {call}"
    reasoning, content, calls = _streamed(text, Reasoning(True), tools=GLM)
    assert reasoning == f"maybe {call}?" and content == "Calling. "
    assert [c["function"].get("name") for c in calls if "id" in c] == ["f"]


@pytest.mark.parametrize("step", [1, 1000])
def test_include_reasoning_false_streams_no_reasoning(step):
    """include_reasoning=false (vLLM's): the think block is dropped from the stream as from the response;
    the content is the same."""
    text = "hmm</think>answer"
    assert _streamed(text, Reasoning(True, include=False), step=step)[:2] == ("", "answer")


def test_marker_start_counts_proper_starts_only():
    """A whole marker at the end is no start of one: callers hold back only what may still become it."""
    from sparsekv.server.reasoning import marker_start
    assert [marker_start(text, "</think>") for text in ("a<", "a</thi", "a</think>", "a", "")] == [1, 5, 0, 0, 0]


def test_stop_string_inside_reasoning_is_held_back():
    reasoning, content, _ = _streamed("abc STO", Reasoning(True), stops=["STOP"])
    assert reasoning == "abc STO" and content == ""  # finished: nothing left to cut
    state = ChoiceState(0, ["STOP"], reasoning=Reasoning(True))
    state.update(RequestOutput("r", [1], [], "abc ST", None, None))
    assert state.take_delta()[:2] == ("abc ", "")


@pytest.fixture(scope="module")
def deepseek_server(tmp_path_factory):
    """A tiny deepseek_v32 checkpoint whose tokenizer has no chat template (as DeepSeek-V3.2's), served
    with --reasoning-parser: the bundled template renders its chats."""
    from sparsekv.paths import default_model_path
    from sparsekv.tools.tiny import save_reference_checkpoint
    from test_server_util import ThreadServer
    path = str(tmp_path_factory.mktemp("ds") / "ds")
    save_reference_checkpoint(path, "deepseek_v32", n_group=1, topk_group=1, vocab_size=4096)
    shutil.copy(f"{default_model_path()}/tokenizer.json", path)
    with open(f"{default_model_path()}/tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("chat_template")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    srv = ThreadServer(path, max_model_len=1024, reasoning_parser="deepseek_v3")
    with srv:
        yield srv


def test_reasoning_through_the_api(deepseek_server):
    srv = deepseek_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Is 7 prime?"}]
    forced = {"guided_regex": "Seven has no divisors\\.</think>Yes\\."}
    thinking = {"chat_template_kwargs": {"thinking": True}}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                           extra_body={**forced, **thinking})
    message = whole.choices[0].message
    assert message.reasoning_content == "Seven has no divisors." and message.content == "Yes."
    prompt = httpx.post(srv.url + "/tokenize", json={"messages": messages, **thinking}).json()
    assert prompt["count"] == whole.usage.prompt_tokens  # /tokenize renders the same template and kwargs
    assert srv.state.tokenizer.decode(prompt["tokens"]).endswith(f"{ASSISTANT}<think>")
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                                   stream=True, extra_body={**forced, **thinking}))
    deltas = [c.choices[0].delta for c in streamed]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Seven has no divisors."
    assert "".join(d.content or "" for d in deltas) == "Yes."
    hidden = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                            extra_body={**forced, **thinking, "include_reasoning": False})
    assert hidden.choices[0].message.content == "Yes." and not hasattr(hidden.choices[0].message, "reasoning_content")
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                           extra_body={"guided_regex": "Yes\\."})  # chat mode: no think block
    assert plain.choices[0].message.content == "Yes." and plain.choices[0].message.reasoning_content is None
    # a JSON grammar holds after the reasoning (vLLM's way): this model never closes its think block
    # in 16 tokens, so all of it is reasoning, unconstrained; without thinking the JSON starts at once
    as_json = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                             response_format={"type": "json_object"}, extra_body=thinking)
    assert as_json.choices[0].message.content is None
    assert not as_json.choices[0].message.reasoning_content.startswith("{")  # free text, not the grammar's
    as_json = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                             response_format={"type": "json_object"})
    assert as_json.choices[0].message.content.startswith("{") and as_json.choices[0].message.reasoning_content is None
    history = messages + [{"role": "assistant", "content": "Yes.", "reasoning_content": "Seven has no divisors."},
                          {"role": "user", "content": "And 9?"}]
    follow = httpx.post(srv.url + "/tokenize", json={"messages": history, **thinking}).json()
    text = srv.state.tokenizer.decode(follow["tokens"])
    assert text.count("<think>") == 1 and "Seven has no divisors" not in text  # earlier reasoning dropped
    srv.engine.check_integrity()


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages"),
], ids=["reserved-key", "not-a-mapping", "template-refuses"])
def test_bad_chat_template_input_is_a_400(deepseek_server, body, param):
    r = httpx.post(deepseek_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bundled_template_only_where_the_tokenizer_has_none(deepseek_server, tmp_path):
    """A deepseek_v32 tokenizer without a template gets the bundled one; a tokenizer's own template
    (GLM's) is kept; the bundled file is only for deepseek_v32."""
    from test_server_util import CHAT_TEMPLATE, ThreadServer, tiny_checkpoint
    assert deepseek_server.state.tokenizer.chat_template == bundled_chat_template("deepseek_v32")
    assert ThreadServer(tiny_checkpoint(tmp_path)).state.tokenizer.chat_template == CHAT_TEMPLATE
    assert bundled_chat_template("glm_moe_dsa") is None


FUZZ_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]


def _random_chat(rng) -> dict:
    """A chat request mixing the features that shape a response: tools and tool_choice, a JSON grammar,
    thinking on or off, stop strings, n, logprobs, parallel_tool_calls, include_reasoning."""
    body = {"messages": [{"role": "user", "content": rng.choice(["hi", "weather?", "Is 7 prime?"])}],
            "max_tokens": rng.choice([1, 8, 24]), "temperature": 0,
            "tool_choice": rng.choice([None, "auto", "none", "required",
                                       {"type": "function", "function": {"name": "get_weather"}}])}
    for key, value, p in (("tools", FUZZ_TOOLS, 0.5), ("response_format", {"type": "json_object"}, 0.3),
                          ("chat_template_kwargs", {"enable_thinking": rng.random() < 0.5}, 0.3),
                          ("stop", ["e"], 0.3), ("n", 2, 0.3), ("logprobs", True, 0.3),
                          ("parallel_tool_calls", False, 0.2), ("include_reasoning", False, 0.2)):
        if rng.random() < p:
            body[key] = value
    return {k: v for k, v in body.items() if v is not None}


def _streamed_choices(url: str, body: dict) -> tuple[int, dict]:
    """(status, per choice index: content, reasoning, tool calls and finish reason as a client joins them)."""
    import json as json_
    out: dict = {}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        if r.status_code != 200:
            return r.status_code, out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json_.loads(line[6:]).get("choices", []):
                o = out.setdefault(ch["index"], {"content": "", "reasoning": "", "calls": {}, "finish": None})
                delta = ch["delta"]
                o["content"] += delta.get("content") or ""
                o["reasoning"] += delta.get("reasoning_content") or ""
                for t in delta.get("tool_calls") or []:
                    call = o["calls"].setdefault(t["index"], ["", ""])
                    call[0] = t["function"].get("name") or call[0]
                    call[1] += t["function"].get("arguments") or ""
                o["finish"] = ch["finish_reason"] or o["finish"]
    return 200, out


FUZZ_REGEXES = ["<think>ab</think>Yes\\.", "<think>x <tool_call>now\n</tool_call></think>ok <tool_call>now\n</tool_call>",
                "Let me see\\. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                "</thin", "<thi", "  <think>a</think>"]


def test_random_chat_requests_stream_what_they_answer():
    """60 random chat requests on the bundled model with a reasoning parser, then 36 made to write
    think blocks and tool calls (guided_regex) and cut by a stop string inside each tag: each is a 200
    or a 400 (never a 500), and streamed it joins to exactly what the unstreamed response says
    (content, reasoning, tool calls, finish reason)."""
    import random

    from sparsekv.paths import default_model_path
    from test_server_util import ThreadServer
    rng, seen = random.Random(0), {200: 0, 400: 0}
    with ThreadServer(default_model_path(), max_model_len=1024, reasoning_parser="glm45") as srv:
        url = srv.url + "/v1/chat/completions"
        cut_tags = [{"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 128, "temperature": 0,
                     "tools": FUZZ_TOOLS, "guided_regex": regex, "stop": [stop]}  # every think/call tag, cut anywhere
                    for regex in FUZZ_REGEXES for stop in ("</", "think", ">", "Paris", "<tool", "arg")]
        for body in [_random_chat(rng) for _ in range(60)] + cut_tags:
            whole = httpx.post(url, json=body, timeout=60)
            status, streamed = _streamed_choices(url, body)
            assert whole.status_code in (200, 400) and status == whole.status_code, (body, whole.text)
            seen[status] += 1
            for choice in whole.json()["choices"] if status == 200 else []:
                message, got = choice["message"], streamed[choice["index"]]
                calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []]
                assert [got["calls"][i] for i in sorted(got["calls"])] == calls, (body, message, got)
                assert got["content"] == (message["content"] or "") and got["finish"] == choice["finish_reason"]
                assert got["reasoning"] == (message.get("reasoning_content") or ""), (body, message, got)
        srv.engine.check_integrity()
    assert seen[200] > 30 and seen[400] > 5


def test_only_the_first_close_ends_the_block():
    """Content may mention `</think>` itself: the block ends at the first one."""
    assert split_reasoning("a</think>b </think> c", True) == ("a", "b </think> c")
    assert split_reasoning("<think>a</think>b</think>", False) == ("a", "b</think>")


@pytest.mark.parametrize("step", [1, 3])
def test_whitespace_before_a_written_think_is_not_streamed_as_content(step):
    """Leading whitespace may still turn out to precede `<think>`: it is held, and then dropped with it."""
    text = "\n <think>hmm</think>answer"
    assert _streamed(text, Reasoning(False), step=step)[:2] == ("hmm", "answer")


def test_a_close_tag_piece_in_content_without_a_block_is_not_held():
    """With no think block, content ending in a piece of `</think>` is content and goes out at once."""
    state = ChoiceState(0, [], reasoning=Reasoning(False))
    state.update(RequestOutput("r", [1], [], "x </th", None, None))
    assert state.take_delta()[:2] == ("", "x </th")
    after = ChoiceState(0, [], reasoning=Reasoning(True))  # after the block, the same
    after.update(RequestOutput("r", [1], [], "a</think>b </th", None, None))
    assert after.take_delta()[:2] == ("a", "b </th")
