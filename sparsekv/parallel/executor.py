"""The multi-rank executor: every executor call runs on every rank, in the same order.

Rank 0 (the engine's process) broadcasts each call as plain data, a (method, arguments) pair whose
arguments are the scheduler's step, an MTP plan or a request id, on the control group, then runs it
itself. Every other rank runs `serve_rank`: it receives the calls and runs them on its own shard
of the model and its own copy of the KV cache. The ranks' caches stay identical because the same
calls reach them in the same order, and every rank selects the same positions: the indexer is
replicated and the hidden states it reads are all-reduced, so they are the same bits everywhere.
The logits come back to rank 0 from the lm_head's all-gather; workers return nothing.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from ..config import ConfigError, EngineConfig
from ..executor import Executor, InProcessExecutor, ModelOutput
from ..scheduler import SchedulerOutput
from ..speculative import MTPPlan
from ..weight_sync import WORKER_GROUPS
from ..weights import (ReceivedUpdate, WeightLoadError, WeightRestoreError, model_weight_shapes,
                       received_here)
from .launch import RankFailure, RankGroup, check_layout, control_group, layout_of, leave, next_command, start_worker

logger = logging.getLogger(__name__)


class MultiRankExecutor(Executor):
    """Rank 0's side: broadcast each call, then run it on rank 0's shard.

    A worker that died, or a collective that failed or timed out, raises `RankFailure` from the call
    that found it; from then on every call that needs the other ranks raises it at once, and the
    calls that only let go of state (forget, release_idle_buffers) run on rank 0 alone, so aborting
    the requests in flight never waits for a dead rank."""

    def __init__(self, local: InProcessExecutor, ranks: RankGroup):
        self.local, self.ranks = local, ranks
        self.observers = local.observers
        self.runner, self.model = local.runner, local.model
        self.weights = local.weights  # where every rank's weights came from (each loads its slices)

    def _together(self, method: str, *args, run):
        """Broadcast the call, then run it here; a failure of either is a RankFailure."""
        self.ranks.check_alive()
        try:
            dist.broadcast_object_list([(method, args)], src=0, group=self.ranks.control)
            return run()
        except RuntimeError as e:
            raise self.ranks.fail(method, e) from e

    def _release(self, method: str, *args) -> None:
        if self.ranks.failure is None:
            try:
                self._together(method, *args, run=lambda: None)
            except RankFailure:
                pass  # state is let go of on rank 0 below; the step that needs the ranks will raise
        getattr(self.local, method)(*args)

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        def run():
            mirror_pages(self.local, step.restored_page_ids)
            return self.local.execute(step)
        return self._together("execute", step, run=run)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()

        def run():
            dist.broadcast(hidden, src=0)
            return self.local.logits(hidden)
        return self._together("logits", tuple(hidden.shape), hidden.dtype, run=run)

    def forget(self, request_id: str) -> None:
        self._release("forget", request_id)

    def release_idle_buffers(self) -> None:
        self._release("release_idle_buffers")

    def check_integrity(self, running: set[str]) -> None:
        self._together("check_integrity", running, run=lambda: self.local.check_integrity(running))

    def draft_extend(self, plan: MTPPlan) -> torch.Tensor:
        return self._together("draft_extend", plan, run=lambda: self.local.draft_extend(plan))

    def draft_step(self, step: int, tokens: list[int]) -> torch.Tensor:
        return self._together("draft_step", step, tokens, run=lambda: self.local.draft_step(step, tokens))

    def layer_taps(self, tensors: list):
        """Rank 0's: the pages of a transfer leave from its cache (every rank holds the whole latent).
        Every rank's decode graphs are turned off with them, as rank 0's are (`disable_decode_graphs`):
        the ranks' steps must take the same path for their collectives to pair up."""
        if self.local.runner.graphs is not None:
            self._together("disable_decode_graphs", run=self.local.disable_decode_graphs)
        return self.local.layer_taps(tensors)

    def update_weights(self, update) -> None:
        """Every rank loads its slices of the update (an in-process update's tensors travel pickled on
        the control group; a trainer's broadcast reached each rank itself); then the ranks agree on the
        outcome before anyone serves again: all loaded it; or every one failed and put its old weights
        back (WeightLoadError: they keep serving); else their weights differ (RankFailure). Checked
        again first (a drain loads well after its check): refused here, no rank has started."""
        self.local.check_weight_update(update)

        def run():
            error = None
            try:
                self.local.update_weights(update)
            except Exception as e:  # checked before: an I/O or memory failure, and the others may have loaded it
                error = e
            return error, _agree_on_update(self.ranks.control, load_status(error))
        sent = update.for_other_ranks() if isinstance(update, ReceivedUpdate) else update
        error, outcome = self._together("update_weights", sent, run=run)
        if outcome == KEPT:
            raise WeightLoadError(f"no rank loaded the weight update; the previous weights keep serving "
                                  f"(rank 0: {error!r})") from error
        if outcome != LOADED:
            why = f"rank 0 failed to load it: {error!r}" if error is not None else "a worker rank failed to load it"
            raise self.ranks.fail("update_weights", RuntimeError(f"the ranks' weights now differ: {why}")) from error

    def check_weight_update(self, update) -> None:
        self.local.check_weight_update(update)

    def weight_groups(self, op: str, args: tuple) -> list:
        """Every worker rank's answer to `WORKER_GROUPS.call(op, args)` (weight_sync.py)."""
        def run():
            gathered = [None] * self.ranks.layout.world_size
            dist.gather_object(None, gathered, dst=0, group=self.ranks.control)
            return gathered[1:]
        return self._together("weight_groups", op, args, run=run)

    def capture_routed_experts(self, on: bool) -> None:
        """Rank 0 records (every rank routes the same rows alike), and every rank learns when it starts
        or stops: a step that records runs the engine's decode path, not the decode graphs' pieces, and
        every rank must take the same path for their collectives to pair up."""
        if on != self.local.capture_routing:
            self._together("capture_routed_experts", on, run=lambda: self.local.capture_routed_experts(on))

    def decode_graph_stats(self) -> dict:
        return self.local.decode_graph_stats()  # every rank runs the same steps through the same buckets

    def rank_stats(self) -> list[dict]:
        """Every rank's figures, gathered on rank 0 (after a rank failure: rank 0's alone)."""
        if self.ranks.failure is not None:
            return [self.local.local_stats()]

        def run():
            gathered = [None] * self.ranks.layout.world_size
            dist.gather_object(self.local.local_stats(), gathered, dst=0, group=self.ranks.control)
            return gathered
        return self._together("rank_stats", run=run)

    def close(self) -> None:
        self.ranks.close(notify=self.ranks.failure is None)


