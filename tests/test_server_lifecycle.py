"""Server lifecycle (issue 4): SIGTERM drains, the shutdown timeout aborts, an engine fault reaches every
client without a hang; plus small pure-function checks (stop-string holdback, API keys)."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
import torch

from test_server_util import (ThreadServer, scrape, scrape_samples, start_subprocess_server,
                              tiny_checkpoint, wait_healthy, wait_until)

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 150, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stream(url: str, body: dict, out: dict, first: threading.Event, headers=None) -> None:
    """Read an SSE stream into out["events"] (parsed JSON, or "[DONE]"); set `first` on the first event."""
    out["events"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=30) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    first.set()


def _post(url: str, body: dict, out: dict, headers=None) -> None:
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
    out["status"], out["body"] = r.status_code, r.json()


def test_sigterm_drains_in_flight_and_refuses_new(model):
    auth = {"Authorization": "Bearer k1"}
    proc, url = start_subprocess_server(model, "--api-key", "k1:team", "--shutdown-timeout", "30",
                                   env={"SPARSEKV_INJECT_STEP_DELAY": "0.01"})
    try:
        wait_healthy(url, proc)
        out, first = {}, threading.Event()
        t = threading.Thread(target=_stream, args=(url, BODY, out, first, auth))
        t.start()
        assert first.wait(20)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 5)
        refused = httpx.post(url + "/v1/completions", json=BODY, headers=auth)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == 503
        t.join(30)
        events = out["events"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events[:-1] if e["choices"]) == 150  # one chunk per token: nothing was cut
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_aborts_the_drain_and_a_third_exits_quietly(model):
    """Second signal: what is in flight ends now with an error to its clients (not after
    --shutdown-timeout), and the process exits 0. Third: it exits without waiting, and without a
    traceback."""
    proc, url = start_subprocess_server(model, "--shutdown-timeout", "120", env={"SPARSEKV_INJECT_STEP_DELAY": "0.05"})
    try:
        wait_healthy(url, proc)
        s_out, p_out, first = {}, {}, threading.Event()
        threads = [threading.Thread(target=_stream, args=(url, BODY, s_out, first)),
                   threading.Thread(target=_post, args=(url, BODY, p_out))]
        [t.start() for t in threads]
        assert first.wait(20)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 5)
        proc.send_signal(signal.SIGTERM)
        [t.join(30) for t in threads]
        assert proc.wait(30) == 0
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = s_out["events"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert sum(1 for e in events[:-1] if e.get("choices")) < 150  # cut short, not drained
    assert p_out["status"] == 503 and "shutting down" in p_out["body"]["error"]["message"]
    assert "a second signal: aborting" in output and "Traceback" not in output, output

    proc, url = start_subprocess_server(model, "--shutdown-timeout", "120", "--log-level", "info",
                                        env={"SPARSEKV_INJECT_STEP_DELAY": "0.05"})
    try:
        wait_healthy(url, proc)
        out, first = {}, threading.Event()
        t = threading.Thread(target=_stream, args=(url, BODY, out, first))
        t.start()
        assert first.wait(20)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        proc.wait(30)
        t.join(30)
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_shutdown_timeout_aborts_the_rest(model):
    srv = ThreadServer(model, shutdown_timeout=0.3)
    with srv:
        srv.delay[0] = 0.02
        s_out, p_out, first = {}, {}, threading.Event()
        threads = [threading.Thread(target=_stream, args=(srv.url, BODY, s_out, first)),
                   threading.Thread(target=_post, args=(srv.url, BODY, p_out))]
        [t.start() for t in threads]
        assert first.wait(10) and wait_until(lambda: srv.state.loop.num_active == 2, 5)
        srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        [t.join(20) for t in threads]
        assert wait_until(lambda: not srv.thread.is_alive(), 10)
    events = s_out["events"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert p_out["status"] == 503 and "shutting down" in p_out["body"]["error"]["message"]
    stats = srv.engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == 0
    srv.engine.check_integrity()


def test_engine_fault_reaches_every_client(tmp_path_factory):
    from sparsekv.server.loop import FAULT_ENV, install_test_hooks
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), with_tokenizer=False)
    srv = ThreadServer(model)
    with srv:
        _checks_without_tokenizer(srv.url)
        install_test_hooks(srv.engine, {FAULT_ENV: "20"})
        srv.delay[0] = 0.02
        s_out, p1, p2, first = {}, {}, {}, threading.Event()
        threads = [threading.Thread(target=_stream, args=(srv.url, BODY, s_out, first)),
                   threading.Thread(target=_post, args=(srv.url, BODY, p1)),
                   threading.Thread(target=_post, args=(srv.url, {**BODY, "n": 2}, p2))]
        t0 = time.monotonic()
        [t.start() for t in threads]
        [t.join(20) for t in threads]
        assert time.monotonic() - t0 < 15 and not any(t.is_alive() for t in threads), "a client hung"
        assert s_out["events"][-1] == "[DONE]" and s_out["events"][-2]["error"]["code"] == 500
        for out in (p1, p2):
            assert out["status"] == 500 and "injected engine fault" in out["body"]["error"]["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        assert httpx.post(srv.url + "/v1/completions", json=BODY).status_code == 503
        _assert_503(httpx.post(srv.url + "/reset_prefix_cache"))  # a dead engine's cache: retry elsewhere
        assert "sparsekv:engine_healthy" in (m := httpx.get(srv.url + "/metrics").text)
        assert 'sparsekv:engine_healthy{model_name="tiny"} 0.0' in m
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10  # and the server still shuts down


def _assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text


def _checks_without_tokenizer(url: str) -> None:
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    text = httpx.post(url + "/v1/completions", json={"prompt": "hello"})
    assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
    tok = httpx.post(url + "/tokenize", json={"prompt": "hello"})
    assert tok.status_code == 400 and "no tokenizer" in tok.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}).json()
    assert ok["choices"][0]["text"] == "" and len(ok["sparsekv"]["choices"][0]["token_ids"]) == 3


def test_a_request_larger_than_the_queue_bound_is_a_400_not_a_503_to_retry(model):
    """n = 3 against a per-tenant bound of 2 could never be admitted: a 503 with Retry-After sent a
    client retrying forever. At the bound it is served."""
    with ThreadServer(model, api_keys=["sk-a:alice"], max_queued_per_tenant=2) as srv:
        def post(n):
            return httpx.post(srv.url + "/v1/completions", json={**BODY, "n": n},
                              headers={"Authorization": "Bearer sk-a"}, timeout=90)
        too_many, fits = post(3), post(2)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert "3 sequences" in too_many.json()["error"]["message"] and fits.status_code == 200


class _QueueOnlyEngine:
    """Just what EngineLoop's queue bounds touch: requests are queued and never stepped."""

    def __init__(self):
        self.queued: list[tuple[str, str]] = []  # (request id, tenant)

    def stats(self) -> dict:
        return {}

    def has_unfinished_requests(self) -> bool:
        return False  # nothing is stepped: what was added stays waiting

    def num_waiting_requests(self, tenant=None) -> int:
        return sum(tenant is None or t == tenant for _, t in self.queued)

    def add_request(self, rid, prompt, params, tenant, cache_salt, first_token):
        self.queued.append((rid, tenant))
        return object()

    def abort(self, rid) -> bool:
        self.queued = [q for q in self.queued if q[0] != rid]
        return True

    def check_ranks(self) -> None:
        pass

    def expire_prefix_cache(self) -> int:
        return 0


