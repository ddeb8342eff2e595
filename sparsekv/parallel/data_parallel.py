"""Data-parallel attention: `data_parallel_size` ranks, each a whole engine of its own (scheduler,
paged latent cache, tiered host store, prefix cache with its tiers) over its own requests, with the
routed experts spread across all of them under expert parallelism (docs/parallel.md).

`DataParallelEngine` is rank 0's front end and answers the `LLMEngine` calls. It routes each request
to a rank (`PrefixAffinityRouter`: the longest prefix sent there before, then the fewest requests in
flight) and steps every rank together: one broadcast carries the step's new requests and aborts to
every rank, each rank runs its engine's step (its `LaneExecutor` keeps the passes in lockstep for the
MoE, a rank with nothing running an empty one), and the ranks' outputs are gathered back.

Weight updates (docs/rl.md) are checked whole on rank 0, then loaded by every rank in one broadcast
command between two steps (`load_lane`): under expert parallelism the ranks' tokens meet at every MoE
layer, so all of them must switch at the same step, or a token would mix old and new experts.
"""
from __future__ import annotations

import logging
import time

import torch.distributed as dist

from ..config import ConfigError, EngineConfig
from ..engine import RANK_PROBE_S, LLMEngine
from ..hub import resolve_config
from ..outputs import FirstToken, check_warm
from ..request import InvalidRequest, Request, RequestOutput, SamplingParams
from ..weights import (WEIGHT_UPDATE_POLICIES, ReceivedUpdate, TensorUpdate, UpdateOutcomes, WeightLoadError,
                       WeightUpdateConflict)
from .dp_kv import DataParallelKV, kv_call, result_of
from .dp_held import RankCalls, is_held, ranks_of, take_held
from .dp_taps import DataParallelTaps, TapReceiver, open_group
from .lanes import lane_integrity, load_lane, merge_stats, rank_figures, serve_lane, step_lane
from .executor import WEIGHTS_MIXED
from .launch import RankFailure, RankGroup, check_layout
from .router import PrefixAffinityRouter

