"""Dispatch between the two roles: the worker for a server's settings, GET /disaggregation, and a
completion or chat request on a worker with a role."""
from __future__ import annotations

from ..input_processor import check_prompt_tokens
from ..request import InvalidRequest
from ..server.errors import APIError, bad_request
from .decode import DecodeWorker
from .prefill import PrefillWorker
from .worker import DisaggSettings, Worker


def build_worker(state, settings: DisaggSettings | None) -> Worker | None:
    if settings is None:
        return None
    if settings.mode == "prefill":
        return PrefillWorker(state, settings)
    return DecodeWorker(state, settings)


def describe(state) -> dict:
    """GET /disaggregation: this worker's role and load (mode "null": a colocated server)."""
    if state.disagg is not None:
        return state.disagg.describe()
    stats = state.loop.stats()
    return {"mode": "null", "bootstrap_host": None, "bootstrap_port": None, "transfer_backend": None,
            "num_running": int(stats.get("running", 0)), "num_waiting": int(stats.get("waiting", 0))}


async def serve(state, request, job, field, prompts: list[list[int]]):
    """A completion or chat request on a worker with a role, or carrying a `disaggregation` field."""
    if state.disagg is None:
        raise bad_request("this worker runs with --disaggregation-mode null (colocated): send the request "
                          "without the `disaggregation` field", "disaggregation")
    if field is None:
        raise bad_request(f"this is a {state.disagg.settings.mode} worker (--disaggregation-mode "
                          f"{state.disagg.settings.mode}): a request needs the `disaggregation` field (room, "
                          f"bootstrap_host, bootstrap_port); send requests through `sparsekv router`",
                          "disaggregation")
    vocab = state.engine.model_config.vocab_size
    try:  # as the engine would, before a worker changes the parameters it runs (max_tokens)
        for sub in job.subs:
            check_prompt_tokens(sub.prompt, sub.params.max_tokens, vocab, state.max_model_len)
    except InvalidRequest as e:
        raise APIError(400, str(e), e.param) from None
    return await state.disagg.serve(request, job, field, prompts)
