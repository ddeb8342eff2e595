"""Rows a data-parallel rank > 0 keeps for a prefill worker until they leave, and rank 0's calls to
that rank about them (docs/disaggregation.md, "Data-parallel prefill ranks").

A prompt that runs on rank r > 0 of a prefill worker has its KV computed there. Rank r keeps the rows
its layer taps hand out and the pages it exports (`HeldRows`), and rank 0, which runs the room's
protocol with the decode worker, names them by `Held` (where they are, and the slices taken) and
`Stacked` (pages stacked along a new first axis). Rank 0 then either has rank r send them to the
decode worker itself (`RankCalls.call` of the disaggregation's own functions: the room's tensors
never cross rank 0), or fetches them (a room whose prompts run on several ranks, or with the direct
send off). A call is a function and its arguments, pickled (the function by reference, as torch.distributed's
object calls pickle), run on rank r on a thread of its own with rank r's `RankSide` first::

    rank 0: call(r, fn, *args) -> calls group: [id] pickle(fn, args) -----> rank r: thread: fn(side, *args)
    rank 0: future of id      <- replies group: [id, ok] pickle(value or why) <-/

Each direction has a gloo group of its own (made with the taps' group, dp_taps.open_group): rank 0's
receiving threads, one per rank, wait on the replies group while its calls go out on the other. A
message is a header (the payload's length, the call's id, whether it succeeded), then the payload,
two sends from one sender at a time (`send_message`). The id stays outside the pickle (which
torch.distributed's `recv_object_list` would unpickle itself), so a call or an answer that cannot be
unpickled fails that call only.

Rows are kept under a handle and an owner: a layer tap's deliveries under its tap (released when the
tap is removed), exported pages under the room that asked (released when rank 0 ends the room);
rows that leave are dropped at once (`take`).
"""
from __future__ import annotations

import itertools
import math
import pickle
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..error_text import first_line

ENDED_ROOMS = 4096  # rooms a rank remembers rank 0 ended, so that a call of theirs arriving late reopens none


@dataclass(frozen=True)
class Held:
    """Part `part` of entry `handle` that rank `rank` keeps, sliced by `index` (basic slices, in order)."""

    rank: int
    handle: int
    part: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: tuple = ()

    def __getitem__(self, key) -> "Held":
        key = key if isinstance(key, tuple) else (key,)
        shape = list(self.shape)
        for dim, s in enumerate(key):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError(f"held rows take slices with no step, not {s!r}")
            start, stop, _ = s.indices(shape[dim])
            shape[dim] = max(0, stop - start)
        return replace(self, shape=tuple(shape), index=(*self.index, key))

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Stacked:
    """Held rows of one rank stacked along a new first axis (`torch.stack`)."""

    parts: tuple[Held, ...]

    @property
    def rank(self) -> int:
        return self.parts[0].rank

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


def is_held(t) -> bool:
    return isinstance(t, (Held, Stacked))


def ranks_of(tensors: list) -> set[int]:
    """The ranks whose held rows `tensors` names (none for tensors rank 0 has)."""
    return {t.rank for t in tensors if is_held(t)}


def stack(rows: list):
    """`torch.stack(rows)`, or its recipe when the rows are held on another rank."""
    if rows and is_held(rows[0]):
        return Stacked(tuple(rows))
    return torch.stack(rows)


