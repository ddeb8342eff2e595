"""What a data-parallel rank runs (parallel/data_parallel.py is rank 0's front end): its part of each
step and of a weight update, the command loop of a spawned rank, the hosting of ranks under torchrun
or on other nodes, and the merge of every rank's stats."""
from __future__ import annotations

import logging
import os
import signal

import torch.distributed as dist

from ..config import EngineConfig
from ..engine import LLMEngine
from ..hub import resolve_config
from ..request import RequestOutput
from .dp_kv import answer_if_wanted, kv_call
from ..weight_sync import WORKER_GROUPS
from ..weights import ReceivedUpdate
from .dp_held import RankSide, HeldRows, serve_calls
from .dp_taps import TapSender, open_group, set_lane_taps
from .executor import load_status, serve_rank
from .launch import RankGroup, check_layout, control_group, leave, next_command, start_worker, torchrun_rank

logger = logging.getLogger(__name__)


def step_lane(engine: LLMEngine, rank: int, message: dict, taps: TapSender | None = None,
              side: RankSide | None = None) -> tuple[list[RequestOutput], dict]:
    """One data-parallel rank's part of a step: its new requests and aborts, during a drain its
    requests never scheduled held, its layer taps (`taps`: on a rank > 0 once they opened), its
    engine's step (the passes it does not run, empty), and what the front end needs back (the
    requests first scheduled in this step among them); with taps, once every row the step handed out
    has left (dp_taps.py)."""
    for request_id in message["aborts"][rank]:
        engine.abort(request_id)
    for request_id, token_ids, params, tenant, cache_salt, first_token in message["adds"][rank]:
        engine.add_request(request_id, token_ids, params, tenant, cache_salt, first_token)
    if taps is not None:
        set_lane_taps(engine, taps, side, message, rank)
    if message["hold"]:
        engine.hold_unstarted_requests()
    fresh = [r for r in engine.scheduler.waiting if r.first_scheduled_time is None] if rank else []
    outs = engine.step() if engine.scheduler.has_unfinished() or engine.has_ready_outputs else []
    engine.executor.finish_step()
    summary = lane_summary(engine)
    summary["scheduled"] = [r.request_id for r in fresh if r.first_scheduled_time is not None]
    if taps is not None:
        summary["taps_sent"] = taps.drain()
    return outs, summary


def lane_summary(engine: LLMEngine) -> dict:
    waiting: dict[str, int] = {}
    for req in engine.waiting_requests():
        waiting[req.tenant] = waiting.get(req.tenant, 0) + 1
    return {"waiting": waiting, "running": len(engine.scheduler.running), "started": len(engine.started_requests()),
            "counters": dict(engine.counters)}


def load_lane(engine: LLMEngine, update, checkpoint: str | None) -> tuple[list[RequestOutput], str | None, int, dict]:
    """One rank's part of a weight update: abort its started requests (none after a drain), then load
    through its engine's own update call, which finds nothing started and so loads at once (never
    deferred: that would let this rank switch at another step than the others). Returns (the aborted
    outputs, the error if it failed to load, its `load_status`, the rank's summary)."""
    aborted = engine.abort_started_requests()  # first: a failed load below must not lose their outputs
    try:
        if checkpoint is not None:
            aborted += engine.update_weights_from_disk(checkpoint, policy="abort")
        elif isinstance(update, ReceivedUpdate) and not update.tensors:  # a rank > 0: the copy it received itself
            aborted += engine.update_weights(update.taken_here(), policy="abort")
        else:
            aborted += engine.update_weights(update.tensors.items(), policy="abort")
    except Exception as e:  # this rank keeps its old weights (a load failing part-way puts back what it loaded)
        logger.exception("data-parallel rank: the weight update failed")
        engine.release_held_requests()  # refused before its engine took them back itself
        return aborted, f"{type(e).__name__}: {e}", load_status(e), lane_summary(engine)
    return aborted, None, load_status(None), lane_summary(engine)


