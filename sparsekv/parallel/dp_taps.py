"""Layer taps on a data-parallel engine: a prefill worker's layer-by-layer send (cache/layer_tap.py,
docs/disaggregation.md) when its prompts run on other ranks' engines.

A request on rank 0 is tapped in rank 0's engine, as on one rank. A request on rank r > 0 is tapped in
rank r's engine, which keeps each delivery's rows there (dp_held.py: they leave from rank r, or are
fetched). Its header goes to rank 0 over a gloo group of the taps' own, sent by a thread so that
rank r's next layer computes meanwhile, and rank 0's receiving thread hands the tap's `deliver` there
the delivery with its rows named where they are (`Held`)::

    rank r: layer i forward -> deliver -> queue -> sender thread: keep(rows), send(header) -----+
    rank 0: receiving thread: recv(header, any rank) -> deliver(rows held on that rank)  <-----+

    header (int64): tap id (-1: the rank leaves), layer, first page, pages, tail rows, the lengths of a
                    tail's selections (-1: none), the rows' handle, number of kinds, kinds...

The rows' shapes follow from the header and rank 0's own page tensors (every rank's cache is alike).
A step's deliveries reach `deliver` before the step returns on rank 0: each rank drains its queue
before answering the step and reports how many deliveries it has sent, and rank 0 waits until it has
received as many. So a page is never named (exported) before its layers' rows are announced, which the
prefill worker's split of a look's pages relies on.

The groups (the taps', and the two of rank 0's calls to the ranks: dp_held.py), the sender and the
receiver are made at the first tap (a command every rank runs), so an engine that never sends layer by
layer opens nothing.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cache.layer_tap import LayerRows
from .dp_held import Held, HeldRows, RankSide

HEADER_LEN = 17  # tap id, layer, first, count, tail, two selection lengths, handle, number of kinds, then up to 8 kinds
FIELDS = 9
LEAVE = -1  # a header's tap id: the sending rank closes


IDLE_WAIT = timedelta(days=365)  # rank 0's receiver waits this long for a rank's next delivery


def open_group(timeout_s: float):
    """The taps' gloo group: every rank of the world calls this, in the same order as any other group.
    Its operations wait unbounded (gloo bounds a point-to-point wait by the timeout the group was made
    with, so it is made with IDLE_WAIT): rank 0's receiver waits for the next delivery however long the
    worker stays idle (bounded, it timed out and closed the group, and the next prompt a rank r > 0
    tapped killed the engine). A rank that dies closes its connections, which ends any wait at once; a
    step waits for its rows within `timeout_s` (`TapReceiver.wait_for`), and a rank that hangs fails
    the step's own collectives."""
    return dist.new_group(backend="gloo", timeout=IDLE_WAIT)


def encode_header(tap_id: int, rows: LayerRows, handle: int = 0) -> torch.Tensor:
    selected = [t.numel() for t in rows.selected] if rows.selected is not None else [-1, -1]
    fields = [tap_id, rows.layer, rows.first, rows.count, rows.tail, *selected, handle, len(rows.kinds), *rows.kinds]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"a layer hands out {len(rows.kinds)} kinds of row; a tap header holds at most "
                         f"{HEADER_LEN - FIELDS}")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[int, int, int, int, int, list[int] | None, int, list[int]]:
    """(tap id, layer, first page, pages, tail rows, the selections' lengths or None, handle, kinds)."""
    tap_id, layer, first, count, tail, union, last, handle, num_kinds, *rest = header.tolist()
    return tap_id, layer, first, count, tail, None if union < 0 else [union, last], handle, rest[:num_kinds]


class TapSender:
    """A rank r > 0's side: its engine's deliveries for tap `tap_id`, kept in `held` (owned by the tap),
    announced to rank 0 in order."""

    def __init__(self, group, held: HeldRows):
        self.group, self.held, self.sent, self.error = group, held, 0, None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sparsekv-tap-sender", daemon=True)
        self._thread.start()

    def deliver_for(self, tap_id: int):
        return lambda rows: self._queue.put((tap_id, rows))  # on the engine's thread

    def drain(self) -> int:
        """Once every queued delivery is sent: how many were, since the group opened."""
        self._queue.join()
        if self.error is not None:
            raise RuntimeError(f"sending layer rows to rank 0 failed: {self.error}")
        return self.sent

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    if self.error is None:
                        dist.send(torch.full((HEADER_LEN,), LEAVE, dtype=torch.int64), dst=0, group=self.group)
                    return
                if self.error is None:
                    self._send(*item)
            except Exception as e:  # rank 0 gone: the step that drains reports it
                self.error = e
            finally:
                self._queue.task_done()

    def _send(self, tap_id: int, rows: LayerRows) -> None:
        handle = self.held.keep(tap_owner(tap_id), [*rows.ready(), *(rows.selected or ())])[0].handle
        dist.send(encode_header(tap_id, rows, handle), dst=0, group=self.group)
        self.sent += 1


def tap_owner(tap_id: int) -> tuple:
    """Who a tap's kept rows belong to (HeldRows): released when the tap is removed."""
    return "tap", tap_id


