"""Starting the ranks (parallel/launch.py): start-up waits `dist_startup_timeout_s`, not the collective
timeout; a rank that dies before joining fails the start at once; the rendezvous port is held from
the moment it is chosen. Two local processes on gloo."""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sparsekv.config import EngineConfig
from sparsekv.parallel.launch import RankGroup, StartupError, host_store, leave, start_worker

COLLECTIVE_TIMEOUT_S = 1.0
LATE_S = 4 * COLLECTIVE_TIMEOUT_S  # a rank this late fails a start bounded by the collective timeout


def _config(**overrides) -> EngineConfig:
    settings = dict(model="unused", tensor_parallel_size=2, num_threads=1, dist_timeout_s=COLLECTIVE_TIMEOUT_S,
                    dist_startup_timeout_s=120.0)
    return EngineConfig(**{**settings, **overrides})


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def late_rank(config: EngineConfig, rank: int, addr: str) -> None:
    """A worker rank that arrives LATE_S late, sums a tensor with rank 0, and leaves when told to."""
    time.sleep(LATE_S)
    started = start_worker(config, rank, addr, lambda control: None)
    assert started is not None
    _, control = started
    summed = torch.ones(1)
    dist.all_reduce(summed)
    message = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    assert message[0][0] == "close"
    leave(control)


def dead_rank(config: EngineConfig, rank: int, addr: str) -> None:
    os._exit(3)


def absent_rank(config: EngineConfig, rank: int, addr: str) -> None:
    time.sleep(60)


def test_a_rank_later_than_the_collective_timeout_still_starts_and_then_collectives_take_it():
    ranks = RankGroup.start(_config(), late_rank)
    try:
        assert _timeout_s(dist.group.WORLD) == 120.0  # joined under the start-up timeout
        ranks.check_started(None)
        assert _timeout_s(dist.group.WORLD) == COLLECTIVE_TIMEOUT_S
        summed = torch.ones(1)
        dist.all_reduce(summed)
        assert summed.item() == 2.0
    finally:
        ranks.close()
    assert not dist.is_initialized()
    assert all(p.exitcode == 0 for p in ranks.processes)


def lingering_rank(config: EngineConfig, rank: int, addr: str) -> None:
    """A worker rank that, told to close, meets rank 0 at the barrier, then takes a second to exit,
    marking the file `config.model` just before it does."""
    started = start_worker(config, rank, addr, lambda control: None)
    assert started is not None
    _, control = started
    message = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    dist.barrier(group=control)
    time.sleep(1.0)
    with open(config.model, "w") as f:
        f.write("left")
    os._exit(0)


def test_rank_0_shuts_its_group_down_only_after_a_rank_it_did_not_spawn_has_exited(tmp_path):
    """A rank on another node, or started by torchrun, is no process of rank 0's to join: rank 0's
    close waits until that rank's connections close (it exited) before shutting its own group down,
    since the two at once can abort rank 0 in gloo."""
    marker = tmp_path / "left"
    ranks = RankGroup.start(_config(model=str(marker)), lingering_rank)
    spawned, ranks.processes = ranks.processes, []  # as if another node hosted rank 1
    try:
        ranks.check_started(None)
        ranks.close()
        assert marker.exists()  # rank 1 had reached its exit when close returned
        assert not dist.is_initialized()
    finally:
        for p in spawned:
            p.join(10)
    assert [p.exitcode for p in spawned] == [0]


def test_a_rank_that_dies_before_joining_fails_the_start_at_once():
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"sparsekv-rank1 \(exit code 3\)"):
        RankGroup.start(_config(dist_startup_timeout_s=600.0), dead_rank)
    assert time.monotonic() - t0 < 120, "the start waited for its timeout instead of seeing the rank exit"
    assert not dist.is_initialized()


def test_a_rank_that_never_joins_fails_the_start_at_the_startup_timeout_naming_it():
    with pytest.raises(StartupError, match=r"rank\(s\) \[1\] did not join within 3 s"):
        RankGroup.start(_config(dist_startup_timeout_s=3.0), absent_rank)
    assert not dist.is_initialized()


