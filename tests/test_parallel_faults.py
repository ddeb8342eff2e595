"""A rank that dies or hangs: every request in flight ends with a clear error within a bounded time
(--dist-timeout), the server answers 503 and exits non-zero, and nothing is left running.

The faults are real: the worker process is killed (SIGKILL) or stopped (SIGSTOP, so it hangs inside
whatever collective it was in). The time bounds are liveness checks (a hang would otherwise block
the suite), generous multiples of the configured timeout, not performance figures.
"""
import multiprocessing
import os
import signal
import subprocess
import time

import httpx
import pytest

from conftest import STARTUP_FLAGS, STARTUP_S
from sparsekv import LLM, SamplingParams
from sparsekv.parallel.executor import RankFailure
from test_server_util import start_subprocess_server, tiny_checkpoint, wait_healthy

TIMEOUT_S = 8.0  # every collective before the injected fault must finish within it, on a loaded machine too
LONG = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def _workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("sparsekv-rank")]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2-ep"])
def test_a_rank_failure_ends_the_step_with_a_clear_error(glm_ckpt, fault, layout):
    llm = LLM(glm_ckpt[0], kv_page_size=4, max_model_len=128, num_threads=1, dist_timeout_s=TIMEOUT_S,
              dist_startup_timeout_s=STARTUP_S, **layout)
    engine = llm.engine
    try:
        req = engine.add_request(None, list(range(1, 30)), LONG)
        engine.add_request(None, list(range(40, 60)), LONG)  # data-parallel: one request per rank
        engine.step()
        engine.step()
        os.kill(_workers()[0].pid, fault)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="exited|failed across ranks"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 4 * TIMEOUT_S + 10, "the failure was not detected within the timeout"
        with pytest.raises(RankFailure):  # every later step fails at once
            engine.step()
        assert engine.stats()["running"] >= 0  # rank 0's own figures: no call to the failed rank, no error
        assert engine.abort(req.request_id)  # letting go of a request never waits for the dead rank
    finally:
        llm.close()
    assert not _workers(), "close() left a worker process"
    again = LLM(glm_ckpt[0], kv_page_size=4, max_model_len=128, num_threads=1, tensor_parallel_size=2,
                dist_startup_timeout_s=STARTUP_S)
    try:  # the process group was torn down: a new parallel engine starts in the same process
        assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        again.close()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["tp2", "dp2"])
def test_worker_ranks_outlast_an_idle_spell_longer_than_the_collective_timeout(glm_ckpt, layout):
    """An idle server or LLM sends its ranks nothing for as long as it is idle: a worker waiting for its
    next command must not time out (only collectives are bounded by dist_timeout_s)."""
    llm = LLM(glm_ckpt[0], kv_page_size=4, max_model_len=128, num_threads=1, dist_timeout_s=TIMEOUT_S,
              dist_startup_timeout_s=STARTUP_S, **layout)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    try:
        first = llm.generate([[1, 2, 3]], greedy)[0].token_ids
        time.sleep(2 * TIMEOUT_S + 1)
        assert all(p.is_alive() for p in _workers())
        assert llm.generate([[1, 2, 3]], greedy)[0].token_ids == first
    finally:
        llm.close()


def test_server_answers_503_turns_unhealthy_and_exits_non_zero_when_a_rank_dies(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    # NOTE: a killed rank closes its connections, which fails the next collective at once; the timeout
    # only bounds how long the idle worker waits for rank 0's first command while its server starts up
    proc, url = start_subprocess_server(model, "-tp", "2", "--dist-timeout", str(10 * TIMEOUT_S), *STARTUP_FLAGS)
    try:
        wait_healthy(url, proc, timeout=120)
        body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": "hello", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        workers = [pid for pid in _children(proc.pid) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(workers) == 1, f"expected rank 1's process, found {workers}"
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 50, "ignore_eos": True}, timeout=60)
        assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        assert proc.wait(timeout=60) == 1, "the server must exit non-zero after a rank failure"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_rank_failure_found_by_the_steps_stats_ends_its_requests_with_503(tmp_path_factory):
    """The figures read after each step are a call across the ranks too (TP: their stats, DP: a gather):
    a rank failing there ends the requests in flight with 503 and turns /health to engine_dead (the
    loop's thread died there and every client hung). The step's own outputs still reach their clients.
    A stand-in engine of one rank raises what a parallel engine raises."""
    from test_server_util import ThreadServer
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with ThreadServer(model) as srv:
        real, calls = srv.engine.stats, []

        def failing_stats():
            calls.append(1)
            if len(calls) > 3:
                raise RankFailure("stats failed across ranks (stand-in)")
            return real()
        srv.engine.stats = failing_stats
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 30, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "stand-in" in r.json()["error"]["message"]
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"


def test_an_idle_server_turns_unhealthy_and_exits_when_a_rank_dies(tmp_path_factory):
    """Nothing runs when rank 1 dies: /health turns 503 (engine_dead) and the server exits 1 without a
    request having to find out (it answered 200 for as long as it stayed idle)."""
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    proc, url = start_subprocess_server(model, "-tp", "2", "--dist-timeout", str(10 * TIMEOUT_S))
    try:
        wait_healthy(url, proc, timeout=120)
        workers = [pid for pid in _children(proc.pid) if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(workers) == 1, f"expected rank 1's process, found {workers}"
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, "the server must exit non-zero after a rank failure"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_idle_data_parallel_engine_finds_an_exited_rank_without_a_step(glm_ckpt):
    """A data-parallel engine's check_ranks (what the idle server calls) sees a worker rank that exited,
    naming it and its exit code, with no step or request to find it; stats() then gives rank 0's own
    figures (the server's /metrics reads them), and close() leaves nothing."""
    llm = LLM(glm_ckpt[0], kv_page_size=4, max_model_len=128, num_threads=1, dist_timeout_s=TIMEOUT_S,
              dist_startup_timeout_s=STARTUP_S, data_parallel_size=2)
    try:
        llm.engine.check_ranks()  # every rank there
        worker = _workers()[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        with pytest.raises(RankFailure, match=r"worker rank\(s\) exited: sparsekv-rank1 \(exit code -9\)"):
            llm.engine.check_ranks()
        assert llm.engine.stats()["running"] == 0  # rank 0's own figures, with no call to the dead rank
    finally:
        llm.close()
    assert not _workers(), "close() left a worker process"
