"""`sparsekv router` against fake prefill and decode workers (small FastAPI apps in threads that keep the
workers' HTTP contract and record what they receive): routing by load and prefix affinity, one room per
request on both sides, SSE passthrough, failures of either side (503, or an error event once streaming,
and the other side's call cancelled), dead workers skipped, the start-up mode check, /metrics."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sparsekv.disagg.router import Router, create_app, main
from sparsekv.disagg.router_workers import POLL_TIMEOUTS_BEFORE_DOWN, RouterConfigError, WorkerPool, check_modes
from sparsekv.server.errors import error_body
from test_server_util import free_port, listening_socket, random_openai_body, scrape_labelled, wait_until

TOKENS = ["He", "llo", " wor", "ld"]
SYSTEM = "You are a careful assistant. " * 60  # a shared system prompt, longer than the affinity window


class FakeWorker:
    """A worker's HTTP contract. `fail`: answer the generation routes with this status; `hang`: wait for
    `release` (prefill: before answering; decode: after `hang_after` stream events, or before a JSON
    answer) until `let_go()` was called once more than for the calls before, counting in `cancelled` the
    calls whose client went away meanwhile."""

    def __init__(self, mode: str, running: int = 0, transfer: str = "torch", layout: list | None = None):
        self.mode, self.running, self.transfer = mode, running, transfer
        self.layout = layout or [[[4, 96], "float32"]]
        self.bootstrap_port = free_port()
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.fail: int | None = None
        self.hang, self.hang_after = False, 0
        self.error_event_after: int | None = None  # decode: end a stream with an error event after N tokens
        self.released = 0
        self.cancelled = 0
        self.app = FastAPI()
        self.app.add_api_route("/disaggregation", self.info, methods=["GET"])
        self.health_delay = 0.0  # seconds /health takes to answer
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/v1/models", lambda: {"object": "list", "data": [{"id": "fake"}]}, methods=["GET"])
        self.app.add_api_route("/v1/models/{model:path}", lambda model: {"id": model, "object": "model"}, methods=["GET"])
        self.app.add_api_route("/v1/completions", self.generate, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.generate, methods=["POST"])

    def let_go(self) -> None:
        self.released += 1

    async def health(self):
        await asyncio.sleep(self.health_delay)
        return {"status": "ok"}

    def info(self):
        prefill = self.mode == "prefill" and self.bootstrap_port is not None
        return {"mode": self.mode, "bootstrap_host": "127.0.0.1" if prefill else None,
                "bootstrap_port": self.bootstrap_port if prefill else None, "transfer_backend": self.transfer,
                "kv_layout": self.layout,
                "num_running": self.running, "num_waiting": 0}

    async def generate(self, request: Request):
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.fail is not None and not self.hang:
            return JSONResponse(error_body(self.fail, f"{self.mode} says no"), status_code=self.fail)
        if self.mode == "decode" and body.get("stream"):
            return StreamingResponse(self.events(index), media_type="text/event-stream")
        if not await self._wait(request, index):
            return JSONResponse(error_body(499, "gone"), status_code=499)
        if self.fail is not None:
            return JSONResponse(error_body(self.fail, f"{self.mode} says no"), status_code=self.fail)
        return {"id": "cmpl-1", "object": "text_completion",
                "choices": [{"index": 0, "text": "".join(TOKENS) if self.mode == "decode" else "H",
                             "finish_reason": "length"}]}

    async def _wait(self, request: Request, index: int) -> bool:
        while self.hang and self.released <= index:
            if await request.is_disconnected():
                self.cancelled += 1
                return False
            await asyncio.sleep(0.01)
        return True

    async def events(self, index: int):
        try:
            for i, token in enumerate(TOKENS):
                while self.hang and i == self.hang_after and self.released <= index:
                    await asyncio.sleep(0.01)
                if i == self.error_event_after:  # as a worker whose engine failed mid-stream
                    yield f"data: {json.dumps(error_body(503, 'the engine failed'), separators=(',', ':'))}\n\n"
                    return
                yield f'data: {{"choices":[{{"index":0,"text":"{token}"}}]}}\n\n'
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class Served:
    """An ASGI app served by uvicorn in a thread, on a socket bound when its port is chosen."""

    def __init__(self, app):
        self.sock = listening_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert wait_until(lambda: self.server.started or not self.thread.is_alive(), 20) and self.server.started
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.stop()


@contextlib.contextmanager
def deployment(prefill: list[FakeWorker], decode: list[FakeWorker], load_slack: int = 4):
    """The fakes served, and a router in front of them: yields (router URL, router, served fakes by role)."""
    with contextlib.ExitStack() as stack:
        served = {"prefill": [stack.enter_context(Served(w.app)) for w in prefill],
                  "decode": [stack.enter_context(Served(w.app)) for w in decode]}
        pool = WorkerPool([s.url for s in served["prefill"]], [s.url for s in served["decode"]], load_slack)
        check_modes(pool, timeout=10, interval=0.05)
        router = Router(pool, prefix_chars=256, request_timeout=60, health_interval=0.05)  # no timeout in a test
        url = stack.enter_context(Served(create_app(router))).url
        yield url, router, served


def complete(url: str, prompt, **extra) -> httpx.Response:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=20)


def test_one_room_on_both_sides_and_the_decode_answer_unchanged():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with deployment([p], [d]) as (url, _, _):
        r = complete(url, "hello", cache_salt="s1", logprobs=2, n=2)
        r2 = complete(url, "hello")
        # the router answers once D has; P's call ends by itself (here, a fake D does not wait for it)
        assert wait_until(lambda: len(p.bodies) == len(d.bodies) == 2)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "".join(TOKENS)
    pb, db = p.bodies[0], d.bodies[0]
    assert pb["disaggregation"] == db["disaggregation"]
    tag = db["disaggregation"]
    assert tag["bootstrap_host"] == "127.0.0.1" and tag["bootstrap_port"] == p.bootstrap_port
    assert tag["room"] != d.bodies[1]["disaggregation"]["room"]  # a new room per request
    sent = {"model": "fake", "prompt": "hello", "max_tokens": 4, "cache_salt": "s1", "logprobs": 2, "n": 2}
    assert {k: v for k, v in db.items() if k != "disaggregation"} == sent
    assert {k: v for k, v in pb.items() if k != "disaggregation"} == {**sent, "stream": False}
    assert p.headers[0]["authorization"] == d.headers[0]["authorization"] == "Bearer k1"
    assert r2.status_code == 200


def test_the_health_poller_outlives_a_poll_that_fails(monkeypatch):
    """An error no poll foresaw (here the pool's own) is logged and the next poll runs on time: the
    poller ended before, and every worker's up/down state and load froze as they were."""
    pool = WorkerPool(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 4)
    polls = []

    async def poll(client):
        polls.append(client)
        if len(polls) == 1:
            raise RuntimeError("something no poll foresaw")
    monkeypatch.setattr(pool, "poll", poll)
    router = Router(pool, request_timeout=60, health_interval=0.01)

    async def main():
        poller = asyncio.ensure_future(router.poll_forever())
        try:
            while len(polls) < 3 and not poller.done():  # bounded by the wait below
                await asyncio.sleep(0.01)
            return poller.done()
        finally:
            poller.cancel()
    assert asyncio.run(asyncio.wait_for(main(), 10)) is False and len(polls) >= 3


def test_stream_passes_through_byte_for_byte():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with deployment([p], [d]) as (url, _, served):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
            got = r.read()
        with httpx.stream("POST", served["decode"][0].url + "/v1/chat/completions", json=body, timeout=20) as r:
            direct = r.read()
        assert wait_until(lambda: len(p.bodies) == 1)
    assert got == direct and got.endswith(b"data: [DONE]\n\n")
    assert d.bodies[0]["stream"] is True and d.bodies[0]["stream_options"] == {"include_usage": True}
    assert p.bodies[0]["stream"] is False and "stream_options" not in p.bodies[0]  # only allowed with a stream


def test_routes_by_load_then_by_prefix_affinity():
    busy, idle = FakeWorker("prefill", running=10), FakeWorker("prefill")
    d1, d2 = FakeWorker("decode"), FakeWorker("decode")
    with deployment([busy, idle], [d1, d2], load_slack=4) as (url, _, _):
        for i in range(8):  # the busy prefill worker never, whatever the prompt
            assert complete(url, f"{i} prompt under load").status_code == 200
        assert wait_until(lambda: len(idle.bodies) == 8) and len(busy.bodies) == 0
        before = len(d1.bodies), len(d2.bodies)
        for i in range(6):  # the same leading prompt: always the same decode worker
            assert complete(url, SYSTEM + f"question {i}").status_code == 200
        assert sorted([len(d1.bodies) - before[0], len(d2.bodies) - before[1]]) == [0, 6]
        busy.running = 0
        for i in range(32):  # distinct prompts spread over the workers
            assert complete(url, f"{i} distinct prompt").status_code == 200
    assert len(busy.bodies) > 0 and len(d1.bodies) > 0 and len(d2.bodies) > 0


def test_affinity_yields_to_load_past_the_slack():
    d1, d2 = FakeWorker("decode"), FakeWorker("decode")
    with deployment([FakeWorker("prefill")], [d1, d2], load_slack=4) as (url, router, served):
        complete(url, SYSTEM + "first")
        home, other = (d1, d2) if d1.bodies else (d2, d1)
        seen = next(w for w in router.pool.workers["decode"] if w.url == served["decode"][(d1, d2).index(home)].url)
        for running, expect in ((4, home), (5, other)):  # within the slack it stays, past it it goes
            home.running = running
            assert wait_until(lambda: seen.load == running)
            count = len(expect.bodies)
            assert complete(url, SYSTEM + f"at load {running}").status_code == 200
            assert len(expect.bodies) == count + 1


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def stream_completion(url: str, prompt: str) -> tuple[int, bytes]:
    with httpx.stream("POST", url + "/v1/completions", timeout=20,
                      json={"prompt": prompt, "max_tokens": 4, "stream": True}) as s:
        return s.status_code, s.read()


def fail_once_both_have_it(failing: FakeWorker, other: FakeWorker, n: int) -> None:
    """Let `failing` answer its error once `other` has received request `n` too."""
    assert wait_until(lambda: len(other.bodies) == n)
    failing.let_go()


def test_failing_prefill_is_a_503_and_cancels_the_decode_call():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    p.fail, p.hang, d.hang = 500, True, True  # the decode worker waits for KV that never comes
    with deployment([p], [d]) as (url, router, _):
        r = in_background(complete, url, "hello")
        fail_once_both_have_it(p, d, 1)
        assert wait_until(lambda: d.cancelled == 1)
        s = in_background(stream_completion, url, "hello")
        fail_once_both_have_it(p, d, 2)
        assert wait_until(lambda: d.cancelled == 2)
        failures = scrape_labelled(url, "role")["sparsekv:router_transfer_failures_total"]
    r, (status, text) = r.result(), s.result()
    assert r.status_code == 503 and status == 503
    for err in (r.json()["error"], json.loads(text)["error"]):
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "prefill worker" in err["message"]
        assert "prefill says no" in err["message"]
    assert failures == {"prefill": 2.0}


def test_prefill_failing_mid_stream_ends_it_with_an_error_event():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    p.fail, p.hang = 500, True      # fails once released
    d.hang, d.hang_after = True, 2  # two events, then waits
    with deployment([p], [d]) as (url, _, _):
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=20,
                          json={"prompt": "hello", "max_tokens": 4, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 2 and not p.released:
                    p.let_go()  # only now: the client has both events
        assert wait_until(lambda: d.cancelled == 1)
    assert s.status_code == 200 and len(events) == 4
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == TOKENS[:2]
    error = json.loads(events[2])["error"]
    assert error["code"] == 503 and "prefill worker" in error["message"] and events[3] == "[DONE]"


@pytest.mark.parametrize("status", [502, 401])
def test_failing_decode_cancels_the_prefill_call(status):
    """A decode worker's 5xx is a 503; its 4xx (a wrong key, bad input) is the client's answer as it is."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    p.hang, d.hang, d.fail = True, True, status
    with deployment([p], [d]) as (url, _, _):
        r = in_background(complete, url, "hello")
        fail_once_both_have_it(d, p, 1)
        assert wait_until(lambda: p.cancelled == 1)
    r = r.result()
    if status >= 500:
        assert r.status_code == 503 and "decode worker" in r.json()["error"]["message"]
    else:
        assert r.status_code == 401 and r.json() == error_body(401, "decode says no")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_ends_both_calls(stream):
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    p.hang, d.hang, d.hang_after = True, True, 1  # a stream: one event, then waits
    with deployment([p], [d]) as (url, _, _):
        body = json.dumps({"prompt": "hello", "max_tokens": 4, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_until(lambda: len(d.bodies) == len(p.bodies) == 1)
            received = b""
            while stream and b"data: " not in received:  # the first event has reached the client
                received += sock.recv(4096)
        assert wait_until(lambda: p.cancelled == d.cancelled == 1)
        statuses = scrape_labelled(url, "status")["sparsekv:router_requests_total"]
    assert statuses == {"499": 1.0}


def test_a_client_gone_mid_stream_after_the_prefill_answered_ends_the_decode_call():
    """The usual case: the prefill call has answered and the decode worker is streaming when the client
    goes away. The router must close its connection to the decode worker (which then aborts the
    request), not leave it half closed with the request generating."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    d.hang, d.hang_after = True, 1  # one event, then waits
    with deployment([p], [d]) as (url, router, _):
        for i in range(3):
            body = json.dumps({"prompt": f"hello {i}", "max_tokens": 4, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                received = b""
                while b"data: " not in received:  # the first event has reached the client
                    received += sock.recv(4096)
                assert wait_until(lambda: len(p.bodies) == i + 1)
        assert wait_until(lambda: d.cancelled == 3), d.cancelled
        assert wait_until(lambda: not router._tasks)  # the closing tasks ended
        statuses = scrape_labelled(url, "status")["sparsekv:router_requests_total"]
    assert statuses == {"499": 3.0}


def test_several_authorization_headers_are_a_400_before_any_worker_is_asked():
    """As on any server: the router forwards the header and hashes it for affinity, so it may not pick one."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with deployment([p], [d]) as (url, _, _):
        body = json.dumps({"model": "fake", "prompt": "x", "max_tokens": 4})
        r = httpx.post(url + "/v1/completions", content=body, timeout=20,
                       headers=[("Content-Type", "application/json"), ("Authorization", "Bearer key-a"),
                                ("Authorization", "Bearer key-b")])
        assert r.status_code == 400 and "more than one Authorization header" in r.json()["error"]["message"]
        assert complete(url, "x").status_code == 200  # one header passes
        assert wait_until(lambda: len(p.bodies) == len(d.bodies) == 1)  # P's call may end after the answer


def test_a_header_that_cannot_be_forwarded_is_a_400_and_counts_nothing_in_flight():
    """A non-ASCII X-Request-Id or Authorization (httpx cannot send either on): a 400 in the envelope
    before any worker is asked, every in-flight count back to 0 (they leaked, and a leaked decode count
    took the worker out of rotation)."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with deployment([p], [d]) as (url, router, _):
        for name in (b"X-Request-Id", b"Authorization"):
            r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', timeout=20,
                           headers=[(b"Content-Type", b"application/json"), (name, b"Bearer \xff\xe9")])
            assert r.status_code == 400 and r.json()["error"]["param"] == name.decode().lower()
        flat = {n: sum(v.values()) for n, v in scrape_labelled(url, "role").items()}
    assert p.bodies == d.bodies == [] and all(w.in_flight == 0 for w in router.pool.all())
    assert flat["sparsekv:router_worker_requests_in_flight"] == 0.0


def test_a_cookie_a_worker_sets_goes_out_with_no_later_request():
    """The router's client is shared by every tenant: a Set-Cookie must not be kept and replayed."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")

    @d.app.middleware("http")
    async def set_cookie(request, call_next):
        response = await call_next(request)
        response.headers["set-cookie"] = "session=tenant-a; Path=/"
        return response
    with deployment([p], [d]) as (url, _, _):
        assert complete(url, "first").status_code == 200
        assert complete(url, "second").status_code == 200
    assert "cookie" not in d.headers[1] and "cookie" not in p.headers[-1]


def test_a_stream_the_decode_worker_ends_with_an_error_event_counts_as_that_error():
    """The error event passes through as the worker sent it; the router counts the request under its
    code and as the decode side's failure, not as a 200."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    d.error_event_after = 2
    with deployment([p], [d]) as (url, _, _):
        status, text = stream_completion(url, "hello")
        assert wait_until(lambda: "503" in scrape_labelled(url, "status")["sparsekv:router_requests_total"])
        statuses = scrape_labelled(url, "status")["sparsekv:router_requests_total"]
        failures = scrape_labelled(url, "role")["sparsekv:router_transfer_failures_total"]
    assert status == 200 and b'"code":503' in text and b"the engine failed" in text
    assert statuses == {"503": 1.0} and failures == {"decode": 1.0}


def test_a_bad_body_is_a_400_before_any_worker_is_asked():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with deployment([p], [d]) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": "four"}, timeout=20)
        r2 = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=20)
    assert r.status_code == r2.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert p.bodies == d.bodies == []


def test_a_dead_worker_is_skipped():
    d1, d2 = FakeWorker("decode"), FakeWorker("decode")
    with deployment([FakeWorker("prefill")], [d1, d2]) as (url, _, served):
        dead = served["decode"][0]
        dead.stop()
        assert wait_until(lambda: httpx.get(url + "/health").json()["decode"] == [served["decode"][1].url])
        codes = [complete(url, f"{i} distinct prompt").status_code for i in range(12)]
        up = scrape_labelled(url, "worker")["sparsekv:router_worker_up"]
        served["decode"][1].stop()
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503)
        assert httpx.head(url + "/health").status_code == 503  # a load balancer's HEAD probe sees it too
        none = complete(url, "hello")
    assert codes == [200] * 12 and len(d2.bodies) == 12
    assert up == {dead.url: 0.0, served["decode"][1].url: 1.0, served["prefill"][0].url: 1.0}
    assert none.status_code == 503 and "no decode worker is up" in none.json()["error"]["message"]


def test_a_worker_answering_polls_late_stays_up_until_several_time_out():
    """A loaded worker may miss one poll's timeout (1 s here): it is busy, not gone. Only
    POLL_TIMEOUTS_BEFORE_DOWN timeouts in a row take it out, and one answer brings it back."""
    d = FakeWorker("decode")
    with deployment([FakeWorker("prefill")], [d]) as (url, router, _):
        worker = router.pool.workers["decode"][0]
        d.health_delay = 1.5
        assert wait_until(lambda: worker.polls_timed_out == POLL_TIMEOUTS_BEFORE_DOWN - 1, 20)
        assert worker.up and complete(url, "served while the polls time out").status_code == 200
        d.health_delay = 0.0
        assert wait_until(lambda: worker.polls_timed_out == 0) and worker.up
        d.health_delay = 1.5
        assert wait_until(lambda: not worker.up, 20)
        assert complete(url, "hello").status_code == 503
        d.health_delay = 0.0
        assert wait_until(lambda: worker.up)


def test_the_router_drops_idle_connections_before_a_worker_closes_them():
    """Equal idle timeouts race: the router would reuse a connection the worker is closing just then,
    and the request fails (a POST is not retried)."""
    from sparsekv.disagg.router import KEEPALIVE_EXPIRY_S
    router = Router(WorkerPool(["http://p:1"], ["http://d:2"]))

    async def expiry():
        async with router.running():
            return router.client._transport._pool._keepalive_expiry
    assert asyncio.run(expiry()) == KEEPALIVE_EXPIRY_S <= uvicorn.Config(app=None).timeout_keep_alive / 2


def test_startup_refuses_a_worker_in_the_wrong_mode(capsys):
    p, d, no_address = FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("prefill")
    no_address.bootstrap_port = None
    with Served(p.app) as sp, Served(d.app) as sd, Served(no_address.app) as sn:
        with pytest.raises(RouterConfigError, match=rf"--prefill {sd.url} is not a prefill worker: GET "
                                                    r"/disaggregation says mode 'decode'"):
            check_modes(WorkerPool([sd.url], [sp.url + "/"]), timeout=5)
        with pytest.raises(RouterConfigError, match="names no bootstrap address"):
            check_modes(WorkerPool([sn.url], [sd.url]), timeout=5)
        with pytest.raises(RouterConfigError, match="did not answer GET /disaggregation within 0.2 s"):
            check_modes(WorkerPool([sp.url], [f"http://127.0.0.1:{free_port()}"]), timeout=0.2, interval=0.05)
        check_modes(WorkerPool([sp.url], [sd.url]), timeout=5)
    drafting = FakeWorker("decode", layout=[[[4, 96], "float32"], [[4, 96], "float32"]])
    with Served(p.app) as sp, Served(d.app) as sd, Served(drafting.app) as sx:
        with pytest.raises(RouterConfigError, match=r"KV pages differ .* --num-speculative-tokens"):
            check_modes(WorkerPool([sp.url], [sd.url, sx.url]), timeout=5)
    other = FakeWorker("decode", transfer="nixl")
    with Served(p.app) as sp, Served(other.app) as so:
        with pytest.raises(RouterConfigError, match=rf"different --disaggregation-transfer-backend \({sp.url}: torch, "
                                                    rf"{so.url}: nixl\)"):
            check_modes(WorkerPool([sp.url], [so.url]), timeout=5)
    assert main(["--prefill", "localhost:1", "--decode", "http://h:2"]) == 2
    assert "--prefill localhost:1: a worker is a URL" in capsys.readouterr().err
    assert main(["--prefill", "http://h:1", "--decode", "http://h:1/", "--worker-startup-timeout", "0"]) == 2
    assert "both --prefill and --decode" in capsys.readouterr().err


def test_a_startup_timeout_of_zero_accepts_workers_that_all_answer_at_once():
    """`--worker-startup-timeout 0` means no waiting, not no workers: when every worker answers the first
    look, start-up succeeds however late that is; only a worker still unanswered at the deadline fails it."""
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with Served(p.app) as sp, Served(d.app) as sd:
        pool = WorkerPool([sp.url], [sd.url])
        check_modes(pool, timeout=0)
    assert all(w.up for w in pool.all())


def test_startup_compares_only_the_page_layouts_the_workers_report():
    """`kv_layout` is optional in a worker's answer to GET /disaggregation: a worker that leaves it out is
    not compared (nor taken for a mismatch), while the layouts reported must still agree."""
    p, d, unreported = FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")
    unreported.layout = None
    with Served(p.app) as sp, Served(d.app) as sd, Served(unreported.app) as su:
        pool = WorkerPool([sp.url], [sd.url, su.url])
        check_modes(pool, timeout=5)
    assert all(w.up for w in pool.all()) and pool.workers["decode"][1].kv_layout is None


def test_metrics_and_models():
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    with deployment([p], [d]) as (url, _, served):
        for _ in range(3):
            complete(url, "hello")
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=20) as s:
            s.read()
        httpx.post(url + "/v1/completions", json={"prompt": 1}, timeout=20)
        in_flight = lambda: sum(scrape_labelled(url, "role")["sparsekv:router_worker_requests_in_flight"].values())
        assert wait_until(lambda: in_flight() == 0)  # P's calls may end after the answers
        by_status = scrape_labelled(url, "status")["sparsekv:router_requests_total"]
        by_endpoint = scrape_labelled(url, "endpoint")
        flat = {name: sum(v.values()) for name, v in scrape_labelled(url, "role").items()}
        models = httpx.get(url + "/v1/models", timeout=20).json()
        one = [httpx.get(url + path, timeout=20).json()["id"] for path in ("/v1/models/fake", "/v1/models/org%2F..%2Fx")]
        health = httpx.get(url + "/health").json()
    assert by_status == {"200": 4.0, "400": 1.0}
    assert by_endpoint["sparsekv:router_request_seconds_count"] == {"/v1/completions": 5.0}
    assert flat["sparsekv:router_worker_up"] == 2.0 and flat["sparsekv:router_worker_requests_in_flight"] == 0.0
    assert models["data"][0]["id"] == "fake" and one == ["fake", "org/../x"]  # a name is never a path on the worker
    assert health == {"status": "ok", "prefill": [served["prefill"][0].url], "decode": [served["decode"][0].url]}