@pytest.mark.parametrize("bound", ["max_queued_requests", "max_queued_per_tenant"])
def test_the_queue_bounds_count_each_sequence_of_a_request(bound, monkeypatch):
    """A request of n choices queues n sequences: with a bound of 4 and 2 waiting, n = 2 fits exactly
    and then n = 2 more is refused (503 QueueFull), however many HTTP requests that is; the refused
    request adds none of its sequences. n = 4 on an empty queue fits, n = 5 never could (400). A fake
    engine that never steps: only EngineLoop's bookkeeping runs (sparsekv/server/loop.py, _add)."""
    from sparsekv.sampling_params import InvalidRequest
    from sparsekv.server.loop import FAULT_ENV, DELAY_ENV, EngineLoop, QueueFull, RequestGroup, Submission
    from sparsekv.request import SamplingParams
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.delenv(DELAY_ENV, raising=False)

    async def scenario():
        engine = _QueueOnlyEngine()
        loop = EngineLoop(engine, **{bound: 4})
        loop.start()
        counter = iter(range(100))

        async def submit(n, tenant="alice"):
            group = RequestGroup(f"g{next(counter)}", n)
            await loop.submit(group, [Submission([1, 2, 3], SamplingParams(max_tokens=2))] * n, tenant, None)

        try:
            await submit(2)
            await submit(2)
            assert engine.num_waiting_requests() == 4
            with pytest.raises(QueueFull):
                await submit(2)
            with pytest.raises(QueueFull):
                await submit(1)
            assert engine.num_waiting_requests() == 4
            if bound == "max_queued_per_tenant":  # another tenant's bound is its own
                await submit(2, "bob")
                assert engine.num_waiting_requests("bob") == 2
            engine.queued.clear()
            await submit(3)
            with pytest.raises(QueueFull):
                await submit(2)  # 3 + 2 > 4: one HTTP request, but two sequences
            engine.queued.clear()
            with pytest.raises(InvalidRequest, match="5 sequences"):
                await submit(5)
            await submit(4)
            assert engine.num_waiting_requests() == 4
        finally:
            loop.stop()
    asyncio.run(scenario())


def test_one_tenants_burst_cannot_fill_the_queue_for_the_others(model):
    """--max-queued-requests-per-tenant 1 with one batch slot: alice's first request runs, her second
    waits, her third is refused (503 + Retry-After), and bob's request is still queued and served.
    Alice's first request runs one step, then the steps hold (a held step returns no output; the engine
    loop's commands, adding and refusing requests, run meanwhile) until bob's request is queued too:
    it cannot end before the others came, however slow their round trips."""
    with ThreadServer(model, api_keys=["sk-a:alice", "sk-b:bob"], max_queued_per_tenant=1, max_num_seqs=1) as srv:
        release, stepped, step, held_until = threading.Event(), [], srv.engine.step, time.monotonic() + 30

        def held():
            if stepped and not release.is_set() and time.monotonic() < held_until:
                time.sleep(0.005)
                return []
            stepped.append(1)
            return step()
        srv.engine.step = held

        def post(key):
            return httpx.post(srv.url + "/v1/completions", json={**BODY, "max_tokens": 60},
                              headers={"Authorization": f"Bearer {key}"}, timeout=90)
        results = {}
        threads = [threading.Thread(target=lambda i=i, key=key: results.setdefault(i, post(key)))
                   for i, key in enumerate(["sk-a", "sk-a", "sk-b"])]
        threads[0].start()
        assert wait_until(lambda: srv.engine.stats()["running"] == 1, 30)
        threads[1].start()
        assert wait_until(lambda: srv.engine.stats()["waiting"] == 1, 30)
        refused = post("sk-a")
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert "this tenant already has 1 requests waiting" in refused.json()["error"]["message"]
        threads[2].start()  # bob's
        assert wait_until(lambda: srv.engine.stats()["waiting"] == 2, 30)
        assert len(stepped) == 1 and srv.engine.stats()["running"] == 1  # alice's first still ran throughout
        release.set()
        for t in threads:
            t.join(90)
        assert [results[i].status_code for i in range(3)] == [200] * 3
    srv.engine.check_integrity()


