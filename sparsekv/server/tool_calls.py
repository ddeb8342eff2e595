"""Tool calls in the model's own format, parsed out of a chat completion, whole or as it streams.

GLM-4.5 and later (and GLM-5, `glm_moe_dsa`) write a call as::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

each value as vLLM's glm45 parser reads it: where the request's tool types the parameter
`"string"`, the value as written, spaces included (they are the string's: "75001" stays a string);
otherwise the value with its surrounding whitespace stripped, as JSON if it parses, else as a Python
literal (`ast.literal_eval`: True, 'single quotes', (1, 2)), else the raw string. A union that admits a
string (`["string", "null"]`, or anyOf/oneOf with a string member) keeps a decoded value only when
the union admits its type ("null" is null there, "75001" stays a string); vLLM's test, `type` equal
to "string", would read every union as a non-string and turn "75001" into a number. A schema that
names no type for a parameter (or an untyped anyOf member) reads as a non-string, as in vLLM.
DeepSeek-V3.2 (`deepseek_v32`) writes DSML, with fullwidth bars (U+FF5C)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

a value raw when `string="true"`, else read as a GLM non-string value is (JSON, a Python literal, else
the text; a value JSON cannot write exactly, NaN or an integer past Python's digit limit, stays text). A function's or
parameter's name is an XML attribute: the bundled template writes `&` and `"` in it as `&amp;` and
`&quot;` (chat_templates/deepseek_v32.jinja), and the parser reads them back, so any name round-trips.

The text before the first call is the message's content (None if only whitespace). Streamed
(`ToolCallStream`), the text stops where calls begin, and each call goes out as OpenAI streams one:
its id and name once the name is whole, then its arguments JSON in pieces, one per complete
argument, closed at the call's end (or the message's). The pieces of a call join to the `arguments`
the unstreamed response gives, a call cut off by max_tokens or a stop string included.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from .tool_values import decoded_value, glm_value, parameter_types


@dataclass(frozen=True)
class CallFormat:
    """Where calls begin (`start`: text before it is content), how each call opens and closes, its name
    once whole (`name(body, ended)`: None while it may still grow), and its complete arguments
    (`arguments(body, types)`, `types`: parameter -> the JSON types the function's schema gives it).
    `parameter_types`: per function of the request's tools, its parameters' types (`for_tools`)."""

    start: str
    call_open: str
    call_close: str
    name: Callable[[str, bool], str | None]
    arguments: Callable[[str, dict[str, frozenset]], list[tuple[str, object]]]
    parameter_types: dict[str, dict[str, frozenset]] = field(default_factory=dict, compare=False)

    def for_tools(self, tools: list[dict] | None) -> CallFormat:
        """This format for a request's tools: a value is read as the type its parameter declares."""
        return replace(self, parameter_types=parameter_types(tools))

    def call_arguments(self, name: str, body: str) -> list[tuple[str, object]]:
        return self.arguments(body, self.parameter_types.get(name, {}))


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_DSML_NAME = re.compile(r'\s*name="([^"]*)"\s*>')
_DSML_ARG = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</｜DSML｜parameter>',
                       re.DOTALL)


def _glm_name(body: str, ended: bool) -> str | None:
    head, has_args = body.split("<arg_key>", 1)[0], "<arg_key>" in body
    return head.strip() or None if has_args or ended else None


def _dsml_name(body: str, ended: bool) -> str | None:
    match = _DSML_NAME.match(body)
    return _dsml_attribute(match.group(1).strip()) or None if match else None


def _glm_arguments(body: str, types: dict[str, frozenset]) -> list[tuple[str, object]]:
    pairs = [(key.strip(), value) for key, value in _GLM_ARG.findall(body)]
    return [(key, glm_value(value, types.get(key, frozenset()))) for key, value in pairs]


def _dsml_attribute(text: str) -> str:
    """An attribute's value as the template escapes it (`&quot;`, `&amp;`), read back; only these two,
    so a name the model wrote with a bare `&` in it reads as written."""
    return re.sub(r"&(quot|amp);", lambda m: '"' if m.group(1) == "quot" else "&", text)


def _dsml_arguments(body: str, types: dict[str, frozenset]) -> list[tuple[str, object]]:
    """The call's own `string` flag says which values are raw (`types` is not needed)."""
    return [(_dsml_attribute(k.strip()), v if raw == "true" else decoded_value(v.strip()))
            for k, raw, v in _DSML_ARG.findall(body)]


GLM = CallFormat("<tool_call>", "<tool_call>", "</tool_call>", _glm_name, _glm_arguments)
DSML = CallFormat("<｜DSML｜function_calls>", "<｜DSML｜invoke", "</｜DSML｜invoke>", _dsml_name, _dsml_arguments)
FORMATS = {"glm_moe_dsa": GLM, "deepseek_v32": DSML}  # model_type -> its call format


def _bodies(text: str, fmt: CallFormat) -> list[str]:
    """The text of each call (from its opening on), in order."""
    if fmt.start not in text:
        return []
    return text[text.index(fmt.start):].split(fmt.call_open)[1:]


