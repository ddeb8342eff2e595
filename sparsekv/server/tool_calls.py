"""Tool calls in GLM's format, parsed out of a finished chat completion.

GLM-4.5 and later (and GLM-5, `glm_moe_dsa`) write a call as::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Each value is JSON if it parses as JSON, else the raw string (vLLM's glm45 parser does the same).
The text before the first call is the message's content (None if only whitespace). Streamed
(`ToolCallStream`), the text stops where a call begins, and each call goes out as OpenAI streams
one: its id and name once the name is written, then its arguments JSON in pieces, one per complete
key/value pair, closed at `</tool_call>`. The pieces of a call join to the `arguments` the unstreamed
response gives. DeepSeek-V3.2 writes calls in another format, not parsed here: such a model refuses
`tools` with a 400.
"""
from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_START = "<tool_call>"
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
MODEL_TYPES = ("glm_moe_dsa",)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call, or None if empty; OpenAI `tool_calls`). No complete call:
    the whole text is content and the list is empty."""
    calls = []
    for match in CALL.finditer(text):
        body = match.group(1)
        name = body.split("<arg_key>", 1)[0].strip()
        if not name:
            continue
        args = {key.strip(): _value(value) for key, value in ARG.findall(body)}
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = text[:text.index(TOOL_CALL_START)]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """The tool calls of a growing chat message, as OpenAI `delta.tool_calls` entries: `update(text)`
    returns what is new since the last call."""

    def __init__(self):
        self.num_calls = 0  # calls whose name has gone out (their stream index is their order)
        self._segments: list[dict] = []  # per <tool_call> in the text: index or None (no name), pairs sent, closed

    def update(self, text: str, finished: bool) -> list[dict]:
        deltas: list[dict] = []
        bodies = text.split(TOOL_CALL_START)[1:]
        for i, body in enumerate(bodies):
            if i == len(self._segments):
                self._segments.append({"index": None, "pairs": 0, "closed": False})
            seg = self._segments[i]
            if not seg["closed"]:
                deltas += self._advance(seg, body, finished or i < len(bodies) - 1)
        return deltas

    def _advance(self, seg: dict, body: str, ended: bool) -> list[dict]:
        """`ended`: no more text will reach this call (the message finished or another call began)."""
        closed = "</tool_call>" in body
        body = body.split("</tool_call>", 1)[0]
        deltas = []
        if seg["index"] is None:
            name = _complete_name(body, closed or ended)
            if name is None:
                seg["closed"] = closed or ended  # a call with no name is skipped, as parse_tool_calls does
                return []
            seg["index"] = self.num_calls
            self.num_calls += 1
            deltas.append({"index": seg["index"], "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": ""}})
        pairs = ARG.findall(body)
        pieces = [("{" if n == 0 else ", ") + json.dumps(key.strip(), ensure_ascii=False) + ": " +
                  json.dumps(_value(value), ensure_ascii=False) for n, (key, value) in enumerate(pairs)][seg["pairs"]:]
        seg["pairs"] = len(pairs)
        if closed or ended:
            pieces.append("}" if pairs else "{}")
            seg["closed"] = True
        if pieces:
            deltas.append({"index": seg["index"], "function": {"arguments": "".join(pieces)}})
        return deltas


def _complete_name(body: str, ended: bool) -> str | None:
    """The call's function name once it is whole (an argument follows, or the call ended); None while
    it may still grow, or if it is empty. The same name parse_tool_calls reads."""
    head, has_args = body.split("<arg_key>", 1)[0], "<arg_key>" in body
    return head.strip() or None if has_args or ended else None
