"""Faults between a prefill and a decode worker: a worker killed mid-transfer or mid-prompt, a
corrupted layer, a wrong secret, a peer that never comes, KV of other weights. Each time the request ends with an error
(503 in the OpenAI envelope), the surviving worker keeps nothing of it (no room, no request, no
imported page, its pools' integrity holds, its bootstrap store holds no key of the room) and serves
the next request; no wait outlives --disaggregation-timeout (the HTTP clients' own timeouts would
fail the test)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import httpx
import pytest
import torch

from sparsekv import LLM, InvalidRequest, SamplingParams
from disagg_util import SECRET, WorkerServer, field, secret_file, send_pair, start_worker_process
from sparsekv.disagg.transfer import CORRUPT_ENV, DELAY_ENV
from test_server_util import scrape, wait_healthy, wait_until

BASE = dict(kv_page_size=4, max_model_len=128, num_threads=1)
BODY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
TIMEOUT_S = 8.0


def _prompt(seed: int = 3) -> list[int]:
    return torch.randint(1, 256, (41,), generator=torch.Generator().manual_seed(seed)).tolist()


def _failed(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    return message


def _clean(w: WorkerServer) -> None:
    w.check_clean()
    if hasattr(w.worker, "store"):
        assert w.worker.store.num_keys() == 0


def _nothing_kept(d: WorkerServer, prompt: list[int]) -> None:
    """No page of the prompt in any tier of the decode worker (those kept as their batches came are
    forgotten again when the room fails)."""
    assert d.engine.kv.held_prefix(prompt) == 0 and d.engine.stats()["prefix_host_pages"] == 0


def test_a_corrupted_layer_fails_the_request_on_both_sides(glm_ckpt, monkeypatch):
    with WorkerServer(glm_ckpt[0], "prefill", **BASE) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        monkeypatch.setenv(CORRUPT_ENV, "1")
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        _failed(rd, "tensor 1", "digest")
        _failed(rp, "refused the KV", "tensor 1")
        _nothing_kept(d, _prompt())
        for w in (p, d):
            assert scrape(w.url)["sparsekv:disagg_transfers_failed_total"] == 1
            _clean(w)
        monkeypatch.delenv(CORRUPT_ENV)
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert (rp.status_code, rd.status_code) == (200, 200)
        assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == 10


def test_a_wrong_secret_is_refused_before_any_kv_moves(glm_ckpt):
    with WorkerServer(glm_ckpt[0], "prefill", **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", secret=b"another-secret-of-enough-bytes", **BASE) as d:
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        _failed(rp, "claim failed authentication")
        _failed(rd, "failed authentication")
        _nothing_kept(d, _prompt())
        assert p.worker.metrics.bytes._value.get() == 0
        _clean(p)
        _clean(d)


def _refused(p: WorkerServer, d: WorkerServer, *words: str) -> None:
    """A request through the pair fails on both sides naming `words`; nothing of it is kept."""
    rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
    _failed(rd, "decode worker", *words)
    assert "refused the KV" not in _failed(rp, "prefill worker", *words)  # at the claim: nothing was sent
    _nothing_kept(d, _prompt())
    _clean(p)
    _clean(d)


def test_kv_of_other_weights_is_refused(glm_ckpt):
    """An RL trainer updates one worker's weights before the other's: until both hold the same
    weights_version, the decode worker takes no KV from the prefill worker."""
    with WorkerServer(glm_ckpt[0], "prefill", **BASE) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        assert d.update_weights_from_disk(glm_ckpt[0]) == 1  # the same checkpoint, loaded again: version 1
        _refused(p, d, "weights_version 0", "weights_version 1")
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 1
        assert p.update_weights_from_disk(glm_ckpt[0]) == 1
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert (rp.status_code, rd.status_code) == (200, 200), rd.text
        assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == 10
        _clean(p)
        _clean(d)


def test_kv_of_another_checkpoint_is_refused(glm_ckpt, tmp_path):
    """Both workers at weights_version 0, started from checkpoints with other weights."""
    from sparsekv.tools.tiny import save_reference_checkpoint
    other = str(tmp_path / "other")
    save_reference_checkpoint(other, "glm_moe_dsa", seed=1)
    with WorkerServer(glm_ckpt[0], "prefill", **BASE) as p, WorkerServer(other, "decode", **BASE) as d:
        _refused(p, d, "checkpoint", "weights_version 0")
        assert d.update_weights_from_disk(glm_ckpt[0]) == 1 and p.update_weights_from_disk(glm_ckpt[0]) == 1
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert (rp.status_code, rd.status_code) == (200, 200), rd.text


def test_a_decode_worker_with_pages_of_another_layout_is_refused_naming_the_flag():
    """Drafting on one side only (the bundled model has an MTP layer): the decode worker's pages hold
    the MTP layer's rows too. Refused at the claim, naming the flags to make the same (it failed at
    import, naming row shapes)."""
    from sparsekv.paths import default_model_path
    with WorkerServer(default_model_path(), "prefill", **BASE) as p, \
            WorkerServer(default_model_path(), "decode", num_speculative_tokens=1, **BASE) as d:
        _refused(p, d, "KV pages differ", "--num-speculative-tokens")
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 1


def test_a_bootstrap_address_that_answers_something_else_says_nothing_of_it(glm_ckpt):
    """The request names the address the decode worker connects to: the 503 says it could not reach a
    bootstrap there, never what answered (that would make the worker a probe of its network)."""
    from disagg_util import http_answering_listener
    listener = http_answering_listener()
    try:
        with WorkerServer(glm_ckpt[0], "decode", timeout_s=2.0, **BASE) as d:
            tag = {"room": "probe", "bootstrap_host": "127.0.0.1", "bootstrap_port": listener.getsockname()[1]}
            r = httpx.post(d.url + "/v1/completions", json={**BODY, "prompt": _prompt(), "disaggregation": tag},
                           timeout=60)
            message = _failed(r, "cannot reach the prefill worker's bootstrap")
            assert "Ping" not in message and "Got" not in message and "HTTP" not in message, message
            _clean(d)
    finally:
        listener.close()


def test_a_peer_that_never_comes_fails_within_the_timeout(glm_ckpt):
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=1.0, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=1.0, **BASE) as d:
        info = httpx.get(p.url + "/disaggregation", timeout=5).json()
        r = httpx.post(p.url + "/v1/completions", json={**BODY, "prompt": _prompt(), "disaggregation": field(info)},
                       timeout=30)
        _failed(r, "no claim from a decode worker within 1 s")
        lone = {**field(info), "bootstrap_port": info["bootstrap_port"]}
        r = httpx.post(d.url + "/v1/completions", json={**BODY, "prompt": _prompt(), "disaggregation": lone},
                       timeout=30)
        _failed(r, "no KV from the prefill worker within 1 s")
        p.worker.store.set("probe", b"")  # the decode worker's claim is gone: only this key is left
        # NOTE: the marker that woke the decode worker's wait for the first batch is deleted by that wait,
        # on a thread of its own, which may end after the answer
        assert wait_until(lambda: p.worker.store.num_keys() == 1, 5)
        p.worker.store.delete_key("probe")
        _clean(p)
        _clean(d)


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_the_decode_worker_killed_mid_transfer(glm_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.5")  # each tensor waits: the transfer is under way long enough
    proc, decode_url = start_worker_process(glm_ckpt[0], "decode", secret_file(tmp_path), 0,
                                            "--disaggregation-timeout", str(TIMEOUT_S))
    try:
        wait_healthy(decode_url, proc)
        with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE) as p, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(send_pair, p.url, decode_url, {**BODY, "prompt": _prompt()}, timeout=3 * TIMEOUT_S)
            assert wait_until(lambda: "send" in p.worker.rooms.values(), 30)
            time.sleep(0.7)  # inside the tensors' sends
            _kill(proc)
            rp, rd = sent.result()
            _failed(rp, "prefill worker")
            assert isinstance(rd, httpx.HTTPError)  # the decode worker died without answering
            _clean(p)
            assert scrape(p.url)["sparsekv:disagg_transfers_in_flight"] == 0
            monkeypatch.delenv(DELAY_ENV)
            r = httpx.post(p.url + "/v1/completions", json={**BODY, "prompt": _prompt()}, timeout=10)
            assert r.status_code == 400  # still serving: a request without its room is refused as always
    finally:
        if proc.poll() is None:
            _kill(proc)


def test_the_prefill_worker_killed_mid_prompt(glm_ckpt, tmp_path):
    proc, prefill_url = start_worker_process(glm_ckpt[0], "prefill", secret_file(tmp_path), 0,
                                             "--disaggregation-timeout", str(TIMEOUT_S),
                                             env={"SPARSEKV_INJECT_STEP_DELAY": "2"})
    try:
        wait_healthy(prefill_url, proc)
        with WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(send_pair, prefill_url, d.url, {**BODY, "prompt": _prompt()}, timeout=3 * TIMEOUT_S)
            assert wait_until(lambda: "claim" in d.worker.rooms.values(), 30)
            _kill(proc)
            rp, rd = sent.result()
            assert isinstance(rp, httpx.HTTPError)
            _failed(rd, "decode worker")
            _nothing_kept(d, _prompt())
            _clean(d)
    finally:
        if proc.poll() is None:
            _kill(proc)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_serve_refuses_a_role_without_a_private_secret(glm_ckpt, tmp_path, mode):
    import subprocess
    import sys
    from test_server_util import REPO
    base = [sys.executable, "-m", "sparsekv", "serve", glm_ckpt[0], "--disaggregation-mode", mode]
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs --disaggregation-secret-file" in out.stderr
    loose = secret_file(tmp_path, SECRET)
    os.chmod(loose, 0o644)
    out = subprocess.run(base + ["--disaggregation-secret-file", loose], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "chmod 600" in out.stderr


def test_a_client_that_goes_away_frees_the_room_before_the_timeout(glm_ckpt):
    """The router cancels one side when the other failed: the waiting worker lets the room go then,
    not at its (long) timeout, and deletes its claim from the prefill worker's store."""
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=300, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=300, **BASE) as d:
        info = httpx.get(p.url + "/disaggregation", timeout=5).json()
        body = {**BODY, "prompt": _prompt(), "disaggregation": field(info)}
        with pytest.raises(httpx.TimeoutException):  # the prefill worker never gets its half
            httpx.post(d.url + "/v1/completions", json=body, timeout=1.0)
        assert wait_until(lambda: d.worker.rooms == {}, 20)
        assert wait_until(lambda: p.worker.store.num_keys() == 0, 5)
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 1
        _clean(d)


