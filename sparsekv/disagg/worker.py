"""A server's prefill or decode role (`sparsekv serve --disaggregation-mode prefill|decode`).

The router sends the same OpenAI request to a prefill worker and to a decode worker, each with a
`disaggregation` field naming the room and the prefill worker's bootstrap address. The prefill
worker computes the prompt (prefill.py) and the decode worker takes its KV before it generates
(decode.py). Both run blocking transport calls on a small thread pool of their own; each room's waits
for its peer (for a key, to join the pair group, for a send to be received) on a thread of their own,
so rooms never wait for each other's threads; and engine calls on the engine loop, so the event loop
never waits on a peer.
"""
from __future__ import annotations

import asyncio
import logging
import time
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..daemon import on_daemon_thread
from ..server.errors import APIError, bad_request
from ..units import MAX_TIMEOUT_S
from .metrics import TransferMetrics
from .nixl import NixlAgent
from .transfer import TRANSFERS, gpu_identity
from .weights_stamp import WeightsStamp, loaded_weights
from .wire import RoomAborted, TransferError

log = logging.getLogger("sparsekv.disagg")
MODES = ("null", "prefill", "decode")
SENDS = ("layers", "chunks")  # --disaggregation-send
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_DECODE_HOST_BYTES = 4 << 30  # the decode worker's prefix host tier: transferred pages the pool has no room for
MAX_TRANSFER_THREADS = 8  # store calls and tensor transfers; a room waiting for its peer holds none of them
WAIT_CHECK_S = 0.5  # how often a waiting room looks whether its client left or its time is up
WAIT_MARGIN_S = 5.0  # the store's own bound on a wait, past the room's: the room wakes it first