class Answer:
    """A completion's first choice as `assert_same_greedy` reads it: token ids and logprob dicts."""

    def __init__(self, body: dict):
        self.token_ids = body["sparsekv"]["choices"][0]["token_ids"]
        self.logprobs = _top_logprobs(body["choices"][0]["logprobs"]["top_logprobs"])

    @classmethod
    def from_events(cls, events: list[dict]) -> "Answer":
        """The same from a stream's events (the ids from their `token_id:N` logprob tokens)."""
        out = cls.__new__(cls)
        logprobs = [e["choices"][0]["logprobs"] for e in events]
        out.token_ids = [int(t.removeprefix("token_id:")) for lp in logprobs for t in lp["tokens"]]
        out.logprobs = _top_logprobs([top for lp in logprobs for top in lp["top_logprobs"]])
        return out


def _top_logprobs(tops: list[dict]) -> list[dict]:
    return [{int(k.removeprefix("token_id:")): v for k, v in top.items()} for top in tops]


def test_router_with_real_workers_answers_as_one_engine(glm_ckpt):
    """Router + a real prefill worker + a real decode worker: greedy tokens and logprobs of one
    colocated engine, streamed or not, and both workers clean afterwards."""
    import torch
    from disagg_util import ADMIN_KEY, WorkerServer
    from sparsekv import LLM, SamplingParams
    from sparsekv.tools.bench_serve import build_parser as bench_parser
    from sparsekv.tools.bench_serve_interference import run as run_interference
    from tolerances import assert_same_greedy, logprob_tolerance
    base = dict(kv_page_size=4, max_model_len=128, num_threads=1)
    body = {"max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    path = glm_ckpt[0]
    prompt = torch.randint(1, 256, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    colocated = LLM(path, **base)
    want = colocated.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    with WorkerServer(path, "prefill", **base) as p, WorkerServer(path, "decode", **base) as d:
        pool = WorkerPool([p.url], [d.url])
        check_modes(pool, timeout=10, interval=0.05)
        with Served(create_app(Router(pool, request_timeout=60, health_interval=0.2))) as router:
            answer = httpx.post(router.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
            for route, ask in (("/tokenize", {"prompt": "def f(x):"}), ("/detokenize", {"tokens": prompt[:5]})):
                assert httpx.post(router.url + route, json=ask, timeout=30).json() == \
                    httpx.post(d.url + route, json=ask, timeout=30).json(), route
            with httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                              json={**body, "prompt": prompt, "stream": True}) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # an RL trainer's update, through the router
            update = httpx.post(router.url + "/update_weights_from_disk", json={"model_path": path}, headers=admin,
                                timeout=60)
            assert update.status_code == 200 and update.json()["weights_version"] == 1, update.text
            assert httpx.post(router.url + "/flush_cache", headers=admin, timeout=30).status_code == 200
            assert httpx.post(router.url + "/flush_cache", timeout=30).status_code == 401  # no admin key
            abort = httpx.post(router.url + "/abort_request", json={"abort_all": True}, timeout=30)
            assert abort.status_code == 200 and abort.json()["aborted"] == 0, abort.text  # nothing in flight
            probe = httpx.get(router.url + "/health_generate", timeout=60)  # each worker's engine generates
            assert probe.status_code == 200 and set(probe.json()["workers"]) == {p.url, d.url}, probe.text
            aborted = _abort_through_the_router(router.url, d, {**body, "prompt": prompt[:20]})
            again = httpx.post(router.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
            assert again["choices"][0]["text"] == answer["choices"][0]["text"]  # both workers on version 1
            bench = asyncio.run(run_interference(bench_parser().parse_args([
                "--url", router.url, "--workload", "interference", "--streams", "2", "--input-len", "8",
                "--output-len", "12", "--long-prompt-len", "60", "--num-long-prompts", "2", "--long-prompt-rate", "20"])))
        streamed = Answer.from_events([e for e in events if e["choices"]])
        # quiet gaps count from when both streams have their first token: all of the later stream's 11,
        # and those of the earlier stream that came after it
        assert 11 <= bench["quiet"]["itl_ms"]["count"] <= 2 * 11 and bench["loaded"]["long_prompts_ok"] == 2
        assert bench["loaded"]["long_ttft_split_s"]["transfer_s"] > 0  # the decode worker's figures, through the router
        assert_same_greedy([want, want], [Answer(answer), streamed], logprob_tolerance(colocated))
        assert answer["sparsekv"]["disaggregation"]["pages_sent"] == (len(prompt) - 1) // base["kv_page_size"]
        assert aborted[-1]["choices"][0]["finish_reason"] == "abort" and aborted[-1]["id"] == "rollout-3"
        assert {e["choices"][0]["finish_reason"] for e in aborted[:-1] if e["choices"]} == {None}
        p.check_clean()
        d.check_clean()


@contextlib.contextmanager
def routed_pair(path: str, **options):
    """A real prefill worker and a real decode worker (disagg_util.WorkerServer, `options` for both) behind
    a router: yields (the router's URL, the prefill worker, the decode worker)."""
    from disagg_util import WorkerServer
    with WorkerServer(path, "prefill", **options) as p, WorkerServer(path, "decode", **options) as d:
        pool = WorkerPool([p.url], [d.url])
        check_modes(pool, timeout=10, interval=0.05)
        with Served(create_app(Router(pool, request_timeout=60, health_interval=0.2))) as router:
            yield router.url, p, d


class TransferHold:
    """Holds a room's batches on the prefill worker once its first tensors went (each waits until
    `release`, 30 s at most), so that its request stays in its transfer; `waiting` is set once one waits."""

    def __init__(self, monkeypatch):
        import sparsekv.disagg.outbox as outbox
        self.waiting, self.released, real = threading.Event(), threading.Event(), outbox.as_sent

        def held(tensors, first: int):
            if first > 0 and not self.released.is_set():
                self.waiting.set()
                self.released.wait(30)
            return real(tensors, first)
        monkeypatch.setattr(outbox, "as_sent", held)

    def hold(self) -> None:
        self.waiting.clear()
        self.released.clear()

    def release(self) -> None:
        self.released.set()


ALICE, BOB = ({"Authorization": f"Bearer sk-{who}"} for who in ("alice", "bob"))


def _abort_in_transfer(url: str, hold: TransferHold, body: dict, abort: dict) -> tuple[list[dict], list[dict]]:
    """Alice's request through the router, held in its transfer, and /abort_request `abort` through the
    router, by bob (then bob's abort_all), then by alice: (the choices alice got, each abort's answer)."""
    r, answers = _held_then_aborted(url, hold, "/v1/completions", body, abort)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] \
        if body.get("stream") else [r.json()]
    return [choice for event in events for choice in event["choices"]], answers


def _held_then_aborted(url: str, hold: TransferHold, path: str, body: dict, abort: dict) -> tuple:
    """Alice's request to `path` through the router, held in its transfer, and /abort_request `abort`
    through the router, by bob (then bob's abort_all), then by alice: (alice's 200, each abort's answer)."""
    hold.hold()
    sent = in_background(httpx.post, url + path, json=body, headers=ALICE, timeout=60)
    try:
        assert hold.waiting.wait(30), "the request never reached its transfer's second batch"
        answers = [httpx.post(url + "/abort_request", json=ask, headers=who, timeout=30).json()
                   for ask, who in ((abort, BOB), ({"abort_all": True}, BOB), (abort, ALICE))]
        concurrent.futures.wait([sent], timeout=30)
        assert sent.done(), "the request did not end while its transfer was held"
    finally:
        hold.release()
    r = sent.result(timeout=60)
    assert r.status_code == 200, r.text
    return r, answers


def _wait_clean(p, d) -> None:
    """Both workers done with every room (the prefill worker stops once it read the decode worker's
    verdict), and nothing of them left: requests, store keys; the pools' integrity holds."""
    assert wait_until(lambda: not p.worker.rooms and not d.worker.rooms and not p.engine.has_unfinished_requests()
                      and p.worker.store.num_keys() == 0, 30), (p.worker.rooms, d.worker.rooms)
    p.check_clean()
    d.check_clean()


def test_an_abort_during_the_transfer_ends_the_request_once_and_leaves_nothing_on_either_worker(glm_ckpt,
                                                                                               monkeypatch):
    """/abort_request through the router while a request is in its transfer (the prefill worker's batches
    after the room's first tensors held): by rid for a stream, with abort_all for a plain request.
    Another tenant's aborts end nothing; the owner's ends it, counted once (the decode worker holds it,
    the prefill worker counts its prefill no second time), and the client gets finish_reason "abort"
    and no token, as one server answers a request aborted before its first token. Neither worker keeps
    anything of the room (pages, requests, store keys) or counts a failed transfer, and the next
    request's greedy tokens and logprobs are one engine's."""
    import torch
    from sparsekv import LLM, SamplingParams
    from test_server_util import scrape
    from tolerances import assert_same_greedy, logprob_tolerance
    base = dict(kv_page_size=4, max_model_len=128, num_threads=1)
    prompts = [torch.randint(1, 256, (41,), generator=torch.Generator().manual_seed(seed)).tolist() for seed in (9, 10)]
    body = {"max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    colocated = LLM(glm_ckpt[0], **base)
    want = colocated.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True))
    hold = TransferHold(monkeypatch)
    with routed_pair(glm_ckpt[0], api_keys=["sk-alice:alice", "sk-bob:bob"], **base) as (url, p, d):
        for prompt, extra, abort in ((prompts[0], {"rid": "rollout-9", "stream": True}, {"rid": "rollout-9"}),
                                     (prompts[1], {}, {"abort_all": True})):
            got, answers = _abort_in_transfer(url, hold, {**body, **extra, "prompt": prompt}, abort)
            assert [a.get("aborted") for a in answers] == [0, 0, 1], answers
            assert answers[-1]["workers"][p.url]["aborted"] == 0, answers
            assert [(c["finish_reason"], c["text"]) for c in got] == [("abort", "")], got
            _wait_clean(p, d)
            assert d.engine.kv.held_prefix(prompt, "alice") == 0  # the pages it kept were forgotten again
        for w in (p, d):
            assert scrape(w.url)["sparsekv:disagg_transfers_failed_total"] == 0
        again = httpx.post(url + "/v1/completions", json={**body, "prompt": prompts[0]}, headers=ALICE, timeout=60)
        assert again.status_code == 200, again.text
        assert_same_greedy(want, [Answer(again.json())], logprob_tolerance(colocated))
        _wait_clean(p, d)


def test_an_abort_during_the_transfer_of_a_generate_batch_given_a_rid_per_prompt_ends_the_batch(glm_ckpt,
                                                                                                monkeypatch):
    """SGLang's /generate through the router, a batch with a `rid` per prompt held in its transfer:
    /abort_request naming one prompt's rid (or abort_all) ends the whole batch, which moves as one room,
    each prompt counted as one request as the engine counts them (another tenant's aborts end
    nothing). Alice gets SGLang's answers, each prompt's with its own id, finish_reason abort and no
    token, streamed or not; nothing of the room is left and the ids are free again."""
    import torch
    base = dict(kv_page_size=4, max_model_len=128, num_threads=1)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (41, 37)]
    body = {"input_ids": prompts, "rid": ["roll-a", "roll-b"],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    hold = TransferHold(monkeypatch)
    with routed_pair(glm_ckpt[0], api_keys=["sk-alice:alice", "sk-bob:bob"], **base) as (url, p, d):
        for extra, abort in (({}, {"rid": "roll-b"}), ({"stream": True}, {"abort_all": True})):
            r, answers = _held_then_aborted(url, hold, "/generate", {**body, **extra}, abort)
            assert [a.get("aborted") for a in answers] == [0, 0, 2], answers
            assert answers[-1]["workers"][p.url]["aborted"] == 0, answers
            if extra:
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                got = {e["index"]: e for e in events}  # each choice's last
                got = [got[i] for i in sorted(got)]
            else:
                got = r.json()
            assert [a["meta_info"]["id"] for a in got] == ["roll-a", "roll-b"], got
            for a in got:
                assert a["meta_info"]["finish_reason"]["type"] == "abort" and a["output_ids"] == [], a
            _wait_clean(p, d)
        again = httpx.post(url + "/generate", json=body, headers=ALICE, timeout=60)
        assert again.status_code == 200, again.text
        assert [a["meta_info"]["finish_reason"]["type"] for a in again.json()] == ["length", "length"]
        _wait_clean(p, d)


def _abort_through_the_router(url: str, decode, body: dict) -> list[dict]:
    """A stream with a client id, decoding slowly on the decode worker, ended by /abort_request through
    the router (which asks both workers; the decode worker holds it): its events."""
    from test_server_util import slow_steps
    delay, events, started = slow_steps(decode.engine), [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**body, "max_tokens": 80, "stream": True, "rid": "rollout-3"}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started.set()
    delay[0] = 0.05
    try:
        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(30)
        answer = httpx.post(url + "/abort_request", json={"rid": "rollout-3"}, timeout=30)
        thread.join(30)
    finally:
        delay[0] = 0.0
    assert answer.status_code == 200 and answer.json()["aborted"] == 1, answer.text
    return events


def test_in_flight_counts_end_with_each_call_however_it_ends_and_the_least_loaded_worker_takes_the_next():
    """The router's count of its requests in flight on each worker (`Worker.in_flight`, which the choice
    of a worker reads) goes back to what it was when a request is answered, fails on either side, ends
    with an error event or its client goes away, streamed or not. With a request held on one decode
    worker and no slack, each of those requests goes to the other, the least loaded: a count left up
    there sent the next request to the held worker (and took the worker out of rotation for good)."""
    p, d1, d2 = FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")
    with deployment([p], [d1, d2], load_slack=0) as (url, router, served):
        by_url = {w.url: w for w in router.pool.all()}
        counts = lambda: {w.url: w.in_flight for w in router.pool.all()}
        d1.hang = d2.hang = True  # the first request waits on its decode worker until let go
        held = in_background(complete, url, "held")
        assert wait_until(lambda: len(d1.bodies) + len(d2.bodies) == 1)
        busy, free = (d1, d2) if d1.bodies else (d2, d1)
        free.hang = False
        seen = {fake: by_url[s.url] for fake, s in zip((p, d1, d2), served["prefill"] + served["decode"])}
        assert wait_until(lambda: seen[p].in_flight == 0) and (seen[busy].in_flight, seen[free].in_flight) == (1, 0)

        def one(prompt: str, stream: bool = False) -> int:
            """A request that must go to the free decode worker; its status once every count is back. A
            failing prefill worker fails once the decode worker has the request too."""
            before = len(free.bodies)
            answer = in_background(stream_completion if stream else complete, url, prompt)
            assert wait_until(lambda: len(free.bodies) == before + 1 and len(p.bodies) == before + 2), prompt
            p.let_go()
            status = answer.result()[0] if stream else answer.result().status_code
            assert len(busy.bodies) == 1, prompt
            assert wait_until(lambda: seen[p].in_flight == 0 and seen[free].in_flight == 0), (prompt, counts())
            assert seen[busy].in_flight == 1, (prompt, counts())
            return status
        assert one("answered") == 200 and one("answered, streamed", stream=True) == 200
        p.fail, p.hang, p.released = 500, True, len(p.bodies)  # each call waits for its own let_go
        free.hang, free.hang_after, free.released = True, 0, len(free.bodies)  # waits for KV that will not come
        assert one("the prefill fails") == 503 and one("the prefill fails, streamed", stream=True) == 503
        p.fail, p.hang, free.hang = None, False, False
        free.fail = 502
        assert one("the decode fails") == 503 and one("the decode fails, streamed", stream=True) == 503
        free.fail = 401
        assert one("the decode refuses") == 401
        free.fail, free.error_event_after = None, 1
        assert one("an error event", stream=True) == 200
        free.error_event_after = None
        free.hang, free.hang_after = True, 1  # one event, then waits: the client leaves
        for stream in (False, True):
            body = json.dumps({"prompt": f"client gone {stream}", "max_tokens": 4, "stream": stream}).encode()
            before, cancelled = len(free.bodies), free.cancelled
            assert len(p.bodies) == before + 1
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert wait_until(lambda: len(free.bodies) == before + 1)
                received = b""
                while stream and b"data: " not in received:
                    received += sock.recv(4096)
            assert wait_until(lambda: free.cancelled == cancelled + 1)
            assert wait_until(lambda: seen[p].in_flight == 0 and seen[free].in_flight == 0), counts()
            assert seen[busy].in_flight == 1 and len(busy.bodies) == 1
        free.hang = False
        busy.let_go()
        assert held.result().status_code == 200
        assert wait_until(lambda: all(w.in_flight == 0 for w in router.pool.all())), counts()
        flat = {n: sum(v.values()) for n, v in scrape_labelled(url, "role").items()}
    assert flat["sparsekv:router_worker_requests_in_flight"] == 0.0


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}