class RankWorker:
    """A worker rank's side of each call, on its shard and its copy of the cache."""

    def __init__(self, executor: InProcessExecutor, pool, control):
        self.executor, self.pool, self.control = executor, pool, control

    def execute(self, step: SchedulerOutput) -> None:
        mirror_pages(self.executor, step.restored_page_ids)
        self.executor.execute(step)

    def logits(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        hidden = torch.empty(shape, dtype=dtype, device=self.executor.model.device)
        dist.broadcast(hidden, src=0)
        self.executor.logits(hidden)

    def forget(self, request_id: str) -> None:
        # rank 0's cache manager released the request's working set just before; mirror it here
        self.pool.release(request_id)
        self.executor.forget(request_id)

    def release_idle_buffers(self) -> None:
        self.executor.release_idle_buffers()

    def check_integrity(self, running: set[str]) -> None:
        self.executor.check_integrity(running)

    def draft_extend(self, plan: MTPPlan) -> None:
        self.executor.draft_extend(plan)

    def draft_step(self, step: int, tokens: list[int]) -> None:
        self.executor.draft_step(step, tokens)

    def rank_stats(self) -> None:
        dist.gather_object(self.executor.local_stats(), None, dst=0, group=self.control)

    def weight_groups(self, op: str, args: tuple) -> None:
        answer = WORKER_GROUPS.call(op, args, dist.get_rank(), self.executor.model.device)
        dist.gather_object(answer, None, dst=0, group=self.control)

    def capture_routed_experts(self, on: bool) -> None:
        self.executor.capture_routed_experts(on)

    def disable_decode_graphs(self) -> None:
        self.executor.disable_decode_graphs()

    def update_weights(self, update) -> None:
        error = None
        try:
            if isinstance(update, ReceivedUpdate):  # rank 0 sent none of the trainer's tensors: this rank's own
                update = received_here(update, model_weight_shapes(self.executor.model))
            self.executor.update_weights(update)
        except Exception as e:
            logger.exception("rank %d: the weight update failed", dist.get_rank())
            error = e
        if _agree_on_update(self.control, load_status(error)) not in (LOADED, KEPT):
            raise RuntimeError("the ranks' weights differ after a failed weight update") from error


LOADED, KEPT, MIXED = "loaded", "kept", "mixed"  # the ranks' outcome of a weight update (`_agree_on_update`)
WEIGHTS_MIXED = 2  # a rank's `load_status` when its weights are a mix of two versions


def load_status(error: BaseException | None) -> int:
    """One rank's outcome of a weight update (tensor- and data-parallel alike): 0 loaded, 1 failed with
    its old weights put back, 2 its weights a mix."""
    return 0 if error is None else WEIGHTS_MIXED if isinstance(error, WeightRestoreError) else 1


def _agree_on_update(control, status: int) -> str:
    """Every rank's `load_status`, summed up alike on every rank: LOADED (all loaded), KEPT (all failed
    and put their old weights back), else MIXED (the ranks' weights now differ)."""
    counts = torch.zeros(3, dtype=torch.int64)
    counts[status] = 1
    dist.all_reduce(counts, group=control)
    loaded, kept, _ = counts.tolist()
    size = dist.get_world_size(control)
    return LOADED if loaded == size else KEPT if kept == size else MIXED


def mirror_pages(executor: InProcessExecutor, page_ids: list[int]) -> None:
    """Rank 0's rows of `page_ids` (written by a prefix-cache restore from its host or disk tier, which
    only rank 0 has) copied into every rank's cache: every slot-indexed tensor of the pool and of the
    selectors, one broadcast per tensor (host tensors over the gloo control group)."""
    if not page_ids:
        return
    rank = dist.get_rank()
    executor.pool.flush()
    tensors = executor.pool.slot_tensors() + [t for s in executor.model.selectors() for t in s.slot_tensors()]
    page_size = executor.runner.page_size
    for t, per_row in tensors:
        n = page_size // per_row
        rows = torch.cat([torch.arange(p * n, (p + 1) * n) for p in page_ids]).to(t.device)
        values = t.index_select(0, rows) if rank == 0 else torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype,
                                                                         device=t.device)
        group = None if t.device.type == "cuda" else control_group()
        dist.broadcast(values, src=0, group=group)
        if rank != 0:
            t.index_copy_(0, rows, values)