def test_a_room_the_prefill_worker_left_first_leaves_no_key_once_the_decode_worker_fails_it(glm_ckpt, monkeypatch):
    """The prefill's client goes away while the prefill worker waits for the decode worker to join the
    transfer: it deletes the room's keys and leaves. The decode worker joins later, fails the room and
    writes its verdict (and its side of the pair group's rendezvous) into the store: nobody would read
    or delete those keys, which stayed in the prefill worker's store for good, two per such room."""
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=3.0, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=3.0, **BASE) as d:
        real = d.worker.connected

        async def late(*args, **kwargs):  # the decode worker joins after the prefill's client left
            await asyncio.sleep(1.5)
            return await real(*args, **kwargs)
        monkeypatch.setattr(d.worker, "connected", late)
        info = httpx.get(p.url + "/disaggregation", timeout=5).json()
        for seed in range(2):
            body = {**BODY, "prompt": _prompt(seed), "disaggregation": field(info)}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                decode = pool.submit(httpx.post, d.url + "/v1/completions", json=body, timeout=30)
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(p.url + "/v1/completions", json=body, timeout=0.8)
                _failed(decode.result(), "decode worker")
        assert wait_until(lambda: p.worker.rooms == {} and d.worker.rooms == {}, 10)
        assert wait_until(lambda: p.worker.store.num_keys() == 0, 10), p.worker.store.num_keys()
        _clean(p)
        _clean(d)


