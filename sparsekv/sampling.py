"""Sampling as small pure functions: greedy, temperature, top-k, top-p, per-request generators, logprobs.

Logprobs are those of the model's raw distribution (log_softmax of the logits, before temperature
or truncation), as vLLM reports them by default.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of fp32 logits."""
    logits = logits / params.temperature
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