def worker_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A worker's view of the config: no prefix cache of its own (rank 0's decides which pages are
    shared; the pages' rows are the same on every rank) and its own host store file."""
    return replace(config, enable_prefix_caching=False, prefix_cache_host_bytes=None, prefix_cache_disk_path=None,
                   prefix_cache_disk_bytes=None, prefix_cache_disk_key_file=None, prefix_cache_disk_old_key_files=None,
                   prefix_cache_disk_unencrypted=False, host_store_path=_own_host_store(config, f"rank{rank}"))


def _own_host_store(config: EngineConfig, tag: str) -> str | None:
    """The tiered host store path of one rank: a directory is shared (each store makes a fresh file in
    it), a file name gets the rank's tag (an existing file is refused)."""
    path = config.host_store_path
    return path if path is None or os.path.isdir(path) else f"{path}.{tag}"


def serve_rank(config: EngineConfig, rank: int, addr: str) -> None:
    """A worker rank's whole life (a spawned process): join, load its shard, report, then run calls
    until told to stop."""
    # a failed start exits this process with 1 (start_worker says why)
    worker, control = start_worker(config, rank, addr, lambda control: _build_worker(config, rank, control))
    while True:
        method, args = next_command(config, control)
        if method == "close":
            leave(control)
        getattr(worker, method)(*args)