def test_tools_and_structured_outputs_through_the_router_answer_as_a_colocated_server():
    """A named tool choice and a JSON schema constrain the decode worker's tokens (its grammar starts at
    the first token, which the prefill worker samples under the same grammar), streamed or not: the
    router's answers are a colocated server's, tool calls and parsed JSON included."""
    from disagg_util import WorkerServer
    from sparsekv.config import EngineConfig
    from sparsekv.engine import LLMEngine
    from sparsekv.server.app import ServerSettings, create_app as create_server
    from sparsekv.paths import default_model_path
    from sparsekv.server.auth import parse_api_keys
    path = default_model_path()  # its tokenizer spells JSON
    base = dict(kv_page_size=16, max_model_len=256, num_threads=1)
    messages = [{"role": "user", "content": "what is the weather in the plain of spain today"}]
    bodies = [("/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 48, "temperature": 0,
                                        "tool_choice": {"type": "function", "function": {"name": "lookup"}}}),
              ("/v1/chat/completions", {"messages": messages, "max_tokens": 48, "temperature": 0, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}),
              ("/v1/completions", {"prompt": "the answer is", "max_tokens": 24, "temperature": 0,
                                   "response_format": {"type": "json_object"}})]

    def answers(url: str) -> list:
        out = []
        for route, body in bodies:
            plain = httpx.post(url + route, json=body, timeout=60)
            assert plain.status_code == 200, plain.text
            with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            choice = plain.json()["choices"][0]
            out.append((choice.get("message", {}).get("tool_calls"), choice.get("message", {}).get("content"),
                        choice.get("text"), choice["finish_reason"], _streamed(events)))
        return out
    engine = LLMEngine(EngineConfig(model=path, **base))
    with Served(create_server(engine, ServerSettings(["tiny"], parse_api_keys([])))) as colocated:
        want = answers(colocated.url)
    with WorkerServer(path, "prefill", **base) as p, WorkerServer(path, "decode", **base) as d:
        pool = WorkerPool([p.url], [d.url])
        check_modes(pool, timeout=10, interval=0.05)
        with Served(create_app(Router(pool, request_timeout=60, health_interval=0.2))) as router:
            got = answers(router.url)
        p.check_clean()
        d.check_clean()
    tool_calls = want[0][0]
    assert tool_calls and tool_calls[0]["function"]["name"] == "lookup"
    assert tool_calls[0]["function"]["arguments"].startswith('{"city": "')  # the grammar's, whatever the tiny model writes
    assert want[1][1].startswith('{"n": ')
    for (w_calls, w_content, w_text, w_reason, w_stream), (g_calls, g_content, g_text, g_reason, g_stream) in zip(want, got):
        strip = lambda calls: calls and [c["function"] for c in calls]  # noqa: E731 (ids are per response)
        assert (strip(g_calls), g_content, g_text, g_reason) == (strip(w_calls), w_content, w_text, w_reason)
        assert g_stream == w_stream