def _hold_steps_after_the_first(engine, monkeypatch, hold_s: float = 30.0) -> tuple[list, float]:
    """After its first step, each step of `engine` returns no output (the engine loop's commands run
    meanwhile) until `hold_s` passed or the prefill was aborted. Returns (the steps run, the hold's end)."""
    steps, real, hold_until = [], engine.step, time.monotonic() + hold_s

    def held():
        if steps and time.monotonic() < hold_until:
            time.sleep(0.002)
            return []
        steps.append(1)
        return real()
    monkeypatch.setattr(engine, "step", held)
    return steps, hold_until


def test_a_corrupted_batch_mid_prompt_ends_the_prefill_too(glm_ckpt, monkeypatch):
    """The first batch of a prompt still being computed (chunks of 8 tokens) is corrupted: the decode
    worker refuses it, and the prefill worker, seeing the refusal at its next look, stops sending and
    aborts the prefill; both answer 503 and keep nothing. The steps after the first wait for that (30 s
    at most: a step held returns no output, the engine loop's commands run meanwhile), so the prefill
    cannot end first however long the refusal takes to come back; one that is never aborted runs its
    six chunks once the wait ran out."""
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(glm_ckpt[0], "prefill", **BASE, **chunked) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        monkeypatch.setenv(CORRUPT_ENV, "0")
        steps, hold_until = _hold_steps_after_the_first(p.engine, monkeypatch)  # the first chunk's rows leave alone
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        _failed(rd, "tensor 0", "digest")
        _failed(rp, "refused the KV", "tensor 0")
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 1
        assert len(steps) < 6 and time.monotonic() < hold_until  # aborted before the prompt's sixth chunk
        _nothing_kept(d, _prompt())
        _clean(p)
        _clean(d)


