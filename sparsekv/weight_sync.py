"""Weight updates broadcast by a trainer over torch.distributed, SGLang's RL interface (slime and verl
drive it): the trainer's ranks and the serving engines form one process group outside their own
worlds, and each update's tensors are broadcast from the trainer to every engine at once, with no
checkpoint written to disk (a 700 GB model is not saved and read back every RL step).

The trainer owns the group: it is rank 0 and hosts the group's `TCPStore` at (master_address,
master_port) (`trainer_group`). An engine process joins as `rank_offset` of `world_size`
(`join_group`, from the server's `/init_weights_update_group`); several engines take consecutive
offsets. An update names its tensors (names, dtypes, shapes, in broadcast order) while the trainer
broadcasts them (`broadcast_weights`); every engine receives each one (`receive_weights`), then loads
them through `LLMEngine.update_weights`, which checks the set whole (an unknown name or a wrong shape is
refused and the old weights keep serving). Every announced tensor is received before that check, so
the trainer's broadcasts complete whatever the engine thinks of them and the group stays usable.

An engine of several processes (tensor- or data-parallel ranks) joins with every process: engine
rank k is rank `rank_offset + k` of the group, as SGLang's engines join with each of their ranks, so
`world_size` counts every engine's processes. Each receives every broadcast itself (a rank's slices
are cut from what it received) and nothing is relayed through rank 0: the worker ranks' joins and
receives run on daemon threads of their own (`WorkerGroups`), while their engines keep stepping.

gloo carries host tensors, NCCL device tensors. gloo has no float8 type: over gloo a float8 tensor
travels as its bytes, which both `broadcast_weights` and `receive_weights` do.
"""
from __future__ import annotations

import datetime
from concurrent.futures import Future

import torch
import torch.distributed as dist

from .daemon import daemon_future
from .error_text import first_line

BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
TIMEOUT_S = 600.0  # one collective of the group (a tensor's broadcast) waits at most this long
THREAD = "sparsekv-weight-sync"  # the name of a worker rank's join and receive threads
JOIN_TIMEOUT_S = 120.0  # an engine waits this long for the trainer's store and ranks (/init_weights_update_group)


class WeightSyncError(RuntimeError):
    """The group could not form, or a broadcast failed (the trainer died or stopped within the
    timeout): the group is unusable; the trainer and the engines form a new one."""


def dtype_of(name: str) -> torch.dtype:
    """A dtype by its torch name ("bfloat16"; "torch.bfloat16" too, as SGLang's trainers send it)."""
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return dtype


def trainer_group(master_address: str, master_port: int, world_size: int, backend: str = "gloo",
                  timeout_s: float | None = None) -> dist.ProcessGroup:
    """The trainer's side of the group (rank 0), hosting its store: what a trainer runs while it asks
    each engine to `/init_weights_update_group`."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    store = dist.TCPStore(master_address, master_port, is_master=True, wait_for_workers=False,
                          timeout=_timeout(timeout_s))
    return _group(store, 0, world_size, backend, timeout_s)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float | None = None) -> dist.ProcessGroup:
    """An engine's side: rank `rank` of the trainer's group (blocks until every rank has joined)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not 0 < rank < world_size:
        raise ValueError(f"rank_offset {rank} must be in [1, world_size {world_size}): the trainer is rank 0")
    try:
        store = dist.TCPStore(master_address, master_port, is_master=False, wait_for_workers=False,
                              timeout=_timeout(min(timeout_s, JOIN_TIMEOUT_S)))
        return _group(store, rank, world_size, backend, timeout_s)
    except Exception as e:  # refused, unreachable, timed out
        raise WeightSyncError(f"could not join the trainer's group at {master_address}:{master_port}: "
                              f"{first_line(e)}") from None


def broadcast_weights(group: dist.ProcessGroup, named_tensors, backend: str = "gloo",
                      device: torch.device | str = "cpu") -> None:
    """The trainer's side of one update: each tensor from rank 0, in the order the engines were told
    (issued together, then waited for: the group runs them in that order without a round trip each)."""
    works = [_broadcast(group, tensor.detach().to(device).contiguous(), backend) for _, tensor in named_tensors]
    _wait_all(works)


def receive_weights(group: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype],
                    shapes: list[tuple[int, ...]], backend: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """An engine's side of one update: every announced tensor, in order, on `device` (the host for gloo)."""
    where = device if backend == "nccl" else torch.device("cpu")
    out, works = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        try:
            tensor = torch.empty(shape, dtype=dtype, device=where)
            works.append((name, _broadcast(group, tensor, backend)))
        except Exception as e:
            _settle(works)
            raise WeightSyncError(f"receiving {name} failed: {first_line(e)}") from None
        out.append((name, tensor))
    for name, work in works:
        try:
            work.wait()
        except Exception as e:
            _settle(works)
            raise WeightSyncError(f"receiving {name} failed: {first_line(e)}") from None
    _synchronize(out)
    return out