def test_chat_default_max_tokens_is_capped_only_when_admission_reserves(model):
    """Reserving admission promises prompt + max_tokens, so the chat default is capped at pool tokens /
    max_num_seqs; optimistic admission reserves as tokens come: the rest of the context, as vLLM."""
    from sparsekv.config import EngineConfig
    from sparsekv.engine import LLMEngine
    from sparsekv.server.app import ServerSettings, create_app
    caps = {}
    for admission in ("reserve", "optimistic"):
        engine = LLMEngine(EngineConfig(model=model, max_model_len=512, max_num_seqs=4, kv_page_size=16,
                                        num_kv_pages=64, kv_admission=admission))
        state = create_app(engine, ServerSettings(["tiny"])).state.server
        caps[admission] = state.chat_default_cap, state.context_limit
    assert caps == {"reserve": (256, 512), "optimistic": (512, 512)}


def test_chat_default_max_tokens_is_the_rest_of_the_context_after_the_prompt(model):
    """Optimistic admission, no max_tokens: the default is context - prompt tokens (vLLM's), so the
    request is answered, never refused for a prompt + max_tokens over the context; a prompt cut by
    truncate_prompt_tokens counts as the tokens it keeps."""
    body = {"messages": [{"role": "user", "content": "hi " * 8}], "temperature": 0, "ignore_eos": True}
    with ThreadServer(model, max_model_len=64, kv_admission="optimistic") as srv:
        whole, cut = (httpx.post(srv.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
                      for extra in ({}, {"truncate_prompt_tokens": 4}))
    for r in (whole, cut):
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert whole.json()["usage"]["prompt_tokens"] > 5 and cut.json()["usage"]["prompt_tokens"] == 4


def test_tier_figures_reach_response_and_metrics(model):
    with ThreadServer(model, kv_tiering=True, kv_cache_dtype="fp8") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1] * 40, "max_tokens": 30, "n": 2,
                                                          "temperature": 0, "ignore_eos": True}).json()
        tiers = r["sparsekv"]["tiers"]
        assert tiers["host_kv_bytes"] > 0 and tiers["h2d_bytes"] > 0 and tiers["tier_hits"] + tiers["tier_misses"] > 0
        assert tiers["h2d_bytes"] == sum(c["tiers"]["h2d_bytes"] for c in r["sparsekv"]["choices"])
        m = scrape(srv.url)
        assert m["sparsekv:host_kv_budget_bytes"] > 0 and m["sparsekv:h2d_bytes_total"] >= tiers["h2d_bytes"]
        assert m["sparsekv:tier_hits_total"] + m["sparsekv:tier_misses_total"] > 0
        [info] = [s for s in scrape_samples(srv.url) if s.name == "sparsekv:cache_config_info"]
        assert info.value == 1 and info.labels["cache_dtype"] == "fp8" and info.labels["kv_tiering"] == "True"
        assert info.labels["host_store"] == "ram" and info.labels["block_size"] == "16"
        assert info.labels["num_gpu_blocks"] == str(srv.engine.kv.allocator.num_pages)
    srv.engine.check_integrity()


def _memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the resident peak so far) of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return {name: int(value.split()[0]) / 1024 for name, value in fields.items()}


