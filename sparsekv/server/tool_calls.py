"""Tool calls in GLM's format, parsed out of a finished chat completion.

GLM-4.5 and later (and GLM-5, `glm_moe_dsa`) write a call as::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Each value is JSON if it parses as JSON, else the raw string (vLLM's glm45 parser does the same).
The text before the first call is the message's content (None if only whitespace). Streamed, the
text stops where a call begins and the calls go out with the last chunk. DeepSeek-V3.2 writes calls
in another format, not parsed here: such a model refuses `tools` with a 400.
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
