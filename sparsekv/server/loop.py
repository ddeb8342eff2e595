"""The engine loop: the one thread that owns the (not thread-safe) engine.

HTTP handlers never touch the engine. They put commands on a queue (add a group of requests, abort a
group, abort everything); the loop runs them between steps, steps the engine while it has work, and
hands each output to the asyncio queue of the HTTP request it belongs to.

A dedicated thread rather than `asyncio.to_thread(engine.step)`: commands and steps then interleave in
one place, so an abort can never race a step, and a slow step never blocks the event loop.

If `engine.step()` raises, the loop is dead: every waiting client gets `EngineDead`, new requests are
refused, /health turns 503. The thread keeps answering commands (with errors), so nothing hangs.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time

import torch

from ..parallel.executor import RankFailure
from dataclasses import dataclass, replace

from ..outputs import FirstToken
from ..sampling_params import InvalidRequest
from ..request import RequestOutput, SamplingParams
from .metrics import RequestTimer

log = logging.getLogger("sparsekv.server")
FAULT_ENV, DELAY_ENV = "SPARSEKV_INJECT_STEP_FAULT", "SPARSEKV_INJECT_STEP_DELAY"  # see install_test_hooks


class EngineDead(RuntimeError):
    """The engine raised, in a step or between steps; the server can no longer generate. `status`: 503
    when a rank of a parallel engine failed (the service is down, not the request at fault), else 500."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class QueueFull(RuntimeError):
    """--max-queued-requests would be exceeded."""


class ShuttingDown(RuntimeError):
    """The server is draining (SIGTERM) and admits nothing new, or aborted the request on shutdown."""


@dataclass
class Submission:
    """One engine request of a group: the prompt (text or token ids) and its sampling parameters."""

    prompt: str | list[int]
    params: SamplingParams
    first_token: FirstToken | None = None  # sampled by a disaggregated prefill worker


class RequestGroup:
    """The engine requests behind one HTTP request (n choices x prompts) and the queue they report on.

    Items on `queue` are `(index, RequestOutput)` or `(None, exception)`.
    """

    def __init__(self, group_id: str, size: int, client_id: str | None = None, client_ids: list[str] | None = None):
        self.request_ids = [f"{group_id}-{i}" for i in range(size)]
        # the id its client knows it by (the response's `id`, or the request's `rid`), which
        # /abort_request names; `chosen`: the client chose it, so no other of its tenant's may hold it.
        # `client_ids`: an id per engine request instead (a /generate batch's `rid` list, one per prompt)
        self.client_id, self.chosen = client_id or group_id, client_id is not None or client_ids is not None
        if client_ids is not None and len(client_ids) != size:
            raise ValueError(f"{len(client_ids)} client ids for {size} engine requests")
        self.client_ids = client_ids
        self.observed = True  # its latencies and finish go to the metrics (not a /health_generate probe's)
        # whether /abort_request may name it: not a prefill worker's prefill, which the decode worker holding
        # the client's request ends through their room (so that an abort counts the request once)
        self.abortable = True
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None  # when the engine first scheduled one of its requests
        self.num_finished = 0

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.request_ids)

    def client_id_of(self, index: int) -> str:
        """The id /abort_request names engine request `index` by."""
        return self.client_id if self.client_ids is None else self.client_ids[index]

    def chosen_ids(self) -> set[str]:
        """The ids its client chose (none: the server named it)."""
        if not self.chosen:
            return set()
        return {self.client_id} if self.client_ids is None else set(self.client_ids)


@dataclass
class _Route:
    group: RequestGroup
    index: int
    request: object  # sparsekv.request.Request, for its scheduling time
    timer: RequestTimer
    last: RequestOutput | None = None  # its latest output, which an abort ends with