def lane_integrity(engine: LLMEngine, side: RankSide | None = None) -> str | None:
    try:
        engine.check_integrity()
        if side is not None:
            side.held.check_integrity(side.live_owners())
    except AssertionError as e:
        return f"data-parallel rank {engine.executor.model.comm.rank}: {e}"
    return None


def export_held(engine: LLMEngine, side: RankSide, token_ids: list[int], tenant: str, cache_salt: str | None,
                skip: int, room: str) -> list:
    """`engine.kv.export_prefix` on a rank > 0 for a room it sends itself: the pages' rows stay here,
    kept for the room (released when rank 0 ends it), and rank 0 gets their names and where they are."""
    side.open_room(room)  # NOTE: a room this rank knows from now until rank 0 ends it
    pages = engine.kv.export_prefix(token_ids, tenant, cache_salt, skip=skip)
    return [(name, side.held.keep(("room", room), rows)) for name, rows in pages]


def serve_lane(config: EngineConfig, rank: int, addr: str) -> None:
    """A data-parallel rank other than 0 (a spawned process): join, build its engine, report, then
    answer the front end's commands until told to stop."""
    # a failed start exits this process with 1 (start_worker says why)
    engine, control = start_worker(config, rank, addr, lambda control: LLMEngine(config, lane=rank))
    taps: list[TapSender] = []  # opened by rank 0's first layer tap
    side = RankSide(HeldRows(rank), engine.device, config.node_rank)

    def open_taps() -> None:  # NOTE: the groups in the order rank 0 makes them (DataParallelEngine._open_taps)
        taps.append(TapSender(open_group(config.dist_timeout_s), side.held))
        calls, replies = open_group(config.dist_timeout_s), open_group(config.dist_timeout_s)
        serve_calls(calls, replies, side)

    commands = {"step": lambda message: step_lane(engine, rank, message, taps[0] if taps else None, side),
                "open_taps": open_taps, "stats": lambda: {**engine.stats(), **side.figures()}, "probe": lambda: None,
                "load_weights": lambda update, checkpoint: load_lane(engine, update, checkpoint),
                "weight_groups": lambda op, args: WORKER_GROUPS.call(op, args, rank, engine.executor.model.device),
                "expire_prefix_cache": engine.expire_prefix_cache, "reset_prefix_cache": engine.reset_prefix_cache,
                "check_integrity": lambda: lane_integrity(engine, side),
                "kv": lambda wanted, method, args, kwargs: kv_call(engine, rank, wanted, method, args, kwargs),
                "export_held": lambda wanted, args: answer_if_wanted(rank, wanted,
                                                                     lambda: export_held(engine, side, *args))}
    while True:
        command, args = next_command(config, control_group())
        if command == "close":
            engine.close()
            for sender in taps:
                sender.close()
            leave(control)
        dist.gather_object(commands[command](*args), None, dst=0, group=control_group())