def test_a_failed_transfer_aborts_the_prefill_before_the_prefill_worker_answers(glm_ckpt, monkeypatch):
    """The prefill worker aborts a prefill whose transfer failed before it answers its 503 (`_cancel`):
    when the answer arrives, its engine holds no request of the room (not one ended later, once the
    server sees its client gone)."""
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(glm_ckpt[0], "prefill", **BASE, **chunked) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        monkeypatch.setenv(CORRUPT_ENV, "0")
        _hold_steps_after_the_first(p.engine, monkeypatch)
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert not p.engine.has_unfinished_requests()
        _failed(rp, "refused the KV", "tensor 0")
        _failed(rd, "tensor 0", "digest")
        _clean(p)
        _clean(d)


def test_an_abort_mid_prompt_ends_the_request_on_both_sides_and_stops_the_prefill(glm_ckpt, monkeypatch):
    """/abort_request sent to both workers (as the router sends it) while the prompt is computed (chunks of
    8 tokens, the steps after the first held): the decode worker, which holds the request in its transfer,
    ends it (`aborted` 1) and answers finish_reason "abort" with no token; its verdict stops the prefill
    worker's prefill (its engine request aborted before the prompt's sixth chunk), which answers as an
    aborted request too and counts it no second time (`aborted` 0). Neither keeps anything of the room
    or counts a failed transfer."""
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(glm_ckpt[0], "prefill", **BASE, **chunked) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        steps, hold_until = _hold_steps_after_the_first(p.engine, monkeypatch)  # the first chunk's rows leave alone
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(send_pair, p.url, d.url, {**BODY, "prompt": _prompt()}, room="aborted-mid-prompt")
            assert wait_until(lambda: d.worker.rooms.get("aborted-mid-prompt") == "receive", 30), d.worker.rooms
            aborted = [httpx.post(w.url + "/abort_request", json={"abort_all": True}, timeout=30).json()["aborted"]
                       for w in (d, p)]
            rp, rd = sent.result(timeout=60)
        assert aborted == [1, 0]
        for r in (rp, rd):
            assert r.status_code == 200, r.text
            assert [(c["finish_reason"], c["text"]) for c in r.json()["choices"]] == [("abort", "")], r.text
        assert len(steps) < 6 and time.monotonic() < hold_until  # aborted before the prompt's sixth chunk
        for w in (p, d):
            assert scrape(w.url)["sparsekv:disagg_transfers_failed_total"] == 0
        _nothing_kept(d, _prompt())
        _clean(p)
        _clean(d)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, 6, 99999]}, "prompt"),  # both workers check the prompt's tokens and length first
    ({"prompt": [5, 6] * 60, "max_tokens": 9}, "max_tokens"),  # with the client's max_tokens, not the prefill's 1
    ({"prompt": [5, 6], "logit_bias": {"300": 1.0}}, "logit_bias"),  # the prefill engine refuses it: the decode worker is told
], ids=["token-outside-the-vocabulary", "too-long-with-max-tokens", "logit-bias-outside-the-vocabulary"])
def test_a_request_the_prefill_worker_refuses_is_the_same_400_on_both_sides(glm_ckpt, body, param):
    """Bad input is a 400 on both workers, with the message and param one server gives, never a failed
    transfer's 503 (the router passes on whichever answers first); no transfer counts as failed."""
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d:
        rp, rd = send_pair(p.url, d.url, {**BODY, **body})
        assert rp.status_code == rd.status_code == 400, (rp.text, rd.text)
        one = LLM(glm_ckpt[0], **BASE)
        params = SamplingParams(max_tokens=body.get("max_tokens", BODY["max_tokens"]),
                                logit_bias={int(t): v for t, v in body.get("logit_bias", {}).items()} or None)
        with pytest.raises(InvalidRequest) as refused:
            one.engine.add_request("r", body["prompt"], params)
        assert rd.json()["error"] == rp.json()["error"]
        assert rd.json()["error"]["message"] == str(refused.value) and rd.json()["error"]["param"] == param
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 0
        _clean(p)
        _clean(d)


