"""Chat tool calls in GLM's format: the parser, and the API end to end (the bundled model is made to
write a call with guided_regex, since an 8M model does not call tools on its own)."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from sparsekv.server.tool_calls import DSML, ToolCallStream, parse_tool_calls

CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    ("Let me look. " + CALL, "Let me look. ", [("get_weather", {"city": "Paris"})]),
    ("\n " + CALL, None, [("get_weather", {"city": "Paris"})]),
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key>\n<arg_value>[1, \"x\"]</arg_value>"
     "</tool_call><tool_call>now\n</tool_call>", None, [("add", {"a": 2, "b": [1, "x"]}), ("now", {})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>", None, [("get_weather", {})]),
    ("So <tool_call>get_wea", "So <tool_call>get_wea", []),
], ids=["text", "text-then-call", "space-then-call", "call", "json-values-and-two-calls",
        "cut-off-call-with-its-name", "cut-off-before-the-name-is-text"])
def test_parse_glm_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def _stream(text: str, step: int = 1, fmt=None) -> list[dict]:
    """The deltas of `text` written `step` characters at a time, then finished."""
    stream, deltas = ToolCallStream(fmt) if fmt else ToolCallStream(), []
    for end in range(step, len(text) + step, step):
        deltas += stream.update(text[:end], finished=end >= len(text))
    return deltas


def _streamed_choice(builder, text: str):
    """`text` fed to one choice of `builder` a character at a time, stopping at its end: (the choice's
    state, the tool-call deltas streamed, the finish reason streamed)."""
    from sparsekv.request import RequestOutput
    state, deltas, finish = builder.choice_state(0, []), [], None
    for end in range(1, len(text) + 1):
        state.update(RequestOutput("r", [1], [], text[:end], None, "stop" if end == len(text) else None))
        choice = builder.chunk(state, end == 1, False)["choices"][0]
        deltas += choice["delta"].get("tool_calls") or []
        finish = choice["finish_reason"] or finish
    return state, deltas, finish


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


def test_a_string_parameter_keeps_its_value_as_written():
    """As vLLM's glm45 parser: a parameter the request's tool types "string" keeps its value raw ("75001",
    "true"), any other is JSON where it parses; streamed alike. Without the tools, every value is JSON."""
    from sparsekv.server.tool_calls import GLM
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "metric": {"type": "string"}, "days": {"type": "integer"}}}}}]
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>metric</arg_key>"
            "\n<arg_value>true</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    fmt = GLM.for_tools(tools)
    [call] = parse_tool_calls(text, fmt)[1]
    assert json.loads(call["function"]["arguments"]) == {"city": "75001", "metric": "true", "days": 3}
    assert _joined(_stream(text, 1, fmt)) == [("get_weather", call["function"]["arguments"])]
    assert json.loads(parse_tool_calls(text)[1][0]["function"]["arguments"]) == {"city": 75001, "metric": True, "days": 3}


def _glm_value(schema: dict | None, raw: str):
    """The value a GLM call's argument `v` written as `raw` reads as, for a parameter typed `schema`
    (None: the tool declares no such parameter); streamed a character at a time, the same."""
    from sparsekv.server.tool_calls import GLM
    properties = {} if schema is None else {"v": schema}
    parameters = {"type": "object", "properties": properties}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    fmt = GLM.for_tools(tools)
    text = f"<tool_call>f\n<arg_key>v</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"
    [call] = parse_tool_calls(text, fmt)[1]
    assert _joined(_stream(text, 1, fmt)) == [("f", call["function"]["arguments"])]
    return json.loads(call["function"]["arguments"])["v"]


@pytest.mark.parametrize("schema, raw, value", [
    ({"type": "integer"}, "  42 ", 42),
    ({"type": "boolean"}, "True", True),
    ({"type": "integer"}, " n/a \n", "n/a"),
    ({"type": "object"}, "{'a': 1}", {"a": 1}),
    ({"type": "array"}, "(1, 'x')", [1, "x"]),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["integer", "null"]}, " 7\n", 7),
    ({"type": "string"}, "  hi  ", "  hi  "),
    ({"type": "string"}, "75001", "75001"),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": ["string", "null"]}, "75001", "75001"),
    ({"type": ["string", "null"]}, "  hi  ", "  hi  "),
    ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "2", 2),
    ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "[2]", "[2]"),
    ({"anyOf": [{"type": "string"}, {"$ref": "#/defs/x"}]}, "[2]", [2]),
    (None, " [1, 2] ", [1, 2]),
    ({"type": "object"}, "{1, 2}", "{1, 2}"),
    ({"type": "object"}, "{1: 'a'}", "{1: 'a'}"),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "number"}, "1e999", "1e999"),
    ({"type": "object"}, "__import__('os').getcwd()", "__import__('os').getcwd()"),
    ({"type": "integer"}, "9" * 5000, "9" * 5000),
    ({"type": "integer"}, "0x" + "f" * 4000, "0x" + "f" * 4000),
], ids=["integer-stripped", "python-true", "unparsed-value-stripped", "python-dict", "python-tuple", "union-null",
        "union-integer", "string-keeps-spaces", "string-digits", "string-union-null",
        "string-union-digits-stay-a-string", "string-union-keeps-spaces", "anyof-string-or-number",
        "anyof-value-of-no-member-type", "anyof-untyped-member-reads-as-non-string", "undeclared-parameter",
        "python-set-has-no-json", "python-int-key-has-no-json", "nan-has-no-json", "infinity-has-no-json",
        "code-is-not-evaluated", "int-too-long-to-convert", "int-too-long-to-write"])
def test_a_glm_value_is_read_as_its_parameters_type(schema, raw, value):
    """vLLM's glm45 reading: a "string" parameter's value as written; any other stripped, then JSON,
    else a Python literal (literals only: code stays text), else the raw string. A union admitting a
    string keeps a decoded value only where it admits that value's type. A value JSON cannot write
    exactly (a set, NaN, an infinity) stays the text, so the arguments are always JSON."""
    assert _glm_value(schema, raw) == value


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
        two = "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>" * 2
        one = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=256,
                                             temperature=0, parallel_tool_calls=False, extra_body={"guided_regex": two})
        assert len(one.choices[0].message.tool_calls) == 1  # two written, one kept (OpenAI's parallel_tool_calls)
        streamed = list(client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=256, temperature=0, stream=True,
            parallel_tool_calls=False, extra_body={"guided_regex": two}))
        calls = [t.model_dump(exclude_none=True) for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert _joined(calls) == [("get_weather", '{"city": "Paris"}')]
        off = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="none",
                                             max_tokens=64, temperature=0, extra_body={"guided_regex": "<tool_call>x"
                                             "\\n</tool_call>"})
        assert off.choices[0].finish_reason == "stop" and off.choices[0].message.content == "<tool_call>x\n</tool_call>"
        digits = client.chat.completions.create(  # "city" is a string parameter: its digits stay a string
            model="tiny", messages=messages, tools=tools, max_tokens=256, temperature=0,
            extra_body={"guided_regex": "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>75001"
                                        "</arg_value>\\n</tool_call>"})
        assert json.loads(digits.choices[0].message.tool_calls[0].function.arguments) == {"city": "75001"}
        srv.engine.check_integrity()


DS_CALL = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
           '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n')


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    ("Let me look. " + DS_CALL + "</｜DSML｜function_calls>", "Let me look. ",
     [("get_weather", {"city": "Paris", "days": 3})]),
    (DS_CALL + '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">[1, "a"]'
     '</｜DSML｜parameter>\n<｜DSML｜parameter name="y" string="true">[1]</｜DSML｜parameter>\n</｜DSML｜invoke>', None,
     [("f", {"x": [1, "a"], "y": "[1]"})]),
    ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="true">1', None,
     [("f", {})]),
    ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f"', '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f"', []),
    ('Write <｜DSML｜invoke name="f"> inside a block. ' + DS_CALL + "</｜DSML｜function_calls>",
     'Write <｜DSML｜invoke name="f"> inside a block. ', [("get_weather", {"city": "Paris", "days": 3})]),
], ids=["text", "text-then-call", "two-calls", "json-and-raw-strings", "cut-off-call-with-its-name",
        "cut-inside-the-invoke-tag-is-text", "an-invoke-before-the-block-is-content"])
def test_parse_deepseek_v32_dsml_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, DSML)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    if calls:  # streamed a character at a time, or in pieces: the same calls
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in got]
        assert _joined(_stream(text, 1, DSML)) == want == _joined(_stream(text, 5, DSML))


DS_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
DS_REGEX = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
            'string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')


def _deepseek_v32_checkpoint(path: str, with_template: bool) -> str:
    """A tiny deepseek_v32 checkpoint with the bundled model's tokenizer, its chat template kept or
    left out (as DeepSeek-V3.2's own tokenizer has none: the server then renders with the bundled one)."""
    from sparsekv.paths import default_model_path
    from sparsekv.tools.tiny import save_reference_checkpoint
    save_reference_checkpoint(path, "deepseek_v32", n_group=1, topk_group=1, vocab_size=4096)
    shutil.copy(f"{default_model_path()}/tokenizer.json", path)
    with open(f"{default_model_path()}/tokenizer_config.json") as f:
        config = json.load(f)
    if not with_template:
        config.pop("chat_template")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    return path


def test_deepseek_v32_tool_calls_through_the_api(tmp_path):
    """A deepseek_v32 checkpoint (with the bundled tokenizer) made to write a DSML call: parsed into
    `tool_calls`, whole and streamed."""
    from test_server_util import ThreadServer
    tools, regex, messages = DS_TOOLS, DS_REGEX, [{"role": "user", "content": "weather in Paris?"}]
    with ThreadServer(_deepseek_v32_checkpoint(str(tmp_path / "ds"), True), max_model_len=1024) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        whole = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=256,
                                               temperature=0, extra_body={"guided_regex": regex})
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        streamed = list(client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=256, temperature=0, stream=True,
            extra_body={"guided_regex": regex}))
        calls = [t.model_dump(exclude_none=True) for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert _joined(calls) == [("get_weather", '{"city": "Paris"}')]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in streamed).strip()
        srv.engine.check_integrity()


