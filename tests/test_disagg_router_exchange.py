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
        router = Router(pool, prefix_chars=64, request_timeout=60)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        exchange = Exchange(router, *pool.workers["prefill"], *pool.workers["decode"], "/v1/completions",
                            {"model": "fake", "prompt": "x"}, {})
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