def test_memory_goes_back_after_max_size_requests(model):
    """Maximum-size requests (4 MiB bodies: /tokenize of a prompt tokenized in full, a completion and a
    chat refused as longer than max_model_len) left RSS gigabytes up for good: glibc kept the
    tokenizer's freed buffers in its arenas. After them RSS is back within 20 % of before."""
    from sparsekv.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
    proc, url = start_subprocess_server(model)
    text = ("the rain in spain falls mainly on the plain " * (DEFAULT_MAX_REQUEST_BODY_BYTES // 44))
    room = DEFAULT_MAX_REQUEST_BODY_BYTES - 100  # the JSON around the text
    requests = [("/tokenize", {"prompt": text[:room]}, 200)] * 2 + [
        ("/v1/completions", {"prompt": text[:room], "max_tokens": 2}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[:room]}]}, 400)]
    warm = [("/tokenize", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]
    try:
        wait_healthy(url, proc)
        for path, body in warm:  # what is allocated once (workers, lazy imports) belongs in `before`
            assert httpx.post(url + path, json=body, timeout=60).status_code == 200
        before = _memory_mb(proc.pid)
        for path, body, status in requests:
            assert httpx.post(url + path, json=body, timeout=300).status_code == status
        after = _memory_mb(proc.pid)
        assert after["VmHWM"] > 1.2 * before["VmRSS"], (before, after)  # the requests did take memory
        assert wait_until(lambda: _memory_mb(proc.pid)["VmRSS"] <= 1.2 * before["VmRSS"], 15), \
            (before, _memory_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)


# -- pure pieces -------------------------------------------------------------------------------

def test_per_tenant_kv_figures_are_exported_with_tenant_and_state_labels():
    """The engine's `kv_by_tenant` (requests running and waiting, KV pages reserved) reaches /metrics as
    sparsekv:tenant_requests{tenant,state} and sparsekv:tenant_kv_pages{tenant}."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparsekv.server.metrics import EngineStatsCollector
    stats = {"kv_pages_total": 40, "kv_pages_free": 16,
             "kv_by_tenant": {"heavy": {"running": 1, "waiting": 3, "kv_pages": 12},
                              "light": {"running": 1, "waiting": 0, "kv_pages": 12}}}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("tiny", lambda: stats, lambda: True))
    samples = [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]
    requests = {(s.labels["tenant"], s.labels["state"]): s.value for s in samples if s.name == "sparsekv:tenant_requests"}
    assert requests == {("heavy", "running"): 1, ("heavy", "waiting"): 3, ("light", "running"): 1,
                        ("light", "waiting"): 0}
    pages = {s.labels["tenant"]: s.value for s in samples if s.name == "sparsekv:tenant_kv_pages"}
    assert pages == {"heavy": 12, "light": 12}
    assert not any(s.name.startswith("sparsekv:kv_by_tenant") for s in samples)


def test_each_data_parallel_ranks_requests_and_kv_are_exported_with_a_dp_rank_label():
    """A data-parallel engine's `by_data_parallel_rank` reaches /metrics per rank (the sums hide one rank
    filling up): the usage fraction from its own pages, waiting requests summed over tenants, counters as
    counters, any other figure as a gauge; the aggregate series stay unlabelled by rank."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparsekv.server.metrics import EngineStatsCollector
    stats = {"kv_pages_total": 80, "kv_pages_free": 50, "running": 3,
             "by_data_parallel_rank": [
                 {"running": 3, "waiting": {"a": 2, "b": 1}, "generation_tokens": 7, "kv_pages_total": 40,
                  "kv_pages_free": 10, "prefix_host_bytes": 4096},
                 {"running": 0, "waiting": {}, "generation_tokens": 0, "kv_pages_total": 40, "kv_pages_free": 40,
                  "prefix_host_bytes": 0}]}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("tiny", lambda: stats, lambda: True))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    kinds = {f.name: f.type for f in families}
    by_rank = {}
    for s in (s for f in families for s in f.samples if "dp_rank" in s.labels):
        by_rank.setdefault(s.name, {})[s.labels["dp_rank"]] = s.value
    assert by_rank["sparsekv:dp_rank_kv_cache_usage_perc"] == {"0": 0.75, "1": 0.0}
    assert by_rank["sparsekv:dp_rank_num_requests_running"] == {"0": 3, "1": 0}
    assert by_rank["sparsekv:dp_rank_num_requests_waiting"] == {"0": 3, "1": 0}
    assert by_rank["sparsekv:dp_rank_generation_tokens_total"] == {"0": 7, "1": 0}
    assert by_rank["sparsekv:dp_rank_prefix_host_bytes"] == {"0": 4096, "1": 0}
    assert kinds["sparsekv:dp_rank_generation_tokens"] == "counter" and kinds["sparsekv:dp_rank_kv_pages_free"] == "gauge"
    aggregate = {s.name: s for f in families for s in f.samples if s.name == "sparsekv:kv_cache_usage_perc"}
    assert aggregate["sparsekv:kv_cache_usage_perc"].value == 30 / 80 and "dp_rank" not in aggregate[
        "sparsekv:kv_cache_usage_perc"].labels
    assert not any(f.name.startswith("sparsekv:by_data_parallel_rank") for f in families)