def test_tool_choice_none_keeps_the_tools_in_the_prompt_through_the_api(tmp_path):
    """tool_choice "none" on a server whose template renders tools (a deepseek_v32 tokenizer without a
    template gets the bundled one): the prompt has the tools, as "auto"'s has, and a call the model
    writes is content; with the server's --exclude-tools-when-tool-choice-none it is the prompt
    without tools."""
    from test_server_util import ThreadServer
    tools, regex, messages = DS_TOOLS, DS_REGEX, [{"role": "user", "content": "weather in Paris?"}]
    srv = ThreadServer(_deepseek_v32_checkpoint(str(tmp_path / "ds"), False), max_model_len=1024)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def prompt_tokens(**extra):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0,
                                              **extra).usage.prompt_tokens
    with srv:
        bare = prompt_tokens()
        assert prompt_tokens(tools=tools, tool_choice="none") == prompt_tokens(tools=tools, tool_choice="auto") > bare
        off = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="none",
                                             max_tokens=256, temperature=0, extra_body={"guided_regex": regex})
        assert off.choices[0].finish_reason == "stop" and not off.choices[0].message.tool_calls
        assert off.choices[0].message.content == regex  # the regex has no escapes: it is the text it matches
        srv.state.settings.exclude_tools_when_tool_choice_none = True
        assert prompt_tokens(tools=tools, tool_choice="none") == bare
        assert prompt_tokens(tools=tools, tool_choice="auto") > bare
        srv.engine.check_integrity()