def test_a_prefill_that_fails_mid_prompt_fails_the_decode_side_at_once(glm_ckpt, monkeypatch):
    """The prefill engine fails at its third chunk after two batches went: the prefill worker writes
    the failure as the next batch, the decode worker answers 503 at once (not at its timeout) and
    cleans the room's keys up; nothing of it is kept."""
    from test_disagg_workers import _StepGate
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE, **chunked) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d:
        # each chunk's step waits until the decode worker kept the pages of the chunks before it (not a
        # sleep: a loaded machine can be slower than any), so two chunks' pages came before the third fails
        gate = _StepGate(p.engine, d.engine, monkeypatch, steps=3)
        gated = p.engine.step

        def failing():
            if gate.steps == 2 and (gate.kept >= 2 * gate.per or gate.gave_up):
                raise RuntimeError("an injected engine failure")
            return gated()
        monkeypatch.setattr(p.engine, "step", failing)
        forgotten, forget = [], d.engine.kv.forget_prefix
        monkeypatch.setattr(d.engine.kv, "forget_prefix", lambda names: forgotten.extend(names) or forget(names))
        started = time.monotonic()
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert time.monotonic() - started < TIMEOUT_S
        assert rp.status_code >= 500
        _failed(rd, "prefill worker failed")
        assert len(forgotten) >= 2  # the pages of the batches that came, kept as they came, then forgotten
        _nothing_kept(d, _prompt())
        _clean(d)
        assert p.worker.rooms == {} and p.worker.store.num_keys() == 0


def test_a_prefill_its_client_left_deletes_the_rooms_keys_when_no_decode_worker_will(glm_ckpt, monkeypatch):
    """The prefill's client goes away mid-prompt (the router cancels it) and no decode worker holds the
    room (it left already, or never came): the error the prefill worker writes for a decode worker
    nobody will read, so it deletes the room's keys itself (they stayed in its store for good)."""
    chunked = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE, **chunked) as p:
        real = p.engine.step

        def slow():
            time.sleep(0.2)
            return real()
        monkeypatch.setattr(p.engine, "step", slow)
        info = httpx.get(p.url + "/disaggregation", timeout=5).json()
        with pytest.raises(httpx.TimeoutException):  # the client leaves during the prompt's six chunks
            httpx.post(p.url + "/v1/completions", json={**BODY, "prompt": _prompt(), "disaggregation": field(info)},
                       timeout=0.5)
        assert wait_until(lambda: p.worker.rooms == {}, TIMEOUT_S)
        assert wait_until(lambda: p.worker.store.num_keys() == 0, 5), p.worker.store.num_keys()
        p.check_clean()


