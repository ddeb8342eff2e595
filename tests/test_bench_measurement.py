"""What the benchmarks measure: each figure is the thing it names (a worker's own memory, a time per
token, the same warm-up on both sides), checked on constructed inputs and fake clocks, never on time."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from sparsekv.tools import bench, bench_worker
from sparsekv.tools.bench import report_console


def test_a_workers_peak_rss_is_its_own_not_its_parents():
    """A parent that touched 600 MB starts a worker that touches nothing: the worker reports far less
    (ru_maxrss, kept across fork and exec on Linux, would report the parent's 600 MB)."""
    if bench_worker.vm_hwm_mb() is None:
        pytest.skip("no /proc/self/status here")
    parent = textwrap.dedent(f"""
        import subprocess, sys
        held = bytearray(600 << 20)   # zero-filled, so every page is resident
        child = "import importlib.util as u; s = u.spec_from_file_location('w', {bench_worker.__file__!r}); " \\
                "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.peak_rss_mb())"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    """)
    worker_mb = float(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                                     check=True).stdout.split()[-1])
    assert 0 < worker_mb < 200, worker_mb


def test_vm_hwm_is_read_from_the_status_file_and_absent_without_one(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9999 kB\nVmHWM:\t  204800 kB\nVmRSS:\t 1024 kB\n")
    assert bench_worker.vm_hwm_mb(str(status)) == 200.0
    assert bench_worker.vm_hwm_mb(str(tmp_path / "none")) is None


class FakeClock:
    """perf_counter for bench_worker: a fake model advances it by the step's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCausalLM:
    """A transformers model whose decode steps cost 100 s on the clock for the first two calls, 1 s after."""

    def __init__(self, clock: FakeClock):
        self.clock, self.decode_calls = clock, 0

    def __call__(self, ids, past_key_values=None, use_cache=True, **_):
        import torch
        if past_key_values is not None:
            self.decode_calls += 1
            self.clock.now += 100.0 if self.decode_calls <= bench_worker.WARMUP_STEPS else 1.0
        return SimpleNamespace(past_key_values=object(), logits=torch.zeros(1, ids.shape[1], 8))


def test_transformers_decode_drops_the_same_warm_up_steps_as_sparsekv(monkeypatch):
    clock = FakeClock()
    model = FakeCausalLM(clock)
    monkeypatch.setattr(bench_worker.time, "perf_counter", clock)
    monkeypatch.setattr(bench_worker, "transformers_model", lambda job: model)
    out = bench_worker.transformers_decode({"context": 4, "steps": 4})
    assert model.decode_calls == 4
    assert out["ms"] == 1000.0 and out["tokens_per_s"] == 1.0  # the two cold steps are not in the median


def test_the_transformers_baseline_runs_as_many_decode_steps_as_sparsekv(monkeypatch):
    jobs = []
    monkeypatch.setattr(bench, "_median_runs", lambda job, threads, repeats: jobs.append(job) or {"ms": 1.0})
    monkeypatch.setattr(bench, "_worker", lambda job, threads: jobs.append(job) or {"ms": 2.0})
    args = bench.parse_args(["decode", "--steps", "9"])
    bench._against_transformers(args, {"kind": "decode", "context": 512, "steps": args.steps})
    assert [(j["engine"], j["steps"]) for j in jobs] == [("sparsekv", 9), ("transformers", 9)]


def test_the_median_runs_rate_is_derived_from_the_median_time(monkeypatch):
    """Four prefill runs of 1000 tokens: the median ms is 2.5 s, so 400 tokens/s (the median of the four
    rates taken apart would be 417)."""
    runs = iter([{"ms": ms, "tokens_per_s": 1000 / (ms / 1000), "peak_rss_mb": 1.0} for ms in (1000, 2000, 3000, 4000)])
    monkeypatch.setattr(bench, "_worker", lambda job, threads: next(runs))
    out = bench._median_runs({}, 1, 4)
    assert out["ms"] == 2500 and out["tokens_per_s"] == pytest.approx(400.0)


def spec_run(ms: float, steps_per_token: float, decode_tokens: int, mtp_passes: int, drafting: bool) -> dict:
    metrics = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 10,
               "spec_decode_num_accepted_tokens_per_pos": [6, 3, 1]} if drafting else {}
    return {"tokens": [1, 2, 3], "ms_per_token": ms, "steps_per_token": steps_per_token, "decode_steps": 10,
            "decode_tokens": decode_tokens, "metrics": metrics, "mtp_passes": mtp_passes}


def test_bench_spec_bandwidth_is_bytes_per_token_over_time_per_token(capsys):
    """Plain: 20 MB a step, a step a token, 4 ms a token: 5 GB/s. Drafting: half a verification step
    (24 MB) a token and 1.5 MTP passes (8 MB each) a token, 4 ms a token: (12 + 12) MB / 4 ms = 6 GB/s
    (the time per target step is 4 / 0.5 ms, not 4 x 0.5)."""
    from sparsekv.tools.bench_spec import report
    ops = {"target": 500, "verification": 520, "extend": 190, "draft step": 100, "by_kind": {}}
    result = {"prompts": 1, "k": 3, "kv_tiering": False, "machine_gbps": 20.0, "bytes_per_step": 20e6,
              "verification_bytes_per_step": 24e6, "mtp_pass_bytes": 8e6, "pass_ops": ops,
              "pass_ms": {"extend": 1.0, "draft step": 0.5, "verification": 5.0},
              "runs": {"plain": [spec_run(4.0, 1.0, 20, 0, False)], "MTP draft": [spec_run(4.0, 0.5, 20, 30, True)]}}
    summary = report(result)["summary"]
    assert summary["plain"]["gbps"] == pytest.approx(5.0)
    drafting = summary["MTP draft"]
    assert drafting["gbps"] == pytest.approx(6.0)
    assert drafting["mtp_passes_per_token"] == 1.5
    assert (drafting["target_mb_per_token"], drafting["mtp_mb_per_token"]) == pytest.approx((12.0, 12.0))
    assert "6.00 GB/s (30%)" in capsys.readouterr().out


class FakeDraftingEngine:
    """Three engine steps: the prompt's (an extend over its rows), then two decode steps with an extend
    and a draft step each; every pass reported to `passes` as the speculator's observer would."""

    def __init__(self, passes: list):
        self.passes, self.step_count = passes, 0

    def add_request(self, request_id, prompt, params):
        pass

    def has_unfinished_requests(self) -> bool:
        return self.step_count < 3

    def step(self):
        self.step_count += 1
        if self.step_count == 1:
            self.passes.append(("extend", 9.0))
        else:
            self.passes += [("extend", 0.25), ("draft step", 0.125)]
        return [SimpleNamespace(token_ids=list(range(2 * self.step_count)), metrics={})]


def test_bench_spec_keeps_only_the_decode_steps_passes():
    from sparsekv.tools.bench_spec import decode_one
    passes = []
    run = decode_one(FakeDraftingEngine(passes), [1, 2, 3], None, passes)
    assert passes == [("extend", 0.25), ("draft step", 0.125)] * 2
    assert run["mtp_passes"] == 4 and run["decode_steps"] == 2


def test_bench_indexer_prefill_scan_alternates_policies_after_an_untimed_call_each(tmp_path, monkeypatch):
    """The engine's policy and the baseline take turns call by call, after one untimed call each, as
    the decode row's timing does; the block printed is the one used (32 queries: a block of 32)."""
    import json

    from sparsekv.model.indexer import LightningIndexer
    from sparsekv.tools.bench_indexer import main as indexer_main
    calls, select = [], LightningIndexer.select

    def recorded(self, *args, **kwargs):
        calls.append(self.policy)
        return select(self, *args, **kwargs)
    monkeypatch.setattr(LightningIndexer, "select", recorded)
    out = tmp_path / "scan.json"
    assert indexer_main(["--contexts", "1K", "--queries", "32", "--repeats", "3", "--json", str(out)]) == 0
    ours, baseline = calls[0], calls[1]
    assert ours != baseline and calls == [ours, baseline] * 4
    (row,) = json.loads(out.read_text())
    assert row["block"] == row["baseline_block"] == 32 and row["identical"]


class FakeWorker:
    def __init__(self, *args, **kwargs):
        self.engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))

    def close(self):
        pass


