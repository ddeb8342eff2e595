"""The router's view of its workers: which are up, how loaded, and which pair a request goes to (or,
in front of colocated servers, `--worker`, which one).

Every worker answers `GET /disaggregation` with its mode, its bootstrap address (where a decode worker
fetches a prompt's KV from a prefill worker) and its load. The router checks the modes once at start-up
(`check_modes`), then polls every worker (`WorkerPool.poll`): a worker is up while `/health` answers 200
and `/disaggregation` names the role it was given. A worker that refuses a connection, answers an error
or names another role is marked down at once; one that does not answer in time is busy, not gone, and
is marked down only after `POLL_TIMEOUTS_BEFORE_DOWN` polls in a row time out (a loaded worker
answering one poll late must not turn every request away). The next poll that finds it healthy brings
it back.

Choosing a worker (`WorkerPool.choose`) weighs prefix-cache affinity against load. A request's
affinity key is its leading prompt (`affinity_key`): requests that share it share prefix-cache pages,
so they should land where the first one did. Workers are ranked for a key by rendezvous hashing
(highest hash of key + URL first), which sends a key to the same worker for as long as that worker
stays up and moves only its keys when it goes down. The first worker in that order whose load is
within `load_slack` requests of the least-loaded up worker takes the request.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("sparsekv.router")
ROLES = ("prefill", "decode", "null")  # null: a colocated server (`--disaggregation-mode null`)
FLAGS = {"prefill": "--prefill", "decode": "--decode", "null": "--worker"}
DISAGGREGATION_PATH = "/disaggregation"
POLL_TIMEOUTS_BEFORE_DOWN = 3


class WorkerInfo(BaseModel):
    """A worker's answer to `GET /disaggregation`."""

    model_config = ConfigDict(extra="ignore", strict=True)
    mode: Literal["prefill", "decode", "null"]
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    transfer_backend: str | None = None
    kv_layout: list | None = None
    num_running: int = 0
    num_waiting: int = 0


class NoWorker(Exception):
    """No worker of a role is up."""


class RouterConfigError(Exception):
    """The workers given at start-up are unusable (wrong mode, unreachable, malformed answer)."""


@dataclass
class Worker:
    url: str
    role: str
    up: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    transfer_backend: str | None = None
    kv_layout: list | None = None
    num_running: int = 0
    num_waiting: int = 0
    in_flight: int = 0  # requests this router sent here that have not ended
    polls_timed_out: int = 0  # polls in a row that got no answer in time

    @property
    def name(self) -> str:
        """How messages name it: "prefill worker", "decode worker", or "worker" (a colocated server)."""
        return "worker" if self.role == "null" else f"{self.role} worker"

    @property
    def flag(self) -> str:
        """The router's option that names a worker of this role."""
        return FLAGS[self.role]

    @property
    def load(self) -> int:
        """Requests on the worker: the larger of its last report (which lags, and counts other
        routers' requests) and what this router has in flight there (exact, for its own)."""
        return max(self.num_running + self.num_waiting, self.in_flight)

    def mismatch(self, info: WorkerInfo) -> str | None:
        """Why this answer to GET /disaggregation does not fit the worker's role (None if it does)."""
        if info.mode != self.role:
            return f"GET {DISAGGREGATION_PATH} says mode {info.mode!r}"
        if self.role == "prefill" and (info.bootstrap_host is None or info.bootstrap_port is None):
            return f"GET {DISAGGREGATION_PATH} names no bootstrap address"
        return None

    def update(self, info: WorkerInfo) -> None:
        self.bootstrap_host, self.bootstrap_port = info.bootstrap_host, info.bootstrap_port
        self.transfer_backend = info.transfer_backend
        self.kv_layout = info.kv_layout
        self.num_running, self.num_waiting = info.num_running, info.num_waiting


def layout_mismatch(named: dict[str, list]) -> str | None:
    """Why workers whose page layouts are `named` (who: layout) cannot move pages (None: they can)."""
    if len({repr(layout) for layout in named.values()}) < 2:
        return None
    kinds = "; ".join(f"{who}: {len(layout)} kinds of rows {layout}" for who, layout in named.items())
    return (f"the workers' KV pages differ ({kinds}); start them with the same --num-speculative-tokens (0 on "
            f"all, or more on all: drafting adds the MTP layer's rows), --kv-cache-dtype, --kv-page-size, "
            f"--dtype, --selector and --indexer-key-dtype")


def affinity_key(body: dict, authorization: str | None, prefix_chars: int) -> bytes:
    """The first `prefix_chars` characters of the request's prompt or messages (/generate's text or
    input_ids) as JSON, with its Authorization header and cache_salt: the prefix caches key pages by
    tenant and salt too."""
    prompt = next((body[k] for k in ("messages", "prompt", "text", "input_ids") if k in body), None)
    lead = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)[:prefix_chars]
    salt = body.get("cache_salt")
    return "\0".join((authorization or "", salt if isinstance(salt, str) else "", lead)).encode()


def _rank(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest(), "big")


