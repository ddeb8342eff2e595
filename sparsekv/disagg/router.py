"""`sparsekv router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...] [--host H] [--port P]`:
the OpenAI-compatible front end of prefill/decode disaggregation. With `--worker URL [--worker URL ...]`
instead, the front end of colocated servers (replicas of the model, each any layout: one per node at
`-tp 8`): each request goes to one of them, chosen the same way, and its answer back as it came.

Each completion, chat or SGLang /generate request goes to one prefill worker P and one decode worker D,
chosen by load and prefix-cache affinity (router_workers.py). Both get the client's body, Authorization
header included (API keys and tenants are the workers' business), with one field added, the same for
both:

    "disaggregation": {"room": <a new id>, "bootstrap_host": <P's>, "bootstrap_port": <P's>}

P gets it with `stream: false` and answers once the prompt's KV has gone to D; D gets it as the client
sent it, and its answer (an SSE stream or one JSON body) goes back to the client byte for byte. A
worker's 4xx (bad input, a wrong key) is the client's answer as it is. A worker that fails (a 5xx, a
connection error, a timeout) ends the request: the router cancels the other worker's call (closing its
connection, which aborts the request there) and answers 503 in the OpenAI error envelope, or, once a
stream has started, one error event with the envelope, then `data: [DONE]`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.cookiejar
import importlib.metadata
import json
import logging
import sys
import time
import urllib.parse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine_args import at_least, port_number, positive_finite
from ..server.auth import OneAuthorization
from ..server.errors import APIError, error_body, error_response
from ..server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from ..server.native import GenerateRequest
from ..server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from .router_exchange import WORKER_GONE, Exchange, WorkerFailure, envelope
from .router_metrics import RouterMetrics
from .router_workers import NoWorker, RouterConfigError, WorkerPool, affinity_key, check_modes

log = logging.getLogger("sparsekv.router")
FORWARDED_HEADERS = ("authorization", "x-request-id")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# An idle connection to a worker is dropped after this many seconds, well before the worker's server
# (uvicorn: 5 s) closes it: a request sent on a connection the server is closing at that moment fails
# (ReadError), and a POST is not retried.
KEEPALIVE_EXPIRY_S = 2.0


class Router:
    """What the routes share: the worker pool, one HTTP client to the workers, metrics, settings."""

    def __init__(self, pool: WorkerPool, prefix_chars: int = 1024, request_timeout: float = 600.0,
                 health_interval: float = 2.0):
        self.pool, self.prefix_chars = pool, prefix_chars
        self.request_timeout, self.health_interval = request_timeout, health_interval
        self.metrics = RouterMetrics(pool)
        self.client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()

    def background(self, task: asyncio.Future) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def poll_forever(self) -> None:
        async with httpx.AsyncClient(timeout=max(1.0, self.health_interval),
                                     limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)) as client:
            while True:
                try:
                    await self.pool.poll(client)
                except Exception:  # noqa: BLE001 - a poll that fails must not end polling: the workers' states would freeze
                    log.exception("polling the workers' health failed")
                await asyncio.sleep(self.health_interval)

    @contextlib.asynccontextmanager
    async def running(self):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(timeout=self.request_timeout, limits=limits, cookies=_no_cookies()) as self.client:
            poller = asyncio.ensure_future(self.poll_forever())
            try:
                yield
            finally:
                poller.cancel()
                for task in list(self._tasks):
                    task.cancel()


def _no_cookies() -> http.cookiejar.CookieJar:
    """A jar that keeps nothing: the client is shared by every tenant's requests, so a cookie a worker
    set would go out with all of them."""
    return http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def _router(request: Request) -> Router:
    return request.app.state.router


async def _generate(request: Request, path: str, model: type) -> Response:
    router = _router(request)
    metrics, start = router.metrics, time.perf_counter()
    metrics.in_flight.inc()
    try:
        exchange, stream = await _start(request, router, path, model)
    except APIError as e:
        _observe(metrics, path, e.status, start)
        raise
    except Exception:  # the router's own fault: still counted, still the OpenAI envelope
        log.exception("starting a request failed")
        _observe(metrics, path, 500, start)
        raise APIError(500, "the router could not start the request") from None
    return await _answer(request, router, exchange, path, stream, start)


async def _start(request: Request, router: Router, path: str, model: type) -> tuple[Exchange, bool]:
    raw = await request.body()
    parse_body(raw, model)  # a bad body is a 400 here, before any worker is asked
    body = json.loads(raw)
    headers = _forwarded(request)
    for name, value in headers.items():
        if not value.isascii():  # not sendable on to a worker (nor a key any worker holds)
            raise APIError(400, f"the {name} header holds bytes that are not ASCII", name)
    key = affinity_key(body, request.headers.get("authorization"), router.prefix_chars)
    pool = router.pool
    try:
        if pool.colocated:
            prefill, decode = None, pool.choose("null", key)
        else:
            prefill, decode = pool.choose("prefill", key), pool.choose("decode", key)
    except NoWorker as e:
        raise APIError(503, str(e)) from None
    return Exchange(router, prefill, decode, path, body, headers), bool(body.get("stream"))


class ClientGone(Exception):
    pass


async def _answer(request: Request, router: Router, exchange: Exchange, path: str, stream: bool,
                  start: float) -> Response:
    """D's answer, or the failure's; until a stream is handed over, a client that goes away ends both
    calls (a plain response is not cancelled when it does, a stream is)."""
    status, handed_over = 200, False
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        response = await _unless_gone(watcher, exchange.open_decode())
        if not stream:
            body = await _unless_gone(watcher, exchange.decode_body())
            return Response(body, media_type=response.headers.get("content-type"))
        chunks = exchange.relay()
        first = await _unless_gone(watcher, anext(chunks, b""))  # a failure before the first event: a plain 503
        handed_over = True
        return StreamingResponse(_stream(router, exchange, path, start, first, chunks),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    except WorkerFailure as failure:
        status = failure.status
        return failure.response()
    except ClientGone:
        status = 499
        return JSONResponse(error_body(499, "client closed the request"), status_code=499)
    finally:
        watcher.cancel()
        if not handed_over:
            exchange.close(failed=status != 200)
            _observe(router.metrics, path, status, start)


async def _unless_gone(watcher: asyncio.Future, awaitable):
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(router: Router, exchange: Exchange, path: str, start: float, first: bytes, chunks):
    status = 499  # the client went away, unless the stream ends otherwise
    worker_error = None  # the code of an error event the decode worker ended the stream with
    try:
        worker_error = _error_code(first)
        yield first
        async for chunk in chunks:
            worker_error = _error_code(chunk) or worker_error
            yield chunk
        status = 200 if worker_error is None else worker_error
        if worker_error is not None and worker_error >= 500:
            router.metrics.failures.labels("decode").inc()
    except WorkerFailure as failure:
        status = failure.body["error"]["code"]
        yield failure.event()
    finally:
        exchange.close(failed=status != 200)
        _observe(router.metrics, path, status, start)


def _error_code(chunk: bytes) -> int | None:
    """The code of an error event among a chunk's events (the relay cuts chunks at event boundaries),
    None if it holds none: a stream the worker ended with one is counted under it, not as a 200."""
    for event in chunk.split(b"\n\n"):
        if event.startswith(b'data: {"error"'):
            try:
                code = json.loads(event[len(b"data: "):])["error"].get("code")
            except (ValueError, AttributeError, TypeError):
                return 500
            return code if isinstance(code, int) else 500
    return None


def _observe(metrics: RouterMetrics, path: str, status: int, start: float) -> None:
    metrics.in_flight.dec()
    metrics.requests.labels(path, str(status)).inc()
    metrics.seconds.labels(path).observe(time.perf_counter() - start)


async def completions(request: Request):
    return await _generate(request, "/v1/completions", CompletionRequest)


async def chat_completions(request: Request):
    return await _generate(request, "/v1/chat/completions", ChatCompletionRequest)


async def native_generate(request: Request):
    """SGLang's /generate (an RL framework's rollouts), routed as a completion is."""
    return await _generate(request, "/generate", GenerateRequest)


async def models(request: Request):
    """A decode worker's model list, or one model of it (the decode workers serve the model's names)."""
    return await _on_a_decode_worker(request, _models_path(request.path_params.get("model")))


async def tokenize(request: Request):
    """A decode worker's /tokenize (the workers share the tokenizer and chat template)."""
    return await _on_a_decode_worker(request, "/tokenize")