def _streamed(events: list[dict]) -> tuple:
    """A stream's text and tool-call arguments, joined, and its finish reason."""
    text, arguments, reason = "", "", None
    for event in events:
        for choice in event.get("choices", []):
            delta = choice.get("delta", {})
            text += delta.get("content") or choice.get("text") or ""
            arguments += "".join(c["function"].get("arguments") or "" for c in delta.get("tool_calls") or [])
            reason = choice.get("finish_reason") or reason
    return text, arguments, reason


# --- in-process checks of the pool, the polling and one exchange (no servers, no ports) -----------------


def _pool(prefill: int = 1, decode: int = 2, load_slack: int = 4) -> WorkerPool:
    """A pool whose workers are up, as check_modes leaves them (prefill workers with a bootstrap address)."""
    pool = WorkerPool([f"http://p{i}:1" for i in range(prefill)], [f"http://d{i}:2" for i in range(decode)], load_slack)
    for i, w in enumerate(pool.all()):
        w.up = True
        if w.role == "prefill":
            w.bootstrap_host, w.bootstrap_port = f"10.0.0.{i}", 7000 + i
    return pool


def test_a_workers_load_counts_its_waiting_requests_and_this_routers_in_flight_ones():
    """Load is running + waiting as last reported, or this router's own in-flight count if larger: a
    worker with a deep queue (or with requests this router just sent, not yet in a report) must lose
    the choice to an idle one whatever the affinity key says."""
    from sparsekv.disagg.router_workers import Worker
    w = Worker("http://d:1", "decode", num_running=2, num_waiting=3, in_flight=4)
    assert w.load == 5
    w.in_flight = 9
    assert w.load == 9
    pool = _pool(decode=2, load_slack=0)
    queued, idle = pool.workers["decode"]
    for attribute in ("num_waiting", "num_running", "in_flight"):
        setattr(queued, attribute, 3)
        assert {pool.choose("decode", f"key {i}".encode()).url for i in range(16)} == {idle.url}, attribute
        setattr(queued, attribute, 0)
    assert {pool.choose("decode", f"key {i}".encode()).url for i in range(32)} == {queued.url, idle.url}