@pytest.mark.parametrize("cause", ["refusal", "engine failure"])
def test_a_prefill_that_ends_before_the_claim_answers_the_decode_worker_that_claims_after_it(
        glm_ckpt, monkeypatch, cause):
    """The prefill ends without KV while the prefill worker waits for the claim (its engine refused the
    request, or failed), and the decode worker claims the room only after it: the decode worker still
    answers as the prefill did, a refusal with the same 400 (docs/disaggregation.md) and a failure with
    a 503 at once, not a 503 at its timeout. Only the decode worker's transfer of a failed prefill counts
    as failed (no KV came; a refusal is the request's own fault)."""
    import threading
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, send="chunks", **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d:
        ended, claim = threading.Event(), d.worker._claim
        name, real = ("add_request", p.engine.add_request) if cause == "refusal" else ("step", p.engine.step)

        def ends_once_waiting(*args, **kwargs):  # the refusal or failure, once the worker waits for the claim
            wait_until(lambda: any(t.name == "sparsekv-disagg-wait" for t in threading.enumerate()), 30)
            try:
                if cause == "engine failure" and not ended.is_set():
                    raise RuntimeError("an injected engine failure")
                return real(*args, **kwargs)
            finally:
                ended.set()

        async def claim_after_the_end(*args):
            await asyncio.to_thread(ended.wait, 30)
            return await claim(*args)
        monkeypatch.setattr(p.engine, name, ends_once_waiting)
        monkeypatch.setattr(d.worker, "_claim", claim_after_the_end)
        refused = {"logit_bias": {"300": 1.0}} if cause == "refusal" else {}  # a token past the vocabulary
        started = time.monotonic()
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": [5, 6], **refused}, timeout=3 * TIMEOUT_S)
        if cause == "refusal":
            assert rp.status_code == rd.status_code == 400, (rp.text, rd.text)
            assert rd.json()["error"] == rp.json()["error"] and rp.json()["error"]["param"] == "logit_bias"
        else:
            assert time.monotonic() - started < TIMEOUT_S
            assert rp.status_code >= 500
            assert "injected engine failure" in _failed(rd, "prefill worker failed")
        assert scrape(p.url)["sparsekv:disagg_transfers_failed_total"] == 0
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == (cause == "engine failure")  # no KV came
        _clean(d)
        if cause == "refusal":
            _clean(p)
        else:  # a failed engine stops generating (the server's loop): its requests stay, the room does not
            assert p.worker.rooms == {} and p.worker.store.num_keys() == 0


def test_a_room_naming_a_dead_bootstrap_ends_when_its_client_leaves(glm_ckpt):
    """The decode worker's connect to a prefill worker's bootstrap that nobody answers (its worker
    died) retries for up to twice the timeout: it ends with the client instead, and holds no transfer
    thread meanwhile."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nobody listens there once closed
    with WorkerServer(glm_ckpt[0], "decode", timeout_s=20.0, **BASE) as d:
        room = {"room": "dead-bootstrap", "bootstrap_host": "127.0.0.1", "bootstrap_port": dead}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(d.url + "/v1/completions", json={**BODY, "prompt": _prompt(), "disaggregation": room}, timeout=1.0)
        assert wait_until(lambda: d.worker.rooms == {}, 10)  # not the minutes of the connect's retries
        assert d.worker.pool._work_queue.qsize() == 0
        d.check_clean()


def test_a_room_whose_peer_never_joins_the_transfer_holds_no_transfer_thread(glm_ckpt, monkeypatch):
    """With one transfer thread per worker, room A's decode side hangs as it joins the pair group (a
    worker that hung), so A's prefill side waits for its peer there; room B, sent meanwhile, is served at
    once: the joins wait on threads of their own (they held the transfer threads, and every other room
    queued behind them until A's timeout)."""
    import threading
    from sparsekv.disagg import transfer as transfer_module
    from sparsekv.disagg import worker as worker_module
    monkeypatch.setattr(worker_module, "MAX_TRANSFER_THREADS", 1)
    entered, release, real = threading.Event(), threading.Event(), transfer_module._gloo_group

    def hangs_once(store, rank, hostname, timeout_s):
        if rank == transfer_module.DECODE_RANK and not entered.is_set():
            entered.set()
            release.wait(60)
            raise RuntimeError("the hung join was let go")
        return real(store, rank, hostname, timeout_s)
    monkeypatch.setattr(transfer_module, "_gloo_group", hangs_once)
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            a = pool.submit(send_pair, p.url, d.url, {**BODY, "prompt": _prompt(1)})
            assert entered.wait(TIMEOUT_S)
            rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt(2)})
            assert (rp.status_code, rd.status_code) == (200, 200) and not a.done()
        finally:
            release.set()
        for r in a.result(timeout=3 * TIMEOUT_S):
            _failed(r)
        assert wait_until(lambda: p.worker.rooms == {} == d.worker.rooms, TIMEOUT_S)
        _clean(p)
        _clean(d)