def _pieces(arguments: list[tuple[str, object]]) -> list[str]:
    """The arguments object as JSON text, in one piece per argument (its closing brace not included)."""
    return [("{" if i == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False)
            for i, (k, v) in enumerate(arguments)]


def _new_call(index: int | None, name: str) -> dict:
    head = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
    return head if index is None else {"index": index, **head}


def parse_tool_calls(text: str, fmt: CallFormat = GLM) -> tuple[str | None, list[dict]]:
    """(content before the first call, or None if empty; OpenAI `tool_calls`) of a finished message.
    A call cut off before its close (max_tokens, a stop string) is still a call once its name is
    whole, with the arguments that are complete, as the stream sends it. No call: the whole text is
    content and the list is empty."""
    calls = []
    bodies = _bodies(text, fmt)
    for i, body in enumerate(bodies):  # a name is whole once its call closes or the next one begins
        whole = fmt.call_close in body or i < len(bodies) - 1
        body = body.split(fmt.call_close, 1)[0]
        name = fmt.name(body, whole)
        if name:
            arguments = fmt.call_arguments(name, body)
            call = _new_call(None, name)
            call["function"]["arguments"] = "".join(_pieces(arguments)) + ("}" if arguments else "{}")
            calls.append(call)
    if not calls:
        return text, []
    content = text[:text.index(fmt.start)]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """The tool calls of a growing chat message, as OpenAI `delta.tool_calls` entries: `update(text)`
    returns what is new since the last call. `max_calls`: calls after that many are not sent."""

    def __init__(self, fmt: CallFormat = GLM, max_calls: int | None = None):
        self.fmt, self.max_calls = fmt, max_calls
        self.num_calls = 0  # calls whose name has gone out (their stream index is their order)
        self._calls: list[dict] = []  # per call in the text: index or None (no name yet), name, arguments sent, closed

    def update(self, text: str, finished: bool) -> list[dict]:
        deltas: list[dict] = []
        bodies = _bodies(text, self.fmt)
        for i, body in enumerate(bodies):
            if i == len(self._calls):
                self._calls.append({"index": None, "name": None, "sent": 0, "closed": False})
            call = self._calls[i]
            if call["closed"]:
                continue
            if call["index"] is None and self.max_calls is not None and self.num_calls >= self.max_calls:
                break  # the limit counts calls that got a name, as the whole response's does
            deltas += self._advance(call, body, finished, i < len(bodies) - 1)
        return deltas

    def _advance(self, call: dict, body: str, finished: bool, next_began: bool) -> list[dict]:
        """No more text reaches this call once the message finished or another call began; its name is
        whole once it closes or another began (a name cut off by the message's end is no call)."""
        fmt = self.fmt
        closed = fmt.call_close in body
        ended = finished or next_began
        body = body.split(fmt.call_close, 1)[0]
        deltas = []
        if call["index"] is None:
            name = fmt.name(body, closed or next_began)
            if name is None:
                call["closed"] = closed or ended  # a call with no name is skipped, as parse_tool_calls does
                return []
            call["index"], call["name"] = self.num_calls, name
            self.num_calls += 1
            deltas.append(_new_call(call["index"], name))
        arguments = fmt.call_arguments(call["name"], body)
        pieces = _pieces(arguments)[call["sent"]:]
        call["sent"] = len(arguments)
        if closed or ended:
            pieces.append("}" if arguments else "{}")
            call["closed"] = True
        if pieces:
            deltas.append({"index": call["index"], "function": {"arguments": "".join(pieces)}})
        return deltas


def _is_call_array(items) -> bool:
    """Whether parsed JSON is what "required"'s schema asks for: a non-empty array of {"name", "parameters"}."""
    return isinstance(items, list) and bool(items) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item for item in items)


def forced_calls(text: str, forced: str) -> list[dict] | None:
    """The calls of a completion written under a forced tool_choice's JSON schema (protocol.py): for a
    named function the text is its arguments; for "required" an array of {"name", "parameters"}
    (None when that array is cut off, not JSON, empty or not such an array)."""
    if forced != "required":
        call = _new_call(None, forced)
        call["function"]["arguments"] = text
        return [call]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not _is_call_array(items):
        return None  # JSON, but not the array of calls the schema asks for: no call (not a 500)
    calls = []
    for item in items:
        call = _new_call(None, item["name"])
        call["function"]["arguments"] = json.dumps(item["parameters"], ensure_ascii=False)
        calls.append(call)
    return calls


class ForcedCallStream:
    """Stream deltas of a forced tool call: a named function's arguments as they are written (its id
    and name first); for "required", every call once the array is complete."""

    def __init__(self, forced: str):
        self.forced, self.started = forced, False

    def update(self, new_text: str, text: str, finished: bool) -> list[dict]:
        if self.forced != "required":
            if not self.started:  # one entry per call and delta: its id and name with the first arguments
                self.started = True
                head = _new_call(0, self.forced)
                head["function"]["arguments"] = new_text
                return [head]
            return [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
        if not finished:
            return []
        return [{"index": i, **call} for i, call in enumerate(forced_calls(text, "required") or [])]