def test_the_affinity_key_holds_the_tenant_the_salt_and_the_leading_prompt_or_messages():
    """Requests of different tenants or salts share no prefix-cache pages, so they must not be sent
    together; chat messages are the prompt of a chat request (a key without them sent every chat request
    of a tenant to one worker); only the leading `prefix_chars` characters count."""
    from sparsekv.disagg.router_workers import affinity_key
    chat = lambda text: {"messages": [{"role": "user", "content": text}]}
    assert affinity_key({"prompt": "hi"}, "Bearer a", 64) != affinity_key({"prompt": "hi"}, "Bearer b", 64)
    assert affinity_key({"prompt": "hi"}, "Bearer a", 64) != affinity_key({"prompt": "hi"}, None, 64)
    assert affinity_key({"prompt": "hi", "cache_salt": "s1"}, None, 64) != \
        affinity_key({"prompt": "hi", "cache_salt": "s2"}, None, 64)
    assert affinity_key(chat("one question"), None, 64) != affinity_key(chat("another question"), None, 64)
    for field, one, other in (("text", "one", "two"), ("input_ids", [1, 2], [1, 3])):  # /generate's prompts
        assert affinity_key({field: one}, None, 64) != affinity_key({field: other}, None, 64)
    lead = lambda text: affinity_key({"prompt": text}, None, 64)
    assert lead("x" * 64 + "tail one") == lead("x" * 64 + "tail two")
    assert lead("x" * 62 + "a") != lead("x" * 62 + "b")  # the 64th character of the JSON, its quote the first


def test_a_prefill_worker_must_name_both_host_and_port_of_its_bootstrap_address():
    """A decode worker needs both to fetch the KV: an answer missing either one is not a prefill worker's."""
    from sparsekv.disagg.router_workers import Worker, WorkerInfo
    w = Worker("http://p:1", "prefill")
    assert w.mismatch(WorkerInfo(mode="prefill", bootstrap_host="h", bootstrap_port=5)) is None
    for host, port in (("h", None), (None, 5), (None, None)):
        assert "names no bootstrap address" in w.mismatch(WorkerInfo(mode="prefill", bootstrap_host=host,
                                                                     bootstrap_port=port))
    assert "says mode 'decode'" in w.mismatch(WorkerInfo(mode="decode"))
    assert Worker("http://d:1", "decode").mismatch(WorkerInfo(mode="decode")) is None


def test_worker_urls_drop_a_trailing_slash_and_refuse_a_worker_given_twice():
    """`http://h:1/` + `/v1/completions` is a path no worker serves; the same worker twice (with and
    without its slash) would count its load twice over."""
    from sparsekv.disagg.router import worker_urls
    assert worker_urls("--decode", ["http://h:1/", "https://g:2"]) == ["http://h:1", "https://g:2"]
    with pytest.raises(RouterConfigError, match="--decode: a worker is given twice"):
        worker_urls("--decode", ["http://h:1", "http://h:1/"])


class _Polled:
    """What a polled worker answers, per worker URL: `health` and `info` (a JSON body) or `error` (an
    httpx exception to raise)."""

    def __init__(self, pool: WorkerPool):
        self.answers = {w.url: {"health": 200, "error": None, "info": {
            "mode": w.role, "bootstrap_host": w.bootstrap_host, "bootstrap_port": w.bootstrap_port,
            "num_running": 0, "num_waiting": 0}} for w in pool.all()}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        answer = self.answers[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
        if answer["error"] is not None:
            raise answer["error"]("no answer", request=request)
        if request.url.path == "/health":
            return httpx.Response(answer["health"], json={})
        return httpx.Response(200, json=answer["info"])


def test_polling_marks_a_worker_down_on_an_error_or_another_role_and_after_the_third_timeout_in_a_row():
    """What one poll does to a worker: a refused connection, a /health that is not 200, or a
    /disaggregation naming another role takes it out at once; a timeout only counts, and the
    POLL_TIMEOUTS_BEFORE_DOWN-th in a row takes it out; any answer resets the count, brings it back and
    takes its reported load."""
    pool = _pool(decode=1)
    polled = _Polled(pool)
    d = pool.workers["decode"][0]
    answer = polled.answers[d.url]

    async def poll(times: int = 1) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(polled)) as client:
            for _ in range(times):
                await pool.poll(client)
    answer["error"] = httpx.ReadTimeout
    asyncio.run(poll(POLL_TIMEOUTS_BEFORE_DOWN - 1))
    assert d.up and d.polls_timed_out == POLL_TIMEOUTS_BEFORE_DOWN - 1
    asyncio.run(poll())
    assert not d.up
    answer["error"], answer["info"]["num_waiting"] = None, 7
    asyncio.run(poll())
    assert d.up and d.polls_timed_out == 0 and d.load == 7
    answer["error"] = httpx.ReadTimeout
    asyncio.run(poll(POLL_TIMEOUTS_BEFORE_DOWN - 1))
    assert d.up  # the count started again from the answer
    for why, change in (("refused", {"error": httpx.ConnectError}), ("unhealthy", {"health": 503}),
                        ("another role", {"info": {**answer["info"], "mode": "prefill"}})):
        answer.update({"error": None, "health": 200, "info": {**answer["info"], "mode": "decode"}})
        asyncio.run(poll())
        assert d.up, why
        answer.update(change)
        asyncio.run(poll())
        assert not d.up, why
    assert all(w.up for w in pool.workers["prefill"])


def _exchange_app(pool: WorkerPool, handler):
    """The router's app over `pool`, its client to the workers replaced by `handler` (an httpx
    MockTransport handler): the lifespan does not run, so nothing polls and the pool stays as set."""
    router = Router(pool, prefix_chars=64, request_timeout=60)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    app = create_app(router)
    return router, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def _routed(pool: WorkerPool, handler, body: dict | None, path: str = "/v1/completions",
            bound_s: float | None = None) -> tuple[Router, httpx.Response]:
    """One request through the router's app over `pool` (`_exchange_app`): `body` posted to `path`, or a
    GET of `path` without one, within `bound_s` if given; the router and the client's response."""
    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await (client.get(path) if body is None else client.post(path, json=body))
        await router.client.aclose()
        return router, r
    return asyncio.run(run() if bound_s is None else asyncio.wait_for(run(), bound_s))


def _role(request: httpx.Request) -> str:
    return "prefill" if request.url.host.startswith("p") else "decode"


def test_a_worker_that_refuses_the_connection_is_taken_out_at_once_and_the_next_request_avoids_it():
    """A connection error on a request is proof the worker is gone: it is marked down there and then, so
    the requests until the next poll go to the other worker instead of failing one after another."""
    pool = _pool(decode=2, load_slack=0)
    dead_url = pool.workers["decode"][0].url
    sent = []

    async def handler(request: httpx.Request) -> httpx.Response:
        sent.append((_role(request), str(request.url.host)))
        if str(request.url).startswith(dead_url):
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"role": _role(request)})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            body = {"model": "fake", "max_tokens": 2}
            first = await client.post("/v1/completions", json={**body, "prompt": "x"})
            later = [await client.post("/v1/completions", json={**body, "prompt": f"p{i}"}) for i in range(8)]
        await router.client.aclose()
        return first, later
    # the first request goes to the dead worker: the only one within the (zero) slack of the least loaded
    other = next(w for w in pool.workers["decode"] if w.url != dead_url)
    other.in_flight = 1
    first, later = asyncio.run(run())
    assert first.status_code == 503 and "connection refused" in first.json()["error"]["message"]
    dead = next(w for w in pool.workers["decode"] if w.url == dead_url)
    assert not dead.up and other.up
    assert [r.status_code for r in later] == [200] * 8