def test_bench_transfer_sends_an_untimed_prompt_first_and_rotates_the_modes(monkeypatch):
    from sparsekv.tools import bench_transfer
    sent = []

    def prompts_at_once(pair, mode, prompts):
        sent.append(mode)
        cold = len(sent) == 1
        return [{"prefill_s": 1.0, "transfer_s": 9.0 if cold else 0.001, "pages_sent": 1, "pages_streamed": 0,
                 "pages_by_layer": 0, "bytes": 1, "batches": 1, "backend": "gloo", "ranks_prefilling": 0} for _ in prompts]
    monkeypatch.setattr(bench_transfer, "InProcessWorker", FakeWorker)
    monkeypatch.setattr(bench_transfer, "prompts_at_once", prompts_at_once)
    args = bench_transfer.build_parser().parse_args(["--model", "m", "--prompt-tokens", "4", "--repeats", "3"])
    out = bench_transfer.run(args)
    assert sent[1:] == ["layers", "chunks", "after", "chunks", "after", "layers", "after", "layers", "chunks"]
    for mode in bench_transfer.MODES:
        assert out["backends"]["torch"][mode]["after_prefill_ms_each"] == [1.0, 1.0, 1.0]  # the cold one left out


BURNT = torch.zeros(1)


def burn(ops: int) -> None:
    """`ops` torch ops a fake engine dispatches (each an add of a tensor made before: one op per add)."""
    for _ in range(ops):
        BURNT + BURNT


