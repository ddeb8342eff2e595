"""The RL trainer's endpoints on a live server (docs/rl.md): /update_weights_from_disk, /pause_generation,
/continue_generation and /flush_cache open to admin keys only; weights_version in responses and
/metrics; return_routed_experts through the OpenAI request extension."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from conftest import STARTUP_S
from sparsekv import LLM, SamplingParams
from sparsekv.tools.bench_weight_sync import checkpoint_tensors
from sparsekv.tools.tiny import save_reference_checkpoint
from test_server_util import (MAX_MODEL_LEN, ThreadServer, free_port, on_engine_loop, scrape, tiny_checkpoint,
                              wait_until)

KEY, ADMIN = "sk-alice", "sk-admin"
TRAINER_TIMEOUT_S = 60.0  # the test trainer's group: its broadcasts and rendezvous
PROMPT = [(7 * i) % 250 + 1 for i in range(30)]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
ADMIN_PATHS = ["/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache",
               "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    b = str(tmp_path_factory.mktemp("rl") / "b")
    save_reference_checkpoint(b, seed=1)  # the same architecture, other weights
    return a, b


@pytest.fixture(scope="module")
def server(ckpts):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ThreadServer(ckpts[0], api_keys=[f"{KEY}:alice"], admin_api_keys=[ADMIN], enable_prefix_caching=True) as srv:
        yield srv
    torch.set_num_threads(threads)


def _post(server, path, body=None, key=KEY):
    return httpx.post(server.url + path, json=body if body is not None else {}, timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def _complete(server, **extra):
    r = _post(server, "/v1/completions", {**BODY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _engine_tokens(path, max_tokens: int = 6, **params):
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
    return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params))[0]


@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_admin_endpoints_refuse_every_other_key(server, path):
    for key in (None, KEY, "sk-wrong"):
        r = _post(server, path, {"model_path": "x"}, key=key)
        assert r.status_code == 401, (key, r.text)
    assert _post(server, "/v1/completions", BODY, key=ADMIN).status_code == 401  # no tenant key either


def test_admin_endpoints_are_off_without_an_admin_key(ckpts):
    with ThreadServer(ckpts[0], api_keys=[KEY]) as srv:
        for path in ADMIN_PATHS:
            assert _post(srv, path, {}, key=KEY).status_code == 403
            assert _post(srv, path, {}, key=None).status_code == 403


def test_update_weights_from_disk_serves_b_and_reports_the_version(server, ckpts):
    a, b = ckpts
    first = _complete(server)
    assert first["sparsekv"]["choices"][0]["weights_version"] == 0
    assert first["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(a).token_ids
    bad = _post(server, "/update_weights_from_disk", {"model_path": a + "-missing"}, key=ADMIN)
    assert bad.status_code == 400 and "model_path" in bad.text
    assert _complete(server)["sparsekv"]["choices"][0]["token_ids"] == first["sparsekv"]["choices"][0]["token_ids"]
    r = _post(server, "/update_weights_from_disk", {"model_path": b}, key=ADMIN)
    assert r.status_code == 200 and r.json()["success"] and r.json()["weights_version"] == 1, r.text
    after = _complete(server)  # the prompt was cached under A: computed again under B
    assert after["sparsekv"]["choices"][0]["weights_version"] == 1
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(b).token_ids
    assert scrape(server.url)["sparsekv:weights_version"] == 1
    flushed = _post(server, "/flush_cache", key=ADMIN)
    assert flushed.status_code == 200 and flushed.json()["pages_removed"] > 0


def test_pause_then_continue_gives_the_uninterrupted_output(server):
    want = _complete(server)["sparsekv"]["choices"][0]["token_ids"]
    assert _post(server, "/pause_generation", key=ADMIN).status_code == 200
    box = []
    worker = threading.Thread(target=lambda: box.append(_complete(server)))
    worker.start()
    engine = server.engine
    assert wait_until(lambda: engine.has_unfinished_requests())
    generated = engine.counters["generation_tokens"]
    assert _post(server, "/flush_cache", key=ADMIN).status_code == 200  # the loop keeps answering commands
    assert engine.counters["generation_tokens"] == generated and not box
    assert _post(server, "/continue_generation", key=ADMIN).status_code == 200
    worker.join(60)
    assert box[0]["sparsekv"]["choices"][0]["token_ids"] == want


def test_pause_and_continue_answer_the_state_they_left(server):
    """SGLang's bodies: /pause_generation answers paused true, /continue_generation paused false (a
    trainer reads them to know whether rollouts run)."""
    paused = _post(server, "/pause_generation", key=ADMIN)
    resumed = _post(server, "/continue_generation", key=ADMIN)
    assert paused.json() == {"success": True, "paused": True}
    assert resumed.json() == {"success": True, "paused": False} and not server.engine.paused


def test_routed_experts_through_the_openai_extension(server, ckpts):
    got = _complete(server, return_routed_experts=True)["sparsekv"]["choices"][0]
    assert len(got["routed_experts"]) == len(got["token_ids"]) == 6
    path = ckpts[got["weights_version"]]  # A, or B once the update test ran
    assert got["routed_experts"] == _engine_tokens(path, return_routed_experts=True).routed_experts
    assert "routed_experts" not in _complete(server)["sparsekv"]["choices"][0]
    assert _post(server, "/v1/completions", {**BODY, "return_routed_experts": "yes"}).status_code == 400


def _update_during_a_request(srv, path):
    """POST /update_weights_from_disk while a 12-token completion is generating: once it has a token,
    its steps hold until the update reached the engine (a held step returns no output; the engine
    loop's commands run meanwhile; 30 s at most), so it is still in flight then however slow the
    update's round trip. (the update's answer, [the completion's answer], its thread, joined)."""
    engine = srv.engine
    step, update, updating, timed_out = engine.step, engine.update_weights_from_disk, threading.Event(), []
    held_until = time.monotonic() + 30

    def held():
        if engine.counters["generation_tokens"] > 0 and not updating.is_set():
            if time.monotonic() < held_until:
                time.sleep(0.005)
                return []
            timed_out.append(True)
        return step()

    def update_called(*args, **options):
        updating.set()
        return update(*args, **options)
    engine.step, engine.update_weights_from_disk = held, update_called
    try:
        box = []
        worker = threading.Thread(target=lambda: box.append(_complete(srv, max_tokens=12)))
        worker.start()
        assert wait_until(lambda: engine.counters["generation_tokens"] > 0, timeout=30)
        r = _post(srv, "/update_weights_from_disk", {"model_path": path}, key=ADMIN)
        worker.join(60)
    finally:
        engine.step, engine.update_weights_from_disk = step, update
    assert updating.is_set() and not timed_out  # the request was still in flight when the update came
    return r, box, worker


@pytest.mark.parametrize("policy", ["drain", "abort"])
def test_a_request_in_flight_during_an_update_never_mixes_weights(ckpts, policy):
    """drain: the request finishes under A and the update answers after it; abort: the request ends
    with finish_reason "abort" (the client resubmits) and the update answers at once."""
    a, b = ckpts
    want_a = _engine_tokens(a, 12).token_ids
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy=policy) as srv:
        r, box, worker = _update_during_a_request(srv, b)
        assert r.status_code == 200 and r.json()["weights_version"] == 1, r.text
        choice, ext = box[0]["choices"][0], box[0]["sparsekv"]["choices"][0]
        assert ext["weights_version"] == 0
        if policy == "drain":
            assert choice["finish_reason"] == "length" and ext["token_ids"] == want_a
        else:
            assert choice["finish_reason"] == "abort" and 0 < len(ext["token_ids"]) < 12
            assert ext["token_ids"] == want_a[:len(ext["token_ids"])]
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(b).token_ids


def test_a_failed_load_answers_500_and_still_ends_the_aborted_request(ckpts):
    """abort: the request in flight is ended before the load; the load then fails (past the checks):
    the update answers 500, the request's client still gets its final answer, and A keeps serving."""
    a, b = ckpts
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="abort") as srv:
        def fail(update):
            raise OSError("disk gone")
        srv.engine.executor.update_weights = fail
        r, box, worker = _update_during_a_request(srv, b)
        assert r.status_code == 500 and "disk gone" in r.text, r.text
        assert not worker.is_alive() and box[0]["choices"][0]["finish_reason"] == "abort"
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(a).token_ids
        assert scrape(srv.url)["sparsekv:weights_version"] == 0


