"""Structured outputs: JSON (any object, or a JSON schema), a regular expression, or one of a list of
choices, enforced token by token with xgrammar (the grammar engine vLLM and SGLang use).

A request's `SamplingParams.structured_output` is one of::

    {"type": "json_object"}                   any JSON object
    {"type": "json_schema", "schema": {...}}  a JSON schema (dict or JSON text)
    {"type": "regex", "pattern": "..."}
    {"type": "choice", "choices": ["a", ...]}

Any of them may add `"after": TEXT`: the grammar then holds only once the output has written TEXT
(vLLM's structured outputs after the reasoning: `"after": "</think>"` lets a model think freely, then
answer in JSON); the rest of the token that completes TEXT is fed to the grammar.

Before each sampled row the request's grammar masks every token that cannot continue a match (and
EOS until the match is complete); the emitted token then advances it. Speculative verification rows
are masked after the tokens before them, so drafting stays exact. Grammars compile once per engine
and spec while they are among the MAX_COMPILED_GRAMMARS used last (the specs are the clients': a
cache of every one ever seen would grow for the server's life); whitespace in JSON is compact (a model
cannot pad it forever).
"""
from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from typing import Callable

import torch

from .request import InvalidRequest

log = logging.getLogger("sparsekv.structured")
MAX_COMPILED_GRAMMARS = 128  # compiled grammars kept per engine, the least recently used dropped first


def spec_key(spec: dict) -> str:
    """What a compiled grammar depends on (not `after`, which only delays it)."""
    return json.dumps({k: v for k, v in spec.items() if k != "after"}, sort_keys=True)


class GrammarCompiler:
    """One engine's xgrammar tokenizer info and compiled grammars (imported on first use)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr
        self.xgr, self.vocab_size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info)
        # NOTE: bounded: each client's spec is a key. A request's GrammarState holds its own compiled grammar,
        # so one dropped here while a request uses it stays alive for that request
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def compile(self, spec: dict):
        key = spec_key(spec)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            log.info("structured output %r does not compile: %s", spec.get("type"), e)
            raise InvalidRequest(f"structured output {spec.get('type')!r} does not compile{_reason(e)}",
                                 "structured_output") from None
        self._compiled[key] = compiled
        while len(self._compiled) > MAX_COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: dict):
        kind = spec["type"]
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "json_schema":
            schema = spec["schema"] if isinstance(spec["schema"], str) else json.dumps(spec["schema"])
            return self.compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec["pattern"])
        return self.compiler.compile_regex("|".join(re.escape(c) for c in spec["choices"]))


# xgrammar prefixes its messages with a time and its C++ source file: "[12:00:00] /src/x.cc:94: reason",
# and an assertion's condition: "Check failed: (error.empty()) is false: reason"
_XGRAMMAR_PREFIX = re.compile(r"^(?:\[[\d:]+\] \S+:\d+: )?(?:Check failed: \(.*?\) is false: )?")
_SOURCE_PATH = re.compile(r"\S+\.(?:cc|cpp|h|hpp|py):\d+|Traceback|Stack trace")


def _reason(e: Exception) -> str:
    """The client's part of a compiler error: its first line without xgrammar's time and source file,
    or nothing when what is left still names internals (the whole message goes to the log)."""
    lines = str(e).strip().splitlines()
    reason = _XGRAMMAR_PREFIX.sub("", lines[0]).strip() if lines else ""
    return f": {reason}" if reason and not _SOURCE_PATH.search(reason) else ""


class GrammarState:
    """One request's position in its grammar. `after` (with `token_text`, a token id's text): the
    grammar waits until the output has written that text."""

    def __init__(self, compiler: GrammarCompiler, compiled, after: str | None = None,
                 token_text: Callable[[int], str] | None = None):
        xgr = compiler.xgr
        self.xgr, self.matcher = xgr, xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self.waiting_for, self.token_text, self._tail = after, token_text, ""
        self.dead_end: str | None = None  # why no output can match the grammar any more (the request ends)

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits with every token the grammar forbids next at -inf."""
        if not self.active:
            return logits
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone().unsqueeze(0)
        self.xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.active:
            self._wait(token)
        elif not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was emitted against the request's grammar")

    def _wait(self, token: int) -> None:
        """Watch the output for the text the grammar waits for; what follows it in the same token
        (whitespace aside) is the grammar's first input."""
        marker = self.waiting_for
        self._tail += self.token_text(token)
        at = self._tail.find(marker)
        if at < 0:  # keep what could be the start of the marker, split over tokens
            self._tail = self._tail[-(len(marker) - 1):] if len(marker) > 1 else ""
            return
        rest, self.waiting_for = self._tail[at + len(marker):].lstrip(), None
        if rest and not self.matcher.accept_string(rest):  # the model's text, not a fault of the engine's
            self.dead_end = f"{rest!r}, written with {marker!r}, does not start the request's grammar"

    @property
    def finished(self) -> bool:
        return self.active and self.matcher.is_terminated()