@pytest.mark.parametrize("choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_none_renders_the_tools_but_parses_no_calls(choice):
    """As vLLM: "none" keeps the tools in the prompt (unless the server excludes them then) and only
    turns off parsing; every other choice renders and parses them. No tools: neither."""
    from sparsekv.server.protocol import ChatCompletionRequest
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 **({} if choice is None else {"tool_choice": choice})})
    assert body.tools_in_prompt() and body.tools_in_prompt(exclude_when_none=True) == (choice != "none")
    assert body.parse_tool_calls == (choice != "none")
    bare = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none"})
    assert not bare.tools_in_prompt() and not bare.parse_tool_calls


def test_exclude_tools_when_tool_choice_none_reaches_the_server_settings(monkeypatch):
    """`sparsekv serve --exclude-tools-when-tool-choice-none` (vLLM's flag) sets the server's setting;
    off without it."""
    from types import SimpleNamespace

    import sparsekv.llm
    import sparsekv.server.app
    from sparsekv.server.cli import build_app, build_parser
    seen = []

    def create_app(engine, settings):
        seen.append(settings)
        return SimpleNamespace(state=SimpleNamespace(server=None))
    monkeypatch.setattr(sparsekv.llm, "build_engine", lambda config: object())
    monkeypatch.setattr(sparsekv.server.app, "create_app", create_app)
    for argv, want in (([], False), (["--exclude-tools-when-tool-choice-none"], True)):
        build_app(build_parser().parse_args(argv))
        assert seen[-1].exclude_tools_when_tool_choice_none is want, argv


