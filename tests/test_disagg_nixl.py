"""The NIXL data path between a prefill and a decode worker (`--disaggregation-transfer-backend nixl`):
the decode worker reads each batch out of the prefill worker's registered host memory over NIXL's
UCX backend, which runs on a CPU (shared memory or TCP between two agents). The answer is one
engine's, faults fail the request only, and a pair of workers connects once, not per room. Skipped
where NIXL is not installed (the test extra installs it on Linux x86-64)."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from disagg_util import WorkerServer, assert_transfer_bytes, secret_file, send_pair, start_worker_process
from sparsekv import LLM
from sparsekv.disagg.nixl import NixlAgent, NixlSender, nixl_available
from sparsekv.disagg.transfer import CORRUPT_ENV, DELAY_ENV
from sparsekv.disagg.wire import TransferError
from test_disagg_workers import BASE, BODY, GREEDY, PAGE, _prompt, _StepGate, assert_as_colocated
from test_server_util import scrape, wait_healthy, wait_until
from tolerances import logprob_tolerance

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
TIMEOUT_S = 8.0


def _pair(path: str, prefill: dict = {}, decode: dict = {}, transfer=("nixl", "nixl"), timeout_s: float = 20.0):
    return (WorkerServer(path, "prefill", transfer=transfer[0], timeout_s=timeout_s, **BASE, **prefill),
            WorkerServer(path, "decode", transfer=transfer[1], timeout_s=timeout_s, **BASE, **decode))


def _failed(r, *words: str) -> None:
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16)], ids=["plain", "decode-tiered"])
def test_nixl_workers_answer_as_one_engine(family, options, glm_ckpt, ds_ckpt):
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    p, d = _pair(path, decode=options)
    with p, d:
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        body = rd.json()
        assert_as_colocated(want, body, d, logprob_tolerance(colocated))
        figures = body["sparsekv"]["disaggregation"]
        assert figures["backend"] == rp.json()["sparsekv"]["disaggregation"]["backend"] == "nixl"
        assert figures["pages_sent"] == (len(prompt) - 1) // PAGE
        assert_transfer_bytes(figures, d.engine, PAGE)
        assert httpx.get(d.url + "/disaggregation", timeout=5).json()["transfer_backend"] == "nixl"
        p.check_clean()
        d.check_clean()


def test_pages_stream_in_batches_over_one_connection(glm_ckpt, monkeypatch):
    """Chunks of 8 tokens: each batch is read as it is named, every registration is released once its
    room closes, and the second room reuses the first's connection (the decode worker's agent added
    the prefill worker's once)."""
    path, prompt = glm_ckpt[0], _prompt(256, 47)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], GREEDY)[0]
    p, d = _pair(path, prefill=dict(prefill_chunk_tokens=8, max_num_batched_tokens=8))
    with p, d:
        gate = _StepGate(p.engine, d.engine, monkeypatch, steps=6)  # chunk c + 1 computes once chunk c's pages came
        answers = []
        for seed in (3, 5):
            gate.reset()
            answers.append(send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256, 47, seed=seed)}))
        for rp, rd in answers:
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            figures = rd.json()["sparsekv"]["disaggregation"]
            assert figures["pages_sent"] == (len(prompt) - 1) // PAGE
            assert figures["batches"] >= 3 and figures["pages_streamed"] >= 4
        assert_as_colocated(want, answers[0][1].json(), d, logprob_tolerance(colocated))
        assert list(d.worker.nixl.peers) == [p.worker.nixl.name]
        assert p.worker.nixl.exposed == 0
        p.check_clean()
        d.check_clean()


