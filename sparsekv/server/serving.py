"""Running one API request on the engine loop: admission, then a stream of SSE chunks or one JSON body.

Whatever way the request ends (finished, client gone, handler cancelled), `finally` aborts its group,
so its pages are freed. Starlette cancels a streaming response when the client disconnects; a plain
response is not cancelled, so `collect_replies` races the engine against `request.receive()` returning
`http.disconnect`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..request import InvalidRequest
from .errors import APIError, error_body
from .loop import EngineDead, EngineLoop, QueueFull, RequestGroup, ShuttingDown, Submission, empty_aborted_output
from .responses import ChoiceState, ResponseBuilder

log = logging.getLogger("sparsekv.server")
RETRY_AFTER_S = "1"


@dataclass
class Job:
    """One API request as the engine loop sees it: its engine requests and how to answer."""

    group: RequestGroup
    subs: list[Submission]
    tenant: str
    cache_salt: str | None
    builder: ResponseBuilder
    stream: bool
    include_usage: bool
    # the client's field for an engine parameter named otherwise (SamplingFields.client_params)
    client_params: dict[str, str] = field(default_factory=dict)
    # how the client is answered when not as an OpenAI response through `builder` (native /generate's
    # Answers; `builder` then only shapes a prefill worker's own answer to the router)
    replies: "Replies | None" = None


async def admit(loop: EngineLoop, job: Job, metrics) -> None:
    """Submit to the engine; map refusals to their HTTP status (never a 500 for bad input)."""
    try:
        await loop.submit(job.group, job.subs, job.tenant, job.cache_salt)
    except InvalidRequest as e:
        raise APIError(400, str(e), job.client_params.get(e.param, e.param)) from None
    except QueueFull as e:
        metrics.reject("queue_full")
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    except ShuttingDown as e:
        metrics.reject("shutting_down")
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    except EngineDead as e:
        metrics.reject("engine_dead")
        raise APIError(503, str(e)) from None
    except (ValueError, TypeError):  # input the engine could not digest is still the caller's input
        log.warning("the engine refused request %s", job.group.request_ids[0], exc_info=True)
        raise APIError(400, "invalid request: the engine could not process this input (details are in the "
                            "server log)") from None


class Replies(Protocol):
    """How an endpoint answers from its group's outputs; `respond` drives it. Two implementations: the
    OpenAI paths' (ChoiceReplies) and SGLang's /generate's (native.Answers)."""

    @property
    def finished(self) -> bool: ...

    def take(self, item) -> int:
        """Feed one queue item to its choice and return the choice's index; an error item raises as an APIError."""

    def response(self) -> dict | list:
        """The whole answer, once every choice finished."""

    def chunk(self, index: int) -> dict:
        """A stream event for choice `index`, which `take` just fed."""

    def closing(self) -> list[dict]:
        """The stream's events after every choice finished (before [DONE])."""


class ChoiceReplies:
    """The OpenAI paths' replies: each choice's state, answered through the response builder."""

    def __init__(self, states: list[ChoiceState], builder: ResponseBuilder, include_usage: bool = False):
        self.states, self.builder, self.include_usage = states, builder, include_usage
        self.started: set[int] = set()  # the choices whose first chunk (the chat role) went

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def take(self, item) -> int:
        return _apply(self.states, item)

    def response(self) -> dict:
        return self.builder.response(self.states)

    def chunk(self, index: int) -> dict:
        first = index not in self.started
        self.started.add(index)
        return self.builder.chunk(self.states[index], first, self.include_usage)

    def closing(self) -> list[dict]:
        return [self.builder.usage_chunk(self.states)] if self.include_usage else []


async def run(request: Request, loop: EngineLoop, job: Job, metrics, states: list | None = None):
    """`states`: a list to fill with the choices' states (what each output), for a caller that reads them."""
    states = states if states is not None else []
    states += [job.builder.choice_state(i, s.params.stop_strings) for i, s in enumerate(job.subs)]
    return await respond(request, loop, job, metrics, ChoiceReplies(states, job.builder, job.include_usage))