logger = logging.getLogger(__name__)


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        if config.node_rank > 0:
            raise ConfigError(f"node_rank {config.node_rank} only hosts ranks for node 0's engine: run "
                              f"`sparsekv serve --node-rank {config.node_rank} ...` there")
        config = resolve_config(config)
        check_layout(config)
        self.config, self.num_ranks = config, config.data_parallel_size
        self.ranks = RankGroup.start(config, serve_lane)
        error = None
        try:
            self.local = LLMEngine(config, lane=0)
        except BaseException as e:
            error = e
        self.ranks.check_started(error)
        self.router = PrefixAffinityRouter(self.num_ranks, config.kv_page_size)
        self.kv = DataParallelKV(self)  # prefix-cache calls routed to a rank (disaggregation)
        self.taps: DataParallelTaps | None = None  # layer taps (a prefill worker's), opened by the first tap
        self.calls: RankCalls | None = None  # rank 0's calls to the other ranks about their held rows (dp_held.py)
        self.rank_of: dict[str, int] = {}  # requests in flight -> their rank
        self._watched: dict[str, int | None] = {}  # requests whose rank a prefill worker's room reads (watch_ranks)
        self._room_of: dict[str, tuple[str, ...]] = {}  # a watched request -> its room's requests, kept on one rank
        self._remote: dict[str, Request] = {}  # rank 0's view of the requests in flight on other ranks
        self._adds: list[list] = [[] for _ in range(self.num_ranks)]
        self._aborts: list[list[str]] = [[] for _ in range(self.num_ranks)]
        self._summaries: list[dict] = [{"waiting": {}, "running": 0, "started": 0, "counters": {}}
                                       for _ in range(self.num_ranks)]
        self._next_id = 0
        self._ranks_probed = time.monotonic()  # when check_ranks last asked every rank
        self.weights_version = 0  # updates every rank loaded (each rank's engine counts the same)
        self.paused = False
        self.weight_update_error: Exception | None = None  # why the last deferred update failed to load
        self.weight_updates = UpdateOutcomes()  # each accepted update's result, for the one who asked for it
        self._pending_update = None  # (update, checkpoint) waiting for every rank's started requests (drain)

    # -- what the local rank's engine knows for all ------------------------------------------------
    @property
    def tokenizer(self):
        return self.local.tokenizer

    @property
    def model_config(self):
        return self.local.model_config

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def device(self):
        return self.local.device

    @property
    def executor(self):
        """Rank 0's executor (what every rank loaded is the same: `weights` names where from)."""
        return self.local.executor

    @property
    def kv_capacity_tokens(self) -> int:
        """What one request can be given: one rank's cache."""
        return self.local.kv_capacity_tokens

    def cache_config(self) -> dict[str, str]:
        return {**self.local.cache_config(), "data_parallel_size": str(self.num_ranks)}

    @property
    def counters(self) -> dict:
        totals = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        for summary in self._summaries:
            for key, value in summary.get("counters", {}).items():
                totals[key] += value
        return totals

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    tenant: str = "default", cache_salt: str | None = None,
                    first_token: FirstToken | None = None) -> Request:
        params = params or SamplingParams()
        params.validate()
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.rank_of:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.local.inputs.process(prompt, params)
        if params.structured_output is not None:
            self.local.outputs.grammar_for(params.structured_output)  # a bad grammar fails here, not on a rank
        if first_token is not None:
            self.local.outputs.check_first(params, first_token)
            cfg = self.local.model_config
            check_warm(first_token.warm, cfg.full_layers, cfg.index_topk, len(token_ids))
        rank = self.kv.take_claim(token_ids, tenant, cache_salt)  # a disaggregated request: where its pages landed
        if params.logits_processors:  # claimed by another rank too: it recomputes the pages that landed there
            rank = 0  # Python callables run in the process they were given to: no other rank could load them
        if rank is None:
            rank = self._rank_of_room(request_id)
        if rank is None:
            rank = self.router.choose(token_ids, tenant, cache_salt)
        else:
            self.router.assign(rank, token_ids, tenant, cache_salt)
        self.rank_of[request_id] = rank
        if request_id in self._watched:
            self._watched[request_id] = rank
        if rank == 0:
            return self.local.add_request(request_id, token_ids, params, tenant, cache_salt, first_token)
        self._adds[rank].append((request_id, token_ids, params, tenant, cache_salt, first_token))
        self._remote[request_id] = Request(request_id, token_ids, params, tenant=tenant, cache_salt=cache_salt)
        return self._remote[request_id]

    def abort(self, request_id: str) -> bool:
        rank = self.rank_of.pop(request_id, None)
        self._remote.pop(request_id, None)
        if rank is None:
            return False
        self.router.finished(rank)
        if rank == 0:
            return self.local.abort(request_id)
        queued = [a for a in self._adds[rank] if a[0] == request_id]
        if queued:
            self._adds[rank].remove(queued[0])
        else:
            self._aborts[rank].append(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, aborts or untaps not sent to their rank yet (a step sends them, and the rank
        frees their pages, or the rows it kept for the tap), or a drain waiting: its update loads in a
        step once the ranks report no started request, also when the last of them was aborted rather
        than finished."""
        return (bool(self.rank_of) or any(self._aborts) or self._pending_update is not None
                or (self.taps is not None and self.taps.untaps_waiting()))

    def num_waiting_requests(self, tenant: str | None = None) -> int:
        """Queued on every rank as of the last step, plus those not sent to their rank yet."""
        queued = sum(s["waiting"].get(tenant, 0) if tenant is not None else sum(s["waiting"].values())
                     for s in self._summaries[1:])
        pending = sum(1 for adds in self._adds for a in adds if tenant is None or a[3] == tenant)
        return self.local.num_waiting_requests(tenant) + queued + pending

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every rank. While a drain waits, every rank first holds its requests never
        scheduled (`LLMEngine.hold_unstarted_requests`; new ones are still sent, and held there), and
        the update loads at the end of the step after which no rank reports a started request."""
        if self.paused:
            return []
        draining = self._pending_update is not None
        # rank 0's adds and aborts went to its engine directly: its lists here stay empty
        message = {"adds": self._adds, "aborts": self._aborts, "hold": draining}
        self._adds = [[] for _ in range(self.num_ranks)]
        self._aborts = [[] for _ in range(self.num_ranks)]
        if self.taps is not None:
            message["taps"], message["untaps"] = self.taps.for_step(self.rank_of)
        started = time.monotonic()
        gathered = self._together("step", message, run=lambda: step_lane(self.local, 0, message))
        if self.taps is not None:
            self._receive_taps([summary.get("taps_sent", 0) for _, summary in gathered])
        outputs = []
        for rank, (outs, summary) in enumerate(gathered):
            self._summaries[rank] = summary
            self._scheduled(summary["scheduled"], started)  # rank 0's is empty: its requests are its own
            for out in outs:
                if out.finished and self.rank_of.pop(out.request_id, None) is not None:
                    self.router.finished(rank)
                    self._remote.pop(out.request_id, None)
                outputs.append(out)
        if draining and not any(s["started"] for s in self._summaries):
            outputs += self._load(*self._pending_update)
        return outputs

    def _scheduled(self, request_ids: list[str], started: float) -> None:
        """Another rank first scheduled these in the step that started at `started` (rank 0's clock):
        the time the server's queue figures read (`Request.first_scheduled_time`)."""
        for request_id in request_ids:
            request = self._remote.get(request_id)
            if request is not None and request.first_scheduled_time is None:
                request.first_scheduled_time = started

    def _together(self, command: str, *args, run):
        """Broadcast a command, run rank 0's part, gather every rank's answer."""
        self.ranks.check_alive()
        try:
            dist.broadcast_object_list([(command, args)], src=0, group=self.ranks.control)
            mine = run()
            gathered = [None] * self.num_ranks
            dist.gather_object(mine, gathered, dst=0, group=self.ranks.control)
            return gathered
        except RuntimeError as e:
            raise self.ranks.fail(command, e) from e

    # -- layer taps (disaggregation's layer-by-layer send: parallel/dp_taps.py) -----------------------
    def tap_layers(self, request_id: str, num_prompt_tokens: int, skip: int, deliver) -> list[int]:
        """`LLMEngine.tap_layers` on the rank the request runs on, set at the step after its add."""
        self.open_rank_calls()
        self.taps.add(request_id, num_prompt_tokens, skip, deliver)
        return self.local.executor.layer_taps(self.local.kv.page_tensors()).kinds

    def untap_layers(self, request_id: str) -> None:
        if self.taps is not None:
            self.taps.remove(request_id)

    def _open_taps(self) -> DataParallelTaps:
        groups = []
        timeout = self.config.dist_timeout_s  # NOTE: three groups: the taps', rank 0's calls, their replies
        self._together("open_taps", run=lambda: groups.extend(open_group(timeout) for _ in range(3)))
        receiver = TapReceiver(groups[0], self.num_ranks, self.local.kv.page_tensors(), self.config.kv_page_size)
        self.calls = RankCalls(groups[1], groups[2], self.num_ranks)
        return DataParallelTaps(self.local, receiver, self.num_ranks)

    def watch_ranks(self, request_ids: list[str], one_rank: bool = False) -> None:
        """These requests are one prefill worker's room: which rank each runs on stays known, also once
        it has finished, until `unwatch_ranks` (`rank_running`: the one rank that sends the room, if they
        all run on one). The router places each (a room's prompts prefill on several ranks at once);
        `one_rank`: each added after the first goes to the first's rank instead, so no room needs rows
        from two ranks (the baseline `sparsekv bench transfer --room-prompts` measures)."""
        room = tuple(request_ids)
        for request_id in request_ids:
            self._watched[request_id] = self.rank_of.get(request_id)
            if one_rank:
                self._room_of[request_id] = room

    def unwatch_ranks(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._watched.pop(request_id, None)
            self._room_of.pop(request_id, None)

    def _rank_of_room(self, request_id: str) -> int | None:
        """The rank an earlier request of this request's watched room was added to (None: it is the first,
        or not watched)."""
        for other in self._room_of.get(request_id, ()):
            rank = self._watched.get(other)
            if rank is not None:
                return rank
        return None

    def rank_running(self, request_ids: list[str]) -> int | None:
        """The one rank all of these requests run on (or ran on, while watched), None when they are on
        several or one is unknown."""
        ranks = {self.rank_of.get(r, self._watched.get(r)) for r in request_ids}
        return ranks.pop() if len(ranks) == 1 and None not in ranks else None

    def open_rank_calls(self) -> None:
        """Open the ranks' calls (and taps), unless a tap did: a command every rank runs."""
        if self.taps is None:
            self.taps = self._open_taps()

    def call_rank(self, rank: int, fn, *args, in_order: bool = False):
        """`fn(side, *args)` on rank `rank` > 0 (dp_held.RankCalls): a concurrent future of its value.
        Any thread may call; the calls must be open (`open_rank_calls`, on the engine loop)."""
        if self.calls is None:
            raise RuntimeError("the data-parallel ranks' calls are not open")
        return self.calls.call(rank, fn, *args, in_order=in_order)

    def fetch_held(self, tensors: list) -> list:
        """`tensors` with every held one (dp_held.Held, Stacked) fetched from its rank: for rows that
        leave from rank 0. Blocks until they are here; RuntimeError if a rank cannot give them."""
        fetched = {rank: self.call_rank(rank, take_held, [t for t in tensors if is_held(t) and t.rank == rank])
                   for rank in sorted(ranks_of(tensors))}
        got = {rank: iter(future.result(timeout=self.config.dist_timeout_s)) for rank, future in fetched.items()}
        return [next(got[t.rank]) if is_held(t) else t for t in tensors]

    def export_held(self, rank: int, token_ids: list[int], tenant: str, cache_salt: str | None, skip: int,
                    room: str) -> list:
        """`engine.kv.export_prefix` on rank `rank` > 0, the rows kept there for `room` (lanes.export_held)."""
        answers = self._together("export_held", rank, (token_ids, tenant, cache_salt, skip, room), run=lambda: None)
        return result_of(answers[rank])

    def _receive_taps(self, sent: list[int]) -> None:
        """Until rank 0 holds every row the step's ranks sent (so none comes after its page is named)."""
        try:
            self.taps.receiver.wait_for(sent, self.config.dist_timeout_s)
        except RuntimeError as e:
            raise self.ranks.fail("step", e) from e

    def kv_call(self, rank: int | None, method: str, args, kwargs) -> list:
        """`engine.kv.<method>` on `rank` (None: every rank), each rank's answer as `dp_kv.kv_call`'s."""
        return self._together("kv", rank, method, args, kwargs,
                              run=lambda: kv_call(self.local, 0, rank, method, args, kwargs))

    def check_ranks(self) -> None:
        """RankFailure if a rank exited or a call across the ranks failed; every RANK_PROBE_S also a round
        trip to every rank, which finds a dead rank on another node, where there is no process to look at
        (LLMEngine.check_ranks)."""
        self.ranks.check_alive()
        now = time.monotonic()
        if now - self._ranks_probed >= RANK_PROBE_S:
            self._ranks_probed = now
            self._together("probe", run=lambda: None)

    def expire_prefix_cache(self) -> int:
        if self.config.prefix_cache_ttl_s is None:  # nothing expires: no round trip (the idle server calls this often)
            return 0
        return sum(self._together("expire_prefix_cache", run=self.local.expire_prefix_cache))

    def reset_prefix_cache(self, tenant: str | None = None) -> int:
        return sum(self._together("reset_prefix_cache", tenant, run=lambda: self.local.reset_prefix_cache(tenant)))

    # -- weights and generation control, for RL trainers (docs/rl.md) -------------------------------
    def update_weights(self, named_tensors, policy: str = "drain") -> list[RequestOutput]:
        """`LLMEngine.update_weights` over every rank: checked whole here (WeightUpdateError: no rank
        changed), then every rank loads its slices in the same command (`_load`)."""
        from ..weights import check_tensor_update, model_weight_shapes
        return self._update(check_tensor_update(model_weight_shapes(self.local.model), named_tensors), None, policy)

    def update_weights_from_group(self, group: str, ticket: int, named_tensors, policy: str = "drain"
                                  ) -> list[RequestOutput]:
        """`LLMEngine.update_weights_from_group` over every rank: each loads the copy it received itself."""
        from ..weights import ReceivedUpdate, check_tensor_update, model_weight_shapes
        checked = check_tensor_update(model_weight_shapes(self.local.model), named_tensors)
        return self._update(ReceivedUpdate(checked.tensors, group, ticket), None, policy)

    def weight_groups(self, op: str, *args) -> list:
        """Every other rank's answer to `weight_sync.WORKER_GROUPS.call(op, args)`."""
        return self._together("weight_groups", op, args, run=lambda: None)[1:]

    def update_weights_from_disk(self, path: str, policy: str = "drain") -> list[RequestOutput]:
        from ..weights import check_disk_update, model_weight_shapes
        update = check_disk_update(path, self.local.model_config, self.config.hf_overrides,
                                   model_weight_shapes(self.local.model))
        return self._update(update, path, policy)

    def _update(self, update, checkpoint: str | None, policy: str) -> list[RequestOutput]:
        """"abort", or nothing started anywhere: load now. "drain": remember the update; `step` holds
        the requests never scheduled on every rank and loads it once no rank has a started one. A rank
        cannot load by itself when its own requests finish, as `LLMEngine` does: the others may still
        be running theirs under the old experts."""
        if policy not in WEIGHT_UPDATE_POLICIES:
            raise ValueError(f"weight update policy must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}")
        if self._pending_update is not None:
            raise WeightUpdateConflict("another weight update is waiting for the running requests to finish")
        self.local.executor.check_weight_update(update)
        started = self._num_started()
        if started and policy == "drain" and self.paused:
            raise WeightUpdateConflict(f"generation is paused with {started} started request(s), which must "
                                       f"finish under the old weights (drain): continue generation first, or abort them")
        self.weight_update_error = None
        self.weight_updates.accept()
        if started and policy == "drain":  # it loads later: the caller's tensors as they are now
            self._pending_update = (update.kept_for_later() if isinstance(update, TensorUpdate) else update, checkpoint)
            return []
        aborted = self._load(update, checkpoint)
        if self.weight_update_error is not None:  # the requests it aborted still get their final outputs
            raise WeightLoadError(str(self.weight_update_error), aborted) from self.weight_update_error
        return aborted

    def _num_started(self) -> int:
        """Started requests: rank 0's now, the others' as of their last answer (nothing runs on a rank
        between two commands; one aborted here since is counted until the next step)."""
        return len(self.local.started_requests()) + sum(s["started"] for s in self._summaries[1:])

    def _load(self, update, checkpoint: str | None) -> list[RequestOutput]:
        """Every rank loads the update in one command, so all switch at the same step; returns the
        outputs of the started requests it aborted (none after a drain)."""
        self._pending_update = None
        sent = update.for_other_ranks() if isinstance(update, ReceivedUpdate) else update
        gathered = self._together("load_weights", sent, checkpoint, run=lambda: load_lane(self.local, update, checkpoint))
        errors = [f"data-parallel rank {rank}: {error}" for rank, (_, error, _, _) in enumerate(gathered) if error]
        self._settle_load(errors, mixed=any(status == WEIGHTS_MIXED for _, _, status, _ in gathered))
        outputs = []
        for rank, (aborted, _, _, summary) in enumerate(gathered):
            self._summaries[rank] = summary
            for out in aborted:  # a request aborted here already (its abort still queued) is not answered twice
                if self.rank_of.pop(out.request_id, None) is not None:
                    self.router.finished(rank)
                    self._remote.pop(out.request_id, None)
                    outputs.append(out)
        return outputs

    def _settle_load(self, errors: list[str], mixed: bool = False) -> None:
        """All ranks loaded: a new version. None did: the old weights keep serving everywhere
        (`weight_update_error`; a rank whose load fails part-way puts back what it loaded). Some did, or
        a rank could not put its weights back (`mixed`): the ranks' weights differ, and the engine
        serves no more (RankFailure)."""
        if not errors:
            self.weights_version += 1
            self.weight_updates.settle(self.weights_version, None)
        elif len(errors) == self.num_ranks and not mixed:
            self.weight_update_error = WeightLoadError("no rank loaded the weight update; the previous weights "
                                                         "keep serving: " + "; ".join(errors))
            logger.error("%s", self.weight_update_error)
            self.weight_updates.settle(None, self.weight_update_error)
        else:
            why = ("a data-parallel rank's weights are now a mix of two versions" if mixed else
                   "the weight update loaded on some data-parallel ranks and failed on others, whose weights now differ")
            self.ranks.failure = RankFailure(f"{why}: " + "; ".join(errors))
            self.weight_updates.settle(None, self.ranks.failure)
            raise self.ranks.failure

    @property
    def weight_update_pending(self) -> bool:
        return self._pending_update is not None

    def pause_generation(self) -> None:
        """Stop stepping: the front end sends no step, so every rank keeps its requests and KV as they
        are (`LLMEngine.pause_generation`); requests may still be added. WeightUpdateConflict while a
        drain update waits for started requests."""
        if self._pending_update is not None and self._num_started():
            raise WeightUpdateConflict("a drain weight update waits for the started requests to finish; pausing "
                                       "would hold it: pause once it has loaded")
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    def flush_cache(self) -> int:
        """Forget every tenant's prefix-cache pages on every rank, in every tier; returns how many."""
        return self.reset_prefix_cache(None)

    # -- observability -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Every rank's figures added up (rates recomputed from the sums); `ranks` lists each rank's
        weights and peak memory, `by_data_parallel_rank` each rank's requests (waiting: by tenant), token
        counters and KV memory (lanes.RANK_MEMORY)."""
        if self.ranks.failure is not None:
            return self.local.stats()
        every = self._together("stats", run=self.local.stats)
        merged = merge_stats(every)
        merged["waiting"] += sum(map(len, self._adds))  # routed, sent to their rank with the next step
        merged["by_data_parallel_rank"] = [rank_figures(self._with_adds(rank), figures)
                                           for rank, figures in enumerate(every)]
        merged.update(weights_version=self.weights_version, paused=self.paused,
                      weight_update_pending=self.weight_update_pending)
        return merged

    def _with_adds(self, rank: int) -> dict:
        """Rank `rank`'s summary of the last step, its waiting requests by tenant as of now: rank 0's
        engine's own, another rank's counting those routed there since (a paused engine sends none:
        without them its queue read empty)."""
        summary = self._summaries[rank]
        queued = [r.tenant for r in self.local.waiting_requests()] if rank == 0 else [a[3] for a in self._adds[rank]]
        waiting = {} if rank == 0 else dict(summary["waiting"])
        for tenant in queued:
            waiting[tenant] = waiting.get(tenant, 0) + 1
        return {**summary, "waiting": waiting}

    def check_integrity(self) -> None:
        problems = [p for p in self._together("check_integrity", run=lambda: lane_integrity(self.local)) if p]
        assert not problems, "; ".join(problems)
        assert set(self.rank_of) >= {r.request_id for r in self.local.scheduler.running}
        assert set(self._remote) <= set(self.rank_of)

    def close(self) -> None:
        """Close every rank's engine (each saves its prefix cache's disk tier) and stop the workers (their
        threads answering rank 0's calls end with them)."""
        if self.ranks.closed:
            return
        self.local.close()
        self.ranks.close(notify=self.ranks.failure is None)