def test_concurrent_rooms_of_one_pair_and_no_progress_while_idle(glm_ckpt):
    """Rooms of the same two workers read at once (each batch's registration reloads the prefill
    worker's metadata on the decode side); once they closed, nothing is exposed and the prefill
    side's progress thread stops calling NIXL."""
    p, d = _pair(glm_ckpt[0])
    with p, d, concurrent.futures.ThreadPoolExecutor(4) as pool:
        sent = [pool.submit(send_pair, p.url, d.url, {**BODY, "prompt": _prompt(256, 41, seed)}) for seed in range(4)]
        for rp, rd in (f.result() for f in sent):
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == 10
        agent = p.worker.nixl
        assert agent.exposed == 0 and agent.progress_calls > 0
        calls = agent.progress_calls
        time.sleep(0.2)
        assert agent.progress_calls <= calls + 1  # at most the call under way when the last room closed
        p.check_clean()
        d.check_clean()


def test_a_corrupted_layer_fails_the_request_and_the_pair_serves_on(glm_ckpt, monkeypatch):
    p, d = _pair(glm_ckpt[0])
    with p, d:
        monkeypatch.setenv(CORRUPT_ENV, "1")
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256)})
        _failed(rd, "tensor 1", "digest")
        _failed(rp, "refused the KV", "tensor 1")
        assert d.engine.stats()["prefix_host_pages"] == 0
        for w in (p, d):
            assert scrape(w.url)["sparsekv:disagg_transfers_failed_total"] == 1
            w.check_clean()
        monkeypatch.delenv(CORRUPT_ENV)
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256)})
        assert (rp.status_code, rd.status_code) == (200, 200)


@pytest.mark.parametrize("transfer", [("nixl", "torch"), ("torch", "nixl")], ids=["prefill-nixl", "decode-nixl"])
def test_workers_on_different_backends_refuse_the_room(glm_ckpt, transfer):
    p, d = _pair(glm_ckpt[0], transfer=transfer)
    with p, d:
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt(256)})
        _failed(rd, "--disaggregation-transfer-backend")
        _failed(rp, "--disaggregation-transfer-backend")
        p.check_clean()
        d.check_clean()


def test_the_decode_worker_killed_mid_transfer(glm_ckpt, tmp_path, monkeypatch):
    """The prefill worker exposed its batches and waits for a verdict that never comes: it fails the
    request within its timeout and releases every registration."""
    monkeypatch.setenv(DELAY_ENV, "0.5")
    proc, decode_url = start_worker_process(glm_ckpt[0], "decode", secret_file(tmp_path), 0, "--disaggregation-timeout",
                                            str(TIMEOUT_S), "--disaggregation-transfer-backend", "nixl")
    try:
        wait_healthy(decode_url, proc)
        with WorkerServer(glm_ckpt[0], "prefill", transfer="nixl", timeout_s=TIMEOUT_S, **BASE) as p, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(send_pair, p.url, decode_url, {**BODY, "prompt": _prompt(256)}, timeout=3 * TIMEOUT_S)
            assert wait_until(lambda: "send" in p.worker.rooms.values(), 30)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            rp, rd = sent.result()
            _failed(rp, "prefill worker")
            assert isinstance(rd, httpx.HTTPError)
            p.check_clean()
            assert p.worker.store.num_keys() == 0 and p.worker.nixl.exposed == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_an_agent_refuses_descriptors_that_do_not_match_the_announced_sizes():
    """The sizes come from the signed metadata; the descriptors must name exactly those bytes. A batch is
    read tensor by tensor, each read paced."""
    exposing, reading = NixlAgent("prefill"), NixlAgent("decode")
    tensors = [torch.arange(10, dtype=torch.uint8), torch.arange(20, dtype=torch.uint8)]
    remote, registration = exposing.expose(tensors)
    try:
        with pytest.raises(TransferError, match="exposed"):
            reading.read(remote, [10, 21], 5.0)
        with pytest.raises(TransferError, match="malformed"):
            reading.read({**remote, "descs": 7}, [10, 20], 5.0)
        paced = []
        got = reading.read(remote, [10, 20], 5.0, pace=lambda fn: paced.append(fn) or fn())
        assert [t.tolist() for t in got] == [t.tolist() for t in tensors]
        assert len(paced) == 2  # a read per tensor, each through the pace (decode.Pacer)
    finally:
        exposing.release(registration)


