"""One routed request's two worker calls, and how either failing ends the other (in front of colocated
servers, one call: the decode call's, to the chosen server, with no prefill call to race).

The prefill call is a plain POST run as a task; the decode call is streamed, so that its SSE events go
back to the client as they come. Every wait on the decode side races the prefill call: a prefill
failure cancels the decode call at once (closing its connection, which aborts the request on the
worker) instead of leaving it to wait for KV that will not come.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import httpx
from fastapi.responses import JSONResponse

from ..server.errors import error_body
from .router_workers import Worker


# the errors of a call that prove its worker gone (it refused or dropped the connection): the worker
# is taken out at once; any other (a slow answer) fails the call only
WORKER_GONE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


class WorkerFailure(Exception):
    """A worker's call failed; `status` and `body` are what the client gets."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)

    def event(self) -> bytes:
        return f"data: {json.dumps(self.body, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _encoded(body: dict) -> bytes:
    """A body as the client's JSON had it: NaN and infinities, which a worker's parser takes as the
    router's did (Python's json), are written back, not refused (httpx's `json=` refuses them)."""
    return json.dumps(body, separators=(",", ":"), allow_nan=True).encode()


class Exchange:
    """One request's two worker calls: the prefill call (a plain POST, run as a task) and the decode call
    (streamed), and how either failing ends the other."""

    def __init__(self, router, prefill: Worker | None, decode: Worker, path: str, body: dict, headers: dict):
        """`prefill` None: `decode` is a colocated server, which gets the client's body as it is."""
        self.router, self.prefill, self.decode = router, prefill, decode
        client = router.client
        headers = {**headers, "content-type": "application/json"}
        self.p_task: asyncio.Future | None = None
        if prefill is not None:
            tag = {"room": uuid.uuid4().hex, "bootstrap_host": prefill.bootstrap_host,
                   "bootstrap_port": prefill.bootstrap_port}
            p_body = {k: v for k, v in body.items() if k != "stream_options"}  # only allowed with stream: true
            p_request = client.build_request("POST", prefill.url + path, headers=headers,
                                             content=_encoded({**p_body, "stream": False, "disaggregation": tag}))
            body = {**body, "disaggregation": tag}
        d_request = client.build_request("POST", decode.url + path, content=_encoded(body),
                                         headers=headers)  # NOTE: both built before any count or task starts
        decode.in_flight += 1
        if prefill is not None:
            prefill.in_flight += 1
            self.p_task = asyncio.ensure_future(client.send(p_request))
            self.p_task.add_done_callback(lambda _: self._ended(prefill))
        self.d_task = asyncio.ensure_future(client.send(d_request, stream=True))
        self.d_response: httpx.Response | None = None
        self.d_reading: asyncio.Future | None = None  # the decode call's wait in progress (unless_prefill_fails)

    def _ended(self, worker: Worker) -> None:
        worker.in_flight -= 1

    def _failure(self, worker: Worker, response: httpx.Response | None = None,
                 error: BaseException | None = None) -> WorkerFailure:
        if response is not None and response.status_code < 500:
            return WorkerFailure(response.status_code, envelope(response) or
                                 error_body(response.status_code, response.text[:200]))
        self.router.metrics.failures.labels(worker.role).inc()
        if response is not None:
            why = f"answered {response.status_code}: {_message(response)}"
            headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        else:
            why = f"failed: {type(error).__name__}: {error}"
            headers = {}
            if isinstance(error, WORKER_GONE):
                self.router.pool.mark_down(worker, why)
        return WorkerFailure(503, error_body(503, f"{worker.name} {worker.url} {why}"), headers)

    def prefill_failure(self) -> WorkerFailure | None:
        """The prefill call's failure once it has ended (None while it runs, if it succeeded, or with none)."""
        if self.p_task is None or not self.p_task.done() or self.p_task.cancelled():
            return None
        if self.p_task.exception() is not None:
            return self._failure(self.prefill, error=self.p_task.exception())
        response = self.p_task.result()
        return None if response.status_code == 200 else self._failure(self.prefill, response)

    async def unless_prefill_fails(self, awaitable):
        """`awaitable`'s result (a wait on the decode call), unless the prefill call fails first: then
        it is cancelled and the prefill call's WorkerFailure raised. NOTE: the wait runs as a task that
        only `asyncio.wait` awaits, so a cancel of this call (a streaming client gone: Starlette cancels
        the stream) never reaches the decode call's read; `close` ends it, one cancel, after which httpx
        closes the connection and the decode worker aborts the request. A cancel delivered inside the
        read left its connection half closed and the request generating."""
        task = self.d_reading = asyncio.ensure_future(awaitable)
        # the prefill call too when it has ended: it may have failed since the last wait (then this one ends at once)
        await asyncio.wait({task} if self.p_task is None else {task, self.p_task}, return_when=asyncio.FIRST_COMPLETED)
        failure = self.prefill_failure()
        if failure is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise failure
        if not task.done():  # the prefill call succeeded first
            await asyncio.wait({task})
        return task.result()

    async def open_decode(self) -> httpx.Response:
        """D's response with status 200, its body not read yet; WorkerFailure otherwise."""
        try:
            self.d_response = response = await self.unless_prefill_fails(self.d_task)
        except httpx.HTTPError as e:
            raise self._failure(self.decode, error=e) from None
        if response.status_code != 200:
            await response.aread()
            raise self._failure(self.decode, response)
        return response

    async def decode_body(self) -> bytes:
        try:
            return await self.unless_prefill_fails(self.d_response.aread())
        except httpx.HTTPError as e:
            raise self._failure(self.decode, error=e) from None

    async def relay(self):
        """D's SSE bytes as they come, cut at event boundaries so that an error event can follow cleanly."""
        pending, chunks = b"", self.d_response.aiter_raw()
        while True:
            try:
                chunk = await self.unless_prefill_fails(anext(chunks))
            except StopAsyncIteration:
                break
            except httpx.HTTPError as e:
                raise self._failure(self.decode, error=e) from None
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut >= 2:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending

    def close(self, failed: bool) -> None:
        """End D's call; cancel P's too when the request failed or was abandoned (P finishes by itself
        when D has answered). NOTE: synchronous, because it runs in the `finally` of a stream that the
        client abandoned, where every await would be cancelled again; the closing awaits run as tasks."""
        reading = self.d_reading
        if reading is not None and not reading.done():
            reading.cancel()
        if not self.d_task.done():
            self.d_task.cancel()
        elif not self.d_task.cancelled() and self.d_task.exception() is None:
            self.router.background(asyncio.ensure_future(_closed(self.d_task.result(), reading)))
        self._ended(self.decode)
        if self.p_task is None:
            return
        if failed and not self.p_task.done():
            self.p_task.cancel()
        else:
            self.router.background(self.p_task)


async def _closed(response: httpx.Response, reading: asyncio.Future | None) -> None:
    """Close the decode call's response once its read in progress, if any, has ended."""
    if reading is not None:
        await asyncio.wait({reading})
    await response.aclose()


def envelope(response: httpx.Response) -> dict | None:
    """The body if it is the OpenAI error envelope with its message and code, as a sparsekv worker answers
    a 4xx; None for any other body (FastAPI's `{"detail": ...}`, a proxy's), which is wrapped in one, since
    the router reads both fields (the message for the failure, the code to count a stream that ends with it)."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return body if isinstance(error, dict) and "message" in error and isinstance(error.get("code"), int) else None
