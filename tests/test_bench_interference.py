"""`sparsekv bench serve --workload interference`: which inter-token gaps count, and one run against a
server (every stream and long prompt answered, the quiet phase's gaps counted from the same moment on)."""
from __future__ import annotations

import asyncio

from sparsekv.tools.bench_serve import build_parser, main
from sparsekv.tools.bench_serve_interference import Stream, format_report, run, summarize_phase


def test_only_the_gaps_that_end_under_load_count():
    split = {"queue_s": 0.0, "prefill_s": 0.5, "transfer_s": 0.25, "decode_queue_s": 0.0, "first_decode_s": 0.25}
    long = Stream(sent=2.0, times=[3.0], output_tokens=1, split=split)
    streams = [Stream(sent=0.0, times=[1.0, 2.0, 3.5, 4.0], output_tokens=4),
               Stream(sent=0.0, times=[1.5, 2.5, 2.75], output_tokens=3)]
    phase = summarize_phase(streams, [long], window=(2.0, 3.5), duration=5.0)
    assert phase["itl_ms"]["count"] == 4  # 1.0->2.0, 2.0->3.5, 1.5->2.5, 2.5->2.75; not 3.5->4.0
    assert phase["itl_ms"]["p99"] == 1500.0 and phase["itl_ms"]["p50"] == 1000.0
    assert phase["stream_ttft_ms"]["count"] == 2 and phase["long_ttft_ms"]["p50"] == 1000.0
    assert phase["stream_output_throughput"] == 7 / 5.0
    assert phase["streams_outlasted_load"] is False  # the second stream ended at 2.75, before 3.5
    assert phase["long_ttft_split_s"] == split
    quiet = summarize_phase(streams, [], window=(float("-inf"), float("inf")), duration=5.0)
    assert quiet["itl_ms"]["count"] == 5 and quiet["long_ttft_ms"]["count"] == 0


def test_interference_run_against_a_server(tmp_path_factory, capsys):
    from test_server_util import ThreadServer, tiny_checkpoint
    argv = ["--workload", "interference", "--streams", "2", "--input-len", "8", "--output-len", "12",
            "--long-prompt-len", "100", "--num-long-prompts", "2", "--long-prompt-rate", "50"]
    with ThreadServer(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))) as server:
        rep = asyncio.run(run(build_parser().parse_args(["--url", server.url, *argv])))
        assert main(["--url", server.url, *argv]) == 0
    quiet, loaded = rep["quiet"], rep["loaded"]
    assert quiet["streams_ok"] == loaded["streams_ok"] == 2 and loaded["long_prompts_ok"] == 2
    assert quiet["errors"] == loaded["errors"] == [] and loaded["streams_started_before_load"]
    assert 12 - 1 <= quiet["itl_ms"]["count"] <= 2 * (12 - 1)  # from every stream's first token: all of the last's
    assert loaded["itl_ms"]["count"] <= 2 * (12 - 1) and loaded["long_ttft_ms"]["count"] == 2
    assert loaded["long_ttft_split_s"] == {}  # a colocated server reports no transfer
    assert "ITL p99, loaded / quiet" in format_report(rep) and "ITL p99, loaded / quiet" in capsys.readouterr().out
    assert main(["--url", server.url, "--workload", "interference", "--streams", "0"]) == 2


def test_long_prompts_sent_to_another_server(tmp_path_factory, capsys):
    """--long-prompt-url: the streams run on --url, the long prompts on the other server only."""
    from test_server_util import ThreadServer, scrape, tiny_checkpoint
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with ThreadServer(model) as streams, ThreadServer(model) as neighbour:
        argv = ["--url", streams.url, "--long-prompt-url", neighbour.url, "--workload", "interference",
                "--streams", "2", "--input-len", "8", "--output-len", "12", "--long-prompt-len", "100",
                "--num-long-prompts", "2", "--long-prompt-rate", "50"]
        rep = asyncio.run(run(build_parser().parse_args(argv)))
        prompt_tokens = {name: scrape(s.url)["sparsekv:prompt_tokens_total"]
                         for name, s in (("streams", streams), ("neighbour", neighbour))}
    assert rep["loaded"]["long_prompts_ok"] == 2 and rep["loaded"]["streams_ok"] == 2
    assert prompt_tokens == {"streams": 2 * 2 * 8, "neighbour": 2 * 100}  # two phases of two streams; two long prompts
    assert f"sent to {rep['long_prompt_url']}" in format_report(rep)


def test_a_phase_whose_streams_fail_before_their_first_token_ends():
    """The long prompts wait for every stream's first token: a stream that fails first (a 503 from a
    router whose transfer failed) must not leave the phase waiting for it."""
    import httpx

    from sparsekv.tools.bench_serve_interference import run_phase
    args = build_parser().parse_args(["--url", "http://server", "--workload", "interference", "--streams", "2",
                                      "--num-long-prompts", "1", "--long-prompt-len", "8"])

    async def phase():
        transport = httpx.MockTransport(lambda request: httpx.Response(503, json={"error": {"message": "down"}}))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await asyncio.wait_for(run_phase(client, "m", args, 100, loaded=True), timeout=30)
    out = asyncio.run(phase())
    assert out["streams_ok"] == 0 and out["long_prompts_ok"] == 0 and out["errors"]


def test_the_quiet_phase_counts_gaps_from_when_every_stream_has_its_first_token(monkeypatch):
    """As the loaded phase does: stream A's first token at 1, B's at 5; A's gaps ending at 2 and 3
    (while B was still starting) do not count, those ending at 6 and 7 do, and both of B's."""
    from types import SimpleNamespace

    from sparsekv.tools import bench_serve_interference as interference
    clock, scripts = SimpleNamespace(now=0.0), [[1.0, 2.0, 3.0, 6.0, 7.0], [5.0, 6.0, 7.0]]

    async def consume(client, model, prompt, max_tokens, key, on_first=None):
        times = scripts.pop(0)
        clock.now = times[0]
        on_first()
        return Stream(sent=0.0, times=times, output_tokens=len(times))
    monkeypatch.setattr(interference, "consume", consume)
    monkeypatch.setattr(interference.time, "perf_counter", lambda: clock.now)
    args = SimpleNamespace(seed=0, api_key=None, streams=2, input_len=4, output_len=5)
    quiet = asyncio.run(interference.run_phase(None, "m", args, 100, loaded=False))
    assert quiet["itl_ms"]["count"] == 4 and quiet["itl_ms"]["p99"] == 3000.0