def test_a_deregistration_nixl_refuses_still_ends_the_batchs_exposure(monkeypatch):
    """A room whose deregistration fails leaves that memory pinned, nothing else: the batch no longer
    counts as exposed, so the prefill side's progress thread goes back to sleep once the room closed."""
    agent = NixlAgent("prefill")
    sender = NixlSender(agent)
    sender.offer([torch.arange(10, dtype=torch.uint8)])
    assert agent.exposed == 1

    def refuse(registration):
        raise RuntimeError("NIXL_ERR_BACKEND")
    monkeypatch.setattr(agent.agent, "deregister_memory", refuse)
    sender.close()
    assert agent.exposed == 0


@pytest.mark.parametrize("failing", ["register_memory", "get_agent_metadata"])
def test_memory_nixl_refuses_fails_the_room_and_stays_unregistered(failing, monkeypatch):
    """NIXL's own errors while exposing a batch are the room's TransferError (a 503), not the worker's;
    a registration made before the failure is released."""
    agent = NixlAgent("prefill")
    registered = []
    real_register, real_deregister = agent.agent.register_memory, agent.agent.deregister_memory
    monkeypatch.setattr(agent.agent, "register_memory", lambda t: registered.append(real_register(t)) or registered[-1])
    monkeypatch.setattr(agent.agent, "deregister_memory", lambda r: registered.remove(r) or real_deregister(r))

    def refuse(*args):
        raise RuntimeError("NIXL_ERR_BACKEND")
    monkeypatch.setattr(agent.agent, failing, refuse)
    with pytest.raises(TransferError, match="NIXL could not .*NIXL_ERR_BACKEND"):
        NixlSender(agent).offer([torch.arange(10, dtype=torch.uint8)])
    assert registered == [] and agent.exposed == 0


def _counting(agent, monkeypatch, register="register_memory", release="deregister_memory"):
    """What `agent` holds of `register` (a NIXL registration or transfer handle) not yet given to `release`."""
    held = []
    real_register, real_release = getattr(agent.agent, register), getattr(agent.agent, release)
    monkeypatch.setattr(agent.agent, register, lambda *a: held.append(real_register(*a)) or held[-1])
    monkeypatch.setattr(agent.agent, release, lambda r: held.remove(r) or real_release(r))
    return held


@pytest.mark.parametrize("failing", [None, "deserialize_descs", "initialize_xfer", "ERR"])
def test_a_read_gives_back_its_buffer_and_handles_and_a_failed_one_forgets_the_peer(failing, monkeypatch):
    """Whether a read succeeds or fails (descriptors NIXL cannot load, a read that cannot start, a read
    NIXL reports failed), the decode side's buffer is deregistered and every transfer handle released;
    after a failure the peer's metadata is forgotten (loaded again from the next batch), and a read
    reported failed fails at once, not at the transfer timeout."""
    exposing, reading = NixlAgent("prefill"), NixlAgent("decode")
    tensors = [torch.arange(10, dtype=torch.uint8), torch.arange(20, dtype=torch.uint8)]
    remote, registration = exposing.expose(tensors)
    registered = _counting(reading, monkeypatch)
    handles = _counting(reading, monkeypatch, "initialize_xfer", "release_xfer_handle")
    try:
        if failing == "ERR":  # the read completes, then NIXL says it failed (as for a peer gone)
            real_state = reading.agent.check_xfer_state

            def failed(handle):
                while real_state(handle) != "DONE":
                    time.sleep(1e-3)
                return "ERR"
            monkeypatch.setattr(reading.agent, "check_xfer_state", failed)
        elif failing is not None:
            def refuse(*args):
                raise RuntimeError("NIXL_ERR_BACKEND")
            monkeypatch.setattr(reading.agent, failing, refuse)
        if failing is None:
            got = reading.read(remote, [10, 20], TIMEOUT_S)
            assert [t.tolist() for t in got] == [t.tolist() for t in tensors]
            assert list(reading.peers) == [exposing.name]
        else:
            words = {"deserialize_descs": "could not be loaded", "initialize_xfer": "could not start",
                     "ERR": "failed \\(the prefill worker gone"}[failing]
            with pytest.raises(TransferError, match=words):
                reading.read(remote, [10, 20], TIMEOUT_S)
            assert reading.peers == {}
        assert registered == [] and handles == []
    finally:
        exposing.release(registration)