class HeldRows:
    """A rank > 0's kept rows: entries of host tensors under a handle, each with its owner (a tap id or
    a room name). Torch-free bookkeeping; its threads (the engine's tap sender, the calls' threads)
    share it under a lock."""

    def __init__(self, rank: int):
        self.rank = rank
        self._entries: dict[int, tuple[object, list[torch.Tensor]]] = {}
        self._handles = itertools.count()
        self._lock = threading.Lock()

    def keep(self, owner, tensors: list[torch.Tensor]) -> list[Held]:
        """Keep `tensors` as one entry of `owner`; returns how rank 0 names each."""
        with self._lock:
            handle = next(self._handles)
            self._entries[handle] = (owner, list(tensors))
        return [Held(self.rank, handle, i, tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]

    def take(self, recipes: list) -> list[torch.Tensor]:
        """The tensors `recipes` name (Held or Stacked, all of this rank), contiguous; their entries are
        dropped (rows leave once). KeyError names a handle that is gone (its tap or room ended)."""
        with self._lock:
            handles = {h.handle for r in recipes for h in (r.parts if isinstance(r, Stacked) else (r,))}
            missing = handles - self._entries.keys()
            if missing:
                raise KeyError(f"rows {sorted(missing)} are no longer held on data-parallel rank {self.rank}")
            entries = {h: self._entries.pop(h)[1] for h in handles}
        return [self._made(r, entries) for r in recipes]

    @staticmethod
    def _made(recipe, entries: dict) -> torch.Tensor:
        if isinstance(recipe, Stacked):
            return torch.stack([HeldRows._made(p, entries) for p in recipe.parts])
        t = entries[recipe.handle][recipe.part]
        for key in recipe.index:
            t = t[key]
        return t.contiguous()

    def release(self, owner) -> int:
        """Drop every entry of `owner`; returns how many."""
        with self._lock:
            gone = [h for h, (o, _) in self._entries.items() if o == owner]
            for h in gone:
                del self._entries[h]
        return len(gone)

    def drop(self, handles) -> None:
        """Drop these entries (rows rank 0 will not send), those still here."""
        with self._lock:
            for h in handles:
                self._entries.pop(h, None)

    def owners(self) -> set:
        with self._lock:
            return {o for o, _ in self._entries.values()}

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for _, tensors in self._entries.values() for t in tensors)

    def check_integrity(self, live_owners: set) -> None:
        """Every entry's owner is live: a tap set on this rank or a room rank 0 has not ended."""
        stale = self.owners() - live_owners
        assert not stale, f"data-parallel rank {self.rank} keeps rows of ended taps or rooms: {sorted(map(str, stale))}"


@dataclass
class RankSide:
    """What a rank > 0 holds for rank 0's calls: its kept rows, the rooms it sends for and its NIXL agent
    (their state is the caller's: disagg/dp_send.py), the rank's device and node."""

    held: HeldRows
    device: torch.device
    node_rank: int = 0
    rooms: dict = field(default_factory=dict)
    agent: object = None
    live_taps: set = field(default_factory=set)  # owners ("tap", id) of the taps set on this rank
    ended: OrderedDict = field(default_factory=OrderedDict)  # the last ENDED_ROOMS rooms rank 0 ended
    lock: threading.Lock = field(default_factory=threading.Lock)  # rooms and ended, read and changed together

    def live_owners(self) -> set:
        with self.lock:  # NOTE: rank 0's calls open and end rooms on threads of their own
            rooms = list(self.rooms)
        return set(self.live_taps) | {("room", room) for room in rooms}

    def open_room(self, room: str, state=None) -> None:
        """Know `room` (with its `state`, once made) until rank 0 ends it; RuntimeError if it has ended: a
        call that outlived its room (rank 0 stopped waiting for it) opens nothing again."""
        with self.lock:
            self._check_open(room)
            if state is not None or room not in self.rooms:
                self.rooms[room] = state

    def while_open(self, room: str, fn, *args):
        """`fn(*args)` unless `room` has ended (RuntimeError), the room not ending meanwhile."""
        with self.lock:
            self._check_open(room)
            return fn(*args)

    def end_room(self, room: str):
        """Rank 0 ended `room`: its state (None if none was made) leaves, and the room stays ended."""
        with self.lock:
            state = self.rooms.pop(room, None)
            self.ended[room] = None
            while len(self.ended) > ENDED_ROOMS:
                self.ended.popitem(last=False)
        return state

    def _check_open(self, room: str) -> None:
        if room in self.ended:
            raise RuntimeError(f"room {room} has ended on data-parallel rank {self.held.rank}")

    def figures(self) -> dict:
        """The rank's `by_data_parallel_rank` figures of what it keeps for a prefill worker."""
        return {"held_rows_bytes": self.held.nbytes(), "held_rooms": len(self.rooms)}


def send_message(call_id: int, flag: bool, payload: bytes, dst: int, group) -> None:
    """One message to rank `dst`: a header (the payload's length, the call's id, a flag: for a call,
    whether it runs in order on the receiving thread; for an answer, whether the call succeeded), then
    the payload (callers send one message at a time)."""
    dist.send(torch.tensor([len(payload), call_id, int(flag)], dtype=torch.int64), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=dst, group=group)