def test_chat_template_flag_replaces_the_tokenizers(tmp_path, capsys):
    """`sparsekv serve --chat-template FILE` (vLLM's flag), e.g. for DeepSeek-V3.2, whose repository
    ships no template: the file renders chat prompts, tools included."""
    from sparsekv.server.cli import build_app, build_parser, main
    from sparsekv.server.protocol import ChatCompletionRequest
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if tools %}[{{ tools | length }} tools]{% endif %}<assistant>")
    _, state = build_app(build_parser().parse_args(["--chat-template", str(template), "--max-model-len", "256"]))
    body = ChatCompletionRequest(model="x", messages=[{"role": "user", "content": "hi"}])
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = state.tokenizer.decode(state.chat_prompt(body, tools)[0])
    assert text == "<user>hi[1 tools]<assistant>"
    assert main(["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "missing.jinja" in capsys.readouterr().err


def test_forced_tool_choice_through_the_api():
    """tool_choice naming a function, or "required": the call is written as JSON under the tools'
    schemas (structured outputs), so even the 8M model calls it with valid arguments; streamed, the
    named call's arguments go out as they are written and join to the unstreamed ones."""
    from sparsekv.paths import default_model_path
    from test_server_util import ThreadServer
    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "now"}}]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ThreadServer(default_model_path(), max_model_len=1024) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        whole = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice=named,
                                               max_tokens=64, temperature=0)
        choice = whole.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI: a named choice "stop"s
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        streamed = list(client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice=named,
                                                       max_tokens=64, temperature=0, stream=True))
        deltas = [t.model_dump(exclude_none=True) for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert len(deltas) >= 3  # the name, then the arguments in pieces
        assert _joined(deltas) == [("get_weather", call.function.arguments)]
        assert not "".join(c.choices[0].delta.content or "" for c in streamed)
        # "required": this model keeps appending calls to the array until max_tokens cuts it; a cut array
        # is no call, and its text is the content (whole and streamed alike)
        required = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required",
                                                  max_tokens=48, temperature=0)
        message = required.choices[0].message
        assert required.choices[0].finish_reason == "length" and not message.tool_calls
        assert message.content.startswith('[{"name": "get_weather", "parameters": {"city": ')
        streamed = list(client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                       tool_choice="required", max_tokens=48, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == message.content
        assert not any(c.choices[0].delta.tool_calls for c in streamed)
        srv.engine.check_integrity()


def test_required_tool_choice_array_becomes_calls_whole_and_streamed():
    from sparsekv.server.tool_calls import ForcedCallStream, forced_calls
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in forced_calls(text, "required")]
    assert calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    stream = ForcedCallStream("required")
    assert stream.update(text[:20], text[:20], False) == []  # nothing until the array is whole
    assert _joined(stream.update(text[20:], text, True)) == calls
    assert forced_calls(text[:-1], "required") is None       # cut off: no calls
    not_calls = ('{"name": "now"}', "[1]", '[{"name": "now"}]', "[]")  # JSON, not the schema's array: no calls
    assert [forced_calls(other, "required") for other in not_calls] == [None] * 4
    named = ForcedCallStream("get_weather")
    first = named.update('{"city"', '{"city"', False)
    assert len(first) == 1 and first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}  # one entry a delta
    assert _joined(first + named.update(': "Rome"}', '{"city": "Rome"}', True)) == [("get_weather", '{"city": "Rome"}')]