def test_closing_a_room_releases_each_registration_once_even_after_one_fails(monkeypatch):
    """A deregistration NIXL refuses does not keep the room's other batches registered, and a room
    closed twice deregisters nothing twice."""
    agent = NixlAgent("prefill")
    registered = _counting(agent, monkeypatch)
    sender = NixlSender(agent)
    for n in (10, 20):
        sender.offer([torch.arange(n, dtype=torch.uint8)])
    first, second = registered
    real_deregister, calls = agent.agent.deregister_memory, []

    def refuse_the_first(r):
        calls.append(r)
        if r is first:
            raise RuntimeError("NIXL_ERR_BACKEND")
        real_deregister(r)
    monkeypatch.setattr(agent.agent, "deregister_memory", refuse_the_first)
    sender.close()
    assert registered == [first] and calls == [first, second]
    sender.close()
    assert calls == [first, second]


def test_one_progress_thread_however_many_batches_and_none_for_a_reading_agent():
    def pumps():
        return sum(t.name == "sparsekv-nixl-progress" for t in threading.enumerate())
    before = pumps()
    exposing, reading = NixlAgent("prefill"), NixlAgent("decode")
    tensors = [torch.arange(10, dtype=torch.uint8), torch.arange(20, dtype=torch.uint8)]
    exposed = [exposing.expose([t]) for t in tensors]
    try:
        for (remote, _), t in zip(exposed, tensors):
            assert reading.read(remote, [t.numel()], TIMEOUT_S)[0].tolist() == t.tolist()
        assert pumps() == before + 1 and reading.pump is None
    finally:
        for _, registration in exposed:
            exposing.release(registration)
    assert exposing.exposed == 0


def test_a_batch_naming_no_nixl_descriptors_fails_its_room():
    from sparsekv.disagg.nixl import NixlReceiver
    receiver = NixlReceiver(NixlAgent("decode"), TIMEOUT_S)
    for meta in ({}, {"nixl": "not a dict"}):
        with pytest.raises(TransferError, match="named NIXL but no descriptors"):
            receiver.pull(meta, [10], 0)


def test_the_progress_thread_outlives_a_progress_call_nixl_fails(monkeypatch, caplog):
    """An error of NIXL's while progressing is logged once per run of failures (a call every PUMP_S)
    and the thread goes on progressing the batches still exposed (it ended before, and every later
    read of this worker's batches waited for its timeout)."""
    agent = NixlAgent("prefill")
    real, calls = agent.agent.get_new_notifs, []

    def flaky():
        calls.append(1)
        if len(calls) <= 3:
            raise RuntimeError("NIXL_ERR_BACKEND")
        return real()
    monkeypatch.setattr(agent.agent, "get_new_notifs", flaky)
    tensors = [torch.arange(10, dtype=torch.uint8)]
    _, registration = agent.expose(tensors)
    try:
        assert wait_until(lambda: len(calls) >= 5), calls
        assert agent.pump.is_alive()
    finally:
        agent.release(registration)
    assert [r.getMessage() for r in caplog.records if "NIXL progress failed" in r.getMessage()] == \
        ["NIXL progress failed (logged again only after it recovers)"]