def test_retry_after_and_x_request_id_and_the_key_reach_the_client_and_the_workers():
    """The X-Request-Id and Authorization headers go to both workers (the request's id in both logs, the
    tenant's key checked on both), and a decode worker's Retry-After on its 503 reaches the client with
    the router's 503."""
    pool = _pool(decode=1)
    seen = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append((_role(request), request.headers.get("x-request-id"), request.headers.get("authorization")))
        if _role(request) == "decode":
            return httpx.Response(503, json=error_body(503, "overloaded"), headers={"Retry-After": "7"})
        return httpx.Response(200, json={})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "x"},
                                  headers={"X-Request-Id": "req-42", "Authorization": "Bearer tenant-a"})
        await router.client.aclose()
        return r
    r = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] == "7" and "overloaded" in r.json()["error"]["message"]
    assert sorted(seen) == [("decode", "req-42", "Bearer tenant-a"), ("prefill", "req-42", "Bearer tenant-a")]


def test_a_prefill_workers_4xx_is_the_clients_answer_not_the_decode_workers():
    """A prefill worker refusing the request (bad input, a wrong key) ends it with that answer as it is,
    even when the decode worker answers 200 afterwards: taking the prefill's 4xx for success handed the
    client an answer computed without the prefill's KV."""
    pool = _pool(decode=1)
    prefill_answered = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            prefill_answered.set()
            return httpx.Response(400, json=error_body(400, "prompt too long", "prompt"))
        await prefill_answered.wait()
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "not from the prefill's KV"}]})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        await router.client.aclose()
        return r
    r = asyncio.run(run())
    assert r.status_code == 400 and r.json() == error_body(400, "prompt too long", "prompt")
    assert all(w.in_flight == 0 for w in pool.all())


@pytest.mark.parametrize("body", [{"detail": "Not Found"}, {"error": "Not Found"},
                                  {"error": {"message": "Not Found", "code": "not_found"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_4xx_whose_json_is_not_the_openai_envelope_is_still_the_clients_answer(stream, body):
    """A 4xx whose JSON body is not the OpenAI error envelope (FastAPI's own `{"detail": ...}`, a
    proxy's in front of a worker, or an error whose code is a string, not the HTTP status) is still the
    client's answer with that status, in the envelope with an int code, and counted under that status:
    it was a bare 500 counted as a 200."""
    pool = _pool(decode=1)

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            return httpx.Response(200, json={})
        return httpx.Response(404, json=body)

    router, r = _routed(pool, handler, {"model": "fake", "prompt": "x", "stream": stream})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "Not Found" in r.json()["error"]["message"]
    value = router.metrics.registry.get_sample_value
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": "404"}) == 1.0
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": "200"}) is None
    assert all(w.in_flight == 0 for w in pool.all())


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_call_still_running_when_the_decode_worker_has_answered_is_left_to_finish(stream):
    """Once the decode worker has answered, the prefill worker has sent the KV and its own answer may
    still be on the way: the router lets that call end by itself (cancelling it closed the connection,
    and the prefill worker aborted a request that had succeeded)."""
    pool = _pool(decode=1)
    answered, prefill_cancelled, prefill_done = asyncio.Event(), [], []

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            try:
                await answered.wait()  # answers only after the client has the decode worker's answer
            except asyncio.CancelledError:
                prefill_cancelled.append(True)
                raise
            prefill_done.append(True)
            return httpx.Response(200, json={})
        if stream:
            async def events():  # a generator: a streamed answer's bytes are read as they come
                yield b'data: {"choices":[]}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "decoded"}]})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "stream": stream})
        answered.set()
        for _ in range(500):  # the prefill call's end, in the router's background
            if prefill_done or prefill_cancelled:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        await router.client.aclose()
        return r
    r = asyncio.run(run())
    assert r.status_code == 200
    assert prefill_cancelled == [] and prefill_done == [True]
    assert all(w.in_flight == 0 for w in pool.all())


def test_models_come_from_the_next_decode_worker_when_one_is_gone_and_the_gone_one_is_taken_out():
    """GET /v1/models asks the up decode workers in turn: one that refuses the connection is skipped and
    marked down at once (left up, generation requests kept going to it until the next poll)."""
    pool = _pool(decode=2)
    gone, alive = pool.workers["decode"]
    asked = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "d0":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "served-by-d1"}]})

    _, r = _routed(pool, handler, None, "/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "served-by-d1" and asked == ["d0", "d1"]
    assert not gone.up and alive.up


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizing_goes_to_an_up_decode_worker_with_the_body_and_the_key(path):
    """/tokenize and /detokenize answer as on one server: a decode worker's answer, its status as it
    is (a 4xx the client's), the body and the client's key forwarded; a worker that refuses the connection
    is skipped and taken out."""
    pool = _pool(decode=2)
    gone, alive = pool.workers["decode"]
    asked = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.path, json.loads(request.content),
                      request.headers.get("authorization"), request.headers.get("content-type")))
        if request.url.host == "d0":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError", "param": "prompt",
                                                   "code": 400}})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post(path, json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
        await router.client.aclose()
        return r
    r = asyncio.run(run())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert asked == [(host, path, {"prompt": "hi"}, "Bearer k", "application/json") for host in ("d0", "d1")]
    assert not gone.up and alive.up and not any(h.startswith("p") for h, *_ in asked)


def test_a_decode_worker_slow_to_tokenize_is_passed_over_not_taken_out():
    """A /tokenize the first decode worker does not answer in time (a long text; a read timeout) goes to
    the next worker, and the slow one stays up: it is busy, not gone, and generation requests still go
    to it. When no worker answers, the 503 names each one's failure."""
    pool = _pool(decode=2)
    slow, other = pool.workers["decode"]
    answering = {"d1"}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host not in answering:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"count": 2, "max_model_len": 128, "tokens": [1, 2]})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            first = await client.post("/tokenize", json={"prompt": "hi"})
            answering.clear()
            none = await client.post("/tokenize", json={"prompt": "hi"})
        await router.client.aclose()
        return first, none
    first, none = asyncio.run(run())
    assert first.status_code == 200 and first.json()["tokens"] == [1, 2]
    assert slow.up and other.up
    assert none.status_code == 503 and none.json()["error"]["message"] == (
        f"no decode worker answered ({slow.url}: ReadTimeout; {other.url}: ReadTimeout)")


def test_a_body_with_an_infinity_reaches_both_workers_as_the_client_wrote_it():
    """Python's json (the server's and the router's parser) reads NaN and infinities; the router writes
    them back to the workers, who answer as one server would, rather than failing with a 500."""
    pool = _pool(decode=1)
    seen = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        seen[_role(request)] = request.content
        return httpx.Response(200, json={"id": "cmpl-1", "choices": []})

    raw = b'{"prompt": "hi", "max_tokens": 2, "guided_json": {"type": "number", "maximum": Infinity}}'

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        await router.client.aclose()
        return r
    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    for role in ("prefill", "decode"):
        assert b'"maximum":Infinity' in seen[role]
        assert json.loads(seen[role])["guided_json"] == {"type": "number", "maximum": float("inf")}


def test_random_bodies_reach_the_workers_as_sent_or_get_a_400_never_a_500():
    """Seeded random requests (odd values in any field, NaN and infinities among them): the router refuses
    what a server would with a 400 envelope before asking a worker, and sends the rest to both workers as
    the client wrote them (the `disaggregation` tag added); never a 5xx of its own."""
    import math
    import random
    rng = random.Random(11)
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    sent = []
    with deployment([p], [d]) as (url, _, _):
        for _ in range(100):
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            chat = path.endswith("chat/completions")
            base = {"model": "fake", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
            content = random_openai_body(rng, chat, base)
            with httpx.stream("POST", url + path, content=content, timeout=20,
                              headers={"content-type": "application/json"}) as r:
                text = r.read().decode()
            assert r.status_code in (200, 400), (content[:300], r.status_code, text[:300])
            if r.status_code == 400:
                assert json.loads(text)["error"]["code"] == 400
            else:
                sent.append(json.loads(content))
        assert wait_until(lambda: len(p.bodies) == len(d.bodies) == len(sent), 10)

    def same(a, b):  # NaN is not equal to itself
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b
    assert 20 < len(sent) < 100  # both kinds exercised
    for want, got in zip(sent, d.bodies):
        assert same({k: v for k, v in got.items() if k != "disaggregation"}, want)


def _fanned_out(pool: WorkerPool, handler, path: str, body: dict) -> httpx.Response:
    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            r = await client.post(path, json=body, headers={"Authorization": "Bearer admin"})
        await router.client.aclose()
        return r
    return asyncio.run(run())


@pytest.mark.parametrize("path, answer, summary", [
    ("/flush_cache", {"success": True, "pages_removed": 3}, {"pages_removed": 9}),
    ("/update_weights_from_disk", {"success": True, "weights_version": 2}, {"weights_version": 2}),
    ("/pause_generation", {"success": True, "paused": True}, {}),
    ("/reset_prefix_cache", {"tenant": "t", "pages_removed": 1}, {"pages_removed": 3}),
    ("/abort_request", {"success": True, "aborted": 1}, {"aborted": 3}),
    ("/health_generate", {"status": "ok"}, {}),
])
def test_admin_calls_go_to_every_worker_of_both_roles(path, answer, summary):
    """The weights, the pause and the prefix caches are each worker's: the call goes to all three with the
    client's body and key, and the answer gathers theirs."""
    asked = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.path, json.loads(request.content), request.headers["authorization"]))
        return httpx.Response(200, json=answer)

    r = _fanned_out(_pool(prefill=1, decode=2), handler, path, {"model_path": "/ckpt"})
    assert r.status_code == 200, r.text
    assert sorted(asked) == [(h, path, {"model_path": "/ckpt"}, "Bearer admin") for h in ("d0", "d1", "p0")]
    assert r.json() == {"success": True, **summary, "workers": {u: answer for u in ("http://p0:1", "http://d0:2", "http://d1:2")}}


