"""Chat tool calls in GLM's format: the parser, and the API end to end (the bundled model is made to
write a call with guided_regex, since an 8M model does not call tools on its own)."""
from __future__ import annotations

import json

import openai
import pytest

from sparsekv.server.tool_calls import parse_tool_calls

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
        calls = [t for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert content == "Let me see. " and streamed[-1].choices[0].finish_reason == "tool_calls"
        assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == \
            [(0, "get_weather", {"city": "Paris"})]
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
