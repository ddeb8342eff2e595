"""Request bodies of the OpenAI-compatible API, as pydantic models.

Strict types: a string where a number belongs is a 400, not a silent coercion. Fields that would
change a request's meaning and are not implemented (`UNSUPPORTED`) are refused unless at their
do-nothing value; other unknown fields are ignored (clients send fields like `service_tier`). Range
checks that the engine's `SamplingParams` already does (max_tokens >= 1, temperature, top_p,
logprobs, penalties) stay there so the rules live in one place; this module checks only what is
HTTP-specific.
"""
from __future__ import annotations

import json
import re
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..input_processor import TEMPLATE_RESERVED
from ..sampling_params import MAX_N
from .errors import bad_request

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_JSON_DEPTH = 64  # a request body's nesting; JSON schemas and tool parameters stay far below it
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SCALARS = {int, float, bool, type(None)}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with include_usage)


def _off(value) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# Fields of OpenAI's API or vLLM's that change what a request means and that sparsekv does not
# implement: accepted at their do-nothing value, refused with a 400 otherwise, so that no request
# silently gets an answer to a question it did not ask (e.g. free text where JSON was required).
UNSUPPORTED = {
    "tools": _off, "functions": _off, "tool_choice": lambda v: _off(v) or v == "none",
    "function_call": lambda v: _off(v) or v == "none", "suffix": _off, "best_of": lambda v: _off(v) or v == 1,
    "use_beam_search": _off, "structured_outputs": _off, "guided_grammar": _off, "bad_words": _off,
    "prompt_logprobs": _off, "chat_template": _off,  # a template from the request: not rendered here (the model's is)
    "return_tokens_as_token_ids": _off, "echo": _off,  # chat's echo (completions implement theirs)
    # the tokenizer's own spacing is kept (vLLM's fast tokenizers ignore the field too)
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    "add_special_tokens": lambda v: v is None or v is False,  # chat: the template writes them
    "documents": _off, "priority": lambda v: v is None or v == 0, "detokenize": lambda v: v is None or v is True,
    "truncation_side": lambda v: v is None or v == "left", "length_penalty": lambda v: v is None or v == 1,
    "logits_processors": _off, "logprob_token_ids": _off, "prompt_embeds": _off, "guided_whitespace_pattern": _off,
    "vllm_xargs": _off, "kv_transfer_params": _off, "ec_transfer_params": _off, "repetition_detection": _off,
    "thinking_token_budget": _off,
}


# Fields OpenAI's API types as nullable that have a non-null default here: null means that default
# (clients that send every field send null for those they leave unset).
NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs", "parallel_tool_calls", "ignore_eos", "include_reasoning",
                   "return_routed_experts")


class Disaggregation(_Body):
    """The router's `disaggregation` field (docs/disaggregation.md): the request's room and the
    prefill worker's bootstrap address, the same on the prefill and the decode worker."""

    room: str
    bootstrap_host: str
    bootstrap_port: int

    @model_validator(mode="after")
    def _check(self):
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", self.room):
            raise ValueError("disaggregation.room: 1 to 128 characters of A-Z a-z 0-9 . _ : -")
        if not self.bootstrap_host:
            raise ValueError("disaggregation.bootstrap_host: must be a non-empty host name or address")
        if not 1 <= self.bootstrap_port <= 65535:
            raise ValueError(f"disaggregation.bootstrap_port: must be in [1, 65535], got {self.bootstrap_port}")
        return self


REQUEST_ID = re.compile(r"[!-~]{1,256}")  # printable ASCII, no space: it reaches logs and responses as given


def check_request_id(value: str | None, name: str) -> None:
    if value is not None and not REQUEST_ID.fullmatch(value):
        raise ValueError(f"{name}: a request id is 1 to 256 printable ASCII characters without spaces")