class WorkerPool:
    """The prefill and decode workers, their state from polling, and the choice of one per request."""

    def __init__(self, prefill: list[str], decode: list[str], load_slack: int = 4, colocated: list[str] = ()):
        if load_slack < 0:
            raise RouterConfigError(f"--affinity-load-slack must be >= 0, got {load_slack}")
        if bool(colocated) == bool(prefill or decode) or bool(prefill) != bool(decode):
            raise RouterConfigError("give --prefill and --decode workers (prefill/decode disaggregation) or "
                                    "--worker workers (colocated servers): one of the two forms")
        self.load_slack = load_slack
        self.workers = {"prefill": [Worker(u, "prefill") for u in prefill],
                        "decode": [Worker(u, "decode") for u in decode],
                        "null": [Worker(u, "null") for u in colocated]}

    @property
    def colocated(self) -> bool:
        """Whether the workers are colocated servers: a request goes to one of them, no KV moves."""
        return bool(self.workers["null"])

    @property
    def answering(self) -> str:
        """The role whose workers answer the clients (tokenize, models): decode, or the colocated."""
        return "null" if self.colocated else "decode"

    def all(self) -> list[Worker]:
        return self.workers["prefill"] + self.workers["decode"] + self.workers["null"]

    def up(self, role: str) -> list[Worker]:
        return [w for w in self.workers[role] if w.up]

    def serving(self) -> bool:
        """Whether a request can be answered now: a prefill and a decode worker up, or a colocated one."""
        if self.colocated:
            return bool(self.up("null"))
        return bool(self.up("prefill")) and bool(self.up("decode"))

    def choose(self, role: str, key: bytes) -> Worker:
        """The worker of `role` for a request with affinity `key` (see the module docstring)."""
        up = self.up(role)
        if not up:
            raise NoWorker(f"no {role} worker is up (of {len(self.workers[role])})")
        floor = min(w.load for w in up)
        return max((w for w in up if w.load <= floor + self.load_slack), key=lambda w: _rank(key, w.url))

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.up:
            log.warning("%s %s is down: %s", worker.name, worker.url, why)
        worker.up = False

    async def poll(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._poll_one(client, w) for w in self.all()))

    async def _poll_one(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            health = await client.get(worker.url + "/health")
            info = _parse_info(await client.get(worker.url + DISAGGREGATION_PATH))
        except httpx.TimeoutException as e:
            worker.polls_timed_out += 1
            if worker.polls_timed_out >= POLL_TIMEOUTS_BEFORE_DOWN:
                self.mark_down(worker, f"{worker.polls_timed_out} polls in a row timed out ({type(e).__name__})")
            return None
        except (httpx.HTTPError, ValueError) as e:
            return self.mark_down(worker, f"{type(e).__name__}: {e}")
        worker.polls_timed_out = 0
        mismatch = worker.mismatch(info)
        if mismatch is not None:
            return self.mark_down(worker, mismatch)
        worker.update(info)
        if health.status_code != 200:
            return self.mark_down(worker, f"GET /health answered {health.status_code}")
        if not worker.up:
            log.info("%s %s is up", worker.name, worker.url)
        worker.up = True


def _parse_info(response: httpx.Response) -> WorkerInfo:
    """The body of a 200 answer to GET /disaggregation, or ValueError saying what is wrong with it."""
    if response.status_code != 200:
        raise ValueError(f"GET {DISAGGREGATION_PATH} answered {response.status_code} (is it a sparsekv "
                         "worker started with --disaggregation-mode?)")
    try:
        return WorkerInfo.model_validate_json(response.content)
    except ValidationError as e:
        raise ValueError(f"GET {DISAGGREGATION_PATH} answered a malformed body: {e.errors()[0]['msg']}") from None


def check_modes(pool: WorkerPool, timeout: float, interval: float = 1.0) -> None:
    """Wait up to `timeout` seconds for every worker to answer GET /disaggregation (they may still be
    loading a model) and check that each says the role it was given and that all move KV the same way;
    RouterConfigError otherwise.
    The workers that answer are marked up."""
    deadline = time.monotonic() + timeout
    pending = list(pool.all())
    with httpx.Client(timeout=max(1.0, interval)) as client:
        while pending:
            last_error = {}
            for worker in list(pending):
                try:
                    info = _parse_info(client.get(worker.url + DISAGGREGATION_PATH))
                except httpx.HTTPError as e:
                    last_error[worker.url] = f"{type(e).__name__}: {e}"
                    continue
                except ValueError as e:
                    raise RouterConfigError(f"{worker.flag} {worker.url}: {e}") from None
                mismatch = worker.mismatch(info)
                if mismatch is not None:
                    what = "colocated server" if worker.role == "null" else worker.name
                    raise RouterConfigError(f"{worker.flag} {worker.url} is not a {what}: {mismatch} (start it "
                                            f"with `sparsekv serve --disaggregation-mode {worker.role}`)")
                worker.update(info)
                worker.up = True
                pending.remove(worker)
            if pending and time.monotonic() >= deadline:
                worker = pending[0]
                raise RouterConfigError(f"{worker.flag} {worker.url} did not answer GET {DISAGGREGATION_PATH} "
                                        f"within {timeout:g} s ({last_error[worker.url]})")
            if pending:
                time.sleep(interval)
    _check_one_backend(pool)
    mismatch = layout_mismatch({w.url: w.kv_layout for w in pool.all() if w.kv_layout is not None})
    if mismatch is not None:
        raise RouterConfigError(mismatch)


def _check_one_backend(pool: WorkerPool) -> None:
    """Every worker moves KV the same way: a prefill worker refuses a decode worker of another
    --disaggregation-transfer-backend, so a mixed set would fail requests at random."""
    backends = {w.transfer_backend for w in pool.all() if w.transfer_backend is not None}
    if len(backends) > 1:
        named = ", ".join(f"{w.url}: {w.transfer_backend}" for w in pool.all())
        raise RouterConfigError(f"the workers run different --disaggregation-transfer-backend ({named}); start them "
                                f"all with the same one")
