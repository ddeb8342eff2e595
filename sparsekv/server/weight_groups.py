"""SGLang's weight updates from a trainer's process group (sparsekv/weight_sync.py), admin keys only
(auth.ADMIN_PATHS): POST /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group.

The engine's process joins the trainer's group (a rendezvous off the event loop and off the engine
thread, so the server keeps serving meanwhile), keeps it under its name, and for each update receives
the announced tensors off both threads too; the update itself then runs as `/update_weights_from_disk`
does (the same drain or abort policy, checked whole, 400 with the old weights serving when refused).
An engine of several processes joins with each (ranks `rank_offset` to `rank_offset + processes - 1`),
and each receives the broadcasts itself (weight_sync.WorkerGroups): the update loads on every rank
only once all of them hold its tensors. One update at a time per group (its broadcasts are ordered);
a failed broadcast closes the group. The waits run on daemon threads of their own: a trainer that
never comes holds no exit up.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import model_validator

from ..daemon import on_daemon_thread
from ..weight_sync import TIMEOUT_S, BACKENDS, WeightSyncError, close_group, dtype_of, join_group, receive_weights
from .admin import call_engine, run_weight_update
from .errors import APIError, bad_request
from .protocol import _Body, parse_body

DEFAULT_GROUP = "weight_update_group"  # SGLang's default name


class InitWeightsUpdateGroup(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # default: NCCL for an engine on CUDA, else gloo

    @model_validator(mode="after")
    def _check(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend: one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: a TCP port, got {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset: must be in [1, world_size {self.world_size}): the trainer is rank 0, "
                             f"got {self.rank_offset}")
        return self


class UpdateWeightsFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True  # accepted: an update never serves the old weights' prefix pages (docs/rl.md)

    @model_validator(mode="after")
    def _check(self):
        if not self.names:
            raise ValueError("names: the update has no tensors")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names: {len(self.names)} names, {len(self.dtypes)} dtypes and {len(self.shapes)} "
                             "shapes: give one of each per tensor")
        for name in self.dtypes:
            dtype_of(name)  # a ValueError naming it, before anything is received
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes: dimensions must be >= 0")
        return self


class DestroyWeightsUpdateGroup(_Body):
    group_name: str = DEFAULT_GROUP


@dataclass
class SyncGroup:
    group: object  # a torch.distributed ProcessGroup
    backend: str
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)


class WeightGroups:
    """The trainer groups this server has joined, by name."""

    def __init__(self):
        self.groups: dict[str, SyncGroup | None] = {}  # None: joining
        self.closed = False  # the server shut down: a join that ends now is closed at once
        # NOTE: tickets are the server's, not a group's: a group formed again under a name must not
        # reuse the ticket of an update received over the old one that still waits to load
        self.updates = 0  # the updates announced: each one's ticket (weight_sync.WorkerGroups)
        self.loading: set[tuple[str, int]] = set()  # (group, ticket) of the updates given to the engine

    def next_ticket(self) -> int:
        self.updates += 1
        return self.updates

    def tickets_loading(self, name: str) -> tuple[int, ...]:
        """The updates received over `name` that the engine still holds (waiting to load)."""
        return tuple(ticket for group, ticket in self.loading if group == name)

    def take(self, name: str) -> SyncGroup:
        found = self.groups.get(name)
        if found is None:
            raise bad_request(f"no weights update group named {name!r}: POST /init_weights_update_group first",
                              "group_name")
        return found

    def drop(self, name: str) -> None:
        """Close this process's side of the group (the other ranks': `leave_everywhere`)."""
        found = self.groups.pop(name, None)
        if found is not None:
            close_group(found.group, found.backend)

    def close(self) -> None:
        self.closed = True
        for name in list(self.groups):
            self.drop(name)


async def init_weights_update_group(request: Request):
    state = request.app.state.server
    await call_engine(state, lambda: None)  # 503 while the server shuts down or once its engine failed
    body = parse_body(await request.body(), InitWeightsUpdateGroup)
    groups, name = state.weight_groups, body.group_name
    if name in groups.groups:
        raise APIError(409, f"a weights update group named {name!r} exists: destroy it first", "group_name")
    backend = body.backend or ("nccl" if state.engine.device.type == "cuda" else "gloo")
    processes = _num_processes(state.engine)
    last = body.rank_offset + processes - 1
    if last >= body.world_size:
        raise bad_request(f"world_size {body.world_size}: this engine joins with each of its {processes} processes, "
                          f"as ranks {body.rank_offset} to {last}", "world_size")
    groups.groups[name] = None
    try:
        await call_engine(state, lambda: state.engine.weight_groups("join", name, body.master_address, body.master_port,
                                                                    body.rank_offset, body.world_size, backend))
        group = await on_daemon_thread(join_group, body.master_address, body.master_port, body.rank_offset,
                                       body.world_size, backend, name="sparsekv-weight-sync")
    except WeightSyncError as e:
        await _on_other_ranks(state, "drop", name, groups.tickets_loading(name))
        raise APIError(503, str(e)) from None
    finally:
        if groups.groups.get(name, False) is None:
            del groups.groups[name]
    if groups.closed:
        close_group(group, backend)
        raise APIError(503, "the server is shutting down")
    groups.groups[name] = SyncGroup(group, backend)
    ranks = f"rank {body.rank_offset}" if processes == 1 else f"ranks {body.rank_offset} to {last}"
    return {"success": True, "message": f"joined {name} as {ranks} of {body.world_size} ({backend})"}


async def update_weights_from_distributed(request: Request):
    state = request.app.state.server
    await call_engine(state, lambda: None)  # 503 while the server shuts down or once its engine failed
    body = parse_body(await request.body(), UpdateWeightsFromDistributed)
    name = body.group_name
    sync, groups = _idle(state, name), state.weight_groups
    async with sync.busy:
        ticket = groups.next_ticket()
        try:
            await call_engine(state, lambda: state.engine.weight_groups("receive", name, ticket, body.names,
                                                                        body.dtypes, body.shapes))
            tensors = await on_daemon_thread(receive_weights, sync.group, body.names,
                                             [dtype_of(d) for d in body.dtypes], [tuple(s) for s in body.shapes],
                                             sync.backend, state.engine.device, name="sparsekv-weight-sync")
            # NOTE: the other ranks received the same broadcasts: their receives end with rank 0's, or fail as it does
            missing = await call_engine(state, lambda: state.engine.weight_groups("outcome", name, ticket, TIMEOUT_S))
            if any(missing):
                raise WeightSyncError("; ".join(f"rank {rank}: {why}" for rank, why in enumerate(missing, 1) if why))
        except WeightSyncError as e:
            await _leave_everywhere(state, name)
            raise APIError(503, f"{e}; the group {name} is closed: form a new one") from None
    policy = state.settings.weight_update_policy
    groups.loading.add((name, ticket))
    try:
        version = await run_weight_update(
            state, lambda: state.engine.update_weights_from_group(name, ticket, tensors, policy), "names")
    except APIError:  # refused (another update waits to load: a drain), or failed: the ranks' copies go
        await _on_other_ranks(state, "discard", name, ticket)
        raise
    finally:
        groups.loading.discard((name, ticket))
    return {"success": True, "message": f"loaded {len(tensors)} tensors from {name}", "weights_version": version}


async def destroy_weights_update_group(request: Request):
    state = request.app.state.server
    await call_engine(state, lambda: None)  # 503 while the server shuts down or once its engine failed
    body = parse_body(await request.body(), DestroyWeightsUpdateGroup)
    _idle(state, body.group_name)
    await _leave_everywhere(state, body.group_name)
    return {"success": True}


def _num_processes(engine) -> int:
    """The engine's processes, each of them a member of a trainer's group."""
    return engine.config.tensor_parallel_size * engine.config.data_parallel_size


async def _leave_everywhere(state, name: str) -> None:
    """Every rank leaves the group; an update received over it that waits to load keeps its tensors."""
    state.weight_groups.drop(name)
    await _on_other_ranks(state, "drop", name, state.weight_groups.tickets_loading(name))


async def _on_other_ranks(state, op: str, *args) -> None:
    """The other ranks drop an update's copies or leave the group (a join still waiting, once it ends);
    nothing to do once the engine is gone (its ranks went with it)."""
    try:
        await state.loop.call(lambda: state.engine.weight_groups(op, *args))
    except Exception:  # the engine loop is closing or dead
        pass


def _idle(state, name: str) -> SyncGroup:
    """The group `name`, with no update in flight over it (409 if one is: its broadcasts come in order)."""
    sync = state.weight_groups.take(name)
    if sync.busy.locked():
        raise APIError(409, f"an update over {name} is in flight: its broadcasts come in order, one update at a time")
    return sync


WEIGHT_GROUP_ROUTES = [("/init_weights_update_group", init_weights_update_group, ["POST"]),
                       ("/update_weights_from_distributed", update_weights_from_distributed, ["POST"]),
                       ("/destroy_weights_update_group", destroy_weights_update_group, ["POST"])]