def test_a_forced_tool_without_parameters_is_called_with_an_object():
    """A tool that declares no parameters still takes an arguments object: the forced call's schema is
    an empty object's, never `{}` (which any JSON value, a bare number included, would satisfy)."""
    from sparsekv.server.protocol import ChatCompletionRequest
    empty = {"type": "object", "properties": {}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert ChatCompletionRequest.model_validate(named).engine_structured_output()["schema"] == empty
    required = ChatCompletionRequest.model_validate({**body, "tool_choice": "required"}).engine_structured_output()
    assert required["schema"]["items"]["anyOf"][0]["properties"]["parameters"] == empty


def test_arguments_keep_non_ascii_text_as_written():
    """Arguments JSON keeps "Zürich" as written (vLLM's ensure_ascii=False), whole and streamed."""
    text = CALL.replace("Paris", "Zürich")
    [call] = parse_tool_calls(text)[1]
    assert call["function"]["arguments"] == '{"city": "Zürich"}'
    assert _joined(_stream(text, 1)) == [("get_weather", '{"city": "Zürich"}')]


def test_a_delta_that_carries_only_calls_has_null_content():
    """As OpenAI streams a call: a chunk whose delta carries tool_calls and no text has content null,
    not an empty string."""
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=GLM)
    state, with_calls = builder.choice_state(0, []), []
    for end in range(1, len(CALL) + 1):
        state.update(RequestOutput("r", [1], [], CALL[:end], None, "stop" if end == len(CALL) else None))
        delta = builder.chunk(state, end == 1, False)["choices"][0]["delta"]
        if delta.get("tool_calls"):
            with_calls.append(delta)
    assert len(with_calls) >= 2 and all(d["content"] is None for d in with_calls)


def test_required_without_parallel_calls_allows_one_call():
    from sparsekv.server.protocol import ChatCompletionRequest
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert "maxItems" not in ChatCompletionRequest.model_validate(body).engine_structured_output()["schema"]
    one = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False})
    assert one.engine_structured_output()["schema"]["maxItems"] == 1


@pytest.mark.parametrize("fmt, text", [
    (None, "So <tool_call>get_wea"),                                               # cut before the name is whole
    (None, "So <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa"),     # cut inside an argument
    (None, "Done." + CALL),
    (None, "Done. <tool_c"),                                                        # ends in a piece of the marker
    (DSML, "<｜DSML｜function_calls>\n<｜DSML｜invok"),                               # cut before any invoke
    (DSML, DS_CALL[:-12]),
], ids=["name-cut", "argument-cut", "whole-call", "marker-piece", "dsml-before-invoke", "dsml-cut"])
def test_a_finished_message_streams_what_the_response_says(fmt, text):
    """Streamed a character at a time, then finished ("stop"): the content and calls a client joins
    are the unstreamed message's, for calls cut off anywhere (max_tokens or a stop string)."""
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=fmt or GLM)
    state, content, deltas = builder.choice_state(0, []), "", []
    for end in range(1, len(text) + 1):
        state.update(RequestOutput("r", [1], [], text[:end], None, "stop" if end == len(text) else None))
        delta = builder.chunk(state, end == 1, False)["choices"][0]["delta"]
        content += delta.get("content") or ""
        deltas += delta.get("tool_calls") or []
    message = builder.response([state])["choices"][0]["message"]
    assert content == (message["content"] or "")
    assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"])
                               for c in message.get("tool_calls") or []]