def _build_worker(config: EngineConfig, rank: int, control) -> RankWorker:
    from ..cache.manager import CacheManager
    from ..model.checkpoint import load_model
    from .comm import TensorParallel
    layout = layout_of(config, rank)
    dtype, device = getattr(torch, config.dtype), torch.device(config.device)  # validated: a torch dtype name
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    comm = TensorParallel(dist.group.WORLD, layout.world_size, rank)
    model = load_model(config.model, dtype, device, config.hf_overrides, config.selector, config.quest_page_tokens,
                       layout=layout, comm=comm)
    local = worker_config(config, rank)
    max_model_len = config.max_model_len or model.cfg.max_position_embeddings
    kv = CacheManager(local, model, dtype, device, max_model_len)
    return RankWorker(InProcessExecutor(model, kv.pool, local), kv.pool, control)


def start_executor(config: EngineConfig, dtype: torch.dtype, device: torch.device, lane: int | None = None):
    """(executor, cache manager): the model in this process on one device, or, with more than one
    rank, rank 0's shard here and the other ranks' in the worker processes this starts. `lane`: this
    process is that data-parallel rank (its process group joined already)."""
    from ..cache.manager import CacheManager
    from ..model.checkpoint import load_model
    if lane is not None:
        return _start_lane(config, dtype, device, lane)
    if config.data_parallel_size > 1:
        raise ConfigError("data_parallel_size > 1 is served by parallel.data_parallel.DataParallelEngine "
                          "(LLM(...) and `sparsekv serve` build it: llm.build_engine)")
    if config.node_rank > 0:
        raise ConfigError(f"node_rank {config.node_rank} only hosts ranks for node 0's engine: run "
                          f"`sparsekv serve --node-rank {config.node_rank} ...` there (parallel.lanes.host_node)")
    layout = layout_of(config)
    if layout.world_size > 1:  # a layout the model cannot take fails here, before any process starts
        check_layout(config)
    ranks = RankGroup.start(config, serve_rank) if layout.world_size > 1 else None
    error = None
    try:
        model = load_model(config.model, dtype, device, config.hf_overrides, config.selector, config.quest_page_tokens,
                           layout=layout if ranks else None, comm=ranks.comm if ranks else None)
        config.validate_for_model(model.cfg)
        kv = CacheManager(config, model, dtype, device, config.max_model_len or model.cfg.max_position_embeddings)
        local = InProcessExecutor(model, kv.pool, config)  # (may refuse the pool: decode graphs)
    except BaseException as e:
        if ranks is None:
            raise
        error = e
    if ranks is None:
        return local, kv
    ranks.check_started(error)  # an error of any rank's start stops every rank and raises here
    return MultiRankExecutor(local, ranks), kv