def ops_of(n: int) -> int:
    from sparsekv.tools.op_count import OpCounter
    with OpCounter() as ops:
        burn(n)
    return ops.total


class FakeBatchEngine:
    """Each request gets one token a step (the first at its prefill step); a step dispatches `ops` torch
    ops and takes 2 s on `clock`; a request finishes at its max_tokens."""

    def __init__(self, clock: FakeClock, ops: int = 3):
        self.clock, self.ops = clock, ops
        self.model_config = SimpleNamespace(vocab_size=50)
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.executor = SimpleNamespace(runner=SimpleNamespace(graphs=None))  # no decode graphs

    def add_request(self, request_id, prompt, params):
        self.scheduler.waiting.append(SimpleNamespace(request_id=request_id, max_tokens=params.max_tokens,
                                                      num_output_tokens=0, token_ids=[]))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self):
        burn(self.ops)
        self.clock.now += 2.0
        sched, outs = self.scheduler, []
        sched.running.extend(sched.waiting)
        sched.waiting.clear()
        for r in list(sched.running):
            r.token_ids.append(len(r.token_ids) + int(r.request_id.split("-")[-1]))
            r.num_output_tokens += 1
            done = r.num_output_tokens == r.max_tokens
            outs.append(SimpleNamespace(request_id=r.request_id, finished=done, token_ids=list(r.token_ids),
                                        logprobs=[{t: -1.0} for t in r.token_ids]))
            if done:
                sched.running.remove(r)
        return outs


def test_bench_batch_times_each_decode_step_and_counts_one_steps_ops(monkeypatch):
    """3 timed steps of 2 s on the fake clock: 2000 ms a step (not 6000 for the three); the ops counted
    are one step's; each request's tokens come back under its own place in the batch."""
    from sparsekv.tools import bench_batch
    clock = FakeClock()
    monkeypatch.setattr(bench_batch.time, "perf_counter", clock)
    engine = FakeBatchEngine(clock, ops=3)
    args = bench_batch.build_parser().parse_args(["--batch", "3", "--prompt-tokens", "4", "--steps", "3"])
    run = bench_batch.decode_run(engine, args, "batched", 0)
    assert run["ms_per_step"] == 2000.0
    assert run["ops_per_step"] == ops_of(3)
    want = [[i + j for j in range(args.steps + 2)] for i in range(3)]   # max_tokens = steps + 2
    assert run["tokens"] == want and [[next(iter(p)) for p in lp] for lp in run["logprobs"]] == want


def batch_run(ms: float, tokens: list, logprobs: list) -> dict:
    return {"ms_per_step": ms, "ops_per_step": 100, "tokens": tokens, "logprobs": logprobs}