def test_a_stop_string_that_cuts_a_whole_argument_never_streams_it():
    """A stop string that begins inside an argument's close tag cuts that argument once it completes;
    until then the stream holds the argument back, so that the arguments a client joins are the
    response's (they were '{"city": "Paris"{}', not JSON)."""
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    stop = "</arg_value>\n</tool_call>"
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=GLM)
    state, deltas = builder.choice_state(0, [stop]), []
    outputs = [RequestOutput("r", [1], [], CALL[:end], None, None) for end in range(1, len(CALL))]
    for i, out in enumerate(outputs + [RequestOutput("r", [1], [], CALL[:CALL.index(stop)], None, "stop")]):
        state.update(out)
        deltas += builder.chunk(state, i == 0, False)["choices"][0]["delta"].get("tool_calls") or []
    [call] = builder.response([state])["choices"][0]["message"]["tool_calls"]
    assert _joined(deltas) == [("get_weather", call["function"]["arguments"])] == [("get_weather", "{}")]


def test_a_dsml_key_with_a_quote_round_trips_through_the_template():
    """An earlier call's function and argument names as the bundled DeepSeek-V3.2 template writes them
    (`"` and `&` escaped in the name attributes) read back by the DSML parser as the same names, whole and
    streamed; a bare `"` would end the name there."""
    from transformers import AutoTokenizer

    from sparsekv.paths import default_model_path
    from sparsekv.server.app import bundled_chat_template
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = bundled_chat_template("deepseek_v32")
    arguments = {'say "hi"': "x", "a&b": 1, "&quot;": [True], 'q"': {"k": 'v"'}}
    call = {"id": "a", "type": "function", "function": {"name": 'f"&g', "arguments": arguments}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tok.apply_chat_template(messages, tokenize=False)
    start = text.index("<｜DSML｜function_calls>")
    block = text[start:text.index("<｜end▁of▁sentence｜>", start)]
    assert 'name="say &quot;hi&quot;"' in block and 'name="a&amp;b"' in block
    [parsed] = parse_tool_calls(block, DSML)[1]
    assert json.loads(parsed["function"]["arguments"]) == arguments
    assert parsed["function"]["name"] == 'f"&g'
    assert _joined(_stream(block, 1, DSML)) == [('f"&g', parsed["function"]["arguments"])]


@pytest.mark.parametrize("written, value", [("NaN", "NaN"), ("1" * 5000, "1" * 5000), ("True", True),
                                            ("{'a': (1, 2)}", {"a": [1, 2]}), (" 7\n", 7), (" n/a \n", "n/a")])
def test_a_dsml_non_string_value_is_json_a_literal_or_its_text_never_an_error(written, value):
    """A value the response could not write as JSON (NaN, an integer past Python's digit limit, which
    json.loads refuses with a plain ValueError) stays its text: before, the first answered NaN (not
    JSON) and the second a 500. Its surrounding whitespace is not its own, as a GLM non-string value's."""
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="v" string="false">'
            + written + '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    [call] = parse_tool_calls(text, DSML)[1]
    assert json.loads(call["function"]["arguments"]) == {"v": value}
    assert _joined(_stream(text, 7, DSML)) == [("f", call["function"]["arguments"])]


def test_a_dsml_parameter_without_a_string_flag_is_json():
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n">3</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="s">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    [call] = parse_tool_calls(text, DSML)[1]
    assert json.loads(call["function"]["arguments"]) == {"n": 3, "s": "x"}


def test_a_nameless_dsml_invoke_is_skipped_whole_and_streamed():
    text = '<｜DSML｜function_calls>\n<｜DSML｜invoke name="">\n</｜DSML｜invoke>\n' + DS_CALL[len("<｜DSML｜function_calls>\n"):]
    want = [("get_weather", '{"city": "Paris", "days": 3}')]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parse_tool_calls(text, DSML)[1]] == want
    assert _joined(_stream(text, 1, DSML)) == want == _joined(_stream(text, 1000, DSML))