class LaneExecutor(InProcessExecutor):
    """The executor of one data-parallel rank (its own requests, cache and scheduler).

    With expert parallelism every rank must run every MoE layer of a pass together (their tokens meet
    there), so each engine step is a fixed sequence of passes: the target's, then with drafting the MTP
    extend pass and draft steps 2..K. Before each pass the ranks agree (a one-element all-reduce)
    whether any has rows for it; a rank without rows then runs its MoE layers with none
    (`DecoderLayer.idle`), and a pass nobody has is skipped. `finish_step` runs the passes this rank's
    engine did not reach. Without expert parallelism the ranks share nothing and never wait.

    With the decode graphs (model/decode_graphs.py) the same agreement also says, for each pass, how
    many rows each rank's pieces would take (or that a rank's pass cannot be run as them):
    when every rank with rows can, all of them run the pieces of the widest one's bucket, a rank
    without rows over padding rows only (`DecodeGraphs.idle`), and the MoE exchange is of that bucket's
    rows from every rank (`ExpertParallelDP.uniform_rows`: no counts exchanged, fixed shapes); else
    every rank takes the engine's path."""

    def __init__(self, model, pool, config: EngineConfig, group):
        super().__init__(model, pool, config)
        self.group, self.lockstep = group, config.enable_expert_parallel
        self.num_passes = 1 + (config.num_speculative_tokens if self.drafter is not None else 0)
        self.next_pass = 0

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        rows = self._piece_rows(lambda graphs: -1 if self.capture_routing else graphs.step_rows(step.chunks))
        return self._pass(0, lambda: super(LaneExecutor, self).execute(step), rows)

    def draft_extend(self, plan: MTPPlan) -> torch.Tensor:
        rows = self._piece_rows(lambda graphs: graphs.extend_rows([len(part[3]) for part in plan.parts]))
        return self._pass(1, lambda: super(LaneExecutor, self).draft_extend(plan), rows)

    def draft_step(self, step: int, tokens: list[int]) -> torch.Tensor:
        rows = self._piece_rows(lambda graphs: graphs.draft_rows(self.drafter.chain))
        return self._pass(1 + step, lambda: super(LaneExecutor, self).draft_step(step, tokens), rows)

    def _piece_rows(self, rows_of) -> int:
        """The rows this rank's pass would run as the decode pieces (`rows_of(graphs)`), for the ranks'
        vote; -1: it cannot, or there are no decode graphs, or no vote (the ranks share nothing)."""
        return -1 if self.runner.graphs is None or not self.lockstep else rows_of(self.runner.graphs)

    def finish_step(self) -> None:
        while self.next_pass < self.num_passes:
            self._agree(self.next_pass, None)
        self.next_pass = 0

    def _pass(self, index: int, work, piece_rows: int = -1):
        while self.next_pass < index:
            self._agree(self.next_pass, None)
        return self._agree(index, work, piece_rows)

    def _agree(self, index: int, work, piece_rows: int = -1):
        """Pass `index`: whether any rank has rows for it, and (with the decode graphs) whether every
        rank with rows can run the pieces, and the widest one's rows."""
        self.next_pass = index + 1
        if not self.lockstep:
            return work() if work is not None else None
        graphs, kind = self.runner.graphs, "target" if index == 0 else "extend" if index == 1 else "draft"
        votes = torch.tensor([int(work is not None), piece_rows, int(work is not None and piece_rows < 0)])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        anyone, widest, refused = votes.tolist()
        bucket = graphs.bucket_for(kind, widest) if graphs is not None and anyone and not refused else None
        if bucket is not None:
            return self._through_pieces(graphs, kind, bucket, work)
        if graphs is not None:
            graphs.agreed_rows = 0  # the engine's path on every rank
        try:
            if work is not None:
                return work()
            if anyone:
                for layer in (self.model.layers if index == 0 else [self.model.mtp.layer]):
                    layer.idle()
            return None
        finally:
            if graphs is not None:
                graphs.agreed_rows = None

    def _through_pieces(self, graphs, kind: str, bucket: int, work):
        """Every rank's pass of `kind` through the decode pieces of the agreed bucket."""
        comm = self.model.comm
        graphs.agreed_rows, comm.uniform_rows = bucket, True
        try:
            return work() if work is not None else graphs.idle(kind, bucket)
        finally:
            graphs.agreed_rows, comm.uniform_rows = None, False


def lane_config(config: EngineConfig, lane: int) -> EngineConfig:
    """A data-parallel rank's own files: its host store file and its prefix cache's disk directory."""
    disk = config.prefix_cache_disk_path
    return replace(config, host_store_path=_own_host_store(config, f"dp{lane}"),
                   prefix_cache_disk_path=None if disk is None else os.path.join(disk, f"dp{lane}"))


def _start_lane(config: EngineConfig, dtype: torch.dtype, device: torch.device, lane: int):
    from ..cache.manager import CacheManager
    from ..model.checkpoint import load_model
    from .comm import ExpertParallelDP
    layout = layout_of(config, lane)
    if device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", lane % torch.cuda.device_count())
        torch.cuda.set_device(device)
    comm = ExpertParallelDP(dist.group.WORLD, layout.world_size, lane) if config.enable_expert_parallel else None
    model = load_model(config.model, dtype, device, config.hf_overrides, config.selector, config.quest_page_tokens,
                       layout=layout, comm=comm)
    config.validate_for_model(model.cfg)
    local = lane_config(config, lane)
    kv = CacheManager(local, model, dtype, device, config.max_model_len or model.cfg.max_position_embeddings)
    return LaneExecutor(model, kv.pool, local, control_group()), kv