def test_the_prefix_tiers_counts_are_counters():
    """Counts since start are counters (`_total`), not gauges; the tiers' sizes are gauges."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparsekv.server.metrics import EngineStatsCollector
    stats = {"prefix_disk_writes": 3, "prefix_disk_reads": 2, "prefix_host_saves": 5, "prefix_cache_expired_pages": 1,
             "prefix_disk_pages": 7}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("tiny", lambda: stats, lambda: True))
    kinds = {f.name: f.type for f in text_string_to_metric_families(generate_latest(registry).decode())}
    for name in ("prefix_disk_writes", "prefix_disk_reads", "prefix_host_saves", "prefix_cache_expired_pages"):
        assert kinds["sparsekv:" + name] == "counter", name
    assert kinds["sparsekv:prefix_disk_pages"] == "gauge"
    values = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
              for s in f.samples}
    assert values["sparsekv:prefix_disk_writes_total"] == 3


def test_stream_holds_back_a_possible_stop_string():
    from sparsekv.request import RequestOutput
    from sparsekv.server.responses import ChoiceState
    s = ChoiceState(0, ["STOP"])
    deltas = []
    for text, reason in [("ab", None), ("abST", None), ("abSTx", None), ("abSTxS", None), ("abSTx", "stop")]:
        s.update(RequestOutput("r", [1], [1], text, None, reason))
        deltas.append(s.take_delta()[1])
    assert deltas == ["ab", "", "STx", "", ""] and "".join(deltas) == "abSTx"
    half = ChoiceState(0, [])
    half.update(RequestOutput("r", [1], [1], "a\ufffd", None, None))
    assert half.take_delta()[1] == "a"


def test_api_keys_map_to_tenants():
    from sparsekv.server.auth import parse_api_keys, tenant_for
    keys = parse_api_keys(["k1:alice", "k2", "k3:alice"])
    assert tenant_for(keys, "Bearer k1") == "alice" == tenant_for(keys, "bearer k3")
    assert tenant_for(keys, "Bearer k2").startswith("key-")
    assert tenant_for(keys, "Bearer k4") is None and tenant_for(keys, None) is None
    assert tenant_for(keys, "Basic k1") is None
    for bad in (["k:"], [":t"], [""]):
        with pytest.raises(ValueError):
            parse_api_keys(bad)


def test_a_long_prompt_is_refused_after_tokenizing_a_bounded_prefix():
    """Encoder.ids_within: a prompt far over the limit costs about what the limit's tokens take, not the
    whole text; one within it gets exactly tokenizer.encode's ids (the engine's), special tokens too."""
    from sparsekv.input_processor import load_tokenizer
    from sparsekv.paths import default_model_path
    from sparsekv.server.tokenizing import CHARS_PER_TOKEN_GUESS, CUT_SLACK_TOKENS, Encoder
    tokenizer = load_tokenizer(default_model_path())
    encoder = Encoder(tokenizer)
    tokenized, encode = [], encoder.encode
    encoder.encode = lambda text, special=False: tokenized.append(len(text)) or encode(text, special)
    text = "the rain in spain falls mainly on the plain. " * 50_000
    assert encoder.ids_within(text, 100) is None
    assert sum(tokenized) <= 5 * (100 + CUT_SLACK_TOKENS) * CHARS_PER_TOKEN_GUESS < len(text) // 100
    for sample in (text[:3000], "<|user|>hi<|endoftext|> caf\u00e9 \u4e2d\u6587 42", ""):
        assert encoder.ids_within(sample, 10_000) == tokenizer.encode(sample, add_special_tokens=False)
        assert encoder.decode(tokenizer.encode(sample)) == tokenizer.decode(tokenizer.encode(sample))


def test_serve_cli_rejects_bad_options(capsys, serve_never_listens):
    from sparsekv.server.cli import main
    assert main(["--api-key", "k:"]) == 2
    assert "KEY:TENANT" in capsys.readouterr().err
    assert main(["--max-queued-requests", "0"]) == 2
    assert "--max-queued-requests" in capsys.readouterr().err
    for flag in ("--max-request-body-bytes", "--max-prompts-per-request"):
        assert main([flag, "0"]) == 2
        assert flag in capsys.readouterr().err
    assert main(["--metrics-api-key", ""]) == 2
    assert "--metrics-api-key" in capsys.readouterr().err
    for flag, value in (("--reasoning-parser", "qwen3"), ("--kv-cache-dtype", "fp16")):
        with pytest.raises(SystemExit) as exit_:  # argparse: not one of the choices
            main([flag, value])
        assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_serve_cli_gives_one_line_for_options_that_would_break_later(tmp_path, capsys):
    """Values that parsed, then crashed, blamed another option or broke every request: one line, exit 2."""
    from sparsekv.server.cli import main
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    bad_template = tmp_path / "bad.jinja"
    bad_template.write_text("{{ messages[0] ")
    cases = [
        (["--prefix-cache-host-bytes", "inf"], "not a byte size"),
        (["--dist-timeout", "inf"], "--dist-timeout must be in (0, "),
        (["--disaggregation-mode", "prefill", "--disaggregation-secret-file", str(secret),
          "--disaggregation-timeout", "inf"], "--disaggregation-timeout must be in (0, "),
        (["--disaggregation-mode", "prefill", "--disaggregation-secret-file", str(tmp_path)],
         f"--disaggregation-secret-file {tmp_path}: Is a directory"),
        (["--disaggregation-mode", "decode", "--disaggregation-secret-file", str(secret), "--no-enable-prefix-caching"],
         "needs the prefix cache"),
        (["--served-model-name", ""], "--served-model-name must not be empty"),
        (["--chat-template", str(bad_template)], "--chat-template: not a Jinja template"),
        (["--max-model-len", "64", "--default-max-tokens", "64"], "--default-max-tokens 64 leaves no room"),
        (["--attention", "dense", "--selector", "quest"], "--selector quest needs --attention sparse"),
    ]
    for argv, message in cases:
        try:
            code = main([*argv, "--port", "0"])  # NOTE: not the default port, which another server may hold
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port in use: said before the weights load
        port = str(taken.getsockname()[1])
        assert main(["/nonexistent/model", "--host", "127.0.0.1", "--port", port]) == 2
        assert f"--host 127.0.0.1 --port {port}: cannot listen there" in capsys.readouterr().err
    # a launcher may give both roles the same flags: a decode worker says which it ignores, and starts
    assert main(["--disaggregation-mode", "decode", "--disaggregation-secret-file", str(secret),
                 "--disaggregation-bootstrap-port", "18391", "--served-model-name", "", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--disaggregation-bootstrap-port applies only to a prefill worker" in err and "warning" in err


def test_serve_cli_refuses_an_fd_that_is_not_a_listening_tcp_socket(tmp_path, capsys, monkeypatch):
    """--fd is checked before the weights load: a file, a socket not listening, a closed descriptor."""
    import os
    import socket

    from sparsekv.server import cli
    from sparsekv.server.cli import main

    def loading(args, bind):
        bind()  # what build_app does before the weights load
        raise AssertionError("the weights load: --fd was not refused first")
    monkeypatch.setattr(cli, "build_app", loading)
    with open(tmp_path / "f", "w") as f, socket.socket() as idle:
        for fd, why in ((f.fileno(), "not an open socket"), (idle.fileno(), "not a listening TCP socket")):
            assert main(["--fd", str(fd)]) == 2
            assert f"--fd {fd}: {why}" in capsys.readouterr().err
        closed = os.dup(f.fileno())
        os.close(closed)
        assert main(["--fd", str(closed)]) == 2
        assert f"--fd {closed}: not an open socket" in capsys.readouterr().err
        assert not f.closed and idle.fileno() >= 0  # the descriptors refused are left as they were


def test_a_start_that_fails_after_the_port_is_bound_closes_the_port_and_the_built_engine(monkeypatch, capsys):
    """Once the port is bound (before the weights load), a failure still gives back what start-up took:
    the listening socket on every error path, and an engine already built when --default-max-tokens
    leaves no room within its max_model_len."""
    import sparsekv.llm
    from sparsekv.parallel.launch import StartupError
    from sparsekv.server import cli
    bound, closed = [], []
    listen = cli.listening_socket
    monkeypatch.setattr(cli, "listening_socket", lambda host, port: bound.append(listen(host, port)) or bound[-1])

    class Engine:
        max_model_len = 64

        def close(self):
            closed.append(self)
    for error, code in ((ValueError("no weights"), 2), (StartupError("rank 1 never came"), 1), (None, 2)):
        def build_engine(config, error=error):
            if error is not None:
                raise error
            return Engine()
        monkeypatch.setattr(sparsekv.llm, "build_engine", build_engine)
        assert cli.main(["--port", "0", "--default-max-tokens", "64"]) == code
        err = capsys.readouterr().err
        assert "sparsekv serve: error: " in err and "Traceback" not in err, err
        assert len(bound) and bound[-1].fileno() == -1, (error, "the listening socket was left open")
    assert len(bound) == 3 and len(closed) == 1


def test_an_engine_option_error_is_said_before_the_port_is_bound(capsys, serve_never_listens):
    """config.validate() runs before bind(): an option the engine refuses never holds the port first."""
    from sparsekv.server.cli import main
    for argv, flag in ((["--dist-timeout", "inf"], "--dist-timeout"), (["--threads", "-2"], "--threads")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} must be" in err and "Traceback" not in err, err


def test_a_process_that_only_hosts_ranks_serves_nothing(monkeypatch):
    """host_ranks returning 0 (this node's or torchrun rank's part done) ends the command: no server."""
    from sparsekv.server import cli
    monkeypatch.setattr(cli, "host_ranks", lambda parser, args: 0)
    monkeypatch.setattr(cli, "build_app", lambda args, bind: pytest.fail("a process hosting ranks built a server"))
    assert cli.main(["--port", "0"]) == 0


def test_a_decode_worker_gets_a_host_tier_for_the_pages_it_is_sent_unless_one_is_given(tmp_path, monkeypatch):
    """docs/disaggregation.md: a decode worker without --prefix-cache-host-bytes gets
    DEFAULT_DECODE_HOST_BYTES (transferred pages the pool has no room for); a given size is kept, and a
    prefill worker or a colocated server gets no host tier it was not asked for."""
    from disagg_util import secret_file

    import sparsekv.llm
    from sparsekv.disagg.worker import DEFAULT_DECODE_HOST_BYTES
    from sparsekv.server.cli import build_app, build_parser
    configs = []

    def build_engine(config):
        configs.append(config)
        raise ValueError("stop before the weights load")
    monkeypatch.setattr(sparsekv.llm, "build_engine", build_engine)
    secret = ["--disaggregation-secret-file", secret_file(tmp_path)]
    for argv, host_bytes in ((["--disaggregation-mode", "decode", *secret], DEFAULT_DECODE_HOST_BYTES),
                             (["--disaggregation-mode", "decode", *secret, "--prefix-cache-host-bytes", "1M"], 1 << 20),
                             (["--disaggregation-mode", "prefill", *secret], None), ([], None)):
        with pytest.raises(ValueError, match="stop before"):
            build_app(build_parser().parse_args(argv))
        assert configs[-1].prefix_cache_host_bytes == host_bytes, argv
    assert len(configs) == 4


def test_signals_drain_then_abort_then_force_and_a_second_after_the_drain_forces():
    """The signal handler's steps: the first starts a drain, the second aborts what is left, the third
    forces the exit; once the drain is over (uvicorn waits for connections), the second forces it."""
    import uvicorn
    from sparsekv.server.cli import DrainingServer
    server = DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None), None, 1.0)
    steps = []
    for _ in range(3):
        server.handle_exit(signal.SIGTERM, None)
        steps.append((server._drain_requested, server._abort_requested, server.force_exit))
    assert steps == [(True, False, False), (True, True, False), (True, True, True)]
    drained = DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None), None, 1.0)
    drained.handle_exit(signal.SIGTERM, None)
    drained.should_exit = True  # what drain() sets when it is done
    drained.handle_exit(signal.SIGINT, None)
    assert drained.force_exit


class _IdleLoop:
    """What DrainingServer reads of the engine loop: nothing in flight, and `dead`."""

    def __init__(self, dead):
        self.dead, self.draining, self.num_active = dead, False, 0

    async def wait_idle(self, timeout, cut_short=lambda: False) -> bool:
        return True


@pytest.mark.parametrize("dead", ["rank", "step"])
def test_a_failed_rank_exits_1_after_the_grace_and_a_failed_step_keeps_serving_errors(dead, monkeypatch):
    """A rank gone: /health answers 503 for RANK_FAILURE_GRACE_S, then the server drains and exits 1 (a
    supervisor restarts it). A step that raised on a one-rank engine is no reason to exit by itself."""
    import uvicorn
    from types import SimpleNamespace

    from sparsekv.parallel.launch import RankFailure
    from sparsekv.server import cli
    loop = _IdleLoop(RankFailure("rank 1 is gone") if dead == "rank" else RuntimeError("boom"))
    server = cli.DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None), SimpleNamespace(loop=loop), 1.0)

    async def main():
        assert not await server.on_tick(1)  # within the grace: still serving (its 503s)
        assert (server.exit_code, server._drain_task, loop.draining) == (0, None, False)
        monkeypatch.setattr(cli, "RANK_FAILURE_GRACE_S", -1.0)  # the grace is over
        await server.on_tick(1)
        if dead == "step":
            assert (server.exit_code, server._drain_task, loop.draining) == (0, None, False)
            return
        assert server.exit_code == 1 and (drain := server._drain_task) is not None
        await server.on_tick(1)
        assert server._drain_task is drain  # one drain, however many ticks it takes
        await drain
        assert loop.draining and server.should_exit and await server.on_tick(1)
    asyncio.run(main())


def test_a_blank_served_model_name_is_refused_before_the_port_is_bound():
    """Whitespace is no model name either: refused before anything is bound or loaded."""
    from sparsekv.server.cli import build_app, build_parser

    def bind():
        raise AssertionError("bound: the blank name was not refused first")
    for name in ("", " ", "\t"):
        with pytest.raises(ValueError, match="--served-model-name must not be empty"):
            build_app(build_parser().parse_args(["--served-model-name", "m", "--served-model-name", name]), bind)


def test_disaggregation_flags_a_role_ignores_are_named_and_only_a_prefill_worker_gets_a_bootstrap_port(tmp_path):
    from sparsekv.server.cli import build_parser, disaggregation_settings, unused_disaggregation_flags
    parser = build_parser()
    given = {"--disaggregation-bootstrap-port": "9", "--disaggregation-bootstrap-host": "h",
             "--disaggregation-secret-file": "s", "--disaggregation-timeout": "5",
             "--disaggregation-transfer-backend": "nixl", "--disaggregation-send": "chunks"}
    for flag, value in given.items():  # a colocated server uses none of them
        assert unused_disaggregation_flags(parser, parser.parse_args([flag, value])) == [flag]
    argv = [part for pair in given.items() for part in pair]
    assert unused_disaggregation_flags(parser, parser.parse_args(["--disaggregation-mode", "decode", *argv])) == \
        ["--disaggregation-bootstrap-port", "--disaggregation-send"]
    assert unused_disaggregation_flags(parser, parser.parse_args(["--disaggregation-mode", "prefill", *argv])) == []
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    for mode, port in (("prefill", 9), ("decode", None)):
        args = parser.parse_args(["--disaggregation-mode", mode, "--disaggregation-secret-file", str(secret),
                                  "--disaggregation-bootstrap-port", "9", "--disaggregation-bootstrap-host", "h"])
        assert disaggregation_settings(args).bootstrap_port == port, mode


def test_a_negative_fd_is_a_usage_error_naming_the_flag(capsys, serve_never_listens):
    """--fd -1 was "error: negative file descriptor" (socket's ValueError, no flag named), after the checks."""
    from sparsekv.server.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--fd", "-1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--fd" in err and "Traceback" not in err, err


def test_weight_updates_drain_by_default():
    """docs/rl.md: `drain` (the default) lets the requests already started finish under the old weights."""
    from sparsekv.server.cli import build_parser
    assert build_parser().parse_args([]).weight_update_policy == "drain"


def test_serve_listens_on_vllms_default_address():
    """Without --host/--port, `sparsekv serve` is where vLLM's is and the README's curl goes: 127.0.0.1:8000."""
    from sparsekv.server.cli import build_parser
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.fd) == ("127.0.0.1", 8000, None)