def recv_message(group, src: int) -> tuple[int, bool, bytes]:
    """The next message rank `src` sent here: (call id, flag, payload)."""
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    size, call_id, ok = header.tolist()
    data = torch.empty(size, dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return call_id, bool(ok), data.numpy().tobytes()


def take_held(side: RankSide, recipes: list) -> list[torch.Tensor]:
    """On a rank > 0: the tensors its held rows `recipes` name, which leave it (a call of rank 0's)."""
    return side.held.take(recipes)


def drop_held(side: RankSide, handles: list[int]) -> None:
    """On a rank > 0: rows that will not leave (rank 0 dropped their deliveries) go now."""
    side.held.drop(handles)


def serve_calls(calls_group, replies_group, side: RankSide) -> threading.Thread:
    """Rank r > 0: answer rank 0's calls, each on a thread of its own (a call may wait for a decode
    worker, and no room waits behind another's), or one sent `in_order` (a call that never waits) on
    the receiving thread, done before any call sent after it starts; until rank 0 is gone (the process
    ends with its engine, and the thread with it). A call that cannot be read or run, or whose value
    cannot be pickled, is answered with why; the rank and its other calls go on."""
    lock = threading.Lock()

    def run(call_id: int, payload: bytes) -> None:
        try:
            fn, args = pickle.loads(payload)
            answer, ok = pickle.dumps(fn(side, *args)), True
        except Exception as e:  # the call fails, never the rank
            answer, ok = pickle.dumps(f"{type(e).__name__}: {first_line(e)}"), False
        try:
            with lock:
                send_message(call_id, ok, answer, 0, replies_group)
        except Exception:  # rank 0 is gone: the rank's own command loop finds it
            pass

    def serve() -> None:
        while True:
            try:
                call_id, in_order, payload = recv_message(calls_group, src=0)
            except Exception:  # rank 0 is gone
                return
            if in_order:
                run(call_id, payload)
            else:
                threading.Thread(target=run, args=(call_id, payload), name="sparsekv-rank-call", daemon=True).start()
    thread = threading.Thread(target=serve, name="sparsekv-rank-calls", daemon=True)
    thread.start()
    return thread


class RankCalls:
    """Rank 0's side: `call(rank, fn, *args)` runs `fn(side, *args)` on that rank; a concurrent future of
    its value, or of a RuntimeError saying why it failed there. A thread per rank receives its answers:
    a receive from any rank does not see one rank's connection close, so a rank that died left its
    calls waiting for their callers' timeouts; from that rank alone, the receive fails at once, and
    with it every call in flight (the engine fails with any of its ranks)."""

    def __init__(self, calls_group, replies_group, num_ranks: int):
        self.calls_group, self.replies_group, self.num_ranks = calls_group, replies_group, num_ranks
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # the calls waiting for an answer
        self._send_lock = threading.Lock()  # one message at a time on the calls group
        self.error: Exception | None = None
        for rank in range(1, num_ranks):
            threading.Thread(target=self._receive, args=(rank,), name=f"sparsekv-rank-replies-{rank}",
                             daemon=True).start()

    def call(self, rank: int, fn, *args, in_order: bool = False) -> Future:
        """`in_order`: a call that never waits (dropping rows), run on rank r's receiving thread, so that
        it is done before any call sent after it starts there."""
        if not 0 < rank < self.num_ranks:
            raise ValueError(f"no data-parallel rank {rank} to call (ranks 1..{self.num_ranks - 1})")
        try:
            payload = pickle.dumps((fn, args))
        except Exception as e:  # a function not importable by name, an argument that does not pickle
            raise RuntimeError(f"a call to data-parallel rank {rank} cannot be pickled: {e}") from None
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"data-parallel rank calls failed: {self.error}")
            call_id = next(self._ids)
            self._pending[call_id] = future
        try:
            # NOTE: not under _lock, which the receiving threads take for each answer: a send waits for rank
            # r to receive it, while rank r may first wait for rank 0 to receive an answer of its own
            with self._send_lock:
                send_message(call_id, in_order, payload, rank, self.calls_group)
        except Exception as e:
            with self._lock:
                self._pending.pop(call_id, None)
            raise RuntimeError(f"calling data-parallel rank {rank} failed: {first_line(e)}") from None
        return future

    def _receive(self, rank: int) -> None:
        while True:
            try:
                call_id, ok, payload = recv_message(self.replies_group, src=rank)
            except Exception as e:  # the rank died, or the engine closed
                with self._lock:
                    self.error = self.error or e
                    pending, self._pending = self._pending, {}
                for future in pending.values():
                    future.set_exception(RuntimeError(f"rank {rank} stopped answering: {first_line(e)}"))
                return
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue
            try:
                value = pickle.loads(payload)
            except Exception as e:  # NOTE: only this call fails: the next message is read as before
                future.set_exception(RuntimeError(f"the answer of data-parallel rank {rank} cannot be read: {e}"))
                continue
            future.set_result(value) if ok else future.set_exception(RuntimeError(value))