async def detokenize(request: Request):
    return await _on_a_decode_worker(request, "/detokenize")


async def _on_a_decode_worker(request: Request, path: str) -> Response:
    """The request (its method, body, `Authorization` and `X-Request-Id`) answered by the first decode
    worker up that answers, as it answers; one that refuses or drops the connection is marked down at
    once, one that fails otherwise (a slow answer: a long text to tokenize) is passed over only."""
    router = _router(request)
    headers = _forwarded(request)
    body = None
    if request.method == "POST":
        body = await request.body()
        headers["content-type"] = "application/json"
    slow = []
    for worker in router.pool.up(router.pool.answering):
        try:
            r = await router.client.request(request.method, worker.url + path, content=body, headers=headers)
        except WORKER_GONE as e:
            router.pool.mark_down(worker, f"{type(e).__name__}: {e}")
            continue
        except httpx.HTTPError as e:
            slow.append(f"{worker.url}: {type(e).__name__}")
            continue
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
    what = "worker" if router.pool.colocated else "decode worker"
    raise APIError(503, f"no {what} answered ({'; '.join(slow)})" if slow else f"no {what} is up")


async def to_every_worker(request: Request):
    """An admin call (`/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
    `/flush_cache`: an admin key's), a tenant's `/reset_prefix_cache` or `/abort_request`, or a probe's
    `/health_generate`, sent to every worker of both roles at once with the client's body and key: what
    it changes or checks (the weights, the pause, the prefix caches, the requests in flight, whether
    each engine generates) is each worker's own, and the prefill and decode workers must hold the same
    weights. 200 when every worker answers 2xx, with each answer
    under `workers` (`pages_removed` and `aborted` added up, the `weights_version` they agree on); else the worst status among the failed (a 5xx over a 4xx), in
    the envelope naming them, with every answer under `workers`. A worker down or gone is a failure
    (503): it did not take the call."""
    router = _router(request)
    body = await request.body()
    headers = {**_forwarded(request), "content-type": "application/json"}
    workers = router.pool.all()

    async def ask(worker) -> tuple[int, dict]:
        try:
            r = await router.client.post(worker.url + request.url.path, content=body, headers=headers)
        except httpx.HTTPError as e:
            return 503, error_body(503, f"{type(e).__name__}: {e}")
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # a proxy's page, not a worker's answer: the call's fate is unknown
            return 502, error_body(502, f"not a worker's answer ({r.status_code}): {r.text[:200]}")
        if not 200 <= r.status_code < 300:  # FastAPI's {"detail": ...} and the like: wrapped, as a 4xx is
            answer = envelope(r) or error_body(r.status_code, r.text[:200])
        return r.status_code, answer
    results = await asyncio.gather(*(ask(w) for w in workers))
    answers = {w.url: answer for w, (_, answer) in zip(workers, results)}
    failed = [(w, status, answer) for w, (status, answer) in zip(workers, results) if not 200 <= status < 300]
    if failed:
        status = max(s for _, s, _ in failed)
        why = "; ".join(f"{w.name} {w.url}: {s} {a['error']['message']}" for w, s, a in failed)
        return JSONResponse({**error_body(status, f"{len(failed)} of {len(workers)} workers failed: {why}"),
                             "workers": answers}, status_code=status)
    out = {"success": True, "workers": answers}
    for counted in ("pages_removed", "aborted"):
        if all(counted in a for a in answers.values()):
            out[counted] = sum(a[counted] for a in answers.values())
    versions = {a.get("weights_version") for a in answers.values()}
    if len(versions) == 1 and None not in versions:
        out["weights_version"] = versions.pop()
    return out