def test_an_update_that_leaves_a_mix_of_weights_answers_503_and_the_server_stops_serving(ckpts, tmp_path, monkeypatch):
    """A load failing part-way whose old weights cannot be put back (the checkpoint they came from was
    written over since): the model holds two versions, so the update answers 503, and the engine steps
    no more (/health answers 503) rather than serve a mix."""
    import os
    import shutil

    from sparsekv.model.checkpoint import LOAD_FAULT_ENV
    a, b = ckpts
    loaded = shutil.copytree(a, tmp_path / "loaded")
    with ThreadServer(str(loaded), admin_api_keys=[ADMIN]) as srv:
        assert _complete(srv)["choices"][0]["finish_reason"] == "length"
        monkeypatch.setenv(LOAD_FAULT_ENV, f"{os.path.basename(b)}:model.layers.1.mlp.experts.2.gate_proj.weight")
        os.utime(loaded / "model.safetensors", ns=(1, 1))
        r = _post(srv, "/update_weights_from_disk", {"model_path": b}, key=ADMIN)
        assert r.status_code == 503 and "parts of both" in r.json()["error"]["message"], r.text
        assert wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503, timeout=30)
        assert _post(srv, "/v1/completions", BODY).status_code == 503


def test_a_stream_carries_the_version_and_routed_experts_in_its_final_chunk(server):
    import json
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={**BODY, "stream": True, "return_routed_experts": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = [c for c in chunks if "sparsekv" in c]
    assert len(final) == 1 and len(final[0]["sparsekv"]["routed_experts"]) == 6
    assert final[0]["sparsekv"]["weights_version"] in (0, 1)


def test_admin_keys_from_flags_files_and_the_environment(tmp_path):
    import os

    from sparsekv.server.auth import ADMIN_API_KEY_ENV, load_admin_keys, tenant_for
    path = tmp_path / "admin.key"
    path.write_text("# trainer\nsk-one\nsk-two\n")
    os.chmod(path, 0o600)
    keys = load_admin_keys(["sk-flag"], [str(path)], {ADMIN_API_KEY_ENV: "sk-env"})
    assert all(tenant_for(keys, f"Bearer {k}") == "admin" for k in ("sk-flag", "sk-one", "sk-two", "sk-env"))
    assert tenant_for(keys, "Bearer sk-other") is None
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_admin_keys([], [str(path)], {})
    with pytest.raises(ValueError, match="must not be empty"):
        load_admin_keys([""], [], {})


def test_a_data_parallel_server_updates_every_rank(ckpts):
    """-dp 2 with expert parallelism behind the server: /update_weights_from_disk loads B on both ranks
    (a batch of two prompts runs one on each), the answers are one B engine's, the version is reported."""
    a, b = ckpts
    other = [(11 * i) % 250 + 1 for i in range(24)]
    with ThreadServer(a, api_keys=[f"{KEY}:alice"], admin_api_keys=[ADMIN], enable_prefix_caching=True,
                      data_parallel_size=2, enable_expert_parallel=True, num_threads=1,
                      dist_startup_timeout_s=STARTUP_S) as srv:
        before = _complete(srv, prompt=[PROMPT, other])
        assert [c["token_ids"] for c in before["sparsekv"]["choices"]] == \
            [_engine_tokens(a).token_ids, _engine_tokens_of(a, other)]
        r = _post(srv, "/update_weights_from_disk", {"model_path": b}, key=ADMIN)
        assert r.status_code == 200 and r.json()["weights_version"] == 1, r.text
        after = _complete(srv, prompt=[PROMPT, other])
        assert [c["token_ids"] for c in after["sparsekv"]["choices"]] == \
            [_engine_tokens(b).token_ids, _engine_tokens_of(b, other)]
        assert _engine_tokens_of(a, other) != _engine_tokens_of(b, other)  # so each rank's answer tells A from B
        assert {c["weights_version"] for c in after["sparsekv"]["choices"]} == {1}
        stats = on_engine_loop(srv, srv.engine.stats)
        assert stats["by_data_parallel_rank"][1]["generation_tokens"] > 0  # rank 1 answered one
        assert scrape(srv.url)["sparsekv:weights_version"] == 1
        _abort_a_request_running_on_both_ranks(srv, [PROMPT, other])


def _abort_a_request_running_on_both_ranks(srv, prompts):
    """/abort_request on a data-parallel server: a request whose two prompts run one on each rank ends
    with finish_reason "abort" for both, and both ranks free its pages."""
    srv.delay[0] = 0.1
    box = []
    try:
        worker = threading.Thread(target=lambda: box.append(_complete(srv, prompt=prompts, max_tokens=200, rid="r")))
        worker.start()
        assert wait_until(lambda: scrape(srv.url)["sparsekv:num_requests_running"] == 2, timeout=30)
        assert _post(srv, "/abort_request", {"rid": "r"}).json() == {"success": True, "aborted": 1}
        worker.join(30)
    finally:
        srv.delay[0] = 0.0
    assert [c["finish_reason"] for c in box[0]["choices"]] == ["abort", "abort"]
    assert all(len(c["token_ids"]) < 200 for c in box[0]["sparsekv"]["choices"])

    def every_page_free():
        ranks = on_engine_loop(srv, srv.engine.stats)["by_data_parallel_rank"]
        return all(r["kv_pages_free"] == r["kv_pages_total"] for r in ranks)
    assert wait_until(every_page_free, timeout=10)


def _engine_tokens_of(path, prompt):
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_page_size=16)
    return llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("second_loads", [False, True], ids=["second-fails", "second-loads"])
