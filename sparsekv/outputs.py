"""What the engine returns for a request: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field


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


def token_counts(req) -> dict[str, int]:
    """A request's lengths (its outputs' metrics; the cache manager adds where its cached tokens came from)."""
    return {"num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": req.num_output_tokens,
            "num_preemptions": req.num_preemptions}