class WorkerGroups:
    """A worker rank's side of the trainer's groups (every engine process but rank 0, whose server
    holds its own): rank 0 tells each rank to `join` and, per update, to `receive`, asks for the
    `outcome` once its own receive is done, and the rank's update then `take`s what it received. An
    update is named by its group and a ticket of rank 0's, so that one waiting to load (a drain) keeps
    its tensors while a later one is received and refused, or while its group is left (and formed
    again). Joins and receives run on daemon threads, so the rank's engine steps with the others meanwhile."""

    def __init__(self):
        self._joins: dict[str, tuple[Future, str]] = {}  # name -> (the join, its backend)
        self._received: dict[tuple[str, int], Future] = {}  # (name, ticket) -> the update's tensors

    def join(self, name: str, address: str, port: int, rank: int, world_size: int, backend: str) -> None:
        self._leave(name)  # the tensors of an update waiting to load stay: it loads from them
        self._joins[name] = (daemon_future(join_group, address, port, rank, world_size, backend, name=THREAD), backend)

    def receive(self, name: str, ticket: int, names: list[str], dtypes: list[str], shapes: list[list[int]],
                device: torch.device) -> None:
        """Start receiving update `ticket`'s announced tensors over group `name`."""
        joined = self._joins.get(name)
        if joined is None:
            self._received[name, ticket] = _failed(WeightSyncError(f"this rank never joined the group {name!r}"))
            return
        join, backend = joined
        self._received[name, ticket] = daemon_future(lambda: receive_weights(
            join.result(JOIN_TIMEOUT_S), names, [dtype_of(d) for d in dtypes], [tuple(x) for x in shapes], backend,
            device), name=THREAD)

    def outcome(self, name: str, ticket: int, timeout_s: float) -> str | None:
        """None once this rank holds the update's tensors, else why it does not (within `timeout_s`)."""
        received = self._received.get((name, ticket))
        if received is None:
            return "no update was announced to this rank"
        try:
            received.result(timeout_s)
        except Exception as e:  # a failed receive (WeightSyncError), or one still running past timeout_s
            return f"{type(e).__name__}: {first_line(e)}"
        return None

    def take(self, name: str, ticket: int) -> list[tuple[str, torch.Tensor]]:
        """The tensors this rank received for the update (once: the update loads them)."""
        received = self._received.pop((name, ticket), None)
        if received is None:
            raise WeightSyncError(f"this rank holds no tensors of update {ticket} over {name!r}")
        return received.result(0)

    def discard(self, name: str, ticket: int) -> None:
        """Forget an update's tensors that will not load (refused, or failed on rank 0)."""
        self._received.pop((name, ticket), None)

    def call(self, op: str, args: tuple, engine_rank: int, device: torch.device):
        """Rank 0's command `op` (join, receive, outcome, discard, drop) on this rank, engine rank
        `engine_rank` on `device`: a join's `rank` argument is rank 0's offset, to which this rank adds its own."""
        if op == "join":
            name, address, port, rank_offset, world_size, backend = args
            return self.join(name, address, port, rank_offset + engine_rank, world_size, backend)
        if op == "receive":
            return self.receive(*args, device)
        if op not in ("outcome", "discard", "drop"):
            raise ValueError(f"unknown weight group command {op!r}")
        return getattr(self, op)(*args)

    def drop(self, name: str, keep: tuple[int, ...] = ()) -> None:
        """Leave the group (once its join ends, if it is still joining), its updates' tensors dropped
        but those of the tickets in `keep`: updates waiting to load (a drain), which load from them."""
        for key in [key for key in self._received if key[0] == name and key[1] not in keep]:
            del self._received[key]
        self._leave(name)

    def _leave(self, name: str) -> None:
        """Close this rank's side of the group, its received tensors left as they are."""
        joined = self._joins.pop(name, None)
        if joined is not None:
            join, backend = joined
            join.add_done_callback(lambda f: f.exception() is None and close_group(f.result(), backend))


WORKER_GROUPS = WorkerGroups()  # this process's, on a worker rank


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def close_group(group: dist.ProcessGroup, backend: str) -> None:
    """An NCCL communicator is aborted (its device buffers and proxy thread go); a gloo group frees its
    connections when dropped."""
    if backend == "nccl":
        group.abort()


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, backend: str):
    """The broadcast of one tensor from rank 0, issued (its work, to wait for)."""
    if backend == "gloo" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = tensor.view(torch.uint8)  # the same storage: the bytes land in the float8 tensor
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def _wait_all(works) -> None:
    for work in works:
        work.wait()


def _settle(works) -> None:
    """After a failure: wait out what was issued, so that no operation still writes a tensor dropped."""
    for _, work in works:
        try:
            work.wait()
        except Exception:
            pass


def _synchronize(named_tensors) -> None:
    """NCCL's wait orders the current stream only; the tensors are read on others after."""
    devices = {t.device for _, t in named_tensors if t.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)


def _group(store, rank: int, size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