def test_each_drain_update_answers_its_own_result(ckpts, monkeypatch, second_loads):
    """Under drain, update 1 (B) waits for the request in flight, loads as version 1, and a second update
    (A) comes before update 1's answer is read, and loads as version 2 or fails: update 1 answers 200
    with version 1, update 2 its own result (200 with version 2, or a 500), not whichever update settled
    last."""
    from sparsekv.server import admin
    a, b = ckpts
    monkeypatch.setattr(admin, "POLL_S", 2.0)  # update 1's answer is read 2 s after its load at the latest
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain") as srv:
        engine, answers = srv.engine, {}
        srv.delay[0] = 0.2  # the request stays in flight while update 1 comes
        worker = threading.Thread(target=lambda: _complete(srv, max_tokens=12))
        worker.start()
        assert wait_until(lambda: engine.counters["generation_tokens"] > 0, timeout=30)
        first = threading.Thread(target=lambda: answers.setdefault(1, _post(srv, "/update_weights_from_disk",
                                                                            {"model_path": b}, key=ADMIN)))
        first.start()
        assert wait_until(lambda: engine.weights_version == 1, timeout=30)  # update 1 loaded: its answer is pending
        real = engine.executor.update_weights

        def fails(update):
            raise OSError("disk gone")
        if not second_loads:
            engine.executor.update_weights = fails
        answers[2] = _post(srv, "/update_weights_from_disk", {"model_path": a}, key=ADMIN)
        engine.executor.update_weights = real
        first.join(30)
        worker.join(60)
    if second_loads:
        assert answers[2].status_code == 200 and answers[2].json()["weights_version"] == 2, answers[2].text
    else:
        assert answers[2].status_code == 500 and "disk gone" in answers[2].text
    assert answers[1].status_code == 200 and answers[1].json()["weights_version"] == 1, answers[1].text