def host_torchrun_rank(config: EngineConfig) -> bool:
    """Under torchrun, rank R > 0 of the world runs that rank here (until rank 0's engine stops it) and
    this returns True; rank 0, or no torchrun, returns False (the engine runs here)."""
    rank = torchrun_rank(config)
    if not rank:
        return False
    config.validate()
    config = resolve_config(config)  # as rank 0's engine does: the ranks' options must agree
    check_layout(config)
    target = serve_lane if config.data_parallel_size > 1 else serve_rank
    target(config, rank, f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    return True


def host_node(config: EngineConfig) -> int:
    """Node `config.node_rank` (> 0) of a multi-node world: run this node's ranks until node 0's engine
    stops them. Returns 0, 143 after a SIGTERM, or the first failed rank's exit code (128 + N for a rank
    that signal N ended, as a shell reports it)."""
    config.validate()
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine itself; host_node is for the other nodes")
    config = resolve_config(config)  # as node 0's engine does: the ranks' options must agree
    check_layout(config)
    target = serve_lane if config.data_parallel_size > 1 else serve_rank
    ranks = RankGroup.start(config, target)
    stopped = _stop_ranks_on_sigterm(ranks.processes)
    for p in ranks.processes:
        p.join()
    if stopped:
        return 128 + signal.SIGTERM
    code = next((p.exitcode for p in ranks.processes if p.exitcode), 0)
    return 128 - code if code < 0 else code  # a rank a signal ended: the shell's 128 + its number


def _stop_ranks_on_sigterm(processes) -> list:
    """SIGTERM to this node's command stops its ranks too (they are its children: left running, they
    went on serving node 0's engine after a supervisor saw the node go, and restarted it into a world
    that was still there). Returns a list that holds True once it came."""
    came = []

    def stop(signum, frame):
        came.append(True)
        for p in processes:
            if p.is_alive():
                p.terminate()
    signal.signal(signal.SIGTERM, stop)
    return came


# -- stats -------------------------------------------------------------------------------------------
PER_REQUEST = {"device_buffer_tokens"}  # a setting, the same on every rank
# each rank's memory figures, kept apart in `by_data_parallel_rank` (the sums hide one rank filling up)
RANK_MEMORY = ("kv_pages_total", "kv_pages_free", "kv_pages_kept", "device_kv_bytes", "device_latent_bytes",
               "device_indexer_bytes", "host_kv_bytes", "host_kv_budget_bytes", "prefix_cached_pages", "prefix_host_bytes", "prefix_disk_bytes",
               "held_rows_bytes", "held_rooms")  # the last two: rows a rank > 0 keeps for a prefill worker
# and its decode graphs' figures (where it has them): a rank whose buckets stay eager shows apart
RANK_DECODE_GRAPHS = ("decode_graph_steps", "decode_graph_buckets", "decode_graph_eager_buckets")


def rank_figures(summary: dict, stats: dict) -> dict:
    """One rank's entry of `by_data_parallel_rank`, from its lane summary and its engine's stats: its
    requests (waiting: by tenant), token counters, memory and decode graphs (those of RANK_MEMORY and
    RANK_DECODE_GRAPHS its engine reports)."""
    return {"running": summary["running"], "waiting": summary["waiting"], **summary["counters"],
            **{key: stats[key] for key in RANK_MEMORY + RANK_DECODE_GRAPHS if key in stats}}


def merge_stats(all_stats: list[dict]) -> dict:
    out = {}
    for key, value in all_stats[0].items():
        values = [s.get(key) for s in all_stats]
        if key == "ranks":
            out[key] = [r for s in all_stats for r in s["ranks"]]
        elif key in PER_REQUEST or isinstance(value, (str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _merge_dicts(values)
        elif isinstance(value, list):
            out[key] = [sum(parts) for parts in zip(*values)]
        elif isinstance(value, int):
            out[key] = sum(values)
        else:
            out[key] = value  # rates: recomputed below
    return _rates(out)


def _merge_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = _merge_dicts([out.get(key, {}), value]) if isinstance(value, dict) else out.get(key, 0) + value
    return out


def _rates(s: dict) -> dict:
    def ratio(a, b):
        return a / b if b else 0.0
    if "tier_miss_rate" in s:
        s["tier_miss_rate"] = ratio(s["tier_misses"], s["tier_hits"] + s["tier_misses"])
    if "prefix_cache_hit_rate" in s:
        hits = sum(v for k, v in s.items() if k.startswith("prefix_cache_hits_"))
        s["prefix_cache_hit_rate"] = ratio(hits, s["prefix_cache_queries"])
    if "spec_decode_acceptance_rate" in s:
        s["spec_decode_acceptance_rate"] = ratio(s["spec_decode_num_accepted_tokens"], s["spec_decode_num_draft_tokens"])
        drafts = s["spec_decode_num_drafts"]
        s["spec_decode_mean_acceptance_length"] = 1 + ratio(s["spec_decode_num_accepted_tokens"], drafts) if drafts else 0.0
    return s