def _forwarded(request: Request) -> dict:
    """The client's headers a worker gets too: its key and its request id."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _models_path(name: str | None) -> str:
    """The list, or one model's path with its name quoted whole (a name is no path on the worker)."""
    return "/v1/models" if name is None else "/v1/models/" + urllib.parse.quote(name, safe="")


async def health(request: Request):
    pool = _router(request).pool
    roles = ("null",) if pool.colocated else ("prefill", "decode")
    up = {"workers" if role == "null" else role: [w.url for w in pool.up(role)] for role in roles}
    ok = pool.serving()
    return JSONResponse({"status": "ok" if ok else "no_worker", **up}, status_code=200 if ok else 503)


async def metrics(request: Request):
    return Response(_router(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request):
    return {"version": importlib.metadata.version("sparsekv")}


ROUTES = [("/v1/completions", completions, ["POST"]), ("/v1/chat/completions", chat_completions, ["POST"]),
          ("/generate", native_generate, ["POST"]),
          ("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"]),
          ("/v1/models", models, ["GET"]), ("/v1/models/{model:path}", models, ["GET"]),
          ("/health", health, ["GET", "HEAD"]), ("/ping", health, ["GET", "POST"]), ("/metrics", metrics, ["GET"]),
          ("/version", version, ["GET"]),
          ("/health_generate", to_every_worker, ["GET", "POST"]),
          *((path, to_every_worker, ["POST"]) for path in ("/update_weights_from_disk", "/pause_generation",
                                                           "/continue_generation", "/flush_cache",
                                                           "/reset_prefix_cache", "/abort_request"))]