def test_an_in_process_server_whose_thread_dies_is_reported_at_once(monkeypatch):
    """serve_in_thread stops waiting when the server's thread ends without starting (not only at its
    deadline): here the clock never moves, so only the thread's end can stop the wait."""
    import types

    import sparsekv.server.cli as cli
    import sparsekv.server.threaded as threaded

    class ReturnsWithoutStarting:
        started = False

        def __init__(self, config, state, shutdown_timeout):
            pass

        def run(self, sockets):
            pass
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        assert len(naps) < 1000, "still waiting on a thread that has ended"
    monkeypatch.setattr(cli, "DrainingServer", ReturnsWithoutStarting)
    monkeypatch.setattr(threaded, "time", types.SimpleNamespace(monotonic=lambda: 0.0, sleep=sleep))
    sock = threaded.listening_socket()
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            threaded.serve_in_thread(object(), None, sock, 1.0)
    finally:
        sock.close()


def test_stopping_an_in_process_server_whose_thread_goes_on_is_an_error():
    """stop_thread_server asks the server to exit, and raises if its thread is still running after the
    wait; a thread that ends is stopped quietly."""
    import types

    from sparsekv.server.threaded import stop_thread_server
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    server = types.SimpleNamespace(should_exit=False)
    try:
        with pytest.raises(RuntimeError, match="did not stop"):
            stop_thread_server(server, stuck, timeout_s=0.01)
        assert server.should_exit
    finally:
        release.set()
        stuck.join()
    stop_thread_server(types.SimpleNamespace(should_exit=False), stuck)  # ended: no error