def test_a_file_that_is_not_safetensors_is_a_refused_update(ckpts, tmp_path):
    """A model.safetensors that is garbage or cut short is refused (400, WeightUpdateError), not a 500."""
    import shutil
    from sparsekv.weights import WeightUpdateError
    a, _ = ckpts
    for name, damage in (("garbage", lambda data: b"\xff" * 64), ("truncated", lambda data: data[:len(data) // 2])):
        bad = tmp_path / name
        shutil.copytree(a, bad)
        weights = bad / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
        llm = LLM(a, max_model_len=MAX_MODEL_LEN, kv_page_size=16)
        with pytest.raises(WeightUpdateError, match=str(bad)):
            llm.engine.update_weights_from_disk(str(bad))
        llm.close()


def test_drain_conflicts_answer_409_and_change_nothing(ckpts):
    """docs/rl.md: under drain, an update while generation is paused with a started request, and a pause
    while a drain update waits for one, are conflicts: 409, and the request still ends under A."""
    a, b = ckpts
    want_a = _engine_tokens(a, 12).token_ids
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain") as srv:
        engine, box = srv.engine, {}
        srv.delay[0] = 0.5  # the request stays in flight through the admin calls below (a loaded machine too)
        worker = threading.Thread(target=lambda: box.setdefault("completion", _complete(srv, max_tokens=12)))
        worker.start()
        assert wait_until(lambda: engine.counters["generation_tokens"] > 0, timeout=30)
        assert _post(srv, "/pause_generation", key=ADMIN).status_code == 200
        refused = _post(srv, "/update_weights_from_disk", {"model_path": b}, key=ADMIN)
        assert refused.status_code == 409 and "paused" in refused.json()["error"]["message"], refused.text
        assert _post(srv, "/continue_generation", key=ADMIN).status_code == 200
        update = threading.Thread(target=lambda: box.setdefault("update", _post(srv, "/update_weights_from_disk",
                                                                                {"model_path": b}, key=ADMIN)))
        update.start()
        assert wait_until(lambda: engine.weight_update_pending, timeout=30)
        paused = _post(srv, "/pause_generation", key=ADMIN)
        assert paused.status_code == 409 and "drain" in paused.json()["error"]["message"], paused.text
        worker.join(60)
        update.join(60)
        completion, loaded = box["completion"], box["update"]
        assert completion["sparsekv"]["choices"][0]["token_ids"] == want_a
        assert loaded.status_code == 200 and loaded.json()["weights_version"] == 1, loaded.text


@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_admin_endpoints_answer_503_while_the_server_shuts_down(ckpts, path):
    """A draining server (SIGTERM) refuses admin commands as it refuses requests: 503, not a 500."""
    with ThreadServer(ckpts[0], admin_api_keys=[ADMIN]) as srv:
        srv.state.loop.draining = True
        r = _post(srv, path, {"model_path": ckpts[1]}, key=ADMIN)
        srv.state.loop.draining = False
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == 503


def test_admin_endpoints_answer_503_once_the_engine_is_dead(ckpts):
    """A dead engine (a step raised: /health 503 engine_dead) refuses admin commands as it refuses
    requests: 503, the service is down, not a 500 "internal server error"."""
    with ThreadServer(ckpts[0], admin_api_keys=[ADMIN]) as srv:
        srv.state.loop.dead = RuntimeError("injected engine fault")
        try:
            answers = [_post(srv, path, {"model_path": ckpts[1]}, key=ADMIN) for path in ADMIN_PATHS]
        finally:
            srv.state.loop.dead = None
    for r in answers:
        assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
        assert "engine failed" in r.json()["error"]["message"], r.text


def test_a_drain_update_whose_load_fails_after_the_wait_answers_500(ckpts):
    """drain: the update waits for the request in flight, then its load fails: 500 (docs/rl.md, "failed
    to load"), not a success without a version; the request ends under A and A keeps serving."""
    a, b = ckpts
    want_a = _engine_tokens(a, 12).token_ids
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain") as srv:
        engine, box = srv.engine, []
        srv.delay[0] = 0.2  # the request stays in flight while the update comes

        def fails(update):
            raise OSError("disk gone")
        engine.executor.update_weights = fails
        worker = threading.Thread(target=lambda: box.append(_complete(srv, max_tokens=12)))
        worker.start()
        assert wait_until(lambda: engine.counters["generation_tokens"] > 0, timeout=30)
        r = _post(srv, "/update_weights_from_disk", {"model_path": b}, key=ADMIN)
        worker.join(60)
        assert r.status_code == 500 and "disk gone" in r.json()["error"]["message"], r.text
        assert box[0]["sparsekv"]["choices"][0]["token_ids"] == want_a
        assert box[0]["choices"][0]["finish_reason"] == "length"  # it drained: finished, not aborted
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(a).token_ids
        assert scrape(srv.url)["sparsekv:weights_version"] == 0


def test_a_drain_update_loads_when_the_request_it_waits_for_is_aborted(ckpts):
    """drain: the update waits for the one request in flight; that request's client leaves (its stream
    closed: the request is aborted, not finished). Nothing is left to run, and the update loads then and
    answers 200 with version 1, rather than waiting for some later request to step the engine."""
    a, b = ckpts
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain") as srv:
        engine, box = srv.engine, {}
        srv.delay[0] = 0.2  # the request stays in flight while the update comes
        update = threading.Thread(target=lambda: box.setdefault("update", _post(srv, "/update_weights_from_disk",
                                                                                {"model_path": b}, key=ADMIN)))
        with httpx.stream("POST", srv.url + "/v1/completions", json={**BODY, "max_tokens": 200, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the stream
            assert next(line for line in lines if line.startswith("data: {"))
            update.start()
            assert wait_until(lambda: engine.weight_update_pending and bool(engine.scheduler.running), timeout=30)
        # the stream is closed: the server aborts its request, and no request is left
        update.join(30)
        assert "update" in box, "the update still waits, with nothing left to run"
        assert box["update"].status_code == 200, box["update"].text
        assert box["update"].json()["weights_version"] == 1 and engine.weights_version == 1


# -- weights broadcast by a trainer (SGLang's /init_weights_update_group, /update_weights_from_distributed) --

def _announce(tensors, group="g") -> dict:
    return {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": group}


def _join_as_trainer(srv, group="g", processes: int = 1):
    """The trainer's group (rank 0, its store on a free port) with the server's engine, of `processes`
    processes, as ranks 1 to `processes`."""
    from sparsekv.weight_sync import trainer_group
    port, box, world = free_port(), {}, 1 + processes
    # NOTE: the trainer's collectives bounded well below the engine's, so that a rank that never joins or
    # receives fails the test in a minute rather than hanging it for the group's default timeout
    thread = threading.Thread(target=lambda: box.setdefault("group", trainer_group("127.0.0.1", port, world,
                                                                                   timeout_s=TRAINER_TIMEOUT_S)))
    thread.start()
    r = _post(srv, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                  "rank_offset": 1, "world_size": world, "group_name": group}, key=ADMIN)
    thread.join(60)
    joined = "rank 1 of 2" if processes == 1 else f"ranks 1 to {processes} of {world}"
    assert r.status_code == 200 and f"{joined} (gloo)" in r.json()["message"], r.text
    return box["group"]


def _broadcast_update(srv, group, announced, sent, meanwhile=None) -> httpx.Response:
    """POST the update announcing `announced` while the trainer broadcasts `sent` (its tensors in order);
    `meanwhile()` runs once the server waits for the broadcasts."""
    from sparsekv.weight_sync import broadcast_weights
    thread, box = threading.Thread(target=lambda: box.append(
        _post(srv, "/update_weights_from_distributed", _announce(announced), key=ADMIN))), []
    thread.start()
    if meanwhile is not None:
        assert wait_until(lambda: srv.state.weight_groups.groups["g"].busy.locked(), timeout=30)
        meanwhile()
    broadcast_weights(group, sent)
    thread.join(60)
    return box[0]


def _record_load_commands(monkeypatch) -> list:
    """The updates rank 0's load commands send the other ranks over the control group, as sent."""
    import torch.distributed as dist
    sent, broadcast = [], dist.broadcast_object_list

    def recording(objects, *args, **kwargs):
        command, command_args = objects[0] if isinstance(objects[0], tuple) else (None, ())
        if command in ("update_weights", "load_weights"):
            sent.append(command_args[0])
        return broadcast(objects, *args, **kwargs)
    monkeypatch.setattr(dist, "broadcast_object_list", recording)
    return sent


def test_a_trainer_broadcasts_new_weights_over_a_process_group(ckpts):
    """An RL trainer's weight sync without a checkpoint on disk: the server joins the trainer's gloo
    group, receives B's tensors as the trainer broadcasts them, and then answers as a B engine. A tensor
    of the wrong shape is received (so the trainer's broadcasts complete) and then refused whole: the old
    weights keep serving and the group stays usable. A dtype it does not know is refused before
    anything is received; a destroyed group is gone."""
    a, b = ckpts
    new = checkpoint_tensors(b)
    with ThreadServer(a, admin_api_keys=[ADMIN]) as srv:
        group = _join_as_trainer(srv)
        name, tensor = new[0]
        wrong = [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:], dtype=tensor.dtype))]
        refused = _broadcast_update(srv, group, wrong, wrong)
        assert refused.status_code == 400 and "wrong shape" in refused.json()["error"]["message"], refused.text
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(a).token_ids
        bad_dtype = _post(srv, "/update_weights_from_distributed", {**_announce(new[:1]), "dtypes": ["int4"]},
                          key=ADMIN)
        assert bad_dtype.status_code == 400 and "int4" in bad_dtype.json()["error"]["message"]
        def second_update_is_refused():  # its broadcasts would interleave with the first's
            r = _post(srv, "/update_weights_from_distributed", _announce(new), key=ADMIN)
            assert r.status_code == 409 and "in flight" in r.json()["error"]["message"], r.text
        loaded = _broadcast_update(srv, group, new, new, meanwhile=second_update_is_refused)
        assert loaded.status_code == 200 and loaded.json()["weights_version"] == 1, loaded.text
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(b).token_ids
        assert _post(srv, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                         "rank_offset": 1, "world_size": 2, "group_name": "g"},
                     key=ADMIN).status_code == 409  # the name is taken
        assert _post(srv, "/destroy_weights_update_group", {"group_name": "g"}, key=ADMIN).json() == {"success": True}
        gone = _post(srv, "/update_weights_from_distributed", _announce(new[:1]), key=ADMIN)
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "group_name"


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "dp2-ep"])
def test_every_rank_of_a_parallel_engine_joins_the_trainers_group_and_receives_the_weights(ckpts, layout, monkeypatch):
    """A parallel engine joins the trainer's group with each of its processes (ranks 1 and 2 of 3: the
    group cannot form without the worker rank), each receives the broadcasts itself, and the update
    loads on both: the answers are then a B engine's (on both data-parallel ranks). A world too small
    for every process is refused before any connection; a refused update leaves the group usable."""
    a, b = ckpts
    new = checkpoint_tensors(b)
    other = [(11 * i) % 250 + 1 for i in range(24)]
    with ThreadServer(a, admin_api_keys=[ADMIN], num_threads=1, dist_startup_timeout_s=STARTUP_S, **layout) as srv:
        small = _post(srv, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                          "rank_offset": 1, "world_size": 2}, key=ADMIN)
        assert small.status_code == 400 and small.json()["error"]["param"] == "world_size", small.text
        info = httpx.get(srv.url + "/server_info", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
        assert info["tp_size"] * info["dp_size"] == 2  # what the trainer sizes the group by
        group, loads = _join_as_trainer(srv, processes=2), _record_load_commands(monkeypatch)
        name, tensor = new[0]
        wrong = [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:], dtype=tensor.dtype))]
        refused = _broadcast_update(srv, group, wrong, wrong)
        assert refused.status_code == 400 and "wrong shape" in refused.json()["error"]["message"], refused.text
        # the worker rank's copy of the refused update is dropped, not held
        assert on_engine_loop(srv, lambda: srv.engine.weight_groups("outcome", "g", 1, 1.0)) == \
            ["no update was announced to this rank"]
        loaded = _broadcast_update(srv, group, new, new)
        assert loaded.status_code == 200 and loaded.json()["weights_version"] == 1, loaded.text
        # the worker rank loaded the copy it received (taken, none kept), not one relayed by rank 0
        assert len(loads) == 1 and loads[0].tensors == {}, loads
        assert on_engine_loop(srv, lambda: srv.engine.weight_groups("outcome", "g", 2, 1.0)) == \
            ["no update was announced to this rank"]
        after = _complete(srv, prompt=[PROMPT, other])
        assert [c["token_ids"] for c in after["sparsekv"]["choices"]] == \
            [_engine_tokens(b).token_ids, _engine_tokens_of(b, other)]
        if "data_parallel_size" in layout:
            assert on_engine_loop(srv, srv.engine.stats)["by_data_parallel_rank"][1]["generation_tokens"] > 0
        assert _post(srv, "/destroy_weights_update_group", {"group_name": "g"}, key=ADMIN).json() == {"success": True}