def test_a_stream_limited_to_one_call_sends_only_the_first():
    """parallel_tool_calls=false (max_calls=1): a second call written is not sent."""
    stream, deltas, text = ToolCallStream(max_calls=1), [], CALL + CALL.replace("Paris", "Rome")
    for end in range(1, len(text) + 1):
        deltas += stream.update(text[:end], end == len(text))
    assert _joined(deltas) == [("get_weather", '{"city": "Paris"}')] and stream.num_calls == 1


@pytest.mark.parametrize("forced, text, reason", [
    ("get_weather", '{"city": "Paris"}', "stop"),
    ("required", '[{"name": "now", "parameters": {}}]', "tool_calls"),
])
def test_a_forced_calls_stream_finishes_as_its_response(forced, text, reason):
    """OpenAI: a named tool_choice finishes "stop", "required" finishes "tool_calls"; streamed, the last
    chunk says the same, and the calls join to the response's."""
    from sparsekv.server.responses import ResponseBuilder, TokenText
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", forced=forced)
    state, deltas, finish = _streamed_choice(builder, text)
    whole = builder.response([state])["choices"][0]
    assert finish == whole["finish_reason"] == reason
    assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"])
                               for c in whole["message"]["tool_calls"]]


def test_forced_streams_send_nothing_twice_and_nothing_empty():
    """"required": the array's calls go out once, when the message finishes (even if the array was
    already whole before); a named call sends no empty arguments deltas."""
    from sparsekv.server.tool_calls import ForcedCallStream
    text = '[{"name": "now", "parameters": {}}]'
    stream = ForcedCallStream("required")
    assert stream.update(text, text, False) == []
    assert _joined(stream.update("", text, True)) == [("now", "{}")]
    named = ForcedCallStream("f")
    assert len(named.update("{", "{", False)) == 1
    assert named.update("", "{", False) == []


@pytest.mark.parametrize("text", ["<tool_call>\n</tool_call>" + CALL, "<tool_call>now<tool_call>" + CALL[len("<tool_call>"):],
                                  "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value>" + CALL])
def test_one_call_streamed_is_the_one_the_response_returns(text):
    """parallel_tool_calls=false: the stream and the whole response keep the same call, the first that
    has a name (a nameless first call, closed or ended by the next call, is skipped by both)."""
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=GLM)
    builder.max_calls = 1  # parallel_tool_calls=false
    state, deltas, finish = _streamed_choice(builder, text)
    message = builder.response([state])["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["message"]["tool_calls"]]
    assert _joined(deltas) == calls and len(calls) == 1
    assert finish == message["finish_reason"] == "tool_calls"


def test_a_streamed_message_without_calls_finishes_stop():
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=GLM)
    state = builder.choice_state(0, [])
    state.update(RequestOutput("r", [1], [], "It is sunny.", None, "stop"))
    assert builder.chunk(state, True, False)["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("finish, reason", [("stop", "tool_calls"), ("length", "length")])
def test_a_call_cut_off_by_max_tokens_still_finishes_length(finish, reason):
    """A message that ended after its calls finishes "tool_calls", streamed or not; one cut off by
    max_tokens keeps "length", so a client knows the last call's arguments may be incomplete."""
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ResponseBuilder, TokenText
    from sparsekv.server.tool_calls import GLM
    text = "So " + CALL[:-len("</tool_call>")]
    builder = ResponseBuilder("chat", "id", "m", 0, 1, TokenText(None), "t", tools=GLM)
    whole, streamed = builder.choice_state(0, []), builder.choice_state(0, [])
    for state in (whole, streamed):
        state.update(RequestOutput("r", [1], [], text, None, finish))
    choice = builder.response([whole])["choices"][0]
    assert choice["finish_reason"] == reason and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert builder.chunk(streamed, True, False)["choices"][0]["finish_reason"] == reason