def test_a_batch_whose_metadata_the_decode_worker_refuses_fails_that_request_only(glm_ckpt, monkeypatch):
    """One room's first batch of metadata reaches the decode worker naming a transfer backend it does not
    know (`DecodeWorker._check_meta`) while another room's transfer runs beside it: the decode worker
    answers 503 at once, naming why, and so does the prefill worker (from the decode worker's verdict,
    read while it waits for the peer's connection, which will never come); nothing of the room is kept, the other request is
    answered as always, and the pair serves the next. The prefill side's wait for that connection ends
    with the room: no thread of it is left (a gloo connect left waiting held a thread and its
    connections until gloo gave up, about five times the timeout, per refused room)."""
    import threading
    from sparsekv.disagg import decode as decode_module
    real, bad = decode_module.verify, "bad-room"

    def corrupting(secret, raw, what):
        meta = real(secret, raw, what)
        if what == "prefill worker's metadata" and meta.get("room") == bad and "error" not in meta:
            meta["backend"] = "tcp"
        return meta
    monkeypatch.setattr(decode_module, "verify", corrupting)

    def post(url: str, body: dict) -> tuple[httpx.Response, float]:
        r = httpx.post(url + "/v1/completions", json=body, timeout=3 * TIMEOUT_S)
        return r, time.monotonic()
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=TIMEOUT_S, **BASE) as p, \
            WorkerServer(glm_ckpt[0], "decode", timeout_s=TIMEOUT_S, **BASE) as d, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        tag = field(httpx.get(p.url + "/disaggregation", timeout=5).json(), bad)
        body = {**BODY, "prompt": _prompt(), "disaggregation": tag}
        started = time.monotonic()
        refused_p, refused_d = pool.submit(post, p.url, {**body, "stream": False}), pool.submit(post, d.url, body)
        served = pool.submit(send_pair, p.url, d.url, {**BODY, "prompt": _prompt(4)})
        (rd, answered), (rp, prefill_answered) = refused_d.result(), refused_p.result()
        _failed(rd, "decode worker", "unknown transfer backend 'tcp'")
        assert answered - started < TIMEOUT_S / 2  # not at the timeout: at the first batch
        assert prefill_answered - started < TIMEOUT_S / 2
        _failed(rp, "prefill worker", "refused the KV", "unknown transfer backend 'tcp'")
        assert [r.status_code for r in served.result()] == [200, 200]
        assert wait_until(lambda: not [t for t in threading.enumerate() if t.name in (
            "sparsekv-pair-connect", "sparsekv-disagg-wait")], TIMEOUT_S / 2)
        _nothing_kept(d, _prompt())
        assert scrape(d.url)["sparsekv:disagg_transfers_failed_total"] == 1
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": _prompt()})
        assert (rp.status_code, rd.status_code) == (200, 200), rd.text
        assert rd.json()["sparsekv"]["disaggregation"]["pages_sent"] == 10
        _clean(p)
        _clean(d)


@pytest.mark.parametrize("cause", ["refusal", "engine failure"])
def test_a_prefill_that_ends_without_kv_and_no_claim_answers_its_own_error(glm_ckpt, monkeypatch, cause):
    """No decode worker claims the room of a prefill that ended without KV: at the timeout the prefill
    worker answers the prefill's own error (the refusal's 400 with its param, or the engine's failure),
    not a missing claim, and deletes the room's keys."""
    with WorkerServer(glm_ckpt[0], "prefill", timeout_s=1.0, **BASE) as p:
        refused = {"logit_bias": {"300": 1.0}} if cause == "refusal" else {}  # a token past the vocabulary
        if cause == "engine failure":
            monkeypatch.setattr(p.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("an injected engine failure")))
        info = httpx.get(p.url + "/disaggregation", timeout=5).json()
        r = httpx.post(p.url + "/v1/completions", json={**BODY, "prompt": [5, 6], **refused, "disaggregation": field(info)},
                       timeout=30)
        if cause == "refusal":
            assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        else:
            assert r.status_code >= 500 and "injected engine failure" in r.json()["error"]["message"], r.text
        # NOTE: the wait for the claim, woken at the timeout, deletes its wake marker on its own thread,
        # which may run after the answer (a loaded machine)
        assert p.worker.rooms == {} and wait_until(lambda: p.worker.store.num_keys() == 0, 10)
