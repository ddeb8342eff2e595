"""Chat tool calls in GLM's format: the parser, and the API end to end (the bundled model is made to
write a call with guided_regex, since an 8M model does not call tools on its own)."""
from __future__ import annotations

import json

import openai
import pytest

from sparsekv.server.tool_calls import ToolCallStream, parse_tool_calls

CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    ("Let me look. " + CALL, "Let me look. ", [("get_weather", {"city": "Paris"})]),
    ("\n " + CALL, None, [("get_weather", {"city": "Paris"})]),
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key>\n<arg_value>[1, \"x\"]</arg_value>"
     "</tool_call><tool_call>now\n</tool_call>", None, [("add", {"a": 2, "b": [1, "x"]}), ("now", {})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>", "<tool_call>get_weather\n<arg_key>city</arg_key>", []),
], ids=["text", "text-then-call", "space-then-call", "call", "json-values-and-two-calls",
        "unfinished-call-is-text"])
def test_parse_glm_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def _stream(text: str, step: int = 1) -> list[dict]:
    """The deltas of `text` written `step` characters at a time, then finished."""
    stream, deltas = ToolCallStream(), []
    for end in range(step, len(text) + step, step):
        deltas += stream.update(text[:end], finished=end >= len(text))
    return deltas


def _joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, from stream deltas: as a client accumulates them."""
    calls: dict[int, list] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text", [
    "It is sunny.", "Let me look. " + CALL, CALL + CALL.replace("Paris", "{\"x\": [1, 2]}"),
    "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key>\n<arg_value>[1, \"x\"]</arg_value>"
    "</tool_call><tool_call>now\n</tool_call>", "<tool_call>\n</tool_call>" + CALL],
    ids=["text", "text-then-call", "two-calls-json-value", "several-args-and-no-args", "nameless-call-skipped"])
@pytest.mark.parametrize("step", [1, 7, 1000])
def test_streamed_tool_calls_join_to_the_parsed_ones(text, step):
    """Written a character at a time, a few at a time, or whole: each call's name goes out once, then
    its arguments in pieces that join to exactly the unstreamed `arguments`."""
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in parse_tool_calls(text)[1]]
    deltas = _stream(text, step)
    assert _joined(deltas) == want
    if step == 1 and want:  # arguments go out pair by pair, not all at the end
        assert len([d for d in deltas if d["function"]["arguments"]]) >= len(want)


def test_a_call_streams_its_name_and_each_argument_as_they_complete():
    stream, text = ToolCallStream(), "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
    assert stream.update("<tool_call>get_wea", False) == []                   # the name may still grow
    [head] = stream.update("<tool_call>get_weather\n<arg_key>ci", False)
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.update(text, False) == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]
    assert stream.update(text + "\n</tool_call>", False) == [{"index": 0, "function": {"arguments": "}"}}]
    assert stream.update(text + "\n</tool_call>", True) == []                # nothing twice
    cut = ToolCallStream()  # a message cut off (max_tokens) inside a call: its arguments are closed
    assert _joined(cut.update(text, True)) == [("get_weather", '{"city": "Paris"}')]


def test_chat_tool_calls_through_the_api():
    from sparsekv.paths import default_model_path
    from test_server_util import ThreadServer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    with ThreadServer(default_model_path(), max_model_len=1024) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        forced = client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=256, temperature=0,
            extra_body={"guided_regex": "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris"
                                        "</arg_value>\\n</tool_call>"})
        choice = forced.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        streamed = list(client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=256, temperature=0, stream=True,
            extra_body={"guided_regex": "Let me see\\. <tool_call>get_weather\n<arg_key>city</arg_key>\n"
                                        "<arg_value>Paris</arg_value>\n</tool_call>"}))
        content = "".join(c.choices[0].delta.content or "" for c in streamed)
        calls = [t.model_dump(exclude_none=True) for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert content == "Let me see. " and streamed[-1].choices[0].finish_reason == "tool_calls"
        assert len(calls) >= 2  # the name, then the arguments: streamed as they are written
        assert _joined(calls) == [("get_weather", '{"city": "Paris"}')]
        history = messages + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": choice.message.tool_calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}]
        follow = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=8,
                                                temperature=0)
        assert follow.choices[0].finish_reason in ("stop", "length") and not follow.choices[0].message.tool_calls
        off = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="none",
                                             max_tokens=64, temperature=0, extra_body={"guided_regex": "<tool_call>x"
                                             "\\n</tool_call>"})
        assert off.choices[0].finish_reason == "stop" and off.choices[0].message.content == "<tool_call>x\n</tool_call>"
        srv.engine.check_integrity()


def test_tools_on_a_model_whose_call_format_is_not_parsed_are_refused(ds_ckpt):
    import httpx

    from test_server_util import ThreadServer
    with ThreadServer(ds_ckpt[0]) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "deepseek_v32" in r.json()["error"]["message"]