@pytest.mark.parametrize("disagg_close_fails", [False, True], ids=["colocated", "disagg-close-raises"])
def test_the_apps_end_closes_the_tokenizer_pool_and_the_engine(model, disagg_close_fails):
    """When the lifespan ends (the engine loop stopped), the tokenizer pool's threads are let go and the
    engine is closed, once (its disk tier saved, a parallel engine's ranks stopped); also when a
    disaggregation worker's close, which runs first, raises."""
    import types
    srv = ThreadServer(model)
    closed, close = [], srv.engine.close
    srv.engine.close = lambda: (closed.append(True), close())[1]

    def disagg_close():
        closed.append("disagg")
        raise RuntimeError("a transfer thread would not stop")
    with srv:
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200
        if disagg_close_fails:
            srv.state.disagg = types.SimpleNamespace(close=disagg_close)
    assert closed == (["disagg", True] if disagg_close_fails else [True]) and not srv.state.loop.healthy
    with pytest.raises(RuntimeError):  # a pool shut down takes no more work
        asyncio.run(srv.state.tokenizing.run(lambda encoder: None))


def test_an_open_server_reports_max_model_len_and_shows_the_per_tenant_series_to_any_scrape(model):
    """/v1/models' and /tokenize's max_model_len is the engine's (docs/server.md, vLLM's), not the
    smaller context a small KV pool leaves; with no --api-key there is one tenant, nobody else's
    activity to tell, so a plain scrape of /metrics gets the per-tenant series too."""
    with ThreadServer(model, num_kv_pages=8) as srv:
        card = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
        one = httpx.get(srv.url + "/v1/models/tiny", timeout=30).json()
        tok = httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}, timeout=30).json()
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                          timeout=30).status_code == 200
        tenant = {s.name for s in scrape_samples(srv.url) if "tenant" in s.labels}
    assert card["max_model_len"] == one["max_model_len"] == tok["max_model_len"] == srv.engine.max_model_len
    assert srv.state.context_limit < srv.engine.max_model_len
    assert "sparsekv:prefix_cache_tenant_queries_total" in tenant


