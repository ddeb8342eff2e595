"""The transport between a prefill worker and a decode worker: torch.distributed or NIXL, nothing
hand-made.

The prefill worker hosts a `TCPStore` on its bootstrap port. For each request (a *room*, named by
the router) the decode worker connects to it and the two exchange signed messages (wire.py) under
the room's keys::

    decode                               store (prefill's)                     prefill
    held_prefix -> claim ------------->  room/R/claim  ---------------------->  (while its prefill runs)
                                         room/R/meta/0 <----------------------  export_prefix(skip=sent)
    <----------------------------------  (names, shapes, digests, weights)
    2-rank group (rank 1)        <====== send/recv, one tensor per kind of row ======>  (rank 0)
                                         room/R/meta/1 ... the last (after the prefill, with its timings)
    check each batch, import_prefix
    verdict --------------------------> room/R/done   ---------------------->  success or failure

Each batch holds the pages named since the last (prefill.py). The tensors go over a 2-rank group of
the two processes made for the room from the same store (over a `PrefixStore`), closed after it:
NCCL when both engines run on CUDA on different GPUs, gloo otherwise (`transfer_backend`: the prefill
worker picks it from its device and the one the claim names, and its metadata tells the decode
worker). With `--disaggregation-transfer-backend nixl` on both workers the decode worker instead
reads each batch out of the prefill worker's registered memory (nixl.py); `sender` and `receiver` give either data
path behind the same two calls, `offer` and `push` on the prefill side, `pull` on the decode side. Every wait
is bounded by the transfer timeout; a peer that dies breaks its group's connections, which fails
that room only. A room waiting for a key of its peer blocks in the store's own wait (`Room.wait_for`,
woken the moment the key is written, with no polling) on a connection and a thread of its own
(`Worker.take`), so rooms waiting on each other's workers can never exhaust the transfer threads, and
a room's other store calls never queue behind its wait.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..daemon import daemon_future
from ..error_text import first_line
from .nixl import NixlReceiver, NixlSender
from .wire import TransferError, at_once

log = logging.getLogger("sparsekv.disagg")

CORRUPT_ENV, DELAY_ENV = "SPARSEKV_INJECT_TRANSFER_CORRUPTION", "SPARSEKV_INJECT_TRANSFER_DELAY"  # test hooks
PREFILL_RANK, DECODE_RANK = 0, 1
BACKENDS = ("gloo", "nccl", "nixl")  # what a batch's metadata may name
TRANSFERS = ("torch", "nixl")  # --disaggregation-transfer-backend: torch.distributed (gloo or NCCL) or NIXL
NCCL_P2P_KEY = f"{PREFILL_RANK}:{DECODE_RANK}"  # where ProcessGroupNCCL publishes a send/recv pair's NCCL id
RENDEZVOUS = {rank: f"pg/0/{rank}" for rank in (PREFILL_RANK, DECODE_RANK)}  # where gloo publishes each side's address
WOKEN = b"sparsekv:woken"  # what a room's own side writes under a key to end its wait for it (Room.wake)
ABSENT = b"sparsekv:absent"  # compare_set(key, ABSENT, ABSENT) reads a key without waiting for it: ABSENT if none


def transfer_backend(prefill_device: str | None, decode_device: str | None, same_gpu: bool = False) -> str:
    """The pair's torch.distributed backend, from each engine's device type: NCCL when both run on
    CUDA (and this torch has it), gloo otherwise. One backend per device: NCCL moves CUDA tensors
    only, gloo host tensors, so a pair with a CPU worker (or a torch without NCCL) takes gloo. NCCL
    refuses two ranks on one GPU ("Duplicate GPU detected"), so two workers sharing a GPU
    (`same_gpu`) take gloo too."""
    both_cuda = prefill_device == "cuda" and decode_device == "cuda"
    return "nccl" if both_cuda and not same_gpu and dist.is_nccl_available() else "gloo"


def pair_backend(transfer: str, prefill_device: str, claim: dict, prefill_gpu: str | None = None) -> str:
    """The backend a room's tensors take: NIXL when both workers run with
    `--disaggregation-transfer-backend nixl`, else torch.distributed's for the two devices
    (`prefill_gpu`: this worker's `gpu_identity`, against the one the claim names). Workers set
    differently refuse the room (the claim names the decode worker's)."""
    theirs = claim.get("transfer", "torch")
    if theirs != transfer:
        raise TransferError(f"the prefill worker runs --disaggregation-transfer-backend {transfer}, the decode "
                            f"worker {theirs}: set the same on both")
    if transfer == "nixl":
        return "nixl"
    same_gpu = prefill_gpu is not None and claim.get("gpu") == prefill_gpu
    return transfer_backend(prefill_device, claim.get("device"), same_gpu)


def gpu_identity(device: torch.device) -> str | None:
    """The physical GPU an engine runs on (its UUID, the same whatever CUDA_VISIBLE_DEVICES numbers
    it), or None off CUDA: two workers naming the same one share it."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def sender(backend: str, link: "Room", settings, device: torch.device, agent):
    """The prefill side of a room's data path (`agent`: the worker's NixlAgent, for NIXL)."""
    if backend == "nixl":
        return NixlSender(agent)
    return TorchPath(link, settings, device, backend, PREFILL_RANK)


def receiver(backend: str, link: "Room", settings, device: torch.device, agent):
    """The decode side of a room's data path: TransferError if this worker has no NIXL agent for it."""
    if backend == "nixl":
        if agent is None:
            raise TransferError("the prefill worker sends over NIXL and this decode worker runs "
                                "--disaggregation-transfer-backend torch: set the same on both")
        return NixlReceiver(agent, settings.timeout_s)
    return TorchPath(link, settings, device, backend, DECODE_RANK)


def transfer_device(backend: str, engine_device: torch.device) -> torch.device:
    """Where the tensors are while they move: the engine's CUDA device for NCCL, the host for gloo."""
    return engine_device if backend == "nccl" else torch.device("cpu")


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_bootstrap(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The prefill worker's store, listening on `port` (0: a free one, see `.port`)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s),
                         use_libuv=True)


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the bootstrap store at host:port: one a room gave back (`StoreClients`),
    else a new one. A `Room` made with it owns it."""
    try:
        return STORE_CLIENTS.take(host, port, timeout_s)
    except Exception as e:  # refused, unreachable, timed out: this request's bootstrap is not there
        # the cause goes to the log only: told to the client, it would say what answers at an address the
        # request named (a probe of the worker's network)
        log.warning("cannot reach a prefill worker's bootstrap at %s:%s: %s", host, port, e)
        raise TransferError(f"cannot reach the prefill worker's bootstrap at {host}:{port}") from None


IDLE_CLIENTS_PER_STORE = 24  # connections to one store kept for the next rooms (three a room)
IDLE_CLIENT_STORES = 16  # stores (prefill workers) with connections kept; the least recently used goes first


class StoreClients:
    """Client connections to bootstrap stores that rooms gave back, by address, for the next rooms. A
    room uses three (its own, its waits', its pair group's rendezvous) on each side. A new one costs a
    TCP connect and, inside torch, reverse DNS lookups of both ends for its log lines (`getnameinfo`),
    which a slow or rate-limited resolver stretches to its retry timeout: 5 s added to a room. A
    connection goes back when the room that owns it is gone (`Room`), unless a call on it failed: a
    wait cut off at its timeout leaves the store's answer pending on it, which the next call would
    read. One taken again is asked first (a key check) whether its store still answers: a prefill
    worker started again at the same address has a new store. Thread-safe."""

    def __init__(self) -> None:
        self._idle: OrderedDict[tuple[str, int], list] = OrderedDict()
        self._leased: dict[int, tuple] = {}  # id of a client handed out -> (it, its address), until a room owns it
        self._lock = threading.Lock()

    def take(self, host: str, port: int, timeout_s: float) -> dist.TCPStore:
        while (client := self._pop(host, port)) is not None:
            try:
                client.set_timeout(_timeout(timeout_s))
                client.check([ALIVE_KEY])
            except Exception:  # its store is gone (the worker stopped, or started again): drop it
                continue
            return self._lease(client, host, port)
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_timeout(timeout_s))
        return self._lease(client, host, port)

    def _pop(self, host: str, port: int) -> dist.TCPStore | None:
        with self._lock:
            idle = self._idle.get((host, port))
            return idle.pop() if idle else None

    def _lease(self, client: dist.TCPStore, host: str, port: int) -> dist.TCPStore:
        with self._lock:
            self._leased[id(client)] = (client, (host, port))
        return client

    def adopt(self, client: dist.TCPStore) -> tuple[str, int] | None:
        """A room takes `client` as its own: its address, or None if it is not one handed out here (or
        another room owns it already), which the room then never gives back."""
        with self._lock:
            leased = self._leased.pop(id(client), None)
        return None if leased is None else leased[1]

    def give_back(self, client: dist.TCPStore, address: tuple[str, int]) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            self._idle.move_to_end(address)
            if len(idle) < IDLE_CLIENTS_PER_STORE:
                idle.append(client)
            while len(self._idle) > IDLE_CLIENT_STORES:
                self._idle.popitem(last=False)

    def drop(self, host: str, port: int) -> None:
        """Close the kept connections to the store at host:port (it is going away)."""
        with self._lock:
            self._idle.pop((host, port), None)

    def idle(self, host: str | None = None, port: int | None = None) -> int:
        """How many connections are kept for the store at host:port, or for every store."""
        with self._lock:
            if host is None:
                return sum(map(len, self._idle.values()))
            return len(self._idle.get((host, port), []))


STORE_CLIENTS = StoreClients()
ALIVE_KEY = "sparsekv/alive"  # what a connection taken again checks (a key nobody writes)


class RoomClients:
    """The store connections a room owns, given back to `STORE_CLIENTS` when the room is gone, but for
    those kept out (`exclude`)."""

    def __init__(self) -> None:
        self.owned: list[tuple[dist.TCPStore, tuple[str, int]]] = []
        self.kept_out: set[int] = set()
        self.lock = threading.Lock()

    def own(self, client: dist.TCPStore) -> dist.TCPStore:
        address = STORE_CLIENTS.adopt(client)
        if address is not None:
            with self.lock:
                self.owned.append((client, address))
        return client

    def exclude(self, client) -> None:
        """Keep `client` out of the pool: a call on it failed, or something past the room's calls uses it."""
        with self.lock:
            self.kept_out.add(id(client))

    def release(self) -> None:
        with self.lock:
            owned, self.owned = self.owned, []
            for client, address in owned:
                if id(client) not in self.kept_out:
                    STORE_CLIENTS.give_back(client, address)


class Room:
    """One request's keys in the prefill worker's store."""

    def __init__(self, store: dist.TCPStore, room: str):
        self.store, self.name = store, room
        # the connections it owns go back for the next rooms once nothing refers to the room any more
        # (no thread uses them then): `store` if `connect` gave it, its waits' and its pair group's
        self.clients = RoomClients()
        self.clients.own(store)
        weakref.finalize(self, self.clients.release).atexit = False
        self.prefix = f"sparsekv/room/{room}/"
        self.waiting: dist.TCPStore | None = None  # wait_for's connection (a TCPStore client runs one call at a time)
        # NOTE: a wait may end before a wake (at its own deadline, or woken by a compare_set on its missing
        # key): the lock orders a wait's end against a wake, which then writes no marker nobody would delete
        self.wait_lock = threading.Lock()
        self.waiting_on: str | None = None
        self.woken: set[str] = set()

    def key(self, part: str) -> str:
        return self.prefix + part

    def put(self, part: str, value: bytes) -> None:
        try:
            self.store.set(self.key(part), value)
        except Exception as e:
            self.clients.exclude(self.store)
            raise TransferError(f"room {self.name}: the bootstrap store failed: {e}") from None

    def ready(self, part: str) -> bool:
        """Whether `part` is there yet (no wait)."""
        try:
            return self.store.check([self.key(part)])
        except Exception as e:  # a connection error: the prefill worker's store is gone
            self.clients.exclude(self.store)
            raise TransferError(f"room {self.name}: the bootstrap store is gone ({first_line(e)})") from None

    def written_by_peer(self, part: str) -> bool:
        """Whether `part` holds a value (not this side's own wake marker), without waiting. NOTE: checked
        first, because a compare_set on a missing key wakes the store's waits for it (libuv's store)."""
        key = self.key(part)
        try:
            return self.store.check([key]) and self.store.compare_set(key, ABSENT, ABSENT) not in (ABSENT, WOKEN)
        except Exception as e:
            self.clients.exclude(self.store)
            raise TransferError(f"room {self.name}: the bootstrap store is gone ({first_line(e)})") from None

    def wait_for(self, part: str, timeout_s: float) -> bytes | None:
        """`part`'s value once it is written, or None when `wake(part)` ended the wait first. Blocks in
        the store's wait, on a connection of the room's own, so its other calls go on meanwhile."""
        key = self.key(part)
        with self.wait_lock:
            if part in self.woken:  # woken before it began
                return None
            self.waiting_on = part
        try:
            if self.waiting is None:
                self.waiting = self.clients.own(STORE_CLIENTS.take(self.store.host, self.store.port, timeout_s))
            self.waiting.wait([key], _timeout(timeout_s))
            with self.wait_lock:
                self.waiting_on = None
                value = self.waiting.compare_set(key, ABSENT, ABSENT)  # NOTE: not get, which waits if forget() came first
                if value == WOKEN:  # nobody else writes it, so the key is this wait's to delete
                    self.waiting.delete_key(key)
            return None if value in (WOKEN, ABSENT) else value
        except Exception as e:  # the store gone (a connection error), or past timeout_s
            self.clients.exclude(self.waiting)
            raise TransferError(f"room {self.name}: waiting for {part} failed: {first_line(e)}") from None
        finally:
            with self.wait_lock:
                self.waiting_on = None

    def wake(self, part: str) -> None:
        """End a wait for `part` (in another thread) that nobody will answer, unless it was written
        already. The marker it writes is the wait's to delete, so none is written once the wait is over."""
        with self.wait_lock:
            self.woken.add(part)
            if self.waiting_on != part:  # the wait is over, or has not begun (it then returns at once)
                return
            try:
                self.store.compare_set(self.key(part), "", WOKEN)
            except Exception:  # the store is gone: the wait has ended with an error already
                self.clients.exclude(self.store)

    def peek(self, part: str) -> bytes | None:
        """`part`'s value, or None when it is not there (no wait, unlike `get`)."""
        try:
            value = self.store.compare_set(self.key(part), ABSENT, ABSENT)
        except Exception as e:
            self.clients.exclude(self.store)
            raise TransferError(f"room {self.name}: the bootstrap store is gone ({first_line(e)})") from None
        return None if value in (ABSENT, WOKEN) else value

    def get(self, part: str) -> bytes:
        try:
            return self.store.get(self.key(part))
        except Exception as e:
            self.clients.exclude(self.store)
            raise TransferError(f"room {self.name}: the bootstrap store failed: {first_line(e)}") from None

    def abandon_join(self) -> None:
        """End the prefill side's wait for the decode side's rendezvous address (`pair_group`), if any."""
        self.wake(RENDEZVOUS[DECODE_RANK])

    def forget(self, batches: int = 1) -> None:
        """Delete every key of the room, the pair group's rendezvous keys included (`batches`: how many
        metadata keys were written, at most)."""
        metas = [meta_key(j) for j in range(batches)]
        for part in ("claim", *metas, "done", *RENDEZVOUS.values(), f"pg/{NCCL_P2P_KEY}"):
            try:
                self.store.delete_key(self.key(part))
            except Exception:  # the store is gone: nothing is left to clean
                self.clients.exclude(self.store)
                return

    def pair_group(self, rank: int, hostname: str, timeout_s: float, backend: str) -> dist.ProcessGroup:
        """The room's 2-rank group (prefill rank 0, decode rank 1); `hostname`: this side's address. Its
        rendezvous runs on a store connection of its own: the room's stays free meanwhile, to read a
        refusal that means the peer will never join (`Worker.connected`). Over gloo the prefill side
        first waits for the decode side's rendezvous address, a wait `abandon_join` ends: a room the
        decode worker never joins (it refused the first batch) then leaves no gloo connect behind, which
        would hold a thread and its connections until gloo gave up (about five times the timeout). Only
        one side waits first: the decode side's address is written by its own rendezvous."""
        if backend == "gloo" and rank == PREFILL_RANK and self.wait_for(RENDEZVOUS[DECODE_RANK], timeout_s) is None:
            raise TransferError(f"room {self.name}: this worker stopped waiting for the peer's transfer connection")
        rendezvous = None
        try:
            rendezvous = self.clients.own(STORE_CLIENTS.take(self.store.host, self.store.port, timeout_s))
            store = dist.PrefixStore(self.key("pg"), rendezvous)
            if backend == "nccl":  # NCCL rendezvous at the first send: the connection is in use past the room's calls
                self.clients.exclude(rendezvous)
                return _nccl_group(store, rank, timeout_s)
            return _within(lambda: _gloo_group(store, rank, hostname, timeout_s), timeout_s)
        except Exception as e:  # NOTE: a connect cut off at the timeout may still use the connection
            self.clients.exclude(rendezvous)
            raise TransferError(f"room {self.name}: the workers could not connect for the transfer ({backend}): "
                                f"{first_line(e)}") from None


def meta_key(batch: int) -> str:
    """The room's key of the metadata of its `batch`-th batch of pages (docs/disaggregation.md)."""
    return f"meta/{batch}"


def _gloo_group(store, rank: int, hostname: str, timeout_s: float) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _within(make, timeout_s: float):
    """make()'s result, made in a thread of its own and waited for at most `timeout_s`. gloo's full-mesh
    connect to a peer that published its address and then stopped answering retries for about five
    times the group's timeout; past `timeout_s` the room fails and the thread is left to gloo, which
    ends it, and the group it may still make is dropped."""
    made = daemon_future(make, name="sparsekv-pair-connect")
    if not concurrent.futures.wait([made], timeout_s).done:
        raise TimeoutError(f"no connection within {timeout_s:g} s")
    return made.result()


def _nccl_group(store, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """NOTE: NCCL connects on the first send/recv (the NCCL id goes through the store under
    NCCL_P2P_KEY), on the device of the tensors given; NCCL finds its own network interfaces."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _timeout(timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def as_sent(tensors: list[torch.Tensor], first: int) -> list[torch.Tensor]:
    """The tensors as the prefill side hands them to its backend, after the test hooks: a pause
    before each, and the tensor whose room index is CORRUPT_ENV damaged after its digest."""
    corrupt, delay = os.environ.get(CORRUPT_ENV), float(os.environ.get(DELAY_ENV) or 0)
    out = []
    for i, t in enumerate(tensors, start=first):
        if delay:
            time.sleep(delay)
        if corrupt is not None and int(corrupt) == i:
            t = t.clone()
            t[0] ^= 0xFF
        out.append(t)
    return out


def send_tensors(group, tensors: list[torch.Tensor], device: torch.device, first: int = 0) -> None:
    """Prefill side: each flat uint8 tensor to the decode rank, in order (tag = its index in the room,
    from `first`), from `device` (transfer_device); returns once they are sent."""
    for i, t in enumerate(tensors, start=first):
        t = t.to(device)
        _run(lambda: group.send([t], DECODE_RANK, i), f"sending tensor {i}")
    if device.type == "cuda":  # NOTE: an NCCL wait() orders the CUDA stream only; the group closes after
        torch.cuda.synchronize(device)


def recv_tensors(group, sizes: list[int], device: torch.device, first: int = 0, pace=None) -> list[torch.Tensor]:
    """Decode side: flat uint8 tensors of `sizes` bytes from the prefill rank, in order (tags from
    `first`), received on `device` (transfer_device) and returned in host memory (the digests and the
    import read them there). `pace(fn)`: runs each receive (decode.Pacer)."""
    out = []
    for i, n in enumerate(sizes, start=first):
        t = torch.empty(n, dtype=torch.uint8, device=device)
        (pace or at_once)(lambda: _run(lambda: group.recv([t], PREFILL_RANK, i), f"receiving tensor {i}"))
        out.append(t.cpu())  # after wait(): the copy is ordered after the receive on the current stream
    return out


class TorchPath:
    """One side of a room over torch.distributed (`rank`: PREFILL_RANK sends, DECODE_RANK receives):
    the pair group, made at the first tensor and kept for the room; each batch's tensors in order."""

    def __init__(self, link: Room, settings, device: torch.device, backend: str, rank: int):
        self.link, self.settings, self.backend, self.rank = link, settings, backend, rank
        self.device, self.group = transfer_device(backend, device), None

    @property
    def needs_connect(self) -> bool:
        return self.group is None

    def connect(self) -> None:
        """Form the pair group: its rendezvous waits for the peer, so the workers run it as a wait for
        the peer (`Worker.connected`), off their transfer threads."""
        self._group()

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            self.group = self.link.pair_group(self.rank, self.settings.bootstrap_host, self.settings.timeout_s,
                                              self.backend)
        return self.group

    def abandon(self) -> None:
        """The room no longer waits for the peer to join (`Worker.connected`): end `connect`'s wait."""
        self.link.abandon_join()

    def offer(self, tensors: list[torch.Tensor]) -> dict:
        """What the batch's metadata names for the backend: nothing, the tags follow the room's order."""
        return {}

    def push(self, tensors: list[torch.Tensor], first: int) -> None:
        send_tensors(self._group(), tensors, self.device, first)

    def pull(self, meta: dict, sizes: list[int], first: int, pace=None) -> list[torch.Tensor]:
        return recv_tensors(self._group(), sizes, self.device, first, pace)

    def close(self) -> None:
        """Drop the pair group. An NCCL pair's communicator (device buffers, a proxy thread) is aborted
        here, not left to the group's destructor, which warns of a group never destroyed; abort, not
        shutdown: a graceful finalize waits for the peer, which a failed room may have lost. Both sides'
        operations have ended by then (a send synchronizes the device, a receive copies to host). A gloo
        pair frees its connections when dropped."""
        group, self.group = self.group, None
        if group is not None and self.backend == "nccl":
            group.abort()


def _run(op, what: str) -> None:
    try:
        op().wait()
    except Exception as e:  # the peer closed the connection, or the group's timeout passed
        raise TransferError(f"{what} failed: {first_line(e)}") from None
