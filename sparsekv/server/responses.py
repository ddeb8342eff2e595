"""Response and stream-chunk bodies for completions and chat, built from engine outputs.

One `ChoiceState` follows one engine request. While streaming it holds back text that could still be
cut: a suffix that starts a stop string (the engine cuts the stop string only once it is complete)
and a trailing U+FFFD (half of a multi-byte character). Without that a client could receive text
that the final response no longer contains.

The `sparsekv` extension field carries the request's tier figures (device/host bytes, hits, misses,
bytes moved: whatever the engine reports in `RequestOutput.metrics`). A `*_bytes` figure keeps the
largest value seen over the request's outputs (the engine may report 0 once the pages are released,
so the peak is what the request held; for cumulative h2d/d2h bytes the peak is the total); every
other figure is the latest reported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..request import RequestOutput
from .reasoning import marker_start, split_reasoning, undecided_chars
from .tool_calls import CallFormat, ForcedCallStream, ToolCallStream, forced_calls, parse_tool_calls


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class TokenText:
    """Token id -> text for logprobs; `token_id:N` when the checkpoint has no tokenizer (vLLM's form)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def text(self, token_ids: list[int]) -> str:
        """A token-id prompt as text (for echo)."""
        if self.tokenizer is None:
            return "".join(self(t) for t in token_ids)
        return self.tokenizer.decode(token_ids)


@dataclass
class Echo:
    """Completions with echo=true: each prompt's text before its completion, and with logprobs the
    prompt tokens' logprobs (the first token's null) before the generated ones. `prompt_only`
    (max_tokens 0): the one token generated for it is dropped, as vLLM does."""

    prompts: list[str]
    prompt_only: bool


@dataclass(frozen=True)
class Reasoning:
    """Chat with a reasoning parser: whether the prompt left the model inside a think block, and
    whether the reasoning goes out (`include_reasoning`; the content excludes it either way)."""

    opened: bool
    include: bool = True


class ChoiceState:
    """`tool_format` (chat with tools): streamed text stops where tool calls begin; the calls go out
    as they are written (`tool_stream`). `reasoning`: the think block streams as `reasoning_content`."""

    def __init__(self, index: int, stop_strings: list[str], tool_format: CallFormat | None = None,
                 reasoning: Reasoning | None = None, forced: str | None = None, max_calls: int | None = None):
        self.index, self.stop_strings, self.reasoning = index, stop_strings, reasoning
        self.hold_marker = tool_format.start if tool_format is not None else None
        self.tool_stream = ToolCallStream(tool_format, max_calls) if tool_format is not None else None
        self.forced_stream = ForcedCallStream(forced) if forced is not None else None
        self.out: RequestOutput | None = None
        self.settled_text = ""  # the text minus what a stop string could still cut (take_delta's)
        self.sent_text = 0  # characters of the content already sent
        self.sent_reasoning = 0  # characters of the reasoning already sent
        self.sent_tokens = 0
        self.text_offset = 0
        self.peak: dict = {}
        self.first_output_at: float | None = None  # monotonic

    @property
    def finished(self) -> bool:
        return self.out is not None and self.out.finished

    def update(self, out: RequestOutput) -> None:
        self.out = out
        if self.first_output_at is None:
            self.first_output_at = time.monotonic()
        for key, value in (out.metrics or {}).items():
            if key.endswith("_bytes") and _is_number(value):  # bytes held: the peak, not the 0 after release
                self.peak[key] = max(self.peak.get(key, value), value)
            else:  # counters, rates, token counts: the latest
                self.peak[key] = value

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of the choice's text; no reasoning parser: (None, text)."""
        return split_reasoning(text, self.reasoning.opened) if self.reasoning is not None else (None, text)

    def take_delta(self) -> tuple[str, str, list[int], list[dict] | None]:
        """Reasoning, content and tokens not yet streamed (text minus what a stop string could still
        cut, and minus what cannot be placed yet as reasoning or content)."""
        out = self.out
        text = out.text
        if not out.finished:
            text = text[:len(text) - _holdback(text, self.stop_strings)]
            if self.reasoning is not None:
                text = text[:len(text) - undecided_chars(text, self.reasoning.opened)]
        self.settled_text = text
        reasoning, content = self.split(text)
        if self.hold_marker is not None and self.hold_marker in content and \
                (not out.finished or parse_tool_calls(content, self.tool_stream.fmt)[1]):
            content = content[:content.index(self.hold_marker)]  # finished without a call: all of it is text
        elif self.hold_marker is not None and not out.finished:
            content = content[:len(content) - _holdback(content, [self.hold_marker])]
        reasoning_delta = (reasoning or "")[self.sent_reasoning:]
        self.sent_reasoning += len(reasoning_delta)
        delta = content[self.sent_text:] if len(content) > self.sent_text else ""
        self.sent_text += len(delta)
        tokens = out.token_ids[self.sent_tokens:]
        lps = out.logprobs[self.sent_tokens:] if out.logprobs is not None else None
        self.sent_tokens = len(out.token_ids)
        return reasoning_delta, delta, tokens, lps


def weights_fields(out) -> dict:
    """For RL trainers (docs/rl.md): the weights version that computed the choice, and with
    return_routed_experts its tokens' routed experts ([token][MoE layer][top-k], SGLang's field name)."""
    fields = {"weights_version": out.metrics.get("weights_version")}
    if out.routed_experts is not None:
        fields["routed_experts"] = out.routed_experts
    return fields


def _holdback(text: str, markers: list[str]) -> int:
    """Trailing characters to hold: a half multi-byte character, or the start of a marker."""
    return max([len(text) - len(text.rstrip("\ufffd"))] + [marker_start(text, m) for m in markers])


class ResponseBuilder:
    """Bodies for one HTTP request: `kind` is "completion" or "chat"; choice i answers prompt i // n."""

    def __init__(self, kind: str, response_id: str, model: str, created: int, n: int, token_text: TokenText,
                 tenant: str, top_logprobs: int | None = None, echo: Echo | None = None,
                 tools: CallFormat | None = None, reasoning: Reasoning | None = None, forced: str | None = None):
        self.kind, self.id, self.model, self.created, self.n = kind, response_id, model, created, n
        self.token_text, self.tenant, self.top_logprobs, self.echo = token_text, tenant, top_logprobs, echo
        self.tools = tools  # chat with tools: the model's call format, parsed out of the message
        self.reasoning = reasoning  # chat with a reasoning parser: the think block split out
        self.forced = forced  # a tool_choice forcing a call: the function's name, or "required"
        self.max_calls: int | None = None  # parallel_tool_calls=false: 1
        self.continuous_usage = False  # stream_options.continuous_usage_stats: usage so far in every chunk
        self.disaggregation = None  # a decode worker's: states -> the request's transfer figures

    def choice_state(self, index: int, stop_strings: list[str]) -> ChoiceState:
        return ChoiceState(index, stop_strings, self.tools, self.reasoning, self.forced, self.max_calls)

    # -- whole responses -----------------------------------------------------------------------
    def response(self, states: list[ChoiceState]) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice(s) for s in states], "usage": self.usage(states),
                "sparsekv": self.extension(states)}

    def _choice(self, s: ChoiceState) -> dict:
        out = s.out
        tokens, entries, text = self._generated(out)
        if self.echo is not None:
            text = self.echo.prompts[s.index // self.n] + text
            if entries is not None:
                tokens, entries = out.prompt_token_ids + tokens, out.prompt_logprobs + entries
        lps = self.logprobs(tokens, entries, 0) if entries is not None else None
        if self.kind == "completion":
            return {"index": s.index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason}
        reasoning, text = s.split(text)
        message, finish = {"role": "assistant", "content": text}, out.finish_reason
        calls = forced_calls(text, self.forced) if self.forced is not None else None
        if calls is not None:  # OpenAI: a named choice finishes "stop", a required one "tool_calls"
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls" if self.forced == "required" and finish == "stop" else finish
        if self.tools:
            content, calls = parse_tool_calls(text, self.tools)
            if calls:  # "tool_calls" when the model ended there; "length" still says a call was cut off
                message = {"role": "assistant", "content": content, "tool_calls": calls[:self.max_calls]}
                finish = "tool_calls" if finish == "stop" else finish
        if self.reasoning is not None:
            if reasoning is not None and not message["content"]:  # all thought, no answer (yet)
                message["content"] = None
            if self.reasoning.include:
                message["reasoning_content"] = reasoning
        return {"index": s.index, "message": message, "logprobs": lps, "finish_reason": finish,
                "stop_reason": out.stop_reason}

    def _generated(self, out: RequestOutput) -> tuple[list[int], list[dict] | None, str]:
        """The choice's generated tokens, their logprob entries and text (none when echoing a prompt only)."""
        if self.echo is not None and self.echo.prompt_only:
            return [], [] if out.logprobs is not None else None, ""
        return list(out.token_ids), out.logprobs, out.text

    def usage(self, states: list[ChoiceState]) -> dict:
        firsts = [s for s in states if s.index % self.n == 0]  # one choice per prompt: count each prompt once
        prompt = sum(len(s.out.prompt_token_ids) for s in firsts)
        completion = sum(len(self._generated(s.out)[0]) for s in states)
        cached = sum(s.out.num_cached_tokens for s in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def extension(self, states: list[ChoiceState]) -> dict:
        total: dict = {}  # integer figures (bytes, hits, tokens) add up over choices; rates do not, nor
        for s in states:  # weights_version, a name (each choice's is in its own entry, weights_fields)
            for key, value in s.peak.items():
                if isinstance(value, int) and not isinstance(value, bool) and key != "weights_version":
                    total[key] = total.get(key, 0) + value
        ext = {"tenant": self.tenant, "tiers": total,
               "choices": [{"index": s.index, "token_ids": self._generated(s.out)[0], "tiers": dict(s.peak),
                            **weights_fields(s.out)} for s in states]}
        if self.disaggregation is not None:
            ext["disaggregation"] = self.disaggregation(first_outputs(states))
        return ext

    # -- stream chunks -------------------------------------------------------------------------
    def chunk(self, s: ChoiceState, first: bool, include_usage: bool) -> dict:
        reasoning, text, tokens, lps = s.take_delta()
        logprobs = self.logprobs(tokens, lps, s.text_offset) if lps is not None else None
        s.text_offset += sum(len(self.token_text(t)) for t in tokens)  # NOTE: not len(text), which a stop string may hold back
        finish = s.out.finish_reason
        if self.kind == "completion":
            choice = {"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": s.out.stop_reason if finish is not None else None}
        else:
            delta = {"role": "assistant"} if first else {}
            if reasoning and self.reasoning.include:
                delta["reasoning_content"] = reasoning
            if text or "reasoning_content" not in delta:
                delta["content"] = text
            if s.forced_stream is not None and self._forced_delta(s, delta, text, finish):
                finish = "tool_calls" if self.forced == "required" and finish == "stop" else finish
            if self.tools and s.tool_stream is not None:
                # NOTE: not out.text, where a stop string not yet complete may span an argument's close
                # tag: that argument may still be cut, and streamed arguments cannot be taken back
                calls = s.tool_stream.update(s.split(s.settled_text)[1], finish is not None)
                if calls:
                    delta["tool_calls"] = calls
                    delta["content"] = text or None
                if finish == "stop" and s.tool_stream.num_calls:
                    finish = "tool_calls"
            choice = {"index": s.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": s.out.stop_reason if finish is not None else None}
        body = self._chunk_head([choice], include_usage)
        if self.continuous_usage:
            prompt, done = len(s.out.prompt_token_ids), len(self._generated(s.out)[0])
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if finish is not None:
            body["sparsekv"] = {"tenant": self.tenant, "tiers": dict(s.peak), "index": s.index, **weights_fields(s.out)}
            if self.disaggregation is not None:
                body["sparsekv"]["disaggregation"] = self.disaggregation(first_outputs([s]))
        return body

    @staticmethod
    def _forced_delta(s: ChoiceState, delta: dict, text: str, finish: str | None) -> bool:
        """A forced call's stream: the text goes out as the call's arguments (or, for "required", as the
        calls once complete; as content if the array never became valid JSON). Whether calls went out."""
        content = s.split(s.out.text)[1]  # after the reasoning, if any
        calls = s.forced_stream.update(text, content, finish is not None)
        delta["content"] = None
        if calls:
            delta["tool_calls"] = calls
        elif s.forced_stream.forced == "required" and finish is not None:
            delta["content"] = content
        return bool(calls)

    def usage_chunk(self, states: list[ChoiceState]) -> dict:
        body = self._chunk_head([], False)
        body["usage"] = self.usage(states)
        body["sparsekv"] = self.extension(states)
        return body

    def _chunk_head(self, choices: list, include_usage: bool) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return body

    # -- logprobs ------------------------------------------------------------------------------
    def logprobs(self, token_ids: list[int], entries: list[dict], offset: int) -> dict:
        if self.kind == "completion":
            return self._completion_logprobs(token_ids, entries, offset)
        return {"content": [self._chat_logprob(t, e) for t, e in zip(token_ids, entries)]}

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict], offset: int) -> dict:
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [None if e is None else {self.token_text(k): v for k, v in e.items()} for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, token_id: int, entry: dict) -> dict:
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top_logprobs or 0]
        return {**self._chat_token(token_id, entry[token_id]),
                "top_logprobs": [self._chat_token(k, v) for k, v in top]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def first_outputs(states) -> list[float]:
    """When each choice's first output came (monotonic), of those that have one."""
    return [s.first_output_at for s in states if s.first_output_at is not None]
