"""Weight updates with data-parallel attention (docs/rl.md, docs/parallel.md): two ranks (gloo), expert
parallelism on, so each rank holds half of the routed experts and the ranks' tokens meet at every MoE
layer. Every rank must switch weights at the same step; a token computed while one rank had switched
and the other not would mix A's experts with B's, and its logprobs would be neither A's nor B's.

The data-parallel engine computes in other row groups than one process (its MoE all-gathers the two
ranks' rows), so outputs are compared with one process's within tests/tolerances.py's bound; the
same engine before and after a refused update is compared bit for bit."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import STARTUP_S
from sparsekv import LLM, SamplingParams
from sparsekv.model.checkpoint import LOAD_FAULT_ENV
from sparsekv.parallel.launch import RankFailure
from sparsekv.tools.tiny import save_reference_checkpoint
from sparsekv.weights import WeightLoadError, WeightUpdateConflict, WeightUpdateError
from tolerances import assert_same_greedy, logprob_tolerance

OPTIONS = dict(max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_seqs=4,
               enable_prefix_caching=False, num_threads=1)
DP = dict(data_parallel_size=2, enable_expert_parallel=True, dist_startup_timeout_s=STARTUP_S)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
LONGER = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPT = [(7 * i) % 250 + 1 for i in range(37)]
OTHER = [(11 * i) % 250 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of one architecture (A, B: other random weights), 4 routed experts per layer."""
    root = tmp_path_factory.mktemp("rl_dp")
    a, b = str(root / "a"), str(root / "b")
    save_reference_checkpoint(a, "glm_moe_dsa", seed=0, index_topk=8)
    save_reference_checkpoint(b, "glm_moe_dsa", seed=1, index_topk=8)
    return a, b


def _run_until_done(engine, outs: dict, finished_at: dict) -> list[int]:
    """Step until nothing is left, noting the step (0-based) each request finished in; returns the
    steps in which the pending update loaded."""
    loaded, step = [], 0
    while engine.has_unfinished_requests():
        pending = engine.weight_update_pending
        for o in engine.step():
            if o.finished:
                outs[o.request_id], finished_at[o.request_id] = o, step
        if pending and not engine.weight_update_pending:
            loaded.append(step)
        step += 1
    return loaded


def test_abort_disk_and_tensor_updates_serve_what_one_process_of_b_serves(ckpts):
    a, b = ckpts
    single = LLM(b, **OPTIONS)
    want = single.generate([PROMPT, OTHER], GREEDY)
    tol = logprob_tolerance(single)
    llm = LLM(a, **OPTIONS, **DP)
    try:
        engine = llm.engine
        engine.add_request("r1", PROMPT, GREEDY)
        engine.add_request("r2", OTHER, GREEDY)
        engine.step()
        engine.step()
        assert set(engine.rank_of.values()) == {0, 1}  # one started request on each rank
        aborted = engine.update_weights_from_disk(b, policy="abort")
        assert sorted(o.request_id for o in aborted) == ["r1", "r2"]
        assert all(o.finish_reason == "abort" and o.metrics["weights_version"] == 0 for o in aborted)
        assert not engine.has_unfinished_requests() and engine.weights_version == 1
        got = llm.generate([PROMPT, OTHER], GREEDY)
        assert_same_greedy(want, got, tol)
        assert [o.metrics["weights_version"] for o in got] == [1, 1]
        assert llm.update_weights_from_disk(a) == 2
        assert llm.update_weights(load_file(f"{b}/model.safetensors").items()) == 3  # tensors sent to rank 1
        assert_same_greedy(want, llm.generate([PROMPT, OTHER], GREEDY), tol)
        stats = llm.stats()
        assert stats["weights_version"] == 3 and not stats["weight_update_pending"]
        assert all(r["generation_tokens"] > 0 for r in stats["by_data_parallel_rank"]), "a rank served nothing"
        assert isinstance(llm.flush_cache(), int)
        engine.check_integrity()
    finally:
        llm.close()


