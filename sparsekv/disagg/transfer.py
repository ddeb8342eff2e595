"""The transport between a prefill worker and a decode worker: torch.distributed, nothing hand-made.

The prefill worker hosts a `TCPStore` on its bootstrap port. For each request (a *room*, named by
the router) the decode worker connects to it and the two exchange signed messages (wire.py) under
the room's keys::

    decode                               store (prefill's)                     prefill
    held_prefix -> claim ------------->  room/R/claim  ---------------------->  (after its prefill)
                                         room/R/meta   <----------------------  export_prefix(skip=held)
    <----------------------------------  (names, shapes, digests, timings)
    2-rank gloo group (rank 1)   <====== send/recv, one tensor per kind of row ======>  (rank 0)
    check digests, import_prefix
    verdict --------------------------> room/R/done   ---------------------->  success or failure

The tensors go over a gloo group of the two processes made for the room from the same store
(`ProcessGroupGloo` over a `PrefixStore`), closed after it. Every wait is bounded by the
transfer timeout; a peer that dies breaks its group's connections, which fails that room only.
Waiting for a key is polled from the event loop (`Worker.take`), so a room waiting for its peer holds
no thread: rooms waiting on each other's workers can never exhaust the transfer threads.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from .wire import TransferError

CORRUPT_ENV, DELAY_ENV = "SPARSEKV_INJECT_TRANSFER_CORRUPTION", "SPARSEKV_INJECT_TRANSFER_DELAY"  # test hooks
PREFILL_RANK, DECODE_RANK = 0, 1


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_bootstrap(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The prefill worker's store, listening on `port` (0: a free one, see `.port`)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s),
                         use_libuv=True)


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_timeout(timeout_s))
    except Exception as e:  # refused, unreachable, timed out: this request's bootstrap is not there
        raise TransferError(f"cannot reach the prefill worker's bootstrap at {host}:{port}: {e}") from None


class Room:
    """One request's keys in the prefill worker's store."""

    def __init__(self, store: dist.TCPStore, room: str):
        self.store, self.name = store, room
        self.prefix = f"sparsekv/room/{room}/"

    def key(self, part: str) -> str:
        return self.prefix + part

    def put(self, part: str, value: bytes) -> None:
        try:
            self.store.set(self.key(part), value)
        except Exception as e:
            raise TransferError(f"room {self.name}: the bootstrap store failed: {e}") from None

    def ready(self, part: str) -> bool:
        """Whether `part` is there yet (no wait: `Worker.take` polls, holding no thread while it waits)."""
        try:
            return self.store.check([self.key(part)])
        except Exception as e:  # a connection error: the prefill worker's store is gone
            raise TransferError(f"room {self.name}: the bootstrap store is gone ({_first_line(e)})") from None

    def get(self, part: str) -> bytes:
        try:
            return self.store.get(self.key(part))
        except Exception as e:
            raise TransferError(f"room {self.name}: the bootstrap store failed: {_first_line(e)}") from None

    def forget(self) -> None:
        """Delete every key of the room, the pair group's rendezvous keys included."""
        for part in ("claim", "meta", "done", *(f"pg/0/{rank}" for rank in (PREFILL_RANK, DECODE_RANK))):
            try:
                self.store.delete_key(self.key(part))
            except Exception:  # the store is gone: nothing is left to clean
                return

    def pair_group(self, rank: int, hostname: str, timeout_s: float) -> dist.ProcessGroup:
        """The room's 2-rank gloo group (prefill rank 0, decode rank 1); `hostname`: this side's address."""
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _timeout(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        try:
            return dist.ProcessGroupGloo(dist.PrefixStore(self.key("pg"), self.store), rank, 2, opts)
        except Exception as e:
            raise TransferError(f"room {self.name}: the workers could not connect for the transfer: "
                                f"{_first_line(e)}") from None


def send_tensors(group, tensors: list[torch.Tensor]) -> None:
    """Prefill side: each flat uint8 tensor to the decode rank, in order (tag = its index)."""
    corrupt, delay = os.environ.get(CORRUPT_ENV), float(os.environ.get(DELAY_ENV) or 0)
    for i, t in enumerate(tensors):
        if delay:
            time.sleep(delay)
        if corrupt is not None and int(corrupt) == i:  # test hook: a layer damaged after its digest
            t = t.clone()
            t[0] ^= 0xFF
        _run(lambda: group.send([t], DECODE_RANK, i), f"sending tensor {i}")


def recv_tensors(group, sizes: list[int]) -> list[torch.Tensor]:
    """Decode side: flat uint8 tensors of `sizes` bytes from the prefill rank, in order."""
    out = []
    for i, n in enumerate(sizes):
        t = torch.empty(n, dtype=torch.uint8)
        _run(lambda: group.recv([t], PREFILL_RANK, i), f"receiving tensor {i}")
        out.append(t)
    return out


def _run(op, what: str) -> None:
    try:
        op().wait()
    except Exception as e:  # the peer closed the connection, or the group's timeout passed
        raise TransferError(f"{what} failed: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