class TapReceiver:
    """Rank 0's side: every other rank's deliveries, handed to the `deliver` of their tap id.
    `tensors`: rank 0's page tensors (a cache's `page_tensors()`), whose shapes and dtypes the rows
    take; `page_size`: tokens per page."""

    def __init__(self, group, num_ranks: int, tensors: list, page_size: int):
        self.group, self.page_size = group, page_size
        self.kinds = [(tuple(t.shape[1:]), t.dtype) for t, _ in tensors]
        self.delivers: dict[int, object] = {}
        self.received = [0] * num_ranks
        self.error: Exception | None = None
        self._left = {0}
        self._num_ranks = num_ranks
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sparsekv-tap-receiver", daemon=True)
        self._thread.start()

    def wait_for(self, sent: list[int], timeout_s: float) -> None:
        """Until each rank's `sent[rank]` deliveries were received (a step's, before its pages are named)."""
        with self._cond:
            done = self._cond.wait_for(lambda: self.error is not None or all(
                got >= want for got, want in zip(self.received, sent)), timeout=timeout_s)
        if self.error is not None:
            raise RuntimeError(f"receiving layer rows from a data-parallel rank failed: {self.error}")
        if not done:
            raise RuntimeError(f"layer rows of a data-parallel rank did not arrive within {timeout_s:g} s "
                               f"(received {self.received}, sent {sent})")

    def _run(self) -> None:
        try:
            while len(self._left) < self._num_ranks:
                self._receive_one()
        except Exception as e:  # a rank died, or the group closed with the engine
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _receive_one(self) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        src = dist.recv(header, group=self.group)  # NOTE: any rank
        tap_id, layer, first, count, tail, selected, handle, kinds = decode_header(header)
        if tap_id == LEAVE:
            self._left.add(src)
            return
        rows = [Held(src, handle, i, (count, tail or self.page_size, *self.kinds[kind][0]), self.kinds[kind][1])
                for i, kind in enumerate(kinds)]
        if selected is not None:
            selected = tuple(Held(src, handle, len(kinds) + j, (n,), torch.int64) for j, n in enumerate(selected))
        deliver = self.delivers.get(tap_id)
        if deliver is not None:
            deliver(LayerRows(layer, first, count, kinds, rows, tail=tail, selected=selected))
        with self._cond:
            self.received[src] += 1
            self._cond.notify_all()


class DataParallelTaps:
    """Rank 0's taps of a data-parallel engine (`DataParallelEngine.tap_layers`). A tap waits until its
    request has a rank (`rank_of`, at its add), then is set at the next step: in rank 0's engine, or
    sent to its rank with that step's command."""

    def __init__(self, local, receiver: TapReceiver, num_ranks: int):
        self.local, self.receiver, self.num_ranks = local, receiver, num_ranks
        self._next_id = 0
        self._pending: dict[str, tuple[int, int, int]] = {}  # request id -> (tap id, prompt tokens, skip)
        self._placed: dict[str, tuple[int, int]] = {}  # request id -> (rank, tap id)
        self._untaps: list[list[str]] = [[] for _ in range(num_ranks)]

    def add(self, request_id: str, num_prompt_tokens: int, skip: int, deliver) -> None:
        self.remove(request_id)
        tap_id, self._next_id = self._next_id, self._next_id + 1
        self.receiver.delivers[tap_id] = deliver
        self._pending[request_id] = (tap_id, num_prompt_tokens, skip)

    def remove(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.receiver.delivers.pop(pending[0], None)
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        rank, tap_id = placed
        self.receiver.delivers.pop(tap_id, None)
        if rank == 0:
            self.local.untap_layers(request_id)
        else:
            self._untaps[rank].append((request_id, tap_id))

    def untaps_waiting(self) -> bool:
        """Whether a removed tap's rank has not been told yet (the next step's command tells it)."""
        return any(self._untaps)

    def for_step(self, rank_of: dict[str, int]) -> tuple[list[list], list[list[str]]]:
        """Set the taps whose request has a rank (rank 0's here); the others' taps and untaps, per rank,
        for the step's command."""
        taps: list[list] = [[] for _ in range(self.num_ranks)]
        for request_id, (tap_id, num_tokens, skip) in list(self._pending.items()):
            rank = rank_of.get(request_id)
            if rank is None:
                continue
            del self._pending[request_id]
            self._placed[request_id] = (rank, tap_id)
            if rank == 0:
                self.local.tap_layers(request_id, num_tokens, skip, self.receiver.delivers[tap_id])
            else:
                taps[rank].append((request_id, tap_id, num_tokens, skip))
        untaps, self._untaps = self._untaps, [[] for _ in range(self.num_ranks)]
        return taps, untaps


def set_lane_taps(engine, sender: TapSender | None, side: RankSide, message: dict, rank: int) -> None:
    """A rank r > 0's part of a step's taps: set and remove what rank 0 sent it; a removed tap's kept
    rows that never left go with it."""
    for request_id, tap_id, num_tokens, skip in message.get("taps", [[]] * (rank + 1))[rank]:
        engine.tap_layers(request_id, num_tokens, skip, sender.deliver_for(tap_id))
        side.live_taps.add(tap_owner(tap_id))
    for request_id, tap_id in message.get("untaps", [[]] * (rank + 1))[rank]:
        engine.untap_layers(request_id)
        sender.drain()  # NOTE: every delivery queued before the untap is kept by now, so released below
        side.live_taps.discard(tap_owner(tap_id))
        side.held.release(tap_owner(tap_id))