def _an_update_waiting_for_a_request(srv, group, tensors, max_tokens: int):
    """A drain update over `group` received by the server while a `max_tokens` completion is in flight
    (its steps slowed: srv.delay), so that it waits to load: (the answers' box, "completion" and
    "first" once they come; the completion's thread; the update's thread)."""
    from sparsekv.weight_sync import broadcast_weights
    engine, box = srv.engine, {}
    srv.delay[0] = 0.5
    worker = threading.Thread(target=lambda: box.setdefault("completion", _complete(srv, max_tokens=max_tokens)))
    worker.start()
    assert wait_until(lambda: engine.counters["generation_tokens"] > 0, timeout=30)
    first = threading.Thread(target=lambda: box.setdefault("first", _post(
        srv, "/update_weights_from_distributed", _announce(tensors), key=ADMIN)))
    first.start()
    broadcast_weights(group, tensors)
    assert wait_until(lambda: engine.weight_update_pending, timeout=30)
    return box, worker, first


def test_an_update_refused_while_a_drain_waits_leaves_the_waiting_updates_tensors_on_every_rank(ckpts):
    """Two processes, drain: the first update is received by both ranks and waits for a request in
    flight; a second one, received too, is refused (409: one update waits at a time) and its copies are
    dropped, while each rank keeps the first's (an update is named by its ticket, not its group). Once
    the request finishes under A the first loads on both ranks: B answers."""
    a, b = ckpts
    new = checkpoint_tensors(b)
    want_a = _engine_tokens(a, 12).token_ids
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain", tensor_parallel_size=2, num_threads=1,
                      dist_startup_timeout_s=STARTUP_S) as srv:
        group = _join_as_trainer(srv, processes=2)
        box, worker, first = _an_update_waiting_for_a_request(srv, group, new, max_tokens=12)
        second = _broadcast_update(srv, group, new, new)
        assert second.status_code == 409 and "waiting" in second.json()["error"]["message"], second.text
        srv.delay[0] = 0.0
        worker.join(60)
        first.join(60)
        assert box["completion"]["sparsekv"]["choices"][0]["token_ids"] == want_a
        assert box["first"].status_code == 200 and box["first"].json()["weights_version"] == 1, box["first"].text
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(b).token_ids


