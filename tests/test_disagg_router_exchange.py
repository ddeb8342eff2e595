"""One routed request's two worker calls (router_exchange.Exchange) in process: the workers are an httpx
MockTransport handler, so the order in which the two calls end is set by the test, not by timing."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from sparsekv.disagg.router import Router
from sparsekv.disagg.router_exchange import Exchange, WorkerFailure
from sparsekv.disagg.router_workers import WorkerPool
from sparsekv.server.errors import error_body


def _exchange(pool: WorkerPool, handler, stream: bool = False) -> tuple[Router, Exchange]:
    """A router whose client calls `handler`, and one request's exchange with the pool's two workers
    (in the running event loop)."""
    router = Router(pool, prefix_chars=64, request_timeout=60)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    body = {"model": "fake", "prompt": "x", **({"stream": True} if stream else {})}
    return router, Exchange(router, *pool.workers["prefill"], *pool.workers["decode"], "/v1/completions", body, {})


def test_a_prefill_failure_before_the_decode_wait_begins_ends_the_decode_call_at_once():
    """The prefill call may end (failed) between two waits on the decode call: before the first, or while
    a stream's chunk is being passed on. The next wait must see that failure at once and cancel the
    decode call, not wait for a decode worker that waits for KV that will not come (until its own
    timeout)."""
    pool = WorkerPool(["http://p:1"], ["http://d:2"])
    for w in pool.all():
        w.up = True
    pool.workers["prefill"][0].bootstrap_host, pool.workers["prefill"][0].bootstrap_port = "10.0.0.1", 7000
    decode_cancelled = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(503, json=error_body(503, "prefill engine failed"))
        try:
            await asyncio.sleep(30)  # for KV that never comes
        except asyncio.CancelledError:
            decode_cancelled.append(True)
            raise
        return httpx.Response(200, json={})

    async def run():
        router, exchange = _exchange(pool, handler)
        await asyncio.wait({exchange.p_task})  # the prefill call has failed before the decode wait begins
        try:
            with pytest.raises(WorkerFailure, match="prefill worker .* prefill engine failed") as failure:
                await asyncio.wait_for(exchange.open_decode(), 10)
        finally:
            exchange.close(failed=True)
            await router.client.aclose()
        return failure.value.status
    assert asyncio.run(run()) == 503
    assert decode_cancelled == [True]
    assert all(w.in_flight == 0 for w in pool.all())


def _up_pool() -> WorkerPool:
    pool = WorkerPool(["http://p:1"], ["http://d:2"])
    for w in pool.all():
        w.up = True
    pool.workers["prefill"][0].bootstrap_host, pool.workers["prefill"][0].bootstrap_port = "10.0.0.1", 7000
    return pool


def test_a_request_abandoned_before_the_decode_wait_began_cancels_both_calls():
    """A client gone before the router first waits on the decode call (`close` with no read ever started):
    both calls are cancelled, closing both connections, so that neither worker keeps the request."""
    pool = _up_pool()
    started, cancelled = [], []

    async def handler(request: httpx.Request) -> httpx.Response:
        started.append(request.url.host)
        try:
            await asyncio.Event().wait()  # the workers answer only when their calls end
        except asyncio.CancelledError:
            cancelled.append(request.url.host)
            raise
        return httpx.Response(200, json={})

    async def run():
        router, exchange = _exchange(pool, handler)
        try:
            while len(started) < 2:  # both calls have reached their worker (bounded by the wait_for below)
                await asyncio.sleep(0)
            exchange.close(failed=True)
            await asyncio.wait({exchange.p_task, exchange.d_task}, timeout=10)  # at once, unless a call was left
            return exchange.p_task.cancelled(), exchange.d_task.cancelled()
        finally:
            await router.client.aclose()
    assert asyncio.run(asyncio.wait_for(run(), 20)) == (True, True)
    assert sorted(cancelled) == ["d", "p"]
    assert all(w.in_flight == 0 for w in pool.all())


def _streaming_decode_worker(events):
    """A handler: the prefill worker answers at once, the decode worker streams `events`."""
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(200, json={})
        return httpx.Response(200, stream=events, headers={"content-type": "text/event-stream"})
    return handler


class _Events(httpx.AsyncByteStream):
    """A decode worker's stream that sends one chunk (by default one event), then waits until its
    connection is closed."""

    def __init__(self, chunk: bytes = b'data: {"choices":[{"index":0,"text":"He"}]}\n\n'):
        self.chunk, self.closed = chunk, False

    async def __aiter__(self):
        yield self.chunk
        await asyncio.Event().wait()

    async def aclose(self):
        self.closed = True


async def _first_chunk_then_close(pool, events) -> bytes:
    """The relay's first chunk of a decode worker streaming `events`; then the exchange closed as failed
    (the client gone) and its closing tasks run."""
    router, exchange = _exchange(pool, _streaming_decode_worker(events), stream=True)
    try:
        await exchange.open_decode()
        chunks = exchange.relay()  # held until the end: the relay stays at its yield, never finalised
        first = await asyncio.wait_for(anext(chunks), 10)
        exchange.close(failed=True)
        while router._tasks:  # the closing tasks
            await asyncio.wait(set(router._tasks))
        return first
    finally:
        await router.client.aclose()


def test_a_stream_abandoned_between_two_reads_has_its_decode_connection_closed():
    """The client may go away while no read of the decode worker's stream is in progress (the router is
    passing a chunk on): `close` must still close the decode call's connection, which aborts the request
    on the worker, rather than leave it open with the request generating."""
    pool, events = _up_pool(), _Events()
    first = asyncio.run(_first_chunk_then_close(pool, events))  # the relay is held at its yield, as while
    assert first.startswith(b"data: ") and events.closed       # a chunk is passed on
    assert all(w.in_flight == 0 for w in pool.all())


def test_every_whole_event_of_a_read_is_passed_on_at_once_and_only_an_unfinished_one_held_back():
    """One read of the decode worker's stream may bring several events and the start of the next: the
    relay passes on every whole event at once and holds back only the unfinished tail: a whole event held
    back would keep its token from the client until the worker's next bytes, for as long as it waits."""
    pool = _up_pool()
    whole = b'data: {"choices":[{"index":0,"text":"He"}]}\n\ndata: {"choices":[{"index":0,"text":"llo"}]}\n\n'
    events = _Events(whole + b'data: {"cho')
    assert asyncio.run(_first_chunk_then_close(pool, events)) == whole and events.closed
    assert all(w.in_flight == 0 for w in pool.all())