def test_an_admin_call_a_worker_fails_or_misses_is_the_worst_status_naming_each():
    """One worker refuses (409), one is gone (connection refused: 503): the answer is the worse status,
    naming both, with every worker's answer; the third still took the call."""
    asked = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "d0":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host == "p0":
            return httpx.Response(409, json=error_body(409, "a drain update is already waiting"))
        return httpx.Response(200, json={"success": True, "weights_version": 1})

    r = _fanned_out(_pool(prefill=1, decode=2), handler, "/update_weights_from_disk", {"model_path": "/ckpt"})
    assert r.status_code == 503 and sorted(asked) == ["d0", "d1", "p0"]
    err = r.json()["error"]
    assert err["code"] == 503 and err["message"].startswith("2 of 3 workers failed")
    assert "prefill worker http://p0:1: 409 a drain update is already waiting" in err["message"]
    assert "decode worker http://d0:2: 503 ConnectError" in err["message"]
    assert r.json()["workers"]["http://d1:2"] == {"success": True, "weights_version": 1}


@pytest.mark.parametrize("reply", [httpx.Response(200, json=["ok"]), httpx.Response(200, text="<html>ok</html>")])
def test_an_admin_answer_that_is_not_a_workers_is_a_failure_naming_it(reply):
    """A 2xx that is not a worker's JSON object (a proxy's page) does not say the call took: a 502."""
    async def handler(request: httpx.Request) -> httpx.Response:
        return reply if request.url.host == "d0" else httpx.Response(200, json={"success": True, "pages_removed": 1})

    r = _fanned_out(_pool(prefill=1, decode=1), handler, "/flush_cache", {})
    assert r.status_code == 502 and "decode worker http://d0:2: 502 not a worker's answer (200)" in r.json()["error"]["message"]


def test_ping_answers_as_health():
    _, r = _routed(_pool(), lambda request: httpx.Response(500), None, "/ping")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_the_same_prompt_from_different_tenants_is_spread_and_from_one_tenant_kept_together():
    """The router keys affinity by the request's Authorization too (a tenant's pages serve only that
    tenant): each tenant's requests for one prompt stay on one decode worker, and the tenants together
    use both (a key without the tenant sent every tenant's copy of a popular prompt to one worker)."""
    pool = _pool(decode=2)
    hosts: dict[str, list[str]] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "decode":
            hosts.setdefault(request.headers["authorization"], []).append(request.url.host)
        return httpx.Response(200, json={"choices": []})

    async def run():
        router, client = _exchange_app(pool, handler)
        async with client:
            for tenant in range(12):
                for _ in range(2):
                    r = await client.post("/v1/completions", json={"model": "fake", "prompt": SYSTEM},
                                          headers={"Authorization": f"Bearer tenant-{tenant}"})
                    assert r.status_code == 200
        await router.client.aclose()
    asyncio.run(run())
    assert len(hosts) == 12 and all(len(set(h)) == 1 for h in hosts.values())
    assert {h[0] for h in hosts.values()} == {"d0", "d1"}


def _error_event(body) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


@pytest.mark.parametrize("chunks, status, decode_failures", [
    # a 500 error event is a decode failure as a 503 is (>= 500, not > 500)
    ([b'data: {"choices":[]}\n\n', _error_event(error_body(500, "boom")), b"data: [DONE]\n\n"], "500", 1.0),
    # a 4xx error event (bad input found mid-stream) is counted under its code, not as the worker's failure
    ([b'data: {"choices":[]}\n\n', _error_event(error_body(400, "bad")), b"data: [DONE]\n\n"], "400", None),
    # an error event whose code is no int, or whose error is no object: the worker failed, counted as a 500
    ([_error_event({"error": {"message": "boom", "code": "overloaded"}}), b"data: [DONE]\n\n"], "500", 1.0),
    ([_error_event({"error": "boom"}), b"data: [DONE]\n\n"], "500", 1.0),
    # an error event cut in two chunks by the transport: the relay joins it before looking at it
    ([b'data: {"choices":[]}\n\ndata: {"err', _error_event(error_body(503, "boom"))[len(b'data: {"err'):],
      b"data: [DONE]\n\n"], "503", 1.0),
    # an error event and then `data: [DONE]` in a chunk of its own: counted under the error's code and as
    # the decode side's failure (the [DONE] chunk must not turn it back into a 200)
    ([b'data: {"choices":[{"index":0,"text":"He"}]}\n\n', _error_event(error_body(503, "the engine failed")),
      b"data: [DONE]\n\n"], "503", 1.0),
    # a last event with no blank line after it still reaches the client, byte for byte
    ([b'data: {"choices":[]}\n\n', b"data: [DONE]"], "200", None),
])
def test_a_stream_is_counted_under_its_error_events_code_and_relayed_byte_for_byte(chunks, status, decode_failures):
    """What a decode worker's stream is counted as, read from its error event (if any), whatever the
    transport's chunking: the code of the event, a 500 for one the router cannot read, a decode failure
    only for a code >= 500; the bytes reach the client unchanged."""
    pool = _pool(decode=1)

    async def events():
        for chunk in chunks:
            yield chunk
            await asyncio.sleep(0)

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            return httpx.Response(200, json={})
        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    router, r = _routed(pool, handler, {"model": "fake", "prompt": "x", "stream": True})
    assert r.status_code == 200 and r.content == b"".join(chunks)
    value = router.metrics.registry.get_sample_value
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": status}) == 1.0
    assert value("sparsekv:router_transfer_failures_total", {"role": "decode"}) == decode_failures


def test_a_prefill_failure_after_the_stream_began_is_counted_as_a_503_with_nothing_left_in_flight():
    """The stream has been handed to the client when the prefill call fails: the client gets the error
    event, and the request counts as a 503 (the code of the event it got) and as the prefill side's
    failure, not as a 200 or a client gone."""
    pool = _pool(decode=1)
    first_sent, never = asyncio.Event(), asyncio.Event()

    async def events():
        yield b'data: {"choices":[{"index":0,"text":"He"}]}\n\n'
        first_sent.set()
        await never.wait()  # waits for KV that will not come, until its call is cancelled
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            await first_sent.wait()
            return httpx.Response(500, json=error_body(500, "prefill says no"))
        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    router, r = _routed(pool, handler, {"model": "fake", "prompt": "x", "stream": True})
    got = [e for e in r.content.split(b"\n\n") if e]
    assert r.status_code == 200 and len(got) == 3 and got[-1] == b"data: [DONE]"
    assert json.loads(got[1][len(b"data: "):])["error"]["code"] == 503
    value = router.metrics.registry.get_sample_value
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": "503"}) == 1.0
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": "200"}) is None
    assert value("sparsekv:router_transfer_failures_total", {"role": "prefill"}) == 1.0
    assert value("sparsekv:router_requests_in_flight", {}) == 0.0


def test_models_with_no_decode_worker_up_is_a_503_in_the_envelope():
    """As a generation request with no worker up: a 503 a client and a load balancer can retry, not a 500."""
    pool = _pool(decode=1)
    pool.workers["decode"][0].up = False

    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no worker is up, yet {request.url} was asked")

    _, r = _routed(pool, handler, None, "/v1/models")
    assert r.status_code == 503 and r.json() == error_body(503, "no decode worker is up")


@pytest.mark.parametrize("info", [(500, {"detail": "boom"}), (200, {"mode": "decode", "num_running": "many"})])
def test_polling_marks_a_worker_down_whose_disaggregation_answer_is_an_error_or_malformed(info):
    """A /disaggregation answering an error status or a body that is not a worker's is no worker in its
    role: that poll takes it out (and the other workers' polls still run), as a refused connection does."""
    pool = _pool(decode=2)
    bad, good = pool.workers["decode"]
    for w in (bad, good):
        w.num_running = 3

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        if request.url.host == "d0":
            return httpx.Response(info[0], json=info[1])
        role = _role(request)
        return httpx.Response(200, json={"mode": role, "bootstrap_host": "h" if role == "prefill" else None,
                                          "bootstrap_port": 5 if role == "prefill" else None})

    async def poll():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await pool.poll(client)
    asyncio.run(poll())
    assert not bad.up and good.up and good.load == 0 and all(w.up for w in pool.workers["prefill"])


def test_startup_refuses_at_once_a_worker_whose_disaggregation_answer_is_an_error():
    """A server with no /disaggregation route (not a sparsekv worker, or one started without
    --disaggregation-mode) answers 404 at once: that is the error to report, not a wait until the
    start-up timeout ends in "did not answer"."""
    app = FastAPI()
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    d = FakeWorker("decode")
    with Served(app) as plain, Served(d.app) as sd:
        with pytest.raises(RouterConfigError, match=rf"--prefill {plain.url}: GET /disaggregation answered 404 "
                                                    r"\(is it a sparsekv worker"):
            check_modes(WorkerPool([plain.url], [sd.url]), timeout=5, interval=0.05)


def test_the_worker_series_report_each_workers_state_load_and_this_routers_requests_apart():
    """`router_worker_up` is the poll's verdict, `router_worker_load` the larger of the reported load and
    this router's requests there, `router_worker_requests_in_flight` only the latter."""
    from sparsekv.disagg.router_metrics import RouterMetrics
    pool = _pool(decode=2)
    busy, down = pool.workers["decode"]
    busy.num_running, busy.num_waiting, busy.in_flight = 5, 2, 1
    down.up, down.in_flight = False, 3
    value = RouterMetrics(pool).registry.get_sample_value
    series = lambda name, w: value(f"sparsekv:router_worker_{name}", {"worker": w.url, "role": w.role})
    assert [series("up", w) for w in (busy, down)] == [1.0, 0.0]
    assert [series("load", w) for w in (busy, down)] == [7.0, 3.0]
    assert [series("requests_in_flight", w) for w in (busy, down)] == [1.0, 3.0]


@pytest.mark.parametrize("error, gone", [(httpx.RemoteProtocolError, True), (httpx.ConnectTimeout, True),
                                         (httpx.ReadTimeout, False)])
def test_a_decode_call_that_proves_the_worker_gone_takes_it_out_and_a_slow_one_does_not(error, gone):
    """A connection dropped with no answer (the worker's process died) or one that could not be opened in
    time takes the worker out at once, as a refused connection does; a read that timed out is a busy
    worker's, which stays up. Either way the client gets a 503 naming the decode worker."""
    pool = _pool(decode=1)
    decode = pool.workers["decode"][0]

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "decode":
            raise error("no answer", request=request)
        return httpx.Response(200, json={})

    _, r = _routed(pool, handler, {"model": "fake", "prompt": "x"})
    assert r.status_code == 503 and f"decode worker {decode.url} failed: {error.__name__}" in r.json()["error"]["message"]
    assert decode.up is not gone and all(w.in_flight == 0 for w in pool.all())