def test_the_start_up_wait_ends_at_the_first_look_past_its_timeout(monkeypatch):
    """A clock that advances one second per look: a 3 s start-up timeout fails the wait at the fourth look
    (the first past the deadline), naming the rank that never came; counted in looks, not in time."""
    from types import SimpleNamespace

    from sparsekv.parallel import launch
    clock = iter(range(1000))
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    looks = []
    with pytest.raises(StartupError, match=r"rank\(s\) \[1\] did not join within 3 s"):
        launch.wait_for_ranks(store, 0, 2, 3.0, alive=lambda: looks.append(1))
    assert len(looks) == 4


def test_the_automatic_rendezvous_port_is_held_by_its_store():
    store = host_store(_config())
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    store.set("k", b"v")
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    assert client.get("k") == b"v"


def test_startup_timeout_must_be_positive():
    with pytest.raises(Exception, match="dist_startup_timeout_s must be in \\(0, "):
        _config(dist_startup_timeout_s=0.0).validate()


def test_the_serve_flag_sets_the_startup_timeout():
    import argparse
    from sparsekv.engine_args import add_engine_args, engine_options
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_options(parser.parse_args(["--dist-startup-timeout", "45", "--dist-timeout", "5"]))
    config = EngineConfig(model="unused", **{k: v for k, v in options.items() if k != "model"})
    assert (config.dist_startup_timeout_s, config.dist_timeout_s) == (45.0, 5.0)
    assert engine_options(parser.parse_args([]))["dist_startup_timeout_s"] == 900.0


@pytest.mark.parametrize("env, gpus, ok", [({}, 1, False), ({}, 2, True),
                                           ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, 1, True)],
                         ids=["one-gpu-two-ranks", "a-gpu-each", "torchrun-one-rank-per-node"])
def test_cuda_ranks_need_a_gpu_each_on_their_node(monkeypatch, env, gpus, ok):
    """NCCL refuses two ranks on one GPU after every rank loaded its shard: a node seeing fewer GPUs than
    the ranks it hosts (torchrun's LOCAL_WORLD_SIZE under torchrun) is refused before anything starts."""
    from sparsekv.config import ConfigError
    from sparsekv.parallel.launch import check_gpus
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = _config(device="cuda")
    if ok:
        check_gpus(config)
    else:
        with pytest.raises(ConfigError, match="puts 2 ranks on this node, one GPU each, and it sees 1"):
            check_gpus(config)