class EngineLoop:
    def __init__(self, engine, metrics=None, max_queued_requests: int | None = None,
                 max_queued_per_tenant: int | None = None):
        self.engine, self.metrics = engine, metrics
        self.max_queued_requests, self.max_queued_per_tenant = max_queued_requests, max_queued_per_tenant
        self.dead: BaseException | None = None
        self.draining = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._stats = engine.stats()
        self.last_step_end: float | None = None  # monotonic time the last step returned
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._cuda_index = _cuda_index(getattr(engine, "device", None))  # read here, on the thread that built the engine
        install_test_hooks(engine, os.environ)

    # -- called from the event loop ------------------------------------------------------------
    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sparsekv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._commands.put((lambda: None, ()))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        return self._stats

    @property
    def num_active(self) -> int:
        return len(self._routes)

    async def submit(self, group: RequestGroup, subs: list[Submission], tenant: str, cache_salt: str | None) -> None:
        """Add every submission to the engine, or none: raises InvalidRequest, QueueFull, ShuttingDown, EngineDead.

        NOTE: the caller must `abort(group)` in a `finally`, also when this is cancelled: the add may
        already have run in the loop thread.
        """
        self._refuse_if_closed()
        fut = self._aloop.create_future()
        self._commands.put((self._add, (group, subs, tenant, cache_salt, fut)))
        await fut

    async def call(self, fn, *args):
        """`fn(*args)` on the loop thread (the only thread that touches the engine); its result."""
        self._refuse_if_closed()
        fut, box = self._aloop.create_future(), []

        def run():
            try:
                box.append(fn(*args))
            except Exception as e:  # handed to the caller
                self._resolve(fut, e)
                return
            self._resolve(fut, None)
        self._commands.put((run, ()))
        await fut
        return box[0]

    def abort(self, group: RequestGroup) -> None:
        if not group.done:
            self._commands.put((self._abort_group, (group, "client_disconnect")))

    async def abort_requests(self, tenant: str, client_id: str | None) -> int:
        """End the tenant's requests in flight whose client id is `client_id` (all of them: None) with
        finish_reason "abort" and what they generated so far, as a client gets a finished request's;
        their pages are freed. How many requests, as their clients name them, it ended (an API request, or a
        prompt of a /generate batch given a `rid` each; 0: none was in flight)."""
        self._refuse_if_closed()
        fut, box = self._aloop.create_future(), []
        self._commands.put((self._abort_matching, (tenant, client_id, box, fut)))
        await fut
        return box[0]

    async def end_aborted(self, group: RequestGroup) -> None:
        """End the group's requests in flight as /abort_request does (finish_reason "abort" and what they
        generated so far), also a group it does not name (`abortable`: a prefill worker's prefill)."""
        self._refuse_if_closed()
        fut = self._aloop.create_future()
        self._commands.put((self._end_group, (group, fut)))
        await fut

    async def abort_all(self, reason: str) -> None:
        """Abort every request in flight; each waiting client gets ShuttingDown(reason)."""
        fut = self._aloop.create_future()
        self._commands.put((self._abort_everything, (reason, fut)))
        await fut

    async def wait_idle(self, timeout: float, cut_short=lambda: False) -> bool:
        """Whether every request finished within `timeout` seconds (waiting ends early once the engine
        is dead or `cut_short()` is true)."""
        deadline = time.monotonic() + timeout
        while self._routes and self.dead is None and time.monotonic() < deadline and not cut_short():
            await asyncio.sleep(0.05)
        return not self._routes

    def _refuse_if_closed(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine failed and cannot serve requests: {self.dead!r}")
        if self.draining:
            raise ShuttingDown("the server is shutting down and accepts no new requests")

    # -- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._cuda_index is not None:  # a new thread's current device is cuda:0
                torch.cuda.set_device(self._cuda_index)
        except Exception as e:  # noqa: BLE001 - a loop that cannot take its device refuses every request
            self._die(e)
        while not self._stopped:
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - outside a step: a rank died or stopped answering, or the engine
                self._die(e)        # failed; an ended thread would leave every client waiting

    def _turn(self) -> None:
        busy = self.dead is None and self._has_work()
        if self._run_commands(block=not busy):
            self._refresh_stats()
        if not busy and self.dead is None:
            self._expire()
        if self.dead is None and self._has_work():
            self._step()

    def _has_work(self) -> bool:
        """Requests to step, and generation not paused (/pause_generation: they wait, KV kept)."""
        return self.engine.has_unfinished_requests() and not getattr(self.engine, "paused", False)

    def deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs the engine made outside a step (requests a weight update aborted), to their clients.
        On the loop thread."""
        now = time.monotonic()
        self._deliver([self._route_output(out, now) for out in outputs if out.request_id in self._routes])

    def _run_commands(self, block: bool) -> bool:
        try:
            fn, args = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            try:
                fn(*args)
            except Exception:  # keep the thread alive: a dead loop thread would hang every client
                log.exception("engine loop command %s failed", getattr(fn, "__name__", fn))
            try:
                fn, args = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _expire(self) -> None:
        """Idle: the prefix cache's retention still runs (a step does it when busy), and the ranks of a
        parallel engine are looked at, so that a rank that died while nothing ran turns /health to 503
        (RankFailure) rather than failing the next request."""
        self.engine.check_ranks()
        try:
            if self.engine.expire_prefix_cache():
                self._refresh_stats()
        except RankFailure:
            raise
        except Exception:
            log.exception("prefix cache expiry failed")

    def _refresh_stats(self) -> None:
        """The figures /metrics and the queue bounds read; RankFailure when the ranks are gone."""
        try:
            self._stats = self.engine.stats()
        except RankFailure:
            raise
        except Exception:  # a broken engine keeps its last figures
            log.exception("engine.stats() failed")

    def _add(self, group: RequestGroup, subs: list[Submission], tenant: str, cache_salt, fut) -> None:
        try:
            self._refuse_if_closed()
            self._refuse_if_queue_full(tenant, len(subs))
            for client_id in sorted(group.chosen_ids()):
                if self._matching(tenant, client_id):
                    raise InvalidRequest(f"request id {client_id!r} is already in use by a request in flight", "rid")
            added = []
            try:
                for i, (rid, sub) in enumerate(zip(group.request_ids, subs)):
                    req = self.engine.add_request(rid, sub.prompt, sub.params, tenant, cache_salt, sub.first_token)
                    added.append(rid)
                    self._routes[rid] = _Route(group, i, req, RequestTimer(group.arrival, tenant))
            except BaseException:
                for rid in added:
                    self.engine.abort(rid)
                    self._routes.pop(rid, None)
                raise
        except Exception as e:  # handed to the HTTP handler, which maps it to a status
            self._resolve(fut, e)
            return
        self._resolve(fut, None)

    def _refuse_if_queue_full(self, tenant: str, adding: int) -> None:
        """503 past the queue's bound, or past the tenant's share of it: one tenant's burst cannot fill
        the queue and turn every other tenant away."""
        engine = self.engine
        bound = min((b for b in (self.max_queued_requests, self.max_queued_per_tenant) if b is not None), default=adding)
        if adding > bound:  # never admissible, however long the client waits: not a 503 to retry
            raise InvalidRequest(f"this request is {adding} sequences (prompts x n), more than the {bound} the queue "
                                 f"may hold waiting (--max-queued-requests / --max-queued-requests-per-tenant)", "n")
        if self.max_queued_requests is not None and engine.num_waiting_requests() + adding > self.max_queued_requests:
            raise QueueFull(f"the request queue is full ({self.max_queued_requests} requests waiting); retry later")
        if self.max_queued_per_tenant is not None and \
                engine.num_waiting_requests(tenant) + adding > self.max_queued_per_tenant:
            raise QueueFull(f"this tenant already has {self.max_queued_per_tenant} requests waiting, its bound; retry later")

    def _abort_group(self, group: RequestGroup, reason: str) -> None:
        n = sum(self._abort_one(rid) for rid in group.request_ids if rid in self._routes)
        if self.metrics:
            self.metrics.abort(reason, n)

    def _abort_one(self, rid: str) -> bool:
        self._routes.pop(rid, None)
        try:
            return self.engine.abort(rid)
        except Exception:  # a dead engine may not abort cleanly; the route is gone either way
            log.exception("abort of %s failed", rid)
            return False

    def _matching(self, tenant: str, client_id: str | None) -> list[tuple[str, _Route]]:
        return [(rid, r) for rid, r in self._routes.items() if r.group.abortable and r.timer.tenant == tenant
                and (client_id is None or r.group.client_id_of(r.index) == client_id)]

    def _abort_matching(self, tenant: str, client_id: str | None, box: list, fut) -> None:
        try:
            matched = self._matching(tenant, client_id)
            self._end_with_abort(matched)
            box.append(len({(id(r.group), r.group.client_id_of(r.index)) for _, r in matched}))
        finally:
            self._resolve(fut, None)

    def _end_group(self, group: RequestGroup, fut) -> None:
        try:
            self._end_with_abort([(rid, self._routes[rid]) for rid in group.request_ids if rid in self._routes])
        finally:
            self._resolve(fut, None)

    def _end_with_abort(self, matched: list[tuple[str, _Route]]) -> None:
        now, batch = time.monotonic(), []
        for rid, route in matched:
            batch.append(self._route_output(_aborted_output(rid, route), now))  # drops the route
            self._abort_one(rid)
        if self.metrics and matched:
            self.metrics.abort("abort_request", len(matched))
        self._deliver(batch)

    def _abort_everything(self, reason: str, fut) -> None:
        routes = list(self._routes.items())
        try:
            for rid, _ in routes:
                self._abort_one(rid)
            if self.metrics:
                self.metrics.abort("shutdown", len(routes))
            self._deliver([(r.group, None, ShuttingDown(reason)) for _, r in routes])
        finally:
            self._resolve(fut, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._die(e)
            return
        now = self.last_step_end = time.monotonic()
        batch = [self._route_output(out, now) for out in outputs if out.request_id in self._routes]
        try:
            self._refresh_stats()
        finally:  # the step's outputs reach their clients even when the ranks failed after it
            self._deliver(batch)

    def _route_output(self, out: RequestOutput, now: float):
        route = self._routes[out.request_id]
        scheduled = getattr(route.request, "first_scheduled_time", None)
        if self.metrics and route.group.observed:
            self.metrics.observe(route.timer, out, now, scheduled)
        if route.group.first_scheduled is None:
            route.group.first_scheduled = scheduled
        route.last = out
        if out.finished:
            del self._routes[out.request_id]
        return route.group, route.index, out

    def _die(self, e: BaseException) -> None:
        log.error("the engine failed; the server can no longer generate", exc_info=e)
        self.dead = e
        routes = list(self._routes.values())
        self._routes.clear()
        if self.metrics:
            self.metrics.abort("engine_fault", len(routes))
        status = 503 if isinstance(e, RankFailure) else 500
        self._deliver([(r.group, None, EngineDead(f"the engine failed: {e!r}", status)) for r in routes])

    # -- thread -> event loop ------------------------------------------------------------------
    def _deliver(self, batch: list) -> None:
        if batch:
            self._call_soon(_put_all, batch)

    def _resolve(self, fut, error) -> None:
        self._call_soon(_set_future, fut, error)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._aloop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _put_all(batch: list) -> None:
    for group, index, item in batch:
        if index is not None and item.finished:
            group.num_finished += 1
        group.queue.put_nowait((index, item))


def _set_future(fut: asyncio.Future, error) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def install_test_hooks(engine, environ) -> None:
    """Test hooks, off unless set: `SPARSEKV_INJECT_STEP_FAULT=N` makes the N-th engine.step raise (to
    check that a fault reaches every client); `SPARSEKV_INJECT_STEP_DELAY=S` sleeps S seconds before
    each step (to keep requests in flight while a test disconnects or sends SIGTERM)."""
    fault, delay = environ.get(FAULT_ENV), float(environ.get(DELAY_ENV) or 0)
    if not fault and not delay:
        return
    remaining = [int(fault or 0)]
    real_step = engine.step

    def hooked_step():
        if delay:
            time.sleep(delay)
        if fault:
            remaining[0] -= 1
            if remaining[0] <= 0:
                raise RuntimeError(f"injected engine fault ({FAULT_ENV})")
        return real_step()

    engine.step = hooked_step


def _cuda_index(device) -> int | None:
    """The index of the CUDA device the engine runs on, or None off CUDA. NOTE: `torch.cuda.set_device`
    refuses a device without an index (`torch.device("cuda")`, what `--device cuda` gives: ValueError
    "Expected a torch.device with a specified index"); such an engine was built on the current device
    of the thread that made it, which is read here, on that thread."""
    if device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _aborted_output(rid: str, route: _Route) -> RequestOutput:
    """The final output of a request ended by /abort_request: its latest output (the tokens, text and
    logprobs so far) with finish_reason "abort", or an empty one when it has none yet."""
    if route.last is not None:
        return replace(route.last, finish_reason="abort", stop_reason=None, new_token_ids=[])
    return empty_aborted_output(rid, route.request.prompt_token_ids, route.request.params)


def empty_aborted_output(rid: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
    """The final output of a request /abort_request ended before it output anything: no token, and
    finish_reason "abort"; with prompt logprobs asked for (an echo), none known for any prompt token."""
    logprobs = [] if params.logprobs is not None else None
    prompt_logprobs = [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
    return RequestOutput(rid, list(prompt_token_ids), [], "", logprobs, "abort", prompt_logprobs=prompt_logprobs)