def test_drain_switches_every_rank_at_the_step_the_last_started_request_finishes(ckpts):
    """r1 (rank 0) and r1b (rank 1, six tokens longer) start under A; r2 and r3, added after the
    update call, are held on their ranks. Rank 0 runs out of started requests first and must keep
    A's experts until r1b, on rank 1, is done: then both ranks load B in the same step."""
    a, b = ckpts
    only_a = LLM(a, **OPTIONS)
    want_a = only_a.generate([PROMPT, OTHER], [GREEDY, LONGER])
    want_b = LLM(b, **OPTIONS).generate([OTHER, PROMPT], GREEDY)
    tol = logprob_tolerance(only_a)
    llm = LLM(a, **OPTIONS, **DP)
    try:
        engine = llm.engine
        engine.add_request("r1", PROMPT, GREEDY)
        engine.add_request("r1b", OTHER, LONGER)
        for _ in range(4):  # prefill and a few decodes under A
            engine.step()
        assert engine.update_weights_from_disk(b, policy="drain") == []
        assert engine.weight_update_pending and engine.weights_version == 0
        engine.add_request("r2", OTHER, GREEDY)
        engine.add_request("r3", PROMPT, GREEDY)
        assert engine.rank_of == {"r1": 0, "r1b": 1, "r2": 1, "r3": 0}  # a held request on each rank
        with pytest.raises(WeightUpdateConflict, match="pausing would hold it"):
            engine.pause_generation()
        outs, finished_at = {}, {}
        loaded = _run_until_done(engine, outs, finished_at)
        assert finished_at["r1"] < finished_at["r1b"] and loaded == [finished_at["r1b"]]
        assert engine.weights_version == 1
        assert_same_greedy(want_a, [outs["r1"], outs["r1b"]], tol)
        assert_same_greedy(want_b, [outs["r2"], outs["r3"]], tol)
        assert [outs[r].metrics["weights_version"] for r in ("r1", "r1b", "r2", "r3")] == [0, 0, 1, 1]
        assert llm.stats()["weights_version"] == 1
        engine.check_integrity()
    finally:
        llm.close()