def test_a_start_up_error_only_a_worker_rank_hits_is_one_line(tmp_path, glm_ckpt):
    """Rank 1's own host store file exists (each rank makes its own): the command says so in one line and
    exits 1, without a traceback (it printed rank 0's StartupError traceback, exit 1)."""
    import subprocess
    import sys
    store = tmp_path / "hs"
    (tmp_path / "hs.rank1").write_text("someone's file")
    out = subprocess.run([sys.executable, "-m", "sparsekv", "generate", glm_ckpt[0], "--prompt-token-ids", "1,2,3",
                          "--max-tokens", "1", "-tp", "2", "--threads", "1", "--kv-page-size", "4",
                          "--max-model-len", "128", "--kv-tiering", "--device-buffer-tokens", "16",
                          "--host-store-path", str(store)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "rank 1" in out.stderr and "hs.rank1" in out.stderr
    assert (tmp_path / "hs.rank1").read_text() == "someone's file"


def test_a_node_whose_node_0_never_comes_says_so_in_one_line(glm_ckpt):
    """Node 1 started alone: its rank cannot reach node 0's rendezvous store within the start-up timeout;
    the command exits 1 with one line naming the address, not a Python traceback."""
    import subprocess
    import sys

    from test_server_util import free_port
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "sparsekv", "serve", glm_ckpt[0], "--node-rank", "1", "-tp", "2",
                          "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-startup-timeout", "3",
                          "--kv-page-size", "4", "--max-model-len", "128"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"rank 1 could not join the world at 127.0.0.1:{port}" in out.stderr
    assert "Traceback (most recent call last)" not in out.stderr


def test_nodes_that_count_other_world_sizes_fail_the_start_at_once():
    """Node 0 counts 2 ranks, node 1 (another -tp) 4, so its ranks are 2 and 3: node 0's rank 0 waited for
    a rank 1 that never comes until the start-up timeout, naming it. A rank that sees another world size
    says so in the store, and every rank fails at once with that message."""
    from concurrent.futures import ThreadPoolExecutor

    from sparsekv.parallel.launch import wait_for_ranks
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        node0 = pool.submit(wait_for_ranks, store, 0, 2, 60.0)
        time.sleep(0.3)
        node1 = pool.submit(wait_for_ranks, store, 2, 4, 60.0)
        for future in (node0, node1):
            with pytest.raises(StartupError, match=r"counts a world of 4 ranks, rank\(s\) \[0\] of \[2\]"):
                future.result(timeout=30)
    assert time.monotonic() - started < 30  # not the start-up timeout


def test_a_launcher_environment_is_torchrun_only_when_complete_and_of_the_worlds_size(monkeypatch):
    """torchrun (or a launcher like it) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT:
    all of them make this process that rank; some alone (a MASTER_ADDR left in a shell) do not; a
    WORLD_SIZE other than tp x dp is refused before anything starts."""
    from sparsekv.config import ConfigError
    from sparsekv.parallel.launch import TORCHRUN_ENV, torchrun_rank
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert torchrun_rank(_config()) is None
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert torchrun_rank(_config()) is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_rank(_config()) == 1
    assert torchrun_rank(_config(tensor_parallel_size=1)) is None  # one rank: nothing to launch
    with pytest.raises(ConfigError, match="WORLD_SIZE 2 is not tensor_parallel_size x data_parallel_size = 4"):
        torchrun_rank(_config(data_parallel_size=2))


def test_a_node_needs_a_gpu_for_each_of_its_own_ranks_only(monkeypatch):
    """-tp 2 over two nodes puts one rank on each: one GPU per node is enough."""
    from sparsekv.config import ConfigError
    from sparsekv.parallel.launch import TORCHRUN_ENV, check_gpus
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus(_config(device="cuda", nnodes=2, dist_init_addr="127.0.0.1:1"))
    with pytest.raises(ConfigError, match="puts 2 ranks on this node"):
        check_gpus(_config(device="cuda", tensor_parallel_size=4, nnodes=2, dist_init_addr="127.0.0.1:1"))


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["tp2", "dp2"])
def test_an_engine_refused_after_its_model_loaded_stops_every_rank_and_the_next_one_starts(tmp_path, glm_ckpt, layout):
    """Rank 0's engine refusing its configuration once its model is built (the decode pieces and a
    working set too small for a decode with its drafts: every rank refuses) fails the start on every
    rank: no worker process is left, the process group is gone, and the same process starts another
    parallel engine at once (a refusal there left rank 1 waiting and this process 'already running' one)."""
    import multiprocessing
    from sparsekv import LLM, SamplingParams
    from sparsekv.config import ConfigError
    from test_batched_decode import with_mtp_layer
    path = with_mtp_layer(glm_ckpt[0], str(tmp_path / "mtp"))
    options = dict(kv_page_size=4, max_model_len=128, num_threads=1, dist_startup_timeout_s=120.0, **layout)
    with pytest.raises(ConfigError, match="decode pieces are not built for a working set of 24 entries"):
        LLM(path, kv_tiering=True, device_buffer_tokens=24, num_speculative_tokens=3, decode_graphs="eager", **options)
    assert not dist.is_initialized() and not multiprocessing.active_children()
    llm = LLM(path, **options)
    try:
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids) == 2
    finally:
        llm.close()