def test_the_other_ranks_are_told_each_updates_ticket_and_a_rank_without_its_tensors_fails_the_update(
        server, ckpts, monkeypatch):
    """What rank 0 tells the other ranks (a stand-in for them answers as one worker rank): each update
    is received and checked under a ticket of its own; one refused after its receive has their copies
    discarded, by that ticket; one that a worker rank does not hold (its `outcome` says why) is a 503
    naming the rank, before anything loads, and every rank leaves the group; a join that fails has them
    leave it too. Leaving, they keep the tensors of an update over the group still waiting to load."""
    from sparsekv import weight_sync
    new = checkpoint_tensors(ckpts[1])
    calls, version = [], server.engine.weights_version

    def weight_groups(op, *args):
        calls.append((op, *args[:2]))  # a drop's second argument: the tickets whose tensors stay
        return ["TimeoutError: still receiving"] if op == "outcome" and args[1] == 2 else [None]
    monkeypatch.setattr(server.engine, "weight_groups", weight_groups)
    group = _join_as_trainer(server)
    name, tensor = new[0]
    wrong = [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:], dtype=tensor.dtype))]
    assert _broadcast_update(server, group, wrong, wrong).status_code == 400
    assert calls[1:] == [("receive", "g", 1), ("outcome", "g", 1), ("discard", "g", 1)]
    del calls[:]
    failed = _broadcast_update(server, group, new, new)
    assert failed.status_code == 503 and "rank 1: TimeoutError: still receiving" in failed.json()["error"]["message"]
    assert calls == [("receive", "g", 2), ("outcome", "g", 2), ("drop", "g", ())], calls
    assert server.state.weight_groups.groups == {} and server.engine.weights_version == version
    del calls[:]
    monkeypatch.setattr(weight_sync, "JOIN_TIMEOUT_S", 1.0)
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    waiting = ("weight_update_group", 7)  # an update received over a group of that name before, not loaded yet
    server.state.weight_groups.loading.add(waiting)
    try:
        assert _post(server, "/init_weights_update_group", body, key=ADMIN).status_code == 503
    finally:
        server.state.weight_groups.loading.discard(waiting)
    assert [c[0] for c in calls] == ["join", "drop"] and calls[1] == ("drop", "weight_update_group", (7,)), calls


def test_a_group_destroyed_and_formed_again_while_its_update_waits_to_load_leaves_that_update_on_each_rank(ckpts):
    """Two processes, drain: an update received by both ranks waits for a request in flight when the
    trainer destroys the group and forms one of the same name again. The ranks leave the old group but
    keep the waiting update's tensors, and the new group's updates are not taken for it: once the
    request finishes under A the update loads on both ranks (B answers), and the new group still
    carries the next update."""
    a, b = ckpts
    new = checkpoint_tensors(b)
    with ThreadServer(a, admin_api_keys=[ADMIN], weight_update_policy="drain", tensor_parallel_size=2, num_threads=1,
                      dist_startup_timeout_s=STARTUP_S) as srv:
        group = _join_as_trainer(srv, processes=2)
        box, worker, first = _an_update_waiting_for_a_request(srv, group, new, max_tokens=40)
        assert _post(srv, "/destroy_weights_update_group", {"group_name": "g"}, key=ADMIN).json() == {"success": True}
        again = _join_as_trainer(srv, processes=2)
        second = _broadcast_update(srv, again, new, new)
        assert second.status_code == 409 and "waiting" in second.json()["error"]["message"], second.text
        srv.delay[0] = 0.0
        worker.join(90)
        first.join(90)
        assert box["first"].status_code == 200 and box["first"].json()["weights_version"] == 1, box["first"].text
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(b).token_ids
        assert _broadcast_update(srv, again, new, new).json()["weights_version"] == 2
        assert srv.state.weight_groups.loading == set()