def test_bench_batch_report_compares_against_one_request_at_a_time(capsys):
    """4 requests, 8 ms a step one at a time and 2 ms batched: 500 and 2000 tokens/s, a 4x speed-up,
    1 and 4 GB/s of 8 MB a step. The second run's tokens differ: not identical. The largest logprob
    difference is the largest in magnitude, of any request (0.5, the second's, where batched is higher)."""
    from sparsekv.tools.bench_batch import report
    lp = [[{1: -1.0}, {2: -1.0}], [{3: -1.0}, {4: -1.0}]]
    moved = [[{1: -1.25}, {2: -1.0}], [{3: -1.0}, {4: -0.5}]]
    result = {"batch": 4, "prompt_tokens": 8, "steps": 2, "step_bytes": 8e6, "machine_gbps": 10.0, "sparse": None,
              "runs": {"one request at a time": [batch_run(8.0, [[1, 2], [3, 4]], lp), batch_run(8.0, [[5], [6]], lp)],
                       "batched": [batch_run(2.0, [[1, 2], [3, 4]], moved), batch_run(2.0, [[5], [7]], lp)]}}
    out = report(result)
    one, batched = out["summary"]["one request at a time"], out["summary"]["batched"]
    assert (one["tokens_per_s"], batched["tokens_per_s"]) == (500.0, 2000.0)
    assert (one["gbps"], batched["gbps"]) == (1.0, 4.0)
    assert out["identical_tokens"] is False and out["max_logprob_diff"] == 0.5
    printed = capsys.readouterr().out
    assert "4.00x" in printed and "greedy tokens identical: False" in printed


def test_bench_modes_prefill_skips_dense_unless_asked_and_compares_with_both_baselines(monkeypatch, capsys):
    """Dense MLA 8 ms, DSA every layer 4 ms, IndexShare 2 ms: IndexShare is 4.0x dense MLA and 2.0x DSA
    in every layer. A dense prefill runs only with --include-dense-prefill."""
    ms = {("FFFF", "dense"): 8.0, ("FFFF", "sparse"): 4.0, ("FSSS", "sparse"): 2.0}
    ran = []

    def median_runs(job, threads, repeats):
        ran.append(job["attention"])
        return {"ms": ms[job["overrides"]["index_topk_pattern"], job["attention"]], "peak_rss_mb": 1.0}
    monkeypatch.setattr(bench, "_median_runs", median_runs)
    args = bench.parse_args(["modes", "--mode-kind", "prefill", "--contexts", "512"])
    args.kind = args.mode_kind
    (row,) = bench.bench_modes(args, "ckpt")
    assert ran == ["sparse", "sparse"] and "error" in row["dense MLA"]
    capsys.readouterr()
    ran.clear()
    args = bench.parse_args(["modes", "--mode-kind", "prefill", "--contexts", "512", "--include-dense-prefill"])
    args.kind = args.mode_kind
    bench.bench_modes(args, "ckpt")
    assert ran == ["dense", "sparse", "sparse"]
    (share,) = [line for line in capsys.readouterr().out.splitlines() if "IndexShare" in line]
    assert share.split()[-4:] == ["4.0x", "│", "2.0x", "│"], share


def test_bench_spec_speed_up_is_plain_time_over_drafting_time_and_outputs_are_compared_per_prompt(capsys):
    """Two prompts, 4 ms a token plain and 2 ms drafting: 2.00x. The second prompt's drafting output
    differs from plain decoding's: 1 of 2 identical."""
    from sparsekv.tools.bench_spec import report
    ops = {"target": 500, "verification": 520, "extend": 190, "draft step": 100, "by_kind": {}}
    differs = {**spec_run(2.0, 0.5, 20, 30, True), "tokens": [1, 2, 4]}
    result = {"prompts": 2, "k": 3, "kv_tiering": False, "machine_gbps": 20.0, "bytes_per_step": 20e6,
              "verification_bytes_per_step": 24e6, "mtp_pass_bytes": 8e6, "pass_ops": ops,
              "pass_ms": {"extend": 1.0, "draft step": 0.5, "verification": 5.0},
              "runs": {"plain": [spec_run(4.0, 1.0, 20, 0, False)] * 2,
                       "MTP draft": [spec_run(2.0, 0.5, 20, 30, True), differs]}}
    assert report(result)["identical"] == 1
    printed = capsys.readouterr().out
    (drafting,) = [line for line in printed.splitlines() if line.startswith("│ MTP draft")]
    assert drafting.split()[-2:] == ["2.00x", "│"], drafting
    assert "greedy outputs identical to plain decoding: 1 of 2" in printed


class FakeH2DEngine:
    """A prompt step, then three decode steps of two tokens each; host -> device bytes: 1000 for the
    prompt, 100 for the first decode step (the MTP layer's prompt pass), 10 for each after."""

    def __init__(self):
        self.step_count = 0

    def add_request(self, request_id, prompt, params):
        pass

    def has_unfinished_requests(self) -> bool:
        return self.step_count < 4

    def step(self):
        self.step_count += 1
        h2d = {1: 1000, 2: 1100, 3: 1110, 4: 1120}[self.step_count]
        return [SimpleNamespace(token_ids=list(range(2 * self.step_count - 1)), metrics={"h2d_bytes": h2d})]