def create_app(router: Router, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The router's app; its lifespan opens the client to the workers and runs the health polling."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with router.running():
            yield

    app = FastAPI(title="sparsekv router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    for path, fn, methods in ROUTES:
        app.add_api_route(path, fn, methods=methods)
    app.add_exception_handler(APIError, lambda req, exc: error_response(exc))
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(OneAuthorization)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv router", description="OpenAI-compatible front end of "
                                "prefill/decode disaggregation (each request to a prefill and a decode worker), "
                                "or of colocated servers (each request to one of them)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill worker (`sparsekv serve --disaggregation-mode prefill`), e.g. http://H:P; repeat")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker (`sparsekv serve --disaggregation-mode decode`); repeat")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="instead of --prefill and --decode: a colocated server (`sparsekv serve`, each a replica "
                        "of the model, e.g. one per node at -tp 8); each request goes to one of them; repeat")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--health-interval", type=positive_finite, default=2.0, help="seconds between polls of every worker")
    p.add_argument("--request-timeout", type=positive_finite, default=600.0,
                   help="seconds a worker may take to answer, or between two chunks of a stream")
    p.add_argument("--worker-startup-timeout", type=at_least(0.0, float), default=300.0,
                   help="seconds to wait at start-up for every worker to answer (they may be loading a model)")
    p.add_argument("--affinity-prefix-chars", type=at_least(0), default=1024,
                   help="requests whose prompt (or messages) share this many leading characters go to the same "
                        "workers, for their prefix caches")
    p.add_argument("--affinity-load-slack", type=at_least(0), default=4,
                   help="a request follows its prefix only to a worker within this many requests of the "
                        "least-loaded one")
    p.add_argument("--max-request-body-bytes", type=at_least(1), default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def worker_urls(flag: str, urls: list[str]) -> list[str]:
    out = [u.rstrip("/") for u in urls]
    bad = next((u for u in out if not u.startswith(("http://", "https://"))), None)
    if bad is not None:
        raise RouterConfigError(f"{flag} {bad}: a worker is a URL, http://HOST:PORT")
    if len(set(out)) != len(out):
        raise RouterConfigError(f"{flag}: a worker is given twice")
    return out


def main(argv: list[str]) -> int:
    import uvicorn
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        prefill, decode = worker_urls("--prefill", args.prefill), worker_urls("--decode", args.decode)
        colocated = worker_urls("--worker", args.worker)
        if set(prefill) & set(decode):
            raise RouterConfigError("a worker cannot be both --prefill and --decode")
        pool = WorkerPool(prefill, decode, args.affinity_load_slack, colocated)
        check_modes(pool, args.worker_startup_timeout)
    except RouterConfigError as e:
        print(f"sparsekv router: error: {e}", file=sys.stderr)
        return 2
    router = Router(pool, args.affinity_prefix_chars, args.request_timeout, args.health_interval)
    uvicorn.run(create_app(router, args.max_request_body_bytes), host=args.host, port=args.port,
                log_level=args.log_level, access_log=args.log_level == "debug")
    return 0
