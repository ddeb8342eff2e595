"""A data-parallel prefill worker's rank r > 0 sending a room's tensors to the decode worker itself
(docs/disaggregation.md, "Data-parallel prefill ranks").

Rank 0 runs the room's protocol (the claim, the weights, each batch's metadata but its tensor specs,
the verdict, the errors) and calls these functions on rank r (parallel/dp_held.py: `RankCalls`),
which hold the room's rows (layer deliveries and exported pages): `publish` takes the batch's rows,
puts their specs (sizes and keyed digests) in its metadata and signs it into the prefill worker's
store; `push` joins the room's pair group as its prefill rank (the decode worker joins whoever
that is) and sends them. Over NIXL `publish` exposes them through the rank's own agent instead, named
in the metadata, and the decode worker reads them from there (`push` has nothing to do). So a room's
tensors never cross rank 0. `abandon` ends a join still waiting for the decode worker; `close_room`
drops the room's group, store connection and any rows still kept for it. Each runs on rank r with its
`RankSide` first, on a thread of its own.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, replace

from ..parallel.dp_held import RankSide
from .nixl import NixlAgent
from .outbox import as_published
from .transfer import Room, connect, gpu_identity, meta_key, sender
from .wire import sign


@dataclass
class RankRoom:
    """A room rank r sends for: its store keys, its data path (a pair group once joined, or the rank's NIXL
    agent), the published batch's tensors."""

    link: Room
    path: object
    tensors: list


def publish(side: RankSide, settings, bootstrap_port: int, room: str, meta: dict, recipes: list, index: int,
            first_tag: int) -> int:
    """The batch `index` of `room`: its rows (`recipes`, held here) taken, their specs put in `meta`,
    which goes signed to the store; its tensors kept for `push`. Returns their bytes."""
    state = _room(side, settings, bootstrap_port, room, meta["backend"])
    state.tensors = as_published(settings.secret, meta, side.held.take(recipes), first_tag)
    if state.tensors:
        meta.update(state.path.offer(state.tensors))
    # NOTE: not once rank 0 ended the room (it gave up waiting for this call): its key would outlive it
    side.while_open(room, state.link.put, meta_key(index), sign(settings.secret, meta))
    return sum(t.numel() for t in state.tensors)


def push(side: RankSide, room: str, first_tag: int) -> int:
    """Send the published batch's tensors (joining the pair group at the room's first); their bytes."""
    state = side.rooms[room]
    tensors, state.tensors = state.tensors, []
    state.path.push(tensors, first_tag)
    return sum(t.numel() for t in tensors)


def gpu_of(side: RankSide) -> str | None:
    """The GPU this rank runs on (`transfer.gpu_identity`), which its pair groups send from."""
    return gpu_identity(side.device)


def abandon(side: RankSide, room: str) -> None:
    """End a join of the pair group still waiting for the decode worker (rank 0 stopped waiting)."""
    state = side.rooms.get(room)
    if state is not None and state.path.needs_connect:  # NOTE: a pair group still forming (NIXL forms none)
        state.path.abandon()


def close_room(side: RankSide, room: str) -> int:
    """Rank 0 ended the room: its group and store connection go, and every row still kept for it.
    Returns how many entries of rows were still kept."""
    state = side.end_room(room)
    if state is not None:
        state.path.close()
    return side.held.release(("room", room))


def _room(side: RankSide, settings, bootstrap_port: int, room: str, backend: str) -> RankRoom:
    """The room's state on this rank, made at its first batch: a connection to the prefill worker's
    store, and the data path, whose transfer connections this rank makes from its own address (the
    bootstrap host on node 0, this machine's name on another node), or the rank's NIXL agent (made at
    its first NIXL room, kept for the rank's life as a worker's is). RuntimeError if rank 0 ended the
    room before or while it was made."""
    state = side.while_open(room, side.rooms.get, room)
    if state is None:
        link = Room(connect(settings.bootstrap_host, bootstrap_port, settings.timeout_s), room)
        own = settings if side.node_rank == 0 else replace(settings, bootstrap_host=socket.gethostname())
        if backend == "nixl" and side.agent is None:
            side.agent = NixlAgent(f"prefill-rank{side.held.rank}")
        state = RankRoom(link, sender(backend, link, own, side.device, side.agent), [])
        try:
            side.open_room(room, state)
        except RuntimeError:
            state.path.close()
            raise
    return state
