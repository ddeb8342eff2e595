"""Argument values of a tool call as the request's tools type them (tool_calls.py parses the calls).

GLM writes every value as text; a parameter its tool types `"string"` keeps it as written, any other
is decoded (`glm_value`, as vLLM's glm45 parser reads it). DeepSeek-V3.2's DSML marks string values
itself, and the others are decoded the same way (`decoded_value`). A decoded value is one JSON can
write exactly (`strict_json`), else the text stays.
"""
from __future__ import annotations

import ast
import json
import math


def strict_json(value):
    """`value` as the JSON it can be written as exactly (tuples become lists), or ValueError: a set,
    bytes, a complex, a non-finite float, a non-string key or an int too long to write in decimal
    (Python's digit limit) has no JSON of its own."""
    if isinstance(value, int) and not isinstance(value, bool):
        str(value)  # past the digit limit this raises ValueError here, not later in json.dumps
        return value
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: strict_json(item) for key, item in value.items()}
    raise ValueError(f"no JSON for {type(value).__name__}")


def decoded_value(text: str):
    """A non-string value as vLLM's glm45 parser reads it: JSON, else a Python literal (a model may
    write True or {'a': 1}; `ast.literal_eval` evaluates literals only, never code), else the text.
    A decoded value JSON cannot write exactly ({1, 2}, NaN) stays the text, and so does one too deep
    or too long to decode."""
    for decode in (json.loads, ast.literal_eval):
        try:
            return strict_json(decode(text))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return text


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _admits(types: frozenset, value) -> bool:
    """Whether a schema's `types` admit a decoded value (an integer is a number too)."""
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def glm_value(raw: str, types: frozenset):
    """One argument's value for a parameter the schema types `types` (empty: untyped)."""
    if "string" not in types:
        return decoded_value(raw.strip())
    if types == {"string"}:
        return raw  # as written: a string's spaces are its own (vLLM keeps them too)
    value = decoded_value(raw.strip())
    return value if not isinstance(value, str) and _admits(types, value) else raw


def schema_types(schema) -> frozenset:
    """The JSON types a parameter's schema admits: its `type` (a name or a list of them), or the types
    of its anyOf/oneOf members; empty when any of these names none (an untyped schema admits anything)."""
    if not isinstance(schema, dict):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset([declared])
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    members = [m for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for m in schema[key]]
    member_types = [schema_types(m) for m in members]
    if not member_types or not all(member_types):
        return frozenset()
    return frozenset().union(*member_types)


def parameter_types(tools: list[dict] | None) -> dict[str, dict[str, frozenset]]:
    """Function name -> parameter -> the JSON types its schema admits (`schema_types`)."""
    out = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(properties, dict):
            out[function.get("name")] = {arg: schema_types(schema) for arg, schema in properties.items()}
    return out