def test_a_trainer_that_stops_broadcasting_closes_the_group_and_leaves_the_weights(ckpts, monkeypatch):
    """The trainer announces two tensors and broadcasts one: the receive fails at the group's timeout
    with a 503 naming the tensor, the group is closed, and the engine still serves its old weights."""
    from sparsekv import weight_sync
    monkeypatch.setattr(weight_sync, "TIMEOUT_S", 2.0)
    a, b = ckpts
    new = checkpoint_tensors(b)
    with ThreadServer(a, admin_api_keys=[ADMIN]) as srv:
        group = _join_as_trainer(srv)
        r = _broadcast_update(srv, group, new[:2], new[:1])
        assert r.status_code == 503 and new[1][0] in r.json()["error"]["message"], r.text
        assert "closed" in r.json()["error"]["message"]
        assert srv.state.weight_groups.groups == {}
        assert _complete(srv)["sparsekv"]["choices"][0]["token_ids"] == _engine_tokens(a).token_ids
        assert scrape(srv.url)["sparsekv:weights_version"] == 0


def test_a_trainer_that_never_comes_is_a_503_and_frees_the_groups_name(server, monkeypatch):
    """No trainer's store at the address: the join gives up at its rendezvous timeout with a 503 naming
    the address, and the group's name is free again."""
    from sparsekv import weight_sync
    monkeypatch.setattr(weight_sync, "JOIN_TIMEOUT_S", 1.0)
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    r = _post(server, "/init_weights_update_group", body, key=ADMIN)
    assert r.status_code == 503 and f"127.0.0.1:{body['master_port']}" in r.json()["error"]["message"], r.text
    assert server.state.weight_groups.groups == {}


@pytest.mark.parametrize("body, param", [
    ({"master_port": 70000}, "master_port"), ({"rank_offset": 0}, "rank_offset"), ({"rank_offset": 2}, "rank_offset"),
    ({"backend": "mpi"}, "backend")])
def test_a_bad_group_is_refused_before_any_connection(server, body, param):
    base = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    r = _post(server, "/init_weights_update_group", {**base, **body}, key=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_weight_sync_carries_float8_over_gloo_as_bytes():
    """gloo has no float8 type: the trainer's and the engine's sides both move an FP8 weight (and a
    bf16 one) as its bytes, and the engine gets the same bits in the announced dtype."""
    from sparsekv.weight_sync import broadcast_weights, join_group, receive_weights, trainer_group
    port, box = free_port(), {}
    fp8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
    bf16 = torch.randn(3, 5).bfloat16()

    def engine():
        group = join_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        box["got"] = receive_weights(group, ["w", "b"], [fp8.dtype, bf16.dtype], [fp8.shape, bf16.shape], "gloo",
                                     torch.device("cpu"))
    thread = threading.Thread(target=engine)
    thread.start()
    broadcast_weights(trainer_group("127.0.0.1", port, 2, timeout_s=30), [("w", fp8), ("b", bf16)])
    thread.join(30)
    (w, got_fp8), (b, got_bf16) = box["got"]
    assert (w, b) == ("w", "b") and got_fp8.dtype == torch.float8_e4m3fn and got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_fp8.view(torch.uint8), fp8.view(torch.uint8)) and torch.equal(got_bf16, bf16)


def test_a_worker_rank_asked_for_its_outcome_waits_for_its_own_receive(monkeypatch):
    """Each rank receives the broadcasts itself, so rank 0's receive can end before a worker rank's:
    asked then for the update's outcome, the worker waits for its own receive (up to the timeout given)
    rather than fail an update it is about to hold."""
    from sparsekv import weight_sync
    release, weights = threading.Event(), [("w", torch.ones(2))]

    def receive_weights(group, names, dtypes, shapes, backend, device):
        assert release.wait(30)
        return weights
    monkeypatch.setattr(weight_sync, "join_group", lambda *args: object())
    monkeypatch.setattr(weight_sync, "receive_weights", receive_weights)
    worker = weight_sync.WorkerGroups()
    worker.join("g", "127.0.0.1", 29500, 2, 3, "gloo")
    worker.receive("g", 1, ["w"], ["float32"], [[2]], torch.device("cpu"))
    threading.Timer(0.2, release.set).start()  # the receive is still running when the outcome is asked
    assert worker.outcome("g", 1, timeout_s=30) is None
    assert worker.take("g", 1) is weights


def _refused_body(model, body: dict, param: str) -> str:
    from sparsekv.server.errors import APIError
    from sparsekv.server.protocol import parse_body
    with pytest.raises(APIError) as e:
        parse_body(json.dumps(body).encode(), model)
    assert e.value.status == 400 and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    return e.value.message


def test_a_groups_master_port_is_a_tcp_port_edges_included():
    """1 and 65535 are ports a trainer's store can listen on; 0 and 65536 are not, and are a 400 naming
    master_port before any connection is tried."""
    from sparsekv.server.protocol import parse_body
    from sparsekv.server.weight_groups import InitWeightsUpdateGroup
    base = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}
    for port in (1, 65535):
        assert parse_body(json.dumps({**base, "master_port": port}).encode(), InitWeightsUpdateGroup).master_port == port
    for port in (0, 65536):
        _refused_body(InitWeightsUpdateGroup, {**base, "master_port": port}, "master_port")


