"""Sampling as small pure functions: greedy, temperature, top-k, top-p, min-p, per-request generators,
logprobs; and `LogitAdjuster`, a request's penalties, logit bias and min_tokens.

Logprobs are those of the model's raw distribution (log_softmax of the logits, before penalties,
temperature or truncation), as vLLM reports them by default.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


class LogitAdjuster:
    """One request's allowed tokens, logit bias, min_tokens and repetition / frequency / presence
    penalties, applied to a row of raw fp32 logits in vLLM's order (allowed tokens and bias, min_tokens,
    then the penalties). Output token counts grow with `note(token)`; the prompt's tokens are marked
    once (a long prompt is not rescanned every step)."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 stop_token_ids: set[int]):
        self.params, self.stop_ids = params, sorted(stop_token_ids)
        self.bias = None
        if params.logit_bias or params.allowed_token_ids:
            self.bias = torch.zeros(vocab_size)
        if params.allowed_token_ids:  # every other token -inf
            self.bias.fill_(float("-inf"))
            self.bias[params.allowed_token_ids] = 0.0
        if params.logit_bias:
            self.bias[list(params.logit_bias)] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.counts = torch.zeros(vocab_size)  # output token counts
        self.in_prompt = None
        if params.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
            self.in_prompt[prompt_token_ids] = True
        self.num_output = 0

    def note(self, token: int) -> None:
        self.counts[token] += 1
        self.num_output += 1

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self.bias is not None:
            logits = logits + self.bias
        if self.num_output < p.min_tokens and self.stop_ids:
            logits = logits.index_fill(0, torch.tensor(self.stop_ids), float("-inf"))
        if self.in_prompt is not None:
            seen = self.in_prompt | (self.counts > 0)
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        if p.frequency_penalty:
            logits = logits - p.frequency_penalty * self.counts
        if p.presence_penalty:
            logits = logits - p.presence_penalty * (self.counts > 0).float()
        return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (nucleus), vLLM's order, on one row of fp32 logits."""
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logprobs: torch.Tensor, token: int, num_top: int | None) -> dict[int, float]:
    """The sampled token's logprob plus the top `num_top` alternatives."""
    out = {token: float(logprobs[token])}
    if num_top:
        values, ids = logprobs.topk(num_top)
        out.update({int(i): float(v) for i, v in zip(ids, values)})
    return out


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