def test_bench_spec_counts_host_to_device_bytes_from_the_second_decode_step_on():
    from sparsekv.tools.bench_spec import decode_one
    run = decode_one(FakeH2DEngine(), [1, 2, 3], None)
    assert (run["decode_h2d_bytes"], run["decode_h2d_tokens"]) == (20, 4)
    assert (run["decode_steps"], run["decode_tokens"]) == (3, 6)


class FakeOpsEngine:
    """Every step dispatches `own` ops; with k drafts it also runs the speculator's passes, each under
    its observers: an extend of `extend` ops, then k - 1 draft steps of `draft` ops. One token a step."""

    def __init__(self, own: int, k: int = 0, extend: int = 0, draft: int = 0):
        self.own, self.k, self.extend, self.draft, self.observers = own, k, extend, draft, []
        self.config = SimpleNamespace(num_speculative_tokens=k)
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.speculator = SimpleNamespace(add_pass_observer=self.observers.append)

    def add_request(self, request_id, prompt, params):
        self.scheduler.waiting.append(SimpleNamespace(num_output_tokens=0, max_tokens=params.max_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _pass(self, name: str, ops: int) -> None:
        from contextlib import ExitStack
        with ExitStack() as stack:
            for observe in self.observers:
                stack.enter_context(observe(name))
            burn(ops)

    def step(self):
        burn(self.own)
        if self.k:
            self._pass("extend", self.extend)
            for _ in range(self.k - 1):
                self._pass("draft step", self.draft)
        sched = self.scheduler
        sched.running.extend(sched.waiting)
        sched.waiting.clear()
        for r in list(sched.running):
            r.num_output_tokens += 1
            if r.num_output_tokens == r.max_tokens:
                sched.running.remove(r)
        return []


def test_bench_spec_pass_ops_splits_a_drafting_step_into_its_passes():
    """Target step 7 ops; a drafting step: 5 of its own (the verification), an extend of 3 and two
    draft steps of 2: each reported as itself, the verification not counting the passes."""
    from sparsekv.tools.bench_spec import pass_ops
    plain, drafting = FakeOpsEngine(7), FakeOpsEngine(5, k=3, extend=3, draft=2)
    ops = pass_ops(plain, drafting, [1, 2, 3], steps=3)
    assert (ops["target"], ops["verification"], ops["extend"], ops["draft step"]) == \
        (ops_of(7), ops_of(5), ops_of(3), ops_of(2))
    assert not plain.has_unfinished_requests() and not drafting.has_unfinished_requests()


def transfer_figures(transfer_ms: float) -> dict:
    return {"prefill_s": 1.0, "after_prefill_ms": transfer_ms, "after_prefill_ms_each": [transfer_ms], "pages_sent": 9,
            "pages_streamed": 0, "pages_by_layer": 0, "mb": 1.0, "batches": 1, "backend": "gloo"}


def test_bench_transfer_reports_each_mode_against_sending_after_the_prefill(capsys):
    from sparsekv.tools import bench_transfer
    out = {"model": "m", "prompt_tokens": 600, "repeats": 1, "prefill_dp": 1,
           "backends": {"torch": {"layers": transfer_figures(5.0), "chunks": transfer_figures(2.5),
                                  "after": transfer_figures(10.0)}}}
    modes = bench_transfer.report(out)["backends"]["torch"]
    assert [modes[m]["over_after"] for m in bench_transfer.MODES] == [0.5, 0.25, 1.0]
    assert "x0.50" in capsys.readouterr().out


def test_bench_transfer_closes_both_workers_whatever_happens(monkeypatch):
    """Each backend's two in-process workers (engines, server threads) are closed after the run, and
    also when a prompt fails."""
    from sparsekv.tools import bench_transfer
    closed = []

    class Worker(FakeWorker):
        def close(self):
            closed.append(self)

    def failing(pair, mode, prompts):
        raise RuntimeError("the decode worker answered 500")
    monkeypatch.setattr(bench_transfer, "InProcessWorker", Worker)
    monkeypatch.setattr(bench_transfer, "prompts_at_once", failing)
    args = bench_transfer.build_parser().parse_args(["--model", "m", "--prompt-tokens", "4", "--repeats", "1"])
    with pytest.raises(RuntimeError, match="answered 500"):
        bench_transfer.run(args)
    assert len(closed) == 2 and closed[0] is not closed[1]


def test_bench_transfer_refuses_an_empty_backend_list():
    from sparsekv.tools.bench_transfer import backends
    for wanted in (",", " , ", ""):
        with pytest.raises(ValueError, match="--backends"):
            backends(wanted)
    assert backends("torch, torch") == ["torch", "torch"]


def test_bench_transfer_send_pair_fails_on_either_workers_error(monkeypatch):
    """Both workers get the same request, tagged with one room and the prefill worker's bootstrap
    address; a worker's error status, 4xx as much as 5xx, fails the pair naming that worker."""
    import httpx

    from sparsekv.tools.bench_transfer import send_pair
    posted, status = [], {}
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(
        json=lambda: {"bootstrap_host": "127.0.0.1", "bootstrap_port": 4242}))

    class Client:
        def __init__(self, timeout):
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def post(self, url, json):
            posted.append((url, json))
            code = status.get(url.split("/v1")[0], 200)
            return SimpleNamespace(status_code=code, text="no such model", json=lambda: {"url": url})
    monkeypatch.setattr(httpx, "AsyncClient", Client)
    prefill, decode = send_pair("http://p", "http://d", {"prompt": [1, 2]})
    assert prefill == {"url": "http://p/v1/completions"} and decode == {"url": "http://d/v1/completions"}
    (_, a), (_, b) = posted
    assert a == b and a["disaggregation"]["bootstrap_port"] == 4242 and a["prompt"] == [1, 2]
    for side, url in (("decode", "http://d"), ("prefill", "http://p")):
        status.clear()
        status[url] = 404
        with pytest.raises(RuntimeError, match=f"the {side} worker answered 404"):
            send_pair("http://p", "http://d", {"prompt": [1]})


class FakeSparseEngine(FakeBatchEngine):
    """FakeBatchEngine whose step dispatches 4 more ops while a request takes its first decode step (its
    prefill's last token promoted into the working set)."""

    def __init__(self, clock: FakeClock, ops: int = 3):
        super().__init__(clock, ops)
        self.config = SimpleNamespace(max_num_batched_tokens=4096, num_speculative_tokens=0)

    def step(self):
        if any(r.num_output_tokens == 1 for r in self.scheduler.running):
            burn(4)
        return super().step()


def test_bench_batch_sparse_regime_counts_a_steady_step_and_times_each(monkeypatch):
    from sparsekv.tools import bench_batch
    clock = FakeClock()
    monkeypatch.setattr(bench_batch.time, "perf_counter", clock)
    args = bench_batch.build_parser().parse_args(["--sparse-prompt-tokens", "300", "--sparse-steps", "3"])
    run = bench_batch.sparse_decode(FakeSparseEngine(clock), args, 2)
    assert run["ops"] == ops_of(3) == sum(run["by_kind"].values()) and run["ms_per_step"] == 2000.0
    assert run["tokens_per_step"] == 2  # a token per request per timed step
    assert [t[:2] for t in run["tokens"]] == [[0, 1], [1, 2]]


def sparse_path(ops: int, tokens: list) -> dict:
    return {"ops": ops, "by_kind": {"add": ops}, "ms_per_step": 1.0, "tokens": tokens}


def test_bench_batch_sparse_report_checks_the_tokens_at_every_batch(capsys):
    """The batched path's tokens differ from one request at a time's at batch 1 only: not identical."""
    from sparsekv.tools.bench_batch import report_sparse
    sparse = {f"{cache}/{path}": {1: sparse_path(10, [[1, 2]]), 4: sparse_path(12 if path == "batched" else 40, [[1]] * 4)}
              for cache in ("untiered", "tiered") for path in ("one request at a time", "batched")}
    assert report_sparse(sparse, report_console())["identical_tokens"] is True
    sparse["tiered/batched"][1] = sparse_path(10, [[1, 3]])
    out = report_sparse(sparse, report_console())
    assert out["identical_tokens"] is False and out["paths"]["untiered/batched"]["ops_ratio"] == 1.2
    assert "greedy tokens identical (every path / one request at a time): False" in capsys.readouterr().out