class SamplingFields(_Body):
    """Fields shared by completions and chat; `sampling_params()` in app.py maps them to the engine."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Structured outputs (sparsekv/structured.py): OpenAI's response_format, or vLLM's guided_* fields
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    cache_salt: str | None = None
    return_routed_experts: bool = False  # SGLang's: each token's routed experts in the response's "sparsekv"
    disaggregation: Disaggregation | None = None  # set by `sparsekv router` for prefill/decode workers
    # the client's id for the request (SGLang's `rid`, vLLM's `request_id`): the response's `id`, and
    # what /abort_request names; unique among its tenant's requests in flight
    rid: str | None = None
    request_id: str | None = None

    SUPPORTED_HERE: ClassVar[tuple[str, ...]] = ()  # UNSUPPORTED fields a subclass implements

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
            for name, harmless in UNSUPPORTED.items():
                if name in data and name not in cls.SUPPORTED_HERE and not harmless(data[name]):
                    raise ValueError(f"{name}: not supported by this server (only its default is accepted)")
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed: must fit in a signed 64-bit integer, got {self.seed}")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt: must be a non-empty string if given")
        given = [f for f in ("guided_json", "guided_regex", "guided_choice") if getattr(self, f) is not None]
        if len(given) + (self.response_format_spec() is not None) > 1:
            raise ValueError("response_format: give one of response_format (json), guided_json, guided_regex, "
                             "guided_choice")
        k = self.truncate_prompt_tokens  # checked here too: the server truncates before the engine sees the prompt
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens: must be an integer >= 1, or -1 for max_model_len, got {k}")
        if self.logit_bias is not None and not all(key.isascii() and key.isdigit() for key in self.logit_bias):
            raise ValueError("logit_bias: keys must be token ids (decimal integers as strings)")
        for name in ("rid", "request_id"):
            check_request_id(getattr(self, name), name)
        if None not in (self.rid, self.request_id) and self.rid != self.request_id:
            raise ValueError("rid: rid and request_id name the same thing; give one, or the same id in both")
        return self

    def client_request_id(self) -> str | None:
        return self.rid if self.rid is not None else self.request_id

    def response_format_spec(self) -> dict | None:
        """The engine's `structured_output` from response_format (None for text)."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return {"type": "json_object"}
        if rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
            return {"type": "json_schema", "schema": rf["json_schema"].get("schema")}
        raise ValueError("response_format: type must be 'text', 'json_object' or 'json_schema' (with "
                         "json_schema.schema)")

    def structured_output_param(self) -> str:
        """The field the client gave the structured output in (what a 400 about it names)."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        return given[0] if given else "response_format"

    def client_params(self) -> dict[str, str]:
        """The client's field for each engine parameter named otherwise here (what a 400 names)."""
        return {"structured_output": self.structured_output_param()}

    def engine_structured_output(self) -> dict | None:
        if self.guided_json is not None:
            return {"type": "json_schema", "schema": self.guided_json}
        if self.guided_regex is not None:
            return {"type": "regex", "pattern": self.guided_regex}
        if self.guided_choice is not None:
            return {"type": "choice", "choices": self.guided_choice}
        return self.response_format_spec()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    SUPPORTED_HERE: ClassVar[tuple[str, ...]] = ("echo", "add_special_tokens")

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS and the like

    def client_params(self) -> dict[str, str]:
        return {**super().client_params(), "prompt_logprobs": "logprobs"}  # echo's prompt logprobs

    @model_validator(mode="after")
    def _check_prompt(self):
        if self.echo and self.stream:
            raise ValueError("echo: echo=true is not supported with stream=true")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a token-id list (a batch is a list of either)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, passed to the chat template
    tool_call_id: str | None = None       # a "tool" message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's and DeepSeek's field)
    reasoning: str | None = None          # the same, by vLLM's newer name

    @model_validator(mode="after")
    def _check_role(self):
        if self.role not in CHAT_ROLES:  # a template may render any role it is given, unchecked
            raise ValueError(f"messages: role must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")
        return self

    def template_dict(self) -> dict:
        out = {"role": self.role, "content": self.text() or ""}
        if self.tool_calls:  # templates read arguments as a mapping; OpenAI sends them as JSON text
            out["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # GLM's and DeepSeek-V3.2's templates read it by this name
            out["reasoning_content"] = reasoning
        return out

    def text(self) -> str | None:
        """The message content as one string; only text parts are supported."""
        if not isinstance(self.content, list):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ValueError("messages: only text content parts are supported")
        return "".join(part.text for part in self.content)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


# apply_chat_template's own parameters: chat_template_kwargs may not set them



class _ChatTemplateFields(_Body):
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last (assistant) message, to continue it
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the template, e.g. {"thinking": true}

    @model_validator(mode="after")
    def _check_template_kwargs(self):
        taken = sorted(TEMPLATE_RESERVED & set(self.chat_template_kwargs or {}))
        if taken:
            raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here (a request field or "
                             "the server decides it)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true together with add_generation_prompt (continuing "
                             "the last message needs add_generation_prompt false)")
        return self

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments besides the messages and tools."""
        return {**(self.chat_template_kwargs or {}), "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(_ChatTemplateFields, SamplingFields):
    SUPPORTED_HERE: ClassVar[tuple[str, ...]] = ("tools", "tool_choice")

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "auto", "none", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # OpenAI's: False keeps at most one call
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, False drops reasoning_content

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: accepted alone, as vLLM accepts it
            raise ValueError("top_logprobs: requires logprobs=true")
        if self.top_logprobs is not None and self.top_logprobs < 0:  # the bound is the engine's max_logprobs
            raise ValueError(f"top_logprobs: must be an integer >= 0 (at most the server's --max-logprobs), "
                             f"got {self.top_logprobs}")
        if self.tools and not all(t.get("type") == "function" and isinstance(t.get("function"), dict)
                                  and t["function"].get("name") for t in self.tools):
            raise ValueError("tools: each must be {'type': 'function', 'function': {'name': ..., ...}}")
        self._check_tool_functions()
        self._check_tool_choice()
        return self

    def _check_tool_functions(self) -> None:
        """OpenAI's rules for a function: a name of 1-64 letters, digits, '_' or '-', unique among the
        tools (a named tool_choice must find one), and parameters, if given, a JSON Schema object."""
        seen = set()
        for i, tool in enumerate(self.tools or []):
            function = tool["function"]
            name = function["name"]
            if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
                raise ValueError(f"tools[{i}].function.name: 1 to 64 letters, digits, '_' or '-', got {name!r}")
            if name in seen:
                raise ValueError(f"tools[{i}].function.name: {name!r} names two tools")
            seen.add(name)
            if "parameters" in function and not isinstance(function["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters: must be a JSON Schema object")

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise ValueError("tool_choice: a named choice is {'type': 'function', 'function': {'name': ...}}")
            if name not in self._tool_functions():
                raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        elif choice not in (None, "auto", "none", "required"):
            raise ValueError("tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")
        elif choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.forced_tool is not None and super().engine_structured_output() is not None:
            raise ValueError("tool_choice: a forced tool call is already a structured output; drop response_format "
                             "and guided_*")

    def _tool_functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools or []}

    def tools_in_prompt(self, exclude_when_none: bool = False) -> bool:
        """Whether the chat template sees the tools. With tool_choice "none" it still does, as in vLLM:
        the model knows the tools it may not call (OpenAI's "none" means no call, not no tools).
        `exclude_when_none`: the server's --exclude-tools-when-tool-choice-none, vLLM's flag to leave
        them out then."""
        return bool(self.tools) and not (exclude_when_none and self.tool_choice == "none")

    @property
    def parse_tool_calls(self) -> bool:
        """Whether the model's output is parsed for calls in its own format; under "none" it is all
        content, whatever the model writes."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The named function a tool_choice forces, "required" (any of the tools, at least one call), or None."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return "required" if self.tool_choice == "required" else None

    def structured_output_param(self) -> str:
        return "tools" if self.forced_tool is not None else super().structured_output_param()

    def client_params(self) -> dict[str, str]:
        return {**super().client_params(), "logprobs": "top_logprobs"}

    def engine_structured_output(self) -> dict | None:
        """A forced tool call is written as JSON under a schema, as vLLM does: the named function's
        arguments, or for "required" a non-empty array of {"name", "parameters"} objects of the tools."""
        forced = self.forced_tool
        if forced is None:
            return super().engine_structured_output()
        functions = self._tool_functions()
        if forced != "required":
            return {"type": "json_schema", "schema": _parameters(functions[forced])}
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"]} for name, f in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return {"type": "json_schema", "schema": array if self.parallel_tool_calls else {**array, "maxItems": 1}}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's `logprobs` (alternatives per token), or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None  # rendered into the chat prompt, as /v1/chat/completions does
    add_special_tokens: bool | None = None  # vLLM's default: a prompt as /v1/completions tokenizes it, messages without

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[BaseModel]):
    """JSON bytes -> a validated model, or a 400 that names the offending field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # nesting past the interpreter's recursion limit
        raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    _check_shape(raw, data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _check_shape(raw: bytes, data: dict) -> None:
    """Nesting no deeper than MAX_JSON_DEPTH (validators, templates and grammar compilers recurse), and
    no lone UTF-16 surrogate in any string (JSON can escape one, "\\ud800"; it is not Unicode text, and
    the tokenizer would fail on it with its own internals in the message). The raw bytes tell cheaply
    whether either can be present; only then is the parsed body walked."""
    nesting = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _ESCAPED_SURROGATE.search(raw) is not None
    if not (nesting or surrogates):
        return
    stack = [(value, 1, key) for key, value in data.items()]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, (dict, list)) and depth > MAX_JSON_DEPTH:  # the field's depth-th container
            raise bad_request(f"invalid parameter {field}: nested deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, str):
            if surrogates and _LONE_SURROGATE.search(value):
                raise bad_request(f"invalid parameter {field}: a string holds a lone UTF-16 surrogate, which is not "
                                  "valid Unicode text", field)
        elif isinstance(value, dict):
            stack.extend((v, depth + 1, field) for v in value.values())
            stack.extend((k, depth + 1, field) for k in value)
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # skip token-id lists fast
            stack.extend((v, depth + 1, field) for v in value)


def _validation_error(e: ValidationError):
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "value_error":  # our own checks say "field: message"
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        param, _, text = msg.partition(": ")
        return bad_request(f"invalid parameter {param}: {text}", param)
    param = loc[0] if loc else None
    where = ".".join(x for x in loc if not x.startswith(("str", "list[", "int", "bool", "float")))
    got = repr(err.get("input"))[:80]
    return bad_request(f"invalid parameter {where or param}: {err['msg']} (got {got})", param)


class AbortRequest(_Body):
    """SGLang's POST /abort_request: one request by its id (`rid`: the response's `id`, or the id the
    request gave), or with `abort_all` every request of the caller's tenant."""

    rid: str | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one(self):
        check_request_id(self.rid, "rid")
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("rid: give a request's id in rid, or abort_all: true (not both)")
        return self