@pytest.mark.parametrize("interval, timeout", [(0.01, 1.0), (3.0, 3.0)])
def test_a_health_poll_waits_at_least_a_second_however_often_the_workers_are_polled(interval, timeout):
    """Each poll may take as long as the interval between polls, and never less than a second: with a
    short --health-interval a poll timed out on any worker a little slow to answer, and three of them in a
    row took a healthy worker out."""
    pool = WorkerPool(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 4)
    clients = []

    async def poll(client):
        clients.append(client)
    router = Router(pool, request_timeout=60, health_interval=interval)

    async def main():
        poller = asyncio.ensure_future(router.poll_forever())
        try:
            while not clients and not poller.done():  # bounded by the wait below
                await asyncio.sleep(0.01)
        finally:
            poller.cancel()
    pool.poll = poll
    asyncio.run(asyncio.wait_for(main(), 10))
    assert clients[0].timeout == httpx.Timeout(timeout)


def test_a_prefill_worker_that_refuses_the_connection_ends_the_request_and_the_decode_call_at_once():
    """A prefill call that fails with no answer at all (here a refused connection) is a prefill failure
    like a 5xx: a 503 naming the prefill worker, which is taken out, and the decode call cancelled at
    once, not left waiting for KV that will never come (until the request timeout)."""
    pool = _pool(decode=1)
    prefill = pool.workers["prefill"][0]
    decode_cancelled = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if _role(request) == "prefill":
            raise httpx.ConnectError("connection refused", request=request)
        try:
            await asyncio.Event().wait()  # for KV that never comes
        except asyncio.CancelledError:
            decode_cancelled.append(True)
            raise
        return httpx.Response(200, json={})

    _, r = _routed(pool, handler, {"model": "fake", "prompt": "x"}, bound_s=20)  # at once, unless the decode call is left waiting
    assert r.status_code == 503 and f"prefill worker {prefill.url} failed: ConnectError" in r.json()["error"]["message"]
    assert not prefill.up and decode_cancelled == [True] and all(w.in_flight == 0 for w in pool.all())


def test_a_fault_of_the_router_itself_is_a_500_in_the_envelope_counted_with_nothing_in_flight():
    """An unexpected exception while the router starts a request (its own fault, no worker's answer) is a
    500 in the OpenAI error envelope, counted under 500, with the in-flight gauge back to 0: otherwise it
    escapes the handler as a bare 500 or a dropped connection and the gauge counts the request forever."""
    pool = _pool(decode=1)

    def broken_choice(role: str, key: bytes):
        raise RuntimeError("a fault of the router's own")
    pool.choose = broken_choice

    async def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"the request never started, yet {request.url} was asked")

    router, r = _routed(pool, handler, {"model": "fake", "prompt": "x"}, bound_s=20)
    assert r.status_code == 500 and r.json() == error_body(500, "the router could not start the request")
    value = router.metrics.registry.get_sample_value
    assert value("sparsekv:router_requests_total", {"endpoint": "/v1/completions", "status": "500"}) == 1.0
    assert value("sparsekv:router_requests_in_flight", {}) == 0.0


def test_leaving_the_running_router_cancels_the_calls_it_let_run_in_the_background():
    """At shutdown the router cancels what it left running (prefill calls left to finish, decode responses
    being closed) before its client to the workers closes, rather than leave them pending on a closed
    client until the event loop destroys them."""
    pool = WorkerPool(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 4)

    async def no_poll(client):
        pass
    pool.poll = no_poll
    router = Router(pool, request_timeout=60, health_interval=60)

    async def main() -> bool:
        async with router.running():
            left = asyncio.ensure_future(asyncio.Event().wait())
            router.background(left)
        await asyncio.wait({left}, timeout=5)  # at once, unless it was left running
        return left.cancelled()
    assert asyncio.run(asyncio.wait_for(main(), 20)) and not router._tasks


class NativeAnswer:
    """One /generate answer as `assert_same_greedy` reads it: its ids and top logprobs by token id."""

    def __init__(self, answer: dict):
        self.token_ids = answer["output_ids"]
        self.logprobs = [{token: lp for lp, token, _ in top} for top in answer["meta_info"]["output_top_logprobs"]]


def test_sglangs_generate_through_the_router_answers_as_a_colocated_server(glm_ckpt):
    """/generate (an RL framework's rollouts) behind the router: a batch with a rid per prompt, greedy
    with logprobs, a seeded sampled prompt and a stream give a colocated server's ids and logprobs, with
    the transfer's figures in meta_info; a batch whose prompts take different n is a 400 there."""
    import torch
    from sparsekv.config import EngineConfig
    from sparsekv.engine import LLMEngine
    from sparsekv.server.app import ServerSettings, create_app as create_server
    from sparsekv.server.auth import parse_api_keys
    from tolerances import assert_same_greedy, logprob_tolerance
    base = dict(kv_page_size=4, max_model_len=128, num_threads=1)
    path = glm_ckpt[0]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (37, 22)]
    greedy = {"input_ids": prompts, "rid": ["roll-a", "roll-b"], "return_logprob": True, "top_logprobs_num": 2,
              "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    seeded = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0.9,
                                                           "sampling_seed": 11, "ignore_eos": True}}

    def answers(url: str) -> tuple:
        batch = httpx.post(url + "/generate", json=greedy, timeout=60)
        sampled = httpx.post(url + "/generate", json=seeded, timeout=60)
        assert batch.status_code == sampled.status_code == 200, (batch.text, sampled.text)
        with httpx.stream("POST", url + "/generate", json={**seeded, "stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return batch.json(), sampled.json(), events
    engine = LLMEngine(EngineConfig(model=path, **base))
    with Served(create_server(engine, ServerSettings(["tiny"], parse_api_keys([])))) as colocated:
        want = answers(colocated.url)
    with routed_pair(path, **base) as (url, p, d):
        got = answers(url)
        uneven = httpx.post(url + "/generate", timeout=60, json={
            "input_ids": prompts, "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2}]})
        p.check_clean()
        d.check_clean()
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "sampling_params", uneven.text
    (w_batch, w_sampled, w_events), (g_batch, g_sampled, g_events) = want, got
    assert [a["meta_info"]["id"] for a in g_batch] == ["roll-a", "roll-b"]
    assert_same_greedy([NativeAnswer(a) for a in w_batch], [NativeAnswer(a) for a in g_batch],
                       logprob_tolerance(engine.executor.model))
    assert g_sampled["output_ids"] == w_sampled["output_ids"] and g_events[-1]["output_ids"] == w_sampled["output_ids"]
    assert w_events[-1]["output_ids"] == w_sampled["output_ids"]
    figures = g_batch[0]["meta_info"]["disaggregation"]
    # the prefill worker's first tokens came: the queue ends with their output, timed from each choice's first
    assert figures["first_tokens"] and figures["first_decode_s"] == 0.0 and figures["decode_queue_s"] >= 0
    assert all(e["meta_info"]["disaggregation"] == g_events[0]["meta_info"]["disaggregation"] for e in g_events)
    assert figures["pages_sent"] == sum((len(p) - 1) // base["kv_page_size"] for p in prompts)
    assert "disaggregation" not in w_batch[0]["meta_info"]


def _served_here(url: str) -> float:
    from test_server_util import scrape
    return scrape(url).get("sparsekv:request_success_total", 0.0)


def test_colocated_servers_behind_the_router_each_request_to_one_by_affinity_then_load():
    """`--worker`: the router in front of colocated servers (replicas). A request goes to one of them,
    its answer (plain, streamed, /generate) the server's own; the same prompt goes where it went before
    (its prefix cache) until that server is loaded past the slack, then to the other; tokenizing is
    answered by one; a server that stops is taken out and the next request goes to the other."""
    from sparsekv.paths import default_model_path
    from test_server_util import ThreadServer
    path = default_model_path()
    body = {"prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    with ThreadServer(path) as a, ThreadServer(path) as b:
        servers = {a.url: a, b.url: b}
        pool = WorkerPool([], [], load_slack=4, colocated=[a.url, b.url])  # NOTE: polled loads lag a request
        check_modes(pool, timeout=10, interval=0.05)
        with Served(create_app(Router(pool, request_timeout=60, health_interval=0.2))) as router:
            want = httpx.post(a.url + "/v1/completions", json=body, timeout=60).json()
            before = {url: _served_here(url) for url in servers}
            got = [httpx.post(router.url + "/v1/completions", json=body, timeout=60).json() for _ in range(3)]
            served = {url: _served_here(url) - before[url] for url in servers}
            assert sorted(served.values()) == [0, 3]  # one prompt, one replica: its prefix cache's
            home = max(served, key=served.get)
            assert all(g["choices"][0]["text"] == want["choices"][0]["text"] for g in got)
            assert got[0]["sparsekv"]["choices"][0]["token_ids"] == want["sparsekv"]["choices"][0]["token_ids"]
            with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                               if line.startswith("data: {"))
            assert text == want["choices"][0]["text"]
            native = httpx.post(router.url + "/generate", timeout=60, json={
                "text": body["prompt"], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
            assert native["text"] == want["choices"][0]["text"] and "disaggregation" not in native["meta_info"]
            assert httpx.post(router.url + "/tokenize", json={"prompt": "x y"}, timeout=30).json() == \
                httpx.post(a.url + "/tokenize", json={"prompt": "x y"}, timeout=30).json()
            health = httpx.get(router.url + "/health", timeout=5).json()
            assert health == {"status": "ok", "workers": [a.url, b.url]}
            pool.load_slack = 0
            servers[home].delay[0] = 0.2  # the home replica busy with a long request: past the slack, the other
            busy = in_background(httpx.post, router.url + "/v1/completions", timeout=60,
                                 json={**body, "max_tokens": 20, "ignore_eos": True})
            assert wait_until(lambda: any(w.in_flight for w in pool.all()), 10)
            other = next(url for url in servers if url != home)
            count = _served_here(other)
            assert httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 200
            assert _served_here(other) == count + 1
            servers[home].delay[0] = 0.0
            assert busy.result(60).status_code == 200
            b.__exit__(None, None, None)  # a replica stops: taken out, the requests go to the other
            codes = [httpx.post(router.url + "/v1/completions", json={**body, "prompt": f"p{i}"}, timeout=60).status_code
                     for i in range(4)]
            assert codes.count(200) >= 3 and set(codes) <= {200, 503}
            assert wait_until(lambda: httpx.get(router.url + "/health", timeout=5).json()["workers"] == [a.url], 10)


def test_the_router_takes_either_workers_by_role_or_colocated_servers_not_both():
    for given in (dict(prefill=["http://p:1"], decode=["http://d:2"], colocated=["http://w:3"]),
                  dict(prefill=[], decode=[], colocated=[]), dict(prefill=["http://p:1"], decode=[], colocated=[])):
        with pytest.raises(RouterConfigError, match="one of the two forms"):
            WorkerPool(given["prefill"], given["decode"], colocated=given["colocated"])
