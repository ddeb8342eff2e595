"""`sparsekv bench prefill`: the ratio against transformers and the compute roofline come from the same run."""
from __future__ import annotations

import json

import torch

from sparsekv.config import ModelConfig
from sparsekv.tools.bench import indexer_pair_flops, main
from sparsekv.tools.tiny import PRESETS


def test_indexer_pair_flops_counts_causal_pairs_in_each_full_layer():
    cfg = ModelConfig.from_dict({"model_type": "glm_moe_dsa", **PRESETS["tiny-bench"]})
    per_pair = 2 * cfg.index_n_heads * cfg.index_head_dim
    brute = sum(t + 1 for t in range(300)) * per_pair * len(cfg.full_layers)   # query t sees keys 0..t
    assert indexer_pair_flops(cfg, 300) == brute > 0


def test_bench_prefill_reports_speedup_and_indexer_rate_against_the_machine(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert main(["prefill", "--contexts", "512", "--chunk", "256", "--repeats", "1", "--threads", "1",
                 "--transformers-max-context", "512", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "machine fp32 matmul" in printed and "indexer GFLOP/s (of machine)" in printed
    (row,) = json.loads(out.read_text())
    assert row["context"] == 512 and row["machine_flops"] > 0
    assert "error" not in row["sparsekv"] and "error" not in row["transformers"]
    assert row["sparsekv"]["ms"] > 0 and row["transformers"]["ms"] > 0
    cfg = ModelConfig.from_dict({"model_type": "glm_moe_dsa", **PRESETS["tiny-bench"]})
    assert row["indexer_flops"] == indexer_pair_flops(cfg, 512)
    rate = row["indexer_flops"] / (row["sparsekv"]["ms"] / 1000) / 1e9
    assert f"{rate:.1f} ({100 * rate * 1e9 / row['machine_flops']:.0f}%)" in printed
    speedup = row["transformers"]["ms"] / row["sparsekv"]["ms"]
    assert f"{speedup:.1f}x" in printed


def test_bench_indexer_times_both_policies_and_checks_they_select_the_same(tmp_path, capsys):
    """`sparsekv bench indexer`: the engine's block policy against an earlier policy in the same run,
    on the same inputs; both must select the same positions, and the module constants stay as they were."""
    from sparsekv.model import indexer
    from sparsekv.tools.bench_indexer import BASELINES, main as indexer_main
    names = ("INDEX_QUERY_BLOCK_CPU_MAX", "INDEX_SCORE_ELEMENTS_CPU", "INDEX_TILE_ELEMENTS_CPU")
    before = [getattr(indexer, n) for n in names]
    cpu = torch.device("cpu")

    def policy_of(context: int, policy=indexer.MODULE_POLICY) -> tuple[int, int]:
        block = min(indexer.index_query_block(cpu, 4, context, policy), 300)   # cut to the queries there are
        return block, indexer.index_key_tile(cpu, block, 4, context, policy)
    for baseline in sorted(BASELINES):
        out = tmp_path / f"{baseline}.json"
        assert indexer_main(["--contexts", "1K,2K", "--queries", "300", "--repeats", "1", "--baseline", baseline,
                             "--json", str(out)]) == 0
        rows = json.loads(out.read_text())
        assert [r["context"] for r in rows] == [1024, 2048] and all(r["identical"] for r in rows)
        assert all((r["block"], r["tile"]) == policy_of(r["context"]) for r in rows)
        assert all((r["block"], r["tile"]) != (r["baseline_block"], r["baseline_tile"]) for r in rows)
        assert all((r["baseline_block"], r["baseline_tile"]) == policy_of(r["context"], BASELINES[baseline])
                   for r in rows)
        assert "same selection" in capsys.readouterr().out
        assert [getattr(indexer, n) for n in names] == before


def test_bench_indexer_decode_times_one_row_in_both_layouts(tmp_path, capsys):
    """`sparsekv bench indexer --decode`: one decode row scored keys-major and query-major, the same
    selection, each layout's key stream against the device's read bandwidth, and which layout the
    engine uses at each length on this device (query-major below 32K keys on a CPU, keys-major past)."""
    from sparsekv.tools.bench_indexer import main as indexer_main
    out = tmp_path / "decode.json"
    assert indexer_main(["--decode", "--contexts", "1K,48K", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["context"] for r in rows] == [1024, 49152] and all(r["identical"] for r in rows)
    assert [r["engine_layout"] for r in rows] == ["query-major", "keys-major"]
    assert all(r["keys_major_ms"] > 0 and r["query_major_ms"] > 0 and r["machine_gb_per_s"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "read bandwidth measured now" in printed and "keys-major speed-up" in printed


def test_transformers_max_context_0_skips_the_transformers_baseline(monkeypatch):
    """`--transformers-max-context 0`: no transformers run at any context (BENCHMARKS.md's sparsekv-only rows)."""
    import pytest

    from sparsekv.tools import bench
    args = bench.parse_args(["prefill", "--contexts", "16K", "--transformers-max-context", "0"])
    assert args.transformers_max_context == 0
    assert bench.parse_args(["prefill"]).transformers_max_context == 16384
    ran = []
    monkeypatch.setattr(bench, "_median_runs", lambda job, threads, repeats: ran.append(job["engine"]) or {"ms": 1.0})
    monkeypatch.setattr(bench, "_worker", lambda job, threads: ran.append(job["engine"]) or {"ms": 2.0})
    assert bench._against_transformers(args, {"kind": "prefill", "context": 512})[1] == {"error": "skipped"}
    assert ran == ["sparsekv"]
    with pytest.raises(SystemExit):
        bench.parse_args(["prefill", "--transformers-max-context", "-1"])


def test_bench_serve_url_defaults_to_sparsekv_serves_address():
    from sparsekv.tools.bench_serve import build_parser
    assert build_parser().parse_args([]).url == "http://127.0.0.1:8000"


def test_bench_parallel_measures_the_collectives_the_planner_predicts(tmp_path, capsys):
    """Each layout runs in its own process; every layout's greedy tokens equal one rank's, and the bytes
    each rank sent per token fed and per sampled row are exactly the planner's figures."""
    out = tmp_path / "parallel.json"
    assert main(["parallel", "--batch", "2", "--prompt-tokens", "40", "--steps", "3", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"1 rank", "tp 2", "tp 2 + ep", "dp 2 + ep"}
    whole = summary["1 rank"]["weight_bytes"][0]
    for name, s in summary.items():
        assert s["identical_tokens"], name
        assert s["sent_per_token"] == s["predicted"]["per_token"]  # equal requests per rank: no padding
        assert s["sent_per_sampled_row"] == s["predicted"]["per_sampled_row"]
        if name != "1 rank":
            assert s["sent_per_token"] > 0 and len(s["weight_bytes"]) == 2
            assert all(w < whole for w in s["weight_bytes"])
    assert "tp 2 + ep" in capsys.readouterr().out


def test_bench_transfer_sends_during_the_prefill_against_one_batch_after_it(tmp_path, capsys):
    """The baseline sends every page in one batch after the prefill; chunk by chunk and layer by layer
    send the same pages in more batches, some during it, the second each layer's rows at once. All
    through a real prefill/decode pair in this process."""
    out = tmp_path / "transfer.json"
    assert main(["transfer", "--prompt-tokens", "600", "--repeats", "1", "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["backends"]["torch"]
    layers, chunks, after = modes["layers"], modes["chunks"], modes["after"]
    assert layers["backend"] == chunks["backend"] == after["backend"] == "gloo"
    assert layers["pages_sent"] == chunks["pages_sent"] == after["pages_sent"] == 599 // 64
    assert chunks["mb"] == after["mb"] < layers["mb"]  # layer by layer, the last page's rows before the last token too
    assert (after["pages_streamed"], after["batches"], after["pages_by_layer"]) == (0, 1, 0)
    assert chunks["batches"] >= 2 and chunks["pages_by_layer"] == 0  # the pages, then the last with the figures
    assert layers["pages_by_layer"] == layers["pages_sent"] and layers["batches"] >= 3  # layers, names, the last
    assert layers["over_after"] > 0 and chunks["over_after"] > 0 and "after the prefill" in capsys.readouterr().out


def test_bench_transfer_with_a_data_parallel_prefill_worker_sends_a_prompt_per_rank_layer_by_layer(tmp_path, capsys,
                                                                                                   monkeypatch):
    """Two prompts at once, a rank each, in every mode, and once more layer by layer from rank 0."""
    from collections import OrderedDict

    from sparsekv.disagg.transfer import STORE_CLIENTS
    monkeypatch.setattr(STORE_CLIENTS, "_idle", OrderedDict())  # none kept by other tests' workers
    leased, lease = set(), STORE_CLIENTS._lease  # the stores this bench's workers connect to
    monkeypatch.setattr(STORE_CLIENTS, "_lease",
                        lambda client, host, port: leased.add((host, port)) or lease(client, host, port))
    out = tmp_path / "transfer.json"
    assert main(["transfer", "--prompt-tokens", "256", "--repeats", "1", "--prefill-dp", "2", "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["backends"]["torch"]
    assert all(len(m["after_prefill_ms_each"]) == 2 for m in modes.values())  # a prompt per rank, each measured
    assert modes["layers"]["pages_by_layer"] == modes["layers"]["pages_sent"] == 255 // 64
    rank_0 = modes["layers-rank-0"]
    assert rank_0["pages_by_layer"] == rank_0["pages_sent"] and rank_0["mb"] == modes["layers"]["mb"]
    # the bench holds the worker until both prompts arrived, so the router gives each a rank (prompts of one
    # prefill chunk, which finished before the next one came: every room ran on rank 0): rank 1 sends its
    # room in every mode but the last, where rank 0 sends all
    assert all(modes[m]["sent_by_other_ranks"] == 1 for m in ("layers", "chunks", "after"))
    assert modes["layers-rank-0"]["sent_by_other_ranks"] == 0
    assert modes["chunks"]["pages_by_layer"] == 0 and "a prompt per rank" in capsys.readouterr().out
    # the prefill workers closed: no connection to their stores kept (an earlier test's room, ending on
    # a thread of its own, may still give one back to its own worker's store meanwhile)
    assert leased and sum(STORE_CLIENTS.idle(host, port) for host, port in leased) == 0


def test_bench_transfer_with_room_prompts_prefills_a_room_on_both_ranks_against_one(tmp_path, capsys, monkeypatch):
    """One request of two prompts at a time on a `-dp 2` prefill worker: the router puts them on both ranks
    (rank 0 sends the room), against both on one rank; the same pages either way."""
    from collections import OrderedDict

    from sparsekv.disagg.transfer import STORE_CLIENTS
    monkeypatch.setattr(STORE_CLIENTS, "_idle", OrderedDict())
    out = tmp_path / "transfer.json"
    assert main(["transfer", "--prompt-tokens", "256", "--repeats", "1", "--prefill-dp", "2", "--room-prompts", "2",
                 "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["backends"]["torch"]
    assert set(modes) == {"layers", "layers-one-rank"}
    spread, one_rank = modes["layers"], modes["layers-one-rank"]
    assert (spread["ranks_prefilling"], one_rank["ranks_prefilling"]) == (2, 1)
    assert spread["sent_by_other_ranks"] == 0  # a room on two ranks: rank 0 sends it, fetching rank 1's rows
    assert spread["pages_sent"] == spread["pages_by_layer"] == one_rank["pages_sent"] == 2 * (255 // 64)
    assert spread["over_one_rank"] > 0 and "against one rank" in capsys.readouterr().out


def test_bench_transfer_room_prompts_needs_a_data_parallel_prefill_worker(capsys):
    assert main(["transfer", "--prompt-tokens", "64", "--room-prompts", "2"]) == 2
    assert "give --prefill-dp 2" in capsys.readouterr().err


def test_bench_transfer_refuses_an_unknown_backend(capsys):
    assert main(["transfer", "--backends", "rdma"]) == 2
    assert "--backends" in capsys.readouterr().err
