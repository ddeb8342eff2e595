"""What the engine returns for a request: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling_params import InvalidRequest


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt and `LLMEngine.step` yields per updated request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # With params.prompt_logprobs: None, then each later prompt token's logprob and alternatives
    # (filled while the prompt is prefilled; shared with the request, never copied per step).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With params.return_routed_experts: per generated token, per MoE layer (in layer order), the top-k
    # expert ids (ascending) the router chose at the position whose logits sampled the token (the last
    # prompt token's for the first one); shared with the request, never copied per step.
    routed_experts: list[list[list[int]]] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it (None: EOS, length)
    index: int = 0  # its choice among the prompt's n (SamplingParams.n)
    other_choices: list[RequestOutput] = field(default_factory=list)  # with n > 1 (LLM.generate): choices 1..n-1

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's `outputs`: the prompt's completions (n of them: this one, then the others), each with
        its own text, token_ids, logprobs, finish_reason, stop_reason and index."""
        return [self, *self.other_choices]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class FirstToken:
    """A request's first token sampled elsewhere (a disaggregated prefill worker), with what its step
    would have recorded: its logprobs (with `params.logprobs`) and its routed experts (with
    `params.return_routed_experts`). The engine emits it first and computes the request from there."""

    token_id: int
    logprobs: dict[int, float] | None = None
    routed_experts: list[list[int]] | None = None
    weights_version: int | None = None  # the engine's weights it was sampled under; None: the current ones
    # per full layer, (layer, the distinct positions the prompt's tail rows selected, ascending, the last
    # row's selection; int sequences, numpy arrays from a decode worker): a tiered engine places them in
    # the request's working set before its first decode
    warm: tuple = ()


def check_warm(warm, full_layers: list[int], top_k: int, num_prompt_tokens: int) -> None:
    """InvalidRequest unless `warm` (FirstToken.warm) names distinct full layers, each with distinct
    prompt positions: its union ascending, its last row's at most top-k."""
    layers = [entry[0] for entry in warm]
    if len(set(layers)) != len(layers) or not set(layers) <= set(full_layers):
        raise InvalidRequest(f"a first token's warm selections name layers {layers}, not distinct full layers "
                             f"of {full_layers}", "first_token")
    for layer, union, last in warm:
        if not (_positions(union, num_prompt_tokens) and _positions(last, num_prompt_tokens)
                and bool(np.all(np.diff(np.asarray(union)) > 0)) and np.unique(np.asarray(last)).size == len(last) <= top_k):
            raise InvalidRequest(f"layer {layer}'s warm selections are not distinct positions of the prompt's "
                                 f"{num_prompt_tokens} (at most {top_k} for its last row)", "first_token")


def _positions(values, num_tokens: int) -> bool:
    """Whether `values` are integers in [0, num_tokens), one-dimensional."""
    a = np.asarray(values)
    return a.ndim == 1 and (a.size == 0 or (a.dtype.kind in "iu" and int(a.min()) >= 0 and int(a.max()) < num_tokens))


def token_counts(req) -> dict[str, int]:
    """A request's lengths (its outputs' metrics; the cache manager adds where its cached tokens came from)."""
    return {"num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": req.num_output_tokens,
            "num_preemptions": req.num_preemptions}
