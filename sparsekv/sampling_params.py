"""Sampling parameters, shaped like vLLM's and validated, and the error a refused request raises. No torch."""
from __future__ import annotations

from dataclasses import dataclass


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says which field is wrong and why."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128  # choices per prompt (`n`), as the server allows
MAX_TEMPERATURE = 100.0  # the largest temperature a request may ask for (the server and rollout's --temperature)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice `choice`'s seed of a request seeded `seed`: its own, away from -1 (vLLM's "random", as is
    the request's -1 itself), so a seeded request repeats whole (seed -2's second choice was -1)."""
    if seed is None or seed == -1:
        return None
    seed = seed + choice if seed >= 0 else seed - choice
    return seed - 2 ** 64 if seed > SEED_MAX else seed + 2 ** 64 if seed < SEED_MIN else seed  # in range, never -1


@dataclass
class SamplingParams:
    """Shaped like vLLM's. `seed` makes one request reproducible whatever else shares the batch.

    Penalties and biases as vLLM applies them (sampling.LogitAdjuster), on the raw logits before
    temperature: `logit_bias` {token id: added value}; `repetition_penalty` divides a positive logit
    (multiplies a negative one) of every token seen in the prompt or output; `frequency_penalty`
    subtracts penalty x count of each output token, `presence_penalty` penalty once per token present
    in the output. `min_tokens`: EOS, stop token ids and stop strings are ignored until that many
    tokens are out. `min_p` drops tokens below min_p x the top token's probability (after temperature).
    `allowed_token_ids`: only these may be sampled. `truncate_prompt_tokens` k: only the prompt's last k
    tokens are used (-1: the last max_model_len).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob + this many alternatives (vLLM's)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False  # a matched stop string (or stop token's text) ends the text instead of being cut
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's)
    # {"type": "json_object"} | {"type": "json_schema", "schema": ...} | {"type": "regex", "pattern": ...}
    # | {"type": "choice", "choices": [...]}: the output must match it (structured.py)
    structured_output: dict | None = None
    # vLLM's (V0) logits processors: each `f(output_token_ids, logits) -> logits`, on a copy of the raw
    # row, before the penalties and bias (e.g. teacher forcing: only the next given token finite)
    logits_processors: list | None = None
    # SGLang's: each generated token's routed expert ids per MoE layer (RequestOutput.routed_experts)
    return_routed_experts: bool = False
    # completions per prompt: `LLM.generate` runs one request per choice, seeded choice_seed(seed, i)
    # (last, so that an older positional call keeps its meaning)
    n: int = 1

    def __post_init__(self):
        if self.top_k == -1:  # vLLM's "off", as 0 is here
            self.top_k = 0
        if self.seed == -1:  # vLLM's "random", as None is here
            self.seed = None
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, min_tokens or a logits processor changes the logits before sampling."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.allowed_token_ids or self.logits_processors)

    def validate(self) -> None:
        def need(ok: bool, param: str, msg: str):
            if not ok:
                raise InvalidRequest(f"invalid sampling parameter {param}: {msg}", param)

        need(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        need(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
             f"must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        need(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        need(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
             f"must be a signed 64-bit integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (_is_int(value) and value >= 0), name,
                 f"must be an integer >= 0 (at most the engine's max_logprobs) or None, got {value!r}")
        need(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
             "must be a non-empty string or a list of them")
        stops = self.stop_strings
        need(all(isinstance(s, str) and s for s in stops), "stop", "must be a non-empty string or a list of them")
        need(self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple))
                                              and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)), "stop_token_ids",
             "must be a list of token ids (integers >= 0)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "return_routed_experts"):
            need(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")
        need(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and -2.0 <= value <= 2.0, name, f"must be a number in [-2, 2], got {value!r}")
        need(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"must be in (0, 2] (1 = off), got {self.repetition_penalty!r}")
        bias = self.logit_bias
        need(bias is None or (isinstance(bias, dict) and all(_is_int(t) and t >= 0 for t in bias)), "logit_bias",
             "must map token ids (integers >= 0) to numbers")
        need(bias is None or all(_is_number(v) and -100.0 <= v <= 100.0 for v in bias.values()), "logit_bias",
             "values must be numbers in [-100, 100]")
        allowed = self.allowed_token_ids
        need(allowed is None or (isinstance(allowed, list) and allowed and all(_is_int(t) and t >= 0 for t in allowed)),
             "allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        self._validate_structured_output(need)
        procs = self.logits_processors
        need(procs is None or (isinstance(procs, list) and all(callable(f) for f in procs)), "logits_processors",
             "must be a list of callables f(output_token_ids, logits) -> logits")
        k = self.truncate_prompt_tokens
        need(k is None or (_is_int(k) and (k >= 1 or k == -1)), "truncate_prompt_tokens",
             f"must be an integer >= 1, or -1 for max_model_len, got {k!r}")

    def _validate_structured_output(self, need) -> None:
        spec = self.structured_output
        if spec is None:
            return
        need(isinstance(spec, dict) and spec.get("type") in STRUCTURED_KINDS, "structured_output",
             f"must be a dict whose 'type' is one of {STRUCTURED_KINDS}, got {spec!r}")
        field, kind = {"json_schema": ("schema", (dict, str)), "regex": ("pattern", str),
                       "choice": ("choices", list)}.get(spec["type"], (None, None))
        if field is not None:
            need(isinstance(spec.get(field), kind) and bool(spec[field]), "structured_output",
                 f"{spec['type']!r} needs a non-empty {field!r}")
        if spec["type"] == "choice":
            need(all(isinstance(c, str) and c for c in spec["choices"]), "structured_output",
                 "'choice': choices must be non-empty strings")
        after = spec.get("after")  # the grammar holds only after this text (e.g. "</think>": reasoning is free)
        need(after is None or (isinstance(after, str) and bool(after)), "structured_output",
             f"'after' must be a non-empty string, got {after!r}")


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
