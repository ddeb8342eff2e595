"""What the benchmarks measure: each figure is the thing it names (a worker's own memory, a time per
token, the same warm-up on both sides), checked on constructed inputs and fake clocks, never on time."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from sparsekv.tools import bench, bench_worker


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
                 "pages_by_layer": 0, "bytes": 1, "batches": 1, "backend": "gloo"} for _ in prompts]
    monkeypatch.setattr(bench_transfer, "InProcessWorker", FakeWorker)
    monkeypatch.setattr(bench_transfer, "prompts_at_once", prompts_at_once)
    args = bench_transfer.build_parser().parse_args(["--model", "m", "--prompt-tokens", "4", "--repeats", "3"])
    out = bench_transfer.run(args)
    assert sent[1:] == ["layers", "chunks", "after", "chunks", "after", "layers", "after", "layers", "chunks"]
    for mode in bench_transfer.MODES:
        assert out["backends"]["torch"][mode]["after_prefill_ms_each"] == [1.0, 1.0, 1.0]  # the cold one left out