@dataclass(frozen=True)
class DisaggSettings:
    """A worker's role. `bootstrap_host`: the address the other worker reaches this one at (its
    transfer connections too); `bootstrap_port`: the prefill worker's store (0: a free port)."""

    mode: str
    bootstrap_host: str
    bootstrap_port: int | None
    secret: bytes
    timeout_s: float = DEFAULT_TIMEOUT_S
    transfer: str = "torch"  # the data path: torch.distributed or NIXL (transfer.TRANSFERS)
    send: str = "layers"  # prefill: each layer's rows as it computes them, or a chunk's pages once all did (SENDS)

    def __post_init__(self):
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFERS)}, got "
                             f"{self.transfer!r}")
        if self.send not in SENDS:
            raise ValueError(f"--disaggregation-send must be one of {', '.join(SENDS)}, got {self.send!r}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"--disaggregation-timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {self.timeout_s}")
        port = self.bootstrap_port
        if self.mode == "prefill" and (port is None or not 0 <= port <= 65535):
            raise ValueError(f"--disaggregation-bootstrap-port must be in [0, 65535] on a prefill worker, got {port}")


def page_layout(engine) -> list[list]:
    """The rows of one KV page in the prefix cache, as JSON: [shape, dtype] per kind of row (each
    layer's latents, indexer keys, with drafting the MTP layer's). A page moves between two workers
    only when their layouts are the same."""
    return [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in engine.kv.prefix.rows.layout]


def default_bootstrap_host(serve_host: str) -> str:
    """The address the other worker reaches this one at: the serve host, unless it is a wildcard."""
    return serve_host if serve_host not in ("0.0.0.0", "::", "") else socket.gethostname()


class Worker:
    """What both roles share: the rooms in flight, the thread pool, the metrics, GET /disaggregation."""

    def __init__(self, state, settings: DisaggSettings):
        engine = state.engine
        if engine.config.data_parallel_size > 1:  # a claim outlives no transfer (parallel/dp_kv.py)
            engine.kv.claim_ttl_s = 2 * settings.timeout_s
        if engine.kv.prefix is None:
            raise ValueError("--disaggregation-mode needs the prefix cache (pages move through it): drop "
                             "--no-enable-prefix-caching")
        self.state, self.settings = state, settings
        self.metrics = TransferMetrics(state.metrics.registry, state.model_name)
        self.rooms: dict[str, str] = {}  # room -> its phase, while a request of this worker is in it
        self.pool = ThreadPoolExecutor(MAX_TRANSFER_THREADS, thread_name_prefix="sparsekv-disagg")
        self.device = engine.device  # the transfer's backend and where its tensors are (transfer.py)
        self.gpu = gpu_identity(self.device)  # two workers on one GPU cannot pair over NCCL
        self.nixl = NixlAgent(settings.mode) if settings.transfer == "nixl" else None  # one for the worker's life
        self.weights = WeightsStamp()
        self.weights.stamp(loaded_weights(engine))  # the checkpoint's digest now, not on the first transfer
        self.layout = page_layout(engine)  # what a page's rows are: both workers' must be the same

    @property
    def bootstrap_port(self) -> int | None:
        return None

    def describe(self) -> dict:
        stats = self.state.loop.stats()
        return {"mode": self.settings.mode, "bootstrap_host": self.settings.bootstrap_host,
                "bootstrap_port": self.bootstrap_port, "transfer_backend": self.settings.transfer,
                "kv_layout": self.layout,
                "num_running": int(stats.get("running", 0)),
                "num_waiting": int(stats.get("waiting", 0))}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def abort_in_transfer(self, tenant: str, client_id: str | None) -> int:
        """/abort_request for the requests still in their transfer: how many it ended. Always 0 on a
        prefill worker: its prefills are its decode workers' requests, whose rooms end them (`RoomAborted`)."""
        return 0

    def abort_asked(self, room: str) -> bool:
        """Whether /abort_request ended the room's request, so that its waits for the peer end."""
        return False

    def stop_if_aborted(self, room: str) -> None:
        if self.abort_asked(room):
            raise RoomAborted(f"room {room}: the request was aborted (/abort_request)")

    async def blocking(self, fn, *args):
        """`fn(*args)` on the transfer threads (store and transfer calls block)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def take(self, link, part: str, waiting_for: str, request) -> bytes:
        """The value of the room's key `part` once the other worker has written it, the moment it is
        (Room.wait_for, on a thread of its own). TransferError past the timeout, when the store is gone,
        or when the client went away (the router cancels one side when the other failed); the wait is
        woken then, so it holds its thread no longer."""
        wait = on_daemon_thread(link.wait_for, part, self.settings.timeout_s + WAIT_MARGIN_S,
                                name="sparsekv-disagg-wait")
        try:
            await self._while_peer_works(wait, link, waiting_for, request)
        finally:
            if not wait.done():
                self._submit(link.wake, part)
        value = wait.result()
        if value is None:
            raise TransferError(f"room {link.name}: the wait for {waiting_for} was ended by this worker")
        return value

    async def connected(self, path, link, request, peer_left=None) -> None:
        """The room's data path joined to the peer's (`path.needs_connect`: a torch.distributed pair
        group, whose rendezvous waits for the peer), on a thread of its own like a wait for a key: a
        room whose peer hangs or died holds no transfer thread meanwhile (rooms with other peers would
        queue behind it), and it ends when its client goes away, when `peer_left()` (a store call, on
        the transfer threads) says the peer will not join, or at the timeout. gloo ends the connect's
        own thread later (transfer._within)."""
        if path.needs_connect:
            try:
                await self.with_peer(link, "the peer's transfer connection", request, path.connect, peer_left=peer_left)
            except BaseException:
                path.abandon()  # a join still waiting for the peer ends now, not at the timeout
                raise

    async def with_peer(self, link, waiting_for: str, request, fn, *args, thread: str = "sparsekv-disagg-wait",
                        peer_left=None):
        """`fn(*args)`, a call that waits for the peer (joining the pair group, sending tensors the peer
        receives), on a thread of its own: TransferError past the timeout, when the client went away or
        when `peer_left()`, the call then left to end on its own (at its group's timeout, or when the
        group closes)."""
        wait = on_daemon_thread(fn, *args, name=thread)
        await self._while_peer_works(wait, link, waiting_for, request, peer_left)
        return wait.result()

    async def _while_peer_works(self, wait: asyncio.Future, link, waiting_for: str, request, peer_left=None) -> None:
        """Until `wait` is done; TransferError past the timeout, when the client went away (the router
        cancels one side when the other failed), when /abort_request ended the room's request
        (`abort_asked`: RoomAborted) or when `peer_left()`, `wait` then left to end on its own."""
        timeout = self.settings.timeout_s
        deadline = time.monotonic() + timeout
        try:
            while not (await asyncio.wait([wait], timeout=WAIT_CHECK_S))[0]:
                if await request.is_disconnected():
                    raise TransferError(f"room {link.name}: the client went away while this worker waited for {waiting_for}")
                self.stop_if_aborted(link.name)
                if peer_left is not None and await self.blocking(peer_left):
                    raise TransferError(f"room {link.name}: the peer left the room while this worker waited for {waiting_for}")
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"room {link.name}: no {waiting_for} within {timeout:g} s")
        finally:
            if not wait.done():
                wait.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now

    def _submit(self, fn, *args) -> None:
        try:
            self.pool.submit(fn, *args)
        except RuntimeError:  # the worker is closing: its rooms go with it
            pass

    def open_room(self, field) -> str:
        room = field.room
        if room in self.rooms:
            raise bad_request(f"disaggregation.room {room!r} is already in use on this worker", "disaggregation")
        self.rooms[room] = "open"
        self.metrics.in_flight.inc()
        return room

    def close_room(self, room: str) -> None:
        if self.rooms.pop(room, None) is not None:
            self.metrics.in_flight.dec()

    def failed(self, room: str, e: TransferError) -> APIError:
        self.metrics.failed.inc()
        log.warning("disaggregation room %s failed on the %s worker: %s", room, self.settings.mode, e)
        return APIError(503, f"the KV transfer failed ({self.settings.mode} worker, room {room}): {e}")


class PeerTimeout(TransferError):
    """The peer did not answer within --disaggregation-timeout."""
