"""Starting the ranks: rank 0 is the engine's own process; the others are worker processes it spawns
(torch.multiprocessing, spawn) and supervises. All join one torch.distributed group: gloo on CPU,
NCCL on CUDA for tensors with a gloo group beside it for the step commands.

Start-up is all or nothing: every rank loads its shard, then the ranks exchange their status, and
if any failed (a missing shard, a bad config) every rank stops and the engine raises that rank's
message.

Start-up has its own timeout (`dist_startup_timeout_s`): ranks start at different times (a spawned
process imports torch, another node starts later, shards load at different speeds), which a short
`dist_timeout_s` must not fail. Node 0's rank 0 hosts the rendezvous store (on a port the system picks
and it holds, unless an address is given); every rank first waits there until all have arrived
(rank 0 also watching the processes it spawned, so one that dies before joining fails the start at
once), then the groups are made and the statuses exchanged under the start-up timeout, and only then
does every collective take `dist_timeout_s`.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..config import ConfigError, EngineConfig, ModelConfig
from ..error_text import first_line
from .comm import TensorParallel
from .layout import ParallelLayout

logger = logging.getLogger(__name__)
ARRIVAL_POLL_S = 0.05  # how often a rank waiting for the others at start-up looks again


def layout_of(config: EngineConfig, rank: int = 0) -> ParallelLayout:
    return ParallelLayout(config.tensor_parallel_size, config.data_parallel_size, config.enable_expert_parallel, rank)


class StartupError(RuntimeError):
    """A rank failed to start; the message names the rank and its error."""


class RankFailure(RuntimeError):
    """A rank died or stopped answering (past `dist_timeout_s`): the engine cannot step any more."""


def check_layout(config: EngineConfig) -> None:
    """ConfigError unless the model takes `config`'s layout (read from config.json) and, on CUDA, this
    node has a GPU for each of its ranks: before any process starts or any weight loads."""
    layout_of(config).check_model(ModelConfig.from_json(config.model, config.hf_overrides))
    if config.device.startswith("cuda"):
        check_gpus(config)


def check_gpus(config: EngineConfig) -> None:
    """ConfigError unless this node sees a GPU per rank it hosts (NCCL refuses two ranks on one GPU,
    "Duplicate GPU detected", at the first collective, after every rank loaded its shard)."""
    if torchrun_rank(config) is not None:  # a launcher started the ranks: it says how many are here
        if "LOCAL_WORLD_SIZE" not in os.environ:
            return
        ranks, where = int(os.environ["LOCAL_WORLD_SIZE"]), "torchrun's LOCAL_WORLD_SIZE"
    else:
        ranks = config.tensor_parallel_size * config.data_parallel_size // config.nnodes
        where = f"-tp {config.tensor_parallel_size} -dp {config.data_parallel_size} over {config.nnodes} node(s)"
    gpus = torch.cuda.device_count()
    if gpus < ranks:
        raise ConfigError(f"{where} puts {ranks} ranks on this node, one GPU each, and it sees {gpus} "
                          f"(CUDA_VISIBLE_DEVICES): NCCL cannot place two ranks on one GPU")


class RankGroup:
    """This process's membership of the world's process group, and the workers it spawned."""

    def __init__(self, config: EngineConfig, layout: ParallelLayout, processes: list, store=None):
        self.config, self.layout, self.processes = config, layout, processes
        self.store = store  # the rendezvous store this process hosts (kept for the group's life)
        self.comm = TensorParallel(dist.group.WORLD, layout.world_size, layout.rank)
        self.control = control_group()
        self.closed = False
        self.failure: RankFailure | None = None  # once a call across the ranks failed, every later one does

    @classmethod
    def start(cls, config: EngineConfig, worker_main) -> "RankGroup":
        """Spawn this node's other ranks, each running `worker_main(config, rank, addr)` (addr: the
        rendezvous store's HOST:PORT), and join the group as rank 0 (on node 0) of `config`'s world."""
        if dist.is_initialized():
            raise ConfigError("this process already runs a parallel engine: close() it before starting another")
        layout = layout_of(config)
        launched = torchrun_rank(config)
        if launched:
            raise ConfigError(f"under torchrun, rank {launched} hosts its rank for rank 0's engine: run "
                              f"`sparsekv serve ...` on every rank (parallel.lanes.host_torchrun_rank)")
        per_node = layout.world_size // config.nnodes
        first = 0 if launched == 0 else config.node_rank * per_node
        store = host_store(config) if first == 0 else None
        addr = _configured_addr(config) or f"127.0.0.1:{store.port}"
        if launched == 0:  # torchrun started every rank: join as rank 0, spawn nothing
            join_group(config, 0, addr, store)
            return cls(config, layout, [], store)
        ctx = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(first + 1 if first == 0 else first, first + per_node):
            p = ctx.Process(target=worker_main, args=(config, rank, addr), daemon=True, name=f"sparsekv-rank{rank}")
            p.start()
            processes.append(p)
        if first != 0:
            return cls._detached(config, processes)
        try:
            join_group(config, 0, addr, store, lambda: _check_spawned(processes))
        except BaseException:
            _stop(processes)
            raise
        return cls(config, layout, processes, store)

    @classmethod
    def _detached(cls, config, processes) -> "RankGroup":
        group = cls.__new__(cls)
        group.config, group.processes, group.closed, group.failure = config, processes, False, None
        group.store = None
        return group

    def check_started(self, error: BaseException | None) -> None:
        """Every rank's start-up status; raises (and stops every rank) if any failed."""
        mine = None if error is None else f"rank 0: {type(error).__name__}: {error}"
        statuses = exchange_status(mine, launch_fingerprint(self.config), self.layout.world_size, self.control)
        failed = [s for s in statuses if s is not None]
        if failed:  # every worker exits now (start_worker): let them go before this group shuts down
            await_departures(self.control, self.layout.world_size)
            self.close(notify=False)
            if error is not None:
                raise error
            raise StartupError("a rank failed to start: " + "; ".join(failed))
        use_operation_timeout(self.config)

    def close(self, notify: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if notify:
            try:
                dist.broadcast_object_list([("close", ())], src=0, group=self.control)
                dist.barrier(group=self.control)  # every rank has closed its engine
            except RuntimeError as e:  # a rank already gone: it cannot be told
                logger.warning("telling the workers to stop failed: %s", e)
            else:
                await_departures(self.control, self.layout.world_size)
        _stop(self.processes, timeout_s=10.0 if notify else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None

    def failed_workers(self) -> list[str]:
        """The workers that exited, with their exit codes."""
        return [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]

    def check_alive(self) -> None:
        """RankFailure if a call across the ranks failed before, or a worker process exited."""
        exited = self.failed_workers()
        if self.failure is None and exited:
            self.failure = RankFailure(f"worker rank(s) exited: {', '.join(exited)}")
        if self.failure is not None:
            raise self.failure

    def fail(self, command: str, error: RuntimeError) -> RankFailure:
        """The RankFailure of a collective that raised (gloo/NCCL: a peer closed its connection, or the
        timeout passed), remembered."""
        exited = self.failed_workers()
        self.failure = RankFailure(f"{command} failed across ranks ({', '.join(exited) or 'no worker exited'}; "
                                   f"dist_timeout_s {self.config.dist_timeout_s}): {error}")
        return self.failure


# options each node's command may set for itself: where its files are, its threads, its place
PER_NODE_OPTIONS = frozenset({"model", "tokenizer", "num_threads", "node_rank", "host_store_path",
                              "prefix_cache_disk_path", "prefix_cache_disk_key_file",
                              "prefix_cache_disk_old_key_files", "dist_startup_timeout_s"})


def launch_fingerprint(config: EngineConfig) -> dict:
    """What every rank's command must agree on: its options but PER_NODE_OPTIONS, and the checkpoint
    by what it holds (config.json and sampled blocks of its weights), not by its path. Each node parses
    its own flags: a node started with other ones (expert parallelism, another checkpoint of the same
    shapes, another dtype) computed other tokens silently, or failed at the first request."""
    import dataclasses
    from ..cache.prefix_disk import checkpoint_identity
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in PER_NODE_OPTIONS}
    try:
        options["checkpoint"] = checkpoint_identity(config.model) if os.path.isdir(config.model) else config.model
    except OSError as e:
        options["checkpoint"] = f"unreadable: {e}"
    return options


def exchange_status(mine: str | None, fingerprint: dict, world_size: int, group) -> list[str | None]:
    """Every rank's start-up error or None, the same list on every rank; a rank whose options differ
    from rank 0's (`launch_fingerprint`) has failed, naming them."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (mine, fingerprint), group=group)
    reference = gathered[0][1]
    statuses = []
    for rank, (error, theirs) in enumerate(gathered):
        differ = [k for k in sorted(set(reference) | set(theirs)) if reference.get(k) != theirs.get(k)]
        if error is None and differ:
            error = (f"rank {rank} was started with other options than rank 0 (run the same command on every node): "
                     + "; ".join(_difference(k, theirs.get(k), reference.get(k)) for k in differ))
        statuses.append(error)
    return statuses


def _difference(option: str, theirs, ours) -> str:
    if option == "checkpoint":
        return "another checkpoint (its config.json or weights differ)"
    return f"{option} {theirs!r} against {ours!r}"


def start_worker(config: EngineConfig, rank: int, addr: str, build):
    """A worker's start: join the group at the rendezvous store `addr` (HOST:PORT), `build(control
    group)`, and exchange every rank's start-up status. Returns (what build made, the control group);
    when a rank failed this process exits 1 (rank 0 raises that rank's message)."""
    import torch
    torch.set_num_threads(config.num_threads or 1)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    try:
        control = join_group(config, rank, addr, None, _check_parent)
    except RuntimeError as e:  # rank 0's store never answered, a rank never came (StartupError), the parent left
        logger.error("rank %d could not join the world at %s: %s", rank, addr, first_line(e))
        raise SystemExit(1) from None
    built, error = None, None
    try:
        built = build(control)
    except Exception as e:  # reported to rank 0, which raises it
        error = f"rank {rank}: {type(e).__name__}: {e}"
    statuses = exchange_status(error, launch_fingerprint(config), config.tensor_parallel_size * config.data_parallel_size,
                               control)
    failed = [s for s in statuses if s is not None]
    if failed:  # rank 0 raises it; said here too, for a node whose own output is all its operator sees
        logger.error("the start failed: %s", "; ".join(failed))
        _exit_now(1)
    use_operation_timeout(config)
    return built, control


_control = []  # this process's control group (step commands, host tensors), once it joined


def join_group(config: EngineConfig, rank: int, addr: str, store=None, alive=None):
    """Join the world's group through the rendezvous store at `addr` (`store`: this process hosts it),
    once every rank has arrived there (`alive()` raises if a rank can no longer come). Returns the gloo
    group for step commands and host tensors (the world itself on CPU, a second group beside NCCL on
    CUDA). Both take the start-up timeout until `use_operation_timeout`."""
    world = config.tensor_parallel_size * config.data_parallel_size
    cuda = config.device.startswith("cuda")
    startup = timedelta(seconds=config.dist_startup_timeout_s)
    if store is None:
        host, port = addr.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=startup)
    wait_for_ranks(store, rank, world, config.dist_startup_timeout_s, alive)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=startup)
    _control[:] = [dist.new_group(backend="gloo", timeout=startup) if cuda else dist.group.WORLD]
    return _control[0]


def wait_for_ranks(store, rank: int, world: int, timeout_s: float, alive=None) -> None:
    """Mark `rank` arrived in the rendezvous store and wait until all `world` ranks have; StartupError
    past `timeout_s`, or as soon as `alive()` raises."""
    store.set(_arrived(rank), str(world).encode())  # each rank's world size: nodes started otherwise never meet
    keys = [_arrived(r) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()  # the ranks whose world size was read already
    keys_then = -1
    while not store.check(keys):
        if store.num_keys() != keys_then:  # a rank arrived (or another key came): read the new ones
            keys_then = store.num_keys()
            _check_same_world(store, rank, world, seen)
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise StartupError(f"rank {rank}: rank(s) {missing} did not join within {timeout_s:g} s "
                               f"(--dist-startup-timeout)")
        time.sleep(ARRIVAL_POLL_S)
    _check_same_world(store, rank, world, seen)


def _check_same_world(store, rank: int, world: int, seen: set[int]) -> None:
    """StartupError once a rank that arrived counts another world size, or another rank found one (it
    says so under START_FAILED_KEY: node 0's ranks would never see node 1's, whose numbers are past
    their world, and waited for the start-up timeout). `seen`: the ranks read already, updated."""
    if store.check([START_FAILED_KEY]):
        raise StartupError(store.get(START_FAILED_KEY).decode())
    new = [r for r in range(world) if r not in seen and store.check([_arrived(r)])]
    other = {r: int(store.get(_arrived(r))) for r in new}
    seen.update(new)
    wrong = {r: w for r, w in other.items() if w != world}
    if wrong:
        message = (f"rank {rank} counts a world of {world} ranks, rank(s) {sorted(wrong)} of "
                   f"{sorted(set(wrong.values()))} (tensor x data parallel size): run the same command on every node")
        store.set(START_FAILED_KEY, message.encode())
        raise StartupError(message)


START_FAILED_KEY = "sparsekv/start-failed"


def _arrived(rank: int) -> str:
    return f"sparsekv/arrived/{rank}"


def use_operation_timeout(config: EngineConfig) -> None:
    """Every rank started: from now on a collective waiting longer than `dist_timeout_s` fails."""
    timeout = timedelta(seconds=config.dist_timeout_s)
    for group in {dist.group.WORLD, control_group()}:
        _set_pg_timeout(timeout, group)


COMMAND_WAIT = timedelta(days=365)  # a worker rank waits for rank 0's next command this long


def next_command(config: EngineConfig, control):
    """A worker rank's next command from rank 0 (a broadcast on the control group). Rank 0 may stay idle
    for any time between two (an idle server, an offline LLM between calls), so the wait itself is
    not bounded by `dist_timeout_s`; rank 0 exiting closes its connections, which ends it at once. Every
    other collective keeps the bound."""
    message = [None]
    _set_pg_timeout(COMMAND_WAIT, control)
    try:
        dist.broadcast_object_list(message, src=0, group=control)
    finally:
        _set_pg_timeout(timedelta(seconds=config.dist_timeout_s), control)
    return message[0]


def _check_spawned(processes) -> None:
    exited = [f"{p.name} (exit code {p.exitcode})" for p in processes if not p.is_alive()]
    if exited:
        raise StartupError(f"worker rank(s) exited before joining: {', '.join(exited)}")


def _check_parent() -> None:
    """In a spawned worker: StartupError if the engine's process that spawned it is gone."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        raise StartupError("the engine's process exited while this rank was starting")


def control_group():
    return _control[0]


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank(config: EngineConfig) -> int | None:
    """This process's rank when torchrun (or any launcher setting its environment) started one process
    per rank of a parallel world; None otherwise (the engine then starts its ranks itself)."""
    world = config.tensor_parallel_size * config.data_parallel_size
    if world == 1 or not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']} is not tensor_parallel_size x "
                          f"data_parallel_size = {world}")
    return int(os.environ["RANK"])


def _configured_addr(config: EngineConfig) -> str | None:
    """node 0's rendezvous HOST:PORT: dist_init_addr, else torchrun's MASTER_ADDR:MASTER_PORT, else None
    (a local port the system picks, see host_store)."""
    if config.dist_init_addr is not None:
        return config.dist_init_addr
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None


def host_store(config: EngineConfig) -> dist.TCPStore:
    """Node 0's rendezvous store, in rank 0's process: listening on the configured address, or on a
    free local port it binds and holds (choosing a port and binding it later could lose it to another
    process in between). Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) the agent hosts it
    and rank 0 connects like every other rank."""
    addr = _configured_addr(config)
    host, port = addr.rsplit(":", 1) if addr else ("127.0.0.1", "0")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return dist.TCPStore(host, int(port), is_master=not agent, wait_for_workers=False,
                         timeout=timedelta(seconds=config.dist_startup_timeout_s), use_libuv=True)


def _stop(processes, timeout_s: float = 10.0) -> None:
    """Wait up to `timeout_s` for each process to exit, then terminate it, then kill it (a stopped
    process only answers SIGKILL)."""
    for p in processes:
        p.join(timeout_s)
        for end in (p.terminate, p.kill):
            if p.is_alive():
                end()
                p.join(2.0)


DEPARTURE_WAIT_S = 10.0  # how long rank 0 waits for a worker told to close to exit


def await_departures(control, world_size: int, timeout_s: float = DEPARTURE_WAIT_S) -> None:
    """Rank 0, once every worker met it at `leave`'s barrier: wait until each has exited, so that this
    process shuts its group down alone. A receive from a rank fails as soon as its connections close
    (it never sends); a spawned worker's exit is also awaited by joining it, but a rank on another node
    or under torchrun can only be seen this way. Shutting the group down while a peer's connections
    close under it can abort this process in C++ (gloo). `timeout_s` bounds the whole wait."""
    probe, deadline = torch.zeros(1), time.monotonic() + timeout_s
    for rank in range(1, world_size):
        _set_pg_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.01)), control)
        try:
            dist.recv(probe, src=rank, group=control)
        except RuntimeError:  # its connection closed (or the wait timed out): either way, go on
            continue
        logger.warning("rank %d sent data after it was told to close", rank)


def leave(control) -> None:
    """A worker's end once told to close: meet every rank at a barrier (all have closed their
    engines), then exit at once. Tearing the group down instead would race rank 0's, whose store the
    others' connections use, and abort in C++ at interpreter exit."""
    dist.barrier(group=control)
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Exit without tearing the process group down: its peers exit at the same moment, and gloo's
    teardown while their connections close can abort in C++ ("terminate called without an active
    exception": a failed start exited 250, not 1)."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
