"""A choice's first token, sampled by the prefill worker and started from by the decode worker.

The prefill worker samples it with the request's own parameters, so it is the token one colocated
engine would sample from the same prompt and weights: the same seed draw, logprobs, grammar, logit
bias, penalties and min_tokens. Only what ends a request is left out there (stop strings, max_tokens
past one); the decode worker's engine applies those to it (`LLMEngine.add_request(first_token=)`).
On the wire it is plain JSON in the last batch's signed metadata: `[token, logprobs, routed
experts]`, logprobs as `[[token, logprob], ...]` (JSON object keys are strings) or None.
"""
from __future__ import annotations

import dataclasses

from ..outputs import FirstToken, RequestOutput
from ..request import SamplingParams
from .wire import TransferError


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The prefill's parameters for a choice: its own, for one token (min_tokens at most one, which
    holds EOS and the stop tokens back from that token exactly as more would), no stop strings, no
    prompt logprobs (the decode worker computes the prompt's rows for those)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                               prompt_logprobs=None)


def plain_greedy(params: SamplingParams) -> bool:
    """Whether the first token is the argmax of the raw logits (no bias, penalty, min_tokens, grammar
    or processor), so that any greedy run of the prompt samples it (a drafting prefill engine's)."""
    return params.greedy and not params.adjusts_logits and params.structured_output is None and \
        not params.return_routed_experts


def first_token_of(out: RequestOutput | None, params: SamplingParams) -> FirstToken | None:
    """The first token of a prefill's output (None: it ended with no token, e.g. a grammar this
    vocabulary cannot continue; the decode worker then computes the prompt's last page itself)."""
    if out is None or not out.token_ids:
        return None
    return FirstToken(out.token_ids[0], out.logprobs[0] if params.logprobs is not None else None,
                      out.routed_experts[0] if params.return_routed_experts else None)


def first_token_wire(first: FirstToken | None) -> list | None:
    if first is None:
        return None
    logprobs = None if first.logprobs is None else [[t, lp] for t, lp in first.logprobs.items()]
    return [first.token_id, logprobs, first.routed_experts]


def first_tokens_from_wire(entries, num_choices: int) -> list[FirstToken | None]:
    """The last batch's first tokens, one per choice, checked for shape (TransferError otherwise); the
    engine checks them against each choice's parameters when it adds the request."""
    if not (isinstance(entries, list) and len(entries) == num_choices):
        raise TransferError(f"the prefill worker sent {_count(entries)} first tokens for {num_choices} choices")
    return [None if entry is None else _first_token(entry) for entry in entries]


def _first_token(entry) -> FirstToken:
    try:
        token, logprobs, routed = entry
        ok = type(token) is int and (logprobs is None or all(type(t) is int and type(lp) is float
                                                              for t, lp in logprobs))
        ok = ok and (routed is None or all(type(e) is int for layer in routed for e in layer))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TransferError(f"the prefill worker's first token is malformed: {entry!r:.200}")
    return FirstToken(token, None if logprobs is None else {t: lp for t, lp in logprobs}, routed)


def _count(entries) -> str:
    return str(len(entries)) if isinstance(entries, list) else "no list of"