class _CudaQueueOnlyEngine(_QueueOnlyEngine):
    """A queue-only engine as `--device cuda` makes it: a CUDA device without an index."""

    device = torch.device("cuda")


@pytest.mark.parametrize("device, index", [("cuda", 3), ("cuda:1", 1), ("cpu", None)])
def test_the_engine_thread_takes_the_engines_cuda_device_by_index(device, index, monkeypatch):
    """`torch.cuda.set_device` refuses a device without an index (ValueError "Expected a torch.device
    with a specified index"): given `torch.device("cuda")`, the engine thread died before its first
    turn, and every request waited forever. It takes the index (the current device of the thread that
    made the loop, for an engine on plain "cuda"), and stays alive. Runs without a GPU: torch.cuda's
    calls are replaced, set_device by one that refuses as torch's does."""
    from torch.cuda._utils import _get_device_index
    from sparsekv.server.loop import EngineLoop
    chosen = []

    def set_device(d):
        chosen.append(_get_device_index(d))  # raises as torch's does for a device without an index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    engine = _CudaQueueOnlyEngine()
    engine.device = torch.device(device)

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        try:
            for _ in range(3000):  # the thread's first act, once it runs (bounded: a loaded machine is slow)
                if chosen or index is None or not loop.healthy:
                    break
                await asyncio.sleep(0.01)
            assert loop.healthy
        finally:
            loop.stop()
    asyncio.run(scenario())
    assert chosen == ([] if index is None else [index])


def test_an_engine_thread_that_cannot_take_its_device_refuses_requests(monkeypatch):
    """set_device failing (a device the process cannot use) kills the loop as a failed step does: the
    error is kept (/health 503 engine_dead, requests 500) instead of a thread that ended unseen."""
    from sparsekv.server.loop import EngineLoop

    def set_device(d):
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    engine = _CudaQueueOnlyEngine()
    engine.device = torch.device("cuda:7")

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        try:
            for _ in range(3000):
                if loop.dead is not None or not loop.healthy:
                    break
                await asyncio.sleep(0.01)
            return loop.dead, loop.healthy
        finally:
            loop.stop()
    dead, healthy = asyncio.run(scenario())
    assert "invalid device ordinal" in repr(dead) and not healthy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py runs it)")
def test_a_server_on_plain_cuda_answers_on_cuda(model):
    """`sparsekv serve --device cuda` (no index): the engine thread sets its device and steps (it died
    at `torch.cuda.set_device(torch.device("cuda"))` before its first turn), and a completion comes back."""
    with ThreadServer(model, device="cuda", dtype="float32") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**BODY, "max_tokens": 8, "temperature": 0.0}, timeout=120)
        assert srv.state.loop.healthy
    assert r.status_code == 200, r.text
    assert len(r.json()["sparsekv"]["choices"][0]["token_ids"]) == 8