@pytest.mark.parametrize("announce", [
    {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2], [3]]},
    {"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[2]]},
    {"names": ["a", "b"], "dtypes": ["float32", "float32"], "shapes": [[2]]},
])
def test_an_update_announces_one_dtype_and_one_shape_per_name(announce):
    """The announcement says how many broadcasts the trainer makes and what each holds: names, dtypes
    and shapes of unequal lengths would receive a different number of tensors than the trainer sends,
    leaving the group's broadcasts out of step, so they are a 400 before anything is received."""
    from sparsekv.server.weight_groups import UpdateWeightsFromDistributed
    message = _refused_body(UpdateWeightsFromDistributed, announce, "names")
    assert "one of each per tensor" in message


def test_dropping_a_group_closes_it_and_closing_drops_every_group(monkeypatch):
    """A group dropped (destroyed, failed, or at shutdown) is closed: an NCCL communicator holds device
    buffers and a proxy thread until it is aborted. A name still joining has nothing to close yet."""
    from sparsekv.server import weight_groups
    closed = []
    monkeypatch.setattr(weight_groups, "close_group", lambda group, backend: closed.append((group, backend)))
    groups = weight_groups.WeightGroups()
    one, two = object(), object()
    groups.groups.update({"one": weight_groups.SyncGroup(one, "nccl"), "joining": None,
                          "two": weight_groups.SyncGroup(two, "gloo")})
    groups.drop("one")
    assert closed == [(one, "nccl")] and list(groups.groups) == ["joining", "two"]
    groups.close()
    assert closed == [(one, "nccl"), (two, "gloo")] and groups.groups == {}


def test_a_join_that_ends_after_the_shutdown_is_closed_at_once(server, monkeypatch):
    """The server shut down (its groups closed) while a join waited for the trainer: the group the join
    then makes is closed at once and the call answers 503, rather than a group nobody will close."""
    from sparsekv.server import weight_groups
    closed, joining, release = [], threading.Event(), threading.Event()
    made = object()

    def join_group(*args, **kwargs):
        joining.set()
        release.wait(30)
        return made
    monkeypatch.setattr(weight_groups, "join_group", join_group)
    monkeypatch.setattr(weight_groups, "close_group", lambda group, backend: closed.append(group))
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": "late"}
    thread, box = threading.Thread(target=lambda: box.append(
        _post(server, "/init_weights_update_group", body, key=ADMIN))), []
    thread.start()
    assert joining.wait(30)
    groups = server.state.weight_groups
    groups.close()
    release.set()
    thread.join(30)
    groups.closed = False  # the module's server serves the next tests
    assert box[0].status_code == 503 and "shutting down" in box[0].json()["error"]["message"], box[0].text
    assert closed == [made] and "late" not in groups.groups


def test_a_group_with_an_update_in_flight_is_not_destroyed(server, monkeypatch):
    """Destroying a group while an update receives over it would close the group under the broadcasts:
    it is a 409 and the group stays, unclosed, until the update is done."""
    import asyncio

    from sparsekv.server import weight_groups
    closed = []
    monkeypatch.setattr(weight_groups, "close_group", lambda group, backend: closed.append(group))
    sync = weight_groups.SyncGroup(object(), "gloo")
    asyncio.run(sync.busy.acquire())  # uncontended: the lock is taken without binding it to this loop
    server.state.weight_groups.groups["busy"] = sync
    try:
        r = _post(server, "/destroy_weights_update_group", {"group_name": "busy"}, key=ADMIN)
        assert r.status_code == 409 and "in flight" in r.json()["error"]["message"], r.text
        assert server.state.weight_groups.groups.get("busy") is sync and closed == []
    finally:
        server.state.weight_groups.groups.pop("busy", None)


def test_an_announced_tensor_that_cannot_be_allocated_closes_the_group_with_a_503(server):
    """A tensor that cannot be allocated (2**62 float32 elements: its byte size overflows, whatever the
    host's memory) fails before its broadcast is received: the engine has then left the group's
    broadcasts out of step with the trainer's, so the group is closed and the answer is the 503 naming
    the tensor that a failed broadcast gets, not a 500 that keeps the broken group."""
    from sparsekv.server import weight_groups
    server.state.weight_groups.groups["huge"] = weight_groups.SyncGroup(object(), "gloo")
    try:
        r = _post(server, "/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"],
                                                               "shapes": [[1 << 62]], "group_name": "huge"},
                  key=ADMIN)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "receiving w failed" in message and "the group huge is closed" in message
        assert "huge" not in server.state.weight_groups.groups
    finally:
        server.state.weight_groups.groups.pop("huge", None)


@pytest.mark.parametrize("tp, host_copy", [(1, True), (2, True), (1, False)])
def test_bench_weight_sync_times_each_way_of_updating_the_same_weights(tmp_path, capsys, tp, host_copy):
    """`sparsekv bench weight-sync`: every update of each way loads (the engine's weights version counts
    them), the answer after each is the same, and each way gets its time; with two tensor-parallel
    processes, each of which joins the trainer's group. The host copy kept after an update: none after
    one from disk, or without the engine's host copy; rank 0's slices of every tensor otherwise."""
    from sparsekv.tools.bench import main
    out = tmp_path / "sync.json"
    copy = [] if host_copy else ["--no-weight-update-host-copy"]
    assert main(["weight-sync", "--repeats", "1", "--tensor-parallel-size", str(tp), "--json", str(out), *copy]) == 0
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"save + disk", "disk", "broadcast", "in process"}
    assert all(s > 0 for s in result["seconds"].values())
    kept = result["kept_mb"]
    assert kept["disk"] == kept["save + disk"] == 0
    if host_copy:  # a whole model's tensors, sliced across the ranks
        assert kept["broadcast"] == kept["in process"] > result["bytes"] / 1e6 / tp / 4
    else:
        assert kept["broadcast"] == kept["in process"] == 0
    assert result["updates_loaded"] == 4 and result["identical"] and result["bytes"] > 0
    assert "greedy answer after every update identical: True" in capsys.readouterr().out