def test_drain_waits_for_a_preempted_started_request_though_no_rank_runs_one(ckpts):
    """A request preempted after it started holds tokens A computed, though it is queued, not running:
    a rank counts it as started, so the drain update waits for it. Here r1 (rank 0, one sequence per
    rank) is preempted behind r2, which runs and finishes first: at the end of that step no rank runs a
    request, and r1 must still finish under A before B loads (a load then would abort it, and a drain
    ends no started request)."""
    a, b = ckpts
    llm = LLM(a, **{**OPTIONS, "max_num_seqs": 1}, **DP)
    try:
        engine = llm.engine
        r1 = engine.add_request("r1", PROMPT, LONGER)
        engine.add_request("r1b", OTHER, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        r2 = engine.add_request("r2", [(13 * i) % 250 + 2 for i in range(37)], GREEDY)  # no page of theirs
        assert engine.rank_of == {"r1": 0, "r1b": 1, "r2": 0}
        for _ in range(4):
            engine.step()
        engine.local.scheduler.preempt(r1, behind=r2)
        engine.step()  # r2 starts; r1 waits, started
        assert r2.first_scheduled_time is not None and r1 in engine.local.scheduler.waiting
        assert engine.update_weights_from_disk(b, policy="drain") == [] and engine.weight_update_pending
        outs, finished_at = {}, {}
        loaded = _run_until_done(engine, outs, finished_at)
        assert finished_at["r2"] < finished_at["r1"] and loaded == [finished_at["r1"]]
        assert [outs[r].metrics["weights_version"] for r in ("r1", "r2")] == [0, 0] and engine.weights_version == 1
        assert outs["r1"].finish_reason == "length" and outs["r1"].metrics["num_preemptions"] == 1
        engine.check_integrity()
    finally:
        llm.close()


def test_drain_conflicts_are_refused_and_leave_the_waiting_update_as_it_was(ckpts):
    """With requests started on both ranks, a drain update while generation is paused (it could never
    load) and a second update while one waits (it would replace the first, whose caller waits for it)
    are refused with WeightUpdateConflict; the waiting update then loads once, on every rank at the
    same step, after the started requests finished under A."""
    a, b = ckpts
    llm = LLM(a, **OPTIONS, **DP)
    try:
        engine = llm.engine
        engine.add_request("r1", PROMPT, GREEDY)
        engine.add_request("r1b", OTHER, GREEDY)
        engine.step()
        assert engine.rank_of == {"r1": 0, "r1b": 1}
        engine.pause_generation()
        with pytest.raises(WeightUpdateConflict, match="paused with 2 started"):
            engine.update_weights_from_disk(b, policy="drain")
        assert not engine.weight_update_pending
        engine.continue_generation()
        assert engine.update_weights_from_disk(b, policy="drain") == [] and engine.weight_update_pending
        for policy in ("drain", "abort"):
            with pytest.raises(WeightUpdateConflict, match="another weight update"):
                engine.update_weights_from_disk(a, policy=policy)
        assert engine.weight_update_pending and set(engine.rank_of) == {"r1", "r1b"}
        outs, finished_at = {}, {}
        loaded = _run_until_done(engine, outs, finished_at)
        assert loaded == [max(finished_at.values())] and engine.weights_version == 1
        assert [outs[r].metrics["weights_version"] for r in ("r1", "r1b")] == [0, 0]
        engine.check_integrity()
    finally:
        llm.close()


def test_a_drain_update_whose_checkpoint_is_gone_by_its_load_keeps_a_and_runs_the_held_requests(ckpts, tmp_path):
    """A drain update is checked when it is asked for and loaded steps later, once no rank has a started
    request: here only rank 1 has one (r1 on rank 0 finished first), so the update waits for it. Its
    directory gone by then, every rank refuses it (the old weights keep serving, `weight_update_error`
    says why), and the requests each rank held during the drain run after it."""
    a, b = ckpts
    gone = str(shutil.copytree(b, tmp_path / "b"))
    only_a = LLM(a, **OPTIONS)
    want = only_a.generate([OTHER, PROMPT], GREEDY)
    llm = LLM(a, **OPTIONS, **DP)
    try:
        engine = llm.engine
        engine.add_request("r1", PROMPT, GREEDY)
        engine.add_request("r1b", OTHER, LONGER)
        outs = {}
        while "r1" not in outs:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert "r1b" not in outs and not engine.local.started_requests()  # rank 1's alone is started
        assert engine.update_weights_from_disk(gone, policy="drain") == [] and engine.weight_update_pending
        engine.add_request("r2", OTHER, GREEDY)
        engine.add_request("r3", PROMPT, GREEDY)
        assert engine.rank_of == {"r1b": 1, "r2": 1, "r3": 0}  # a held request on each rank
        shutil.rmtree(gone)
        for _ in range(4 * LONGER.max_tokens):  # bounded: requests held for good would never finish
            if not engine.has_unfinished_requests():
                break
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert sorted(outs) == ["r1", "r1b", "r2", "r3"] and not engine.has_unfinished_requests()
        assert engine.weights_version == 0 and not engine.weight_update_pending
        assert isinstance(engine.weight_update_error, WeightLoadError)
        assert "no rank loaded" in str(engine.weight_update_error)
        assert_same_greedy(want, [outs["r2"], outs["r3"]], logprob_tolerance(only_a))
        engine.check_integrity()
    finally:
        llm.close()


def _expert(e: int) -> str:
    return f"model.layers.1.mlp.experts.{e}.gate_proj.weight"


def _copy(src: str, dst) -> str:
    """A copy of `src` whose name LOAD_FAULT_ENV may give: reading the experts it names fails; the
    headers pass rank 0's check, so the load fails on the rank holding them (rank 0: 0-1, rank 1: 2-3)."""
    shutil.copytree(src, dst)
    return str(dst)


def test_ranks_that_cannot_put_their_weights_back_stop_the_engine(ckpts, tmp_path, monkeypatch):
    """Both ranks fail part-way (an expert each reads in layer 1, after layer 0 was copied in) and
    cannot put layer 0 back, the checkpoint they loaded having changed on disk since: however many
    ranks failed, their weights are a mix, so the update raises RankFailure and the engine steps no
    more (not the "previous weights keep serving" of a failure put back)."""
    import os
    a, _ = ckpts
    loaded = _copy(a, tmp_path / "loaded")
    monkeypatch.setenv(LOAD_FAULT_ENV, f"both:{_expert(0)},both:{_expert(2)}")  # before the ranks start
    llm = LLM(loaded, **OPTIONS, **DP)
    try:
        llm.generate([PROMPT, OTHER], GREEDY)
        os.utime(os.path.join(loaded, "model.safetensors"), ns=(1, 1))
        with pytest.raises(RankFailure, match="rank 0: WeightRestoreError.*rank 1: WeightRestoreError"):
            llm.update_weights_from_disk(_copy(ckpts[1], tmp_path / "both"))
        with pytest.raises(RankFailure):
            llm.generate([PROMPT], GREEDY)
    finally:
        llm.close()


def test_a_refused_or_failed_update_keeps_a_on_both_ranks_and_a_split_one_stops_the_engine(ckpts, tmp_path,
                                                                                             monkeypatch):
    a, b = ckpts
    monkeypatch.setenv(LOAD_FAULT_ENV, f"both:{_expert(0)},both:{_expert(2)},rank1:{_expert(2)}")  # the ranks' own
    llm = LLM(a, **OPTIONS, **DP)
    try:
        want = llm.generate([PROMPT, OTHER], GREEDY)
        with pytest.raises(WeightUpdateError, match="wrong shape"):
            llm.update_weights([("model.norm.weight", torch.zeros(3))])
        with pytest.raises(WeightLoadError, match="no rank loaded .*rank 0: .*rank 1: "):
            llm.update_weights_from_disk(_copy(b, tmp_path / "both"))
        again = llm.generate([PROMPT, OTHER], GREEDY)
        assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in want]
        assert llm.weights_version == 0 and [o.metrics["weights_version"] for o in again] == [0, 0]
        with pytest.raises(RankFailure, match="rank 1: .*an injected fault"):
            llm.update_weights_from_disk(_copy(b, tmp_path / "rank1"))
        with pytest.raises(RankFailure):  # rank 0 has B's experts, rank 1 A's: it never steps again
            llm.generate([PROMPT], GREEDY)
    finally:
        llm.close()