async def answer(request: Request, loop: EngineLoop, job: Job, metrics):
    """Run `job` and answer as its endpoint does: its own replies, or an OpenAI response."""
    if job.replies is not None:
        return await respond(request, loop, job, metrics, job.replies)
    return await run(request, loop, job, metrics)


async def respond(request: Request, loop: EngineLoop, job: Job, metrics, replies: Replies):
    """Admit `job`, then answer one JSON body or an SSE stream of `replies`."""
    try:
        await admit(loop, job, metrics)
        if not job.stream:
            return await collect_replies(request, loop, job.group, replies)
    except BaseException:
        loop.abort(job.group)
        raise
    return _streamed(loop, job.group, replies)


async def answer_aborted(request: Request, loop: EngineLoop, job: Job, metrics):
    """The answer of a request /abort_request ended before it reached the engine (a decode worker's
    request still in its KV transfer): each choice ends with no token and finish_reason "abort", as a
    request the engine had not stepped yet ends (EngineLoop.abort_requests)."""
    for i, (rid, sub) in enumerate(zip(job.group.request_ids, job.subs)):
        job.group.queue.put_nowait((i, empty_aborted_output(rid, sub.prompt, sub.params)))
    job.group.num_finished = len(job.subs)
    metrics.abort("abort_request", len(job.subs))
    replies = job.replies
    if replies is None:
        states = [job.builder.choice_state(i, s.params.stop_strings) for i, s in enumerate(job.subs)]
        replies = ChoiceReplies(states, job.builder, job.include_usage)
    if not job.stream:
        return await collect_replies(request, loop, job.group, replies)
    return _streamed(loop, job.group, replies)


def _streamed(loop: EngineLoop, group: RequestGroup, replies: Replies) -> StreamingResponse:
    return StreamingResponse(stream_replies(loop, group, replies), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collect(request: Request, loop: EngineLoop, group: RequestGroup, states: list[ChoiceState],
                  builder: ResponseBuilder):
    """The OpenAI paths' JSON body."""
    return await collect_replies(request, loop, group, ChoiceReplies(states, builder))


def sse(loop: EngineLoop, group: RequestGroup, states: list[ChoiceState], builder: ResponseBuilder,
        include_usage: bool):
    """The OpenAI paths' SSE stream."""
    return stream_replies(loop, group, ChoiceReplies(states, builder, include_usage))


async def collect_replies(request: Request, loop: EngineLoop, group: RequestGroup, replies: Replies):
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        while not replies.finished:
            getter = asyncio.ensure_future(group.queue.get())
            await asyncio.wait([getter, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                log.info("client disconnected; aborting %s", group.request_ids[0])
                return JSONResponse(error_body(499, "client closed the request"), status_code=499)
            replies.take(getter.result())
        return JSONResponse(replies.response())
    except APIError as e:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)
    finally:
        watcher.cancel()
        loop.abort(group)


async def stream_replies(loop: EngineLoop, group: RequestGroup, replies: Replies):
    try:
        while not replies.finished:
            try:
                index = replies.take(await group.queue.get())
            except APIError as e:  # headers are sent: report in-band, then end the stream
                yield sse_event(error_body(e.status, e.message, e.param))
                break
            yield sse_event(replies.chunk(index))
        else:
            for body in replies.closing():
                yield sse_event(body)
        yield "data: [DONE]\n\n"
    finally:
        loop.abort(group)


def _apply(states: list[ChoiceState], item) -> int:
    """Feed one queue item to its choice; an error item becomes an APIError."""
    index, payload = queue_item(item)
    states[index].update(payload)
    return index


def queue_item(item) -> tuple:
    """A group's queue item as (choice index, RequestOutput); an error item raises as an APIError."""
    index, payload = item
    if index is None:
        status = payload.status if isinstance(payload, EngineDead) else 503
        raise APIError(status, str(payload))
    return index, payload


def sse_event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
