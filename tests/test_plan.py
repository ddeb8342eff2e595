"""Tests for `sparsekv plan` (issue 6): published figures, capacity, roofline, CLI errors.

Each published number carries its source. Nothing here loads weights or a GPU; the only
measurement is one quick run of the `this-cpu` micro-benchmark.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from sparsekv.config import ModelConfig
from sparsekv.tools.hardware import PRESETS as HW, Hardware, load_hardware, measure_this_cpu
from sparsekv.tools.plan import main
from sparsekv.tools.plan_capacity import capacity, device_bytes_per_request, hot_buffer_bytes
from sparsekv.tools.plan_compare import indexcache_decode_roofline_ratio, indexshare_ratio
from sparsekv.cache.sizing import indexer_bytes_per_token_layer, latent_bytes_per_token_layer
from sparsekv.tools.plan_costs import flops_per_token, param_counts
from sparsekv.tools.plan_decode import FUSED, estimate_step, predict_decode_step_ms
from sparsekv.tools.plan_presets import load_model
from sparsekv.tools.plan_sweep import sweep_point
from sparsekv.tools.plan_workload import Deployment, PlanError, Workload, parse_contexts

K128, M1 = 128 * 1024, 1024 * 1024


def model(name):
    return load_model(name)[1]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- published cache formats

def test_deepseek_indexer_fp8_is_132_bytes():
    # DeepSeek-V3.2-Exp inference/model.py: indexer k cache is 128 x e4m3 plus one fp32 scale per
    # 128 values (act_quant block 128) -> 132 B/token/layer (model-spec.md §5, §7).
    assert indexer_bytes_per_token_layer(model("deepseek-v3.2"), "fp8") == 132
    assert indexer_bytes_per_token_layer(model("deepseek-v3.2"), "bf16") == 256


def test_flashmla_fp8_latent_is_656_bytes():
    # deepseek-ai/FlashMLA README: FP8 KV cache is 656 B/token = 512 e4m3 + 4 fp32 scales + 64 bf16 rope.
    for name in ("deepseek-v3.2", "glm-5.2"):
        assert latent_bytes_per_token_layer(model(name), "fp8") == 656
        assert latent_bytes_per_token_layer(model(name), "bf16") == 1152


def test_glm5_cache_bytes_per_token_match_spec():
    # model-spec.md §7: GLM-5 bf16 89,856 B/token MLA + 19,968 B indexer (GLM-5.1) or 5,376 (GLM-5.2).
    for name, indexer in (("glm-5", 19968), ("glm-5.2", 5376)):
        plan = json.loads(_json_plan(name, "--latent-cache", "bf16", "--indexer-cache", "bf16"))
        assert plan["memory"]["bytes_per_token"] == {"latent": 89856, "indexer": indexer,
                                                     "total": 89856 + indexer}


def test_hisparse_hot_buffer_is_292_mb_for_deepseek():
    # tiered-kv-cache.md §1.3 (SGLang HiSparseCoordinator): a request owns B + P = 4096 + 64 device
    # slots per layer; DeepSeek-V3.2 x 61 layers x 1152 B (bf16) ~= 292 MB, ~166 MB in FP8. The
    # indexer keys are not in that figure: they stay on the device, 128K x 132 B x 61 ~= 1.06 GB.
    cfg = model("deepseek-v3.2")
    wl = Workload(((K128, 1.0),), device_buffer_tokens=4096, tiering=True)
    bf16 = Deployment(HW["h200"], latent_format="bf16", indexer_format="fp8")
    assert hot_buffer_bytes(cfg, bf16, wl) == 4160 * 1152 * 61
    assert round(hot_buffer_bytes(cfg, bf16, wl) / 1e6) == 292
    assert round(hot_buffer_bytes(cfg, Deployment(HW["h200"], latent_format="fp8"), wl) / 1e6) == 166
    tiered = device_bytes_per_request(cfg, bf16, wl, tiered=True)
    assert tiered - hot_buffer_bytes(cfg, bf16, wl) == pytest.approx(1.06e9, rel=0.01)
    # same page: the full 128K latent history is 9.2 GB in bf16
    assert device_bytes_per_request(cfg, bf16, wl, tiered=False) - 1.055e9 == pytest.approx(9.2e9, rel=0.01)


def test_glm52_has_21_full_indexer_layers():
    # model-spec.md §1: GLM-5.2 config index_topk_freq 4 / offset 3 -> full at 0,1,2,6,10,...,74.
    cfg = model("glm-5.2")
    assert cfg.full_layers == [0, 1, 2, *range(6, 78, 4)]
    assert len(cfg.full_layers) == 21
    assert len(model("glm-5").full_layers) == 78


def test_parameter_totals_match_model_cards():
    # GLM-5 model card: 744B parameters, 40B active. DeepSeek-V3 report: 671B total, 37B
    # activated (V3.2 adds ~0.85B of indexers). IndexCache: "a 30B DSA model" (our stand-in).
    glm, ds, ic = (param_counts(model(n)) for n in ("glm-5", "deepseek-v3.2", "indexcache-30b"))
    assert glm.total == pytest.approx(744e9, rel=0.01)
    assert glm.active == pytest.approx(40e9, rel=0.05)
    assert ds.total == pytest.approx(671e9, rel=0.01)
    assert ds.active == pytest.approx(37e9, rel=0.05)
    assert ic.total == pytest.approx(30e9, rel=0.05)


# ---------------------------------------------------------------- FLOP ratios

def test_indexshare_ratio_at_1m_matches_glm52_blog():
    # GLM-5.2 blog: IndexShare gives 2.9x fewer FLOPs per token at 1M context. Counting only
    # 2 x active params + indexer reproduces it; the sparse-attention core (equal in both) lowers it.
    cfg = model("glm-5.2")
    assert indexshare_ratio(cfg, M1, "decode", with_attention=False) == pytest.approx(2.9, abs=0.05)
    assert indexshare_ratio(cfg, M1, "decode") == pytest.approx(2.9, rel=0.1)
    assert indexshare_ratio(cfg, M1, "decode") < indexshare_ratio(cfg, M1, "decode", with_attention=False)
    # the saving grows with context: small at 128K, and prefill (keys average T/2) saves less
    assert indexshare_ratio(cfg, K128, "decode") < 1.6
    assert indexshare_ratio(cfg, M1, "prefill") < indexshare_ratio(cfg, M1, "decode")


def test_indexcache_speedups_sit_between_bytes_and_flops():
    # IndexCache (arXiv 2603.12201): 30B DSA model, 1/4 indexers kept, H100, 200K: prefill
    # 1.82x, decode 1.48x; the indexer is 81% of prefill time at 200K.
    ic = model("indexcache-30b")
    assert len(ic.full_layers) == 12 and ic.num_hidden_layers == 47
    prefill = indexshare_ratio(ic, 200_000, "prefill")
    assert 1.82 < prefill < 4.0  # FLOPs bound the speed-up; 4x if only indexers existed
    every = flops_per_token(ic, 200_000, "dsa-every-layer", "prefill")
    assert every.indexer / every.total == pytest.approx(0.81, abs=0.06)
    assert indexcache_decode_roofline_ratio() < 1.48 < indexshare_ratio(ic, 200_000, "decode")


def test_dense_attention_grows_with_context_dsa_does_not():
    cfg = model("glm-5.2")
    dense = flops_per_token(cfg, M1, "dense-mla", "decode")
    dsa = flops_per_token(cfg, M1, "dsa-every-layer", "decode")
    assert dense.attention / dsa.attention == pytest.approx(M1 / 2048)
    assert dense.indexer == 0 and dsa.indexer > 0


# ---------------------------------------------------------------- capacity and roofline

def test_tiering_moves_the_capacity_limit():
    cfg = model("glm-5.2")
    dep = Deployment(HW["h200"], latent_format="bf16", indexer_format="bf16")
    cap = capacity(cfg, dep, Workload(((K128, 1.0),), concurrency=8))
    assert cap.per_unit["no_tiering"] == 8            # 12.5 GB per request, ~15.8 GB budget per GPU
    assert cap.per_unit["tiering"] >= 10 * cap.per_unit["no_tiering"]
    assert cap.per_unit["tiering"] <= cap.host_limit


def test_decode_reads_only_activated_experts():
    cfg = model("glm-5")
    dep = Deployment(HW["h200"])
    step = estimate_step(cfg, dep, Workload(((K128, 1.0),), concurrency=1))
    experts = next(s for s in step.stages if s.name == "experts")
    c = param_counts(cfg)
    assert experts.bytes * dep.expert_shards == pytest.approx(8 * c.expert * 75, rel=0.001)  # fp8, 8 of 256
    big = estimate_step(cfg, dep, Workload(((K128, 1.0),), concurrency=4096))
    assert next(s for s in big.stages if s.name == "experts").bytes * dep.expert_shards == pytest.approx(
        c.routed_total, rel=0.01)


def test_link_binds_at_high_miss_rate():
    cfg, dep = model("glm-5.2"), Deployment(HW["h200"])
    point = lambda miss: sweep_point(cfg, dep, Workload(((K128, 1.0),), concurrency=64, tiering=True,
                                                        miss_rate=miss), FUSED)
    assert point(1.0)["limit"] == "link bandwidth" and point(1.0)["fits"]
    assert point(0.01)["limit"] == "HBM bandwidth"


def test_predict_decode_step_ms_by_hand():
    # memory-bound machine, dense attention, batch 1: step = bytes / bandwidth, counted here from
    # the config fields directly (fp32 weights and cache).
    cfg = _tiny()
    hw = Hardware("test", "", 1e12, 1e10, 1e9, "memcpy", 1e20, 1e20, 1, 1e12)
    T = 10_000
    c = param_counts(cfg)
    expected = (c.non_expert - c.indexer_per_full_layer * c.num_full
                + cfg.num_experts_per_tok * c.expert * c.num_moe + 4 * T * 80) * 4 / 1e10
    assert predict_decode_step_ms(cfg, T, hw, "dense", profile=FUSED) == pytest.approx(expected * 1e3)
    sparse = [predict_decode_step_ms(cfg, t, hw, "sparse", profile=FUSED) for t in (1000, 100_000)]
    dense = [predict_decode_step_ms(cfg, t, hw, "dense", profile=FUSED) for t in (1000, 100_000)]
    # dense reads all 4 x 80 fp32 latents per key; DSA reads 2 indexer keys (32 fp32) + logits
    assert dense[1] > 3 * sparse[1] and dense[1] / dense[0] > 3 * sparse[1] / sparse[0]


def test_predicted_indexer_keys_stay_in_the_model_dtype_under_fp8_latents():
    """As in the engine, FP8 latents (`kv_cache_dtype`) leave the indexer keys in the model dtype; only
    `indexer_dtype` (the engine's `indexer_key_dtype`) makes them FP8. On a memory-bound machine at a
    long context the keys' bytes show in the step."""
    cfg = _tiny()
    hw = Hardware("test", "", 1e12, 1e10, 1e9, "memcpy", 1e20, 1e20, 1, 1e12)
    step = lambda **dtypes: predict_decode_step_ms(cfg, 100_000, hw, "sparse", profile=FUSED, **dtypes)  # noqa: E731
    assert step(cache_dtype="fp8") == step(cache_dtype="fp8", indexer_dtype="float32")
    assert step(cache_dtype="fp8", indexer_dtype="fp8") < step(cache_dtype="fp8")


# ---------------------------------------------------------------- CLI and bad input

def _json_plan(*argv):
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main([*argv, "--json"])
    return buf.getvalue()


def test_json_plan_is_consistent():
    plan = json.loads(_json_plan("glm-5.2", "--context", "64K:0.5,1M:0.5", "--concurrency", "16", "--tiering"))
    dec = plan["decode"]
    assert set(dec["bytes_per_step_per_gpu"]) >= {"weights", "selected_kv", "indexer_keys", "host_to_device"}
    assert dec["tok_s_aggregate"] == pytest.approx(16 * dec["tok_s_per_request"])
    assert plan["workload"]["mean_context"] == pytest.approx((64 * 1024 + M1) / 2)
    assert plan["verdict"]["fits"] and plan["verdict"]["binding"] == dec["binding"]


def test_table_output_and_plot(capsys, tmp_path):
    png = tmp_path / "plan.png"
    rc, out, err = run(capsys, "deepseek-v3.2", "--context", "128K", "--sweep", "--plot", str(png))
    assert rc == 0 and err == ""
    for title in ("KV cache per token", "Decode roofline", "FLOPs per token", "Sweep, tiering"):
        assert title in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bf16_weights_do_not_fit(capsys):
    rc, out, _ = run(capsys, "glm-5", "--weights", "bf16", "--json")
    verdict = json.loads(out)["verdict"]
    assert rc == 1 and not verdict["fits"] and verdict["binding"] == "HBM capacity"
    assert "weights need" in verdict["message"]


def test_impossible_even_with_tiering_names_the_binding_resource(capsys):
    rc, out, _ = run(capsys, "glm-5.2", "--context", "1M", "--concurrency", "512", "--tiering",
                     "--latent-cache", "bf16", "--indexer-cache", "bf16")
    assert rc == 1
    assert "does not fit even with tiering" in out and "binding: HBM capacity" in out
    rc, out, _ = run(capsys, "glm-5.2", "--context", "1M", "--concurrency", "16", "--tiering",
                     "--latent-cache", "bf16", "--indexer-cache", "bf16", "--host-dram-gb", "256", "--json")
    assert rc == 1 and json.loads(out)["verdict"]["binding"] == "host capacity"


@pytest.mark.parametrize("argv, words", [
    (["glm-9"], "unknown model 'glm-9'"),
    (["glm-5", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["glm-5", "--context", "12Q"], "cannot read '12Q'"),
    (["glm-5", "--tp", "3"], "must divide"),
    (["glm-5", "--miss-rate", "2"], "--miss-rate"),
    (["glm-5", "--weights", "int4"], "invalid choice"),
    (["glm-5", "--device-buffer-tokens", "100"], "must be >= top-k 2048"),
    (["glm-5", "--hardware", "this-cpu:x"], "must be a number"),
    (["glm-5", "--hardware", "this-cpu:0"], "must be a number"),
    (["glm-5", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["glm-5", "--tp", "0"], "--tp, --dp, --nodes and --gpus-per-node must be >= 1"),
    (["glm-5", "--dp", "0"], "--tp, --dp, --nodes and --gpus-per-node must be >= 1"),
    (["glm-5", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["glm-5", "--context", ","], "--context is empty"),
    (["glm-5", "--context", ""], "--context is empty"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_config_missing_fields_is_one_line_exit_2(capsys, tmp_path):
    raw = {"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    rc, out, err = run(capsys, str(tmp_path))
    assert rc == 2 and err.count("\n") == 1
    assert "missing required field(s)" in err and "hidden_size" in err


def test_context_beyond_the_model_is_a_warning(capsys):
    rc, out, _ = run(capsys, "deepseek-v3.2", "--context", "1M", "--concurrency", "8", "--tiering", "--json")
    plan = json.loads(out)
    assert rc == 0 and "max_position_embeddings 163,840" in plan["warnings"][0]


def test_parse_contexts():
    assert parse_contexts("131072") == ((131072, 1.0),)
    assert parse_contexts("128K") == ((K128, 1.0),) and parse_contexts("1M") == ((M1, 1.0),)
    assert parse_contexts("64K:1,1M:3") == ((65536, 0.25), (M1, 0.75))
    with pytest.raises(PlanError):
        parse_contexts("64K:-1")


# ---------------------------------------------------------------- hardware

def test_measure_this_cpu_is_quick_and_sane(tmp_path):
    start = time.perf_counter()
    hw = measure_this_cpu(quick=True, threads=1)
    assert time.perf_counter() - start < 3.0
    assert hw.measured and 1e8 < hw.mem_bw < 1e12 and 1e8 < hw.flops_bf16 < 1e14
    assert 0 < hw.op_overhead_s < 1e-3 and hw.topk_s_per_key > 0
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw.to_dict()))
    assert load_hardware(str(path)) == hw


def _tiny() -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="glm_moe_dsa", vocab_size=1000, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_topk=64, index_head_dim=32, index_n_heads=2, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=256, first_k_dense_replace=1,
        index_topk_freq=2, index_skip_topk_offset=1))


def _weight_to_request_kv_ratio(cfg, dep, context=64 * 1024, per_rank=4):
    """Weight bytes read per decode step over the cache bytes one request reads in that step."""
    est = estimate_step(cfg, dep, Workload(((context, 1.0),), concurrency=per_rank * dep.attention_ranks))
    b = est.bytes_by_stage()
    return (b["weights"] + b["experts"]) / ((b["attention"] + b["indexer"]) / per_rank)


def test_glm52_proportions_preset_has_the_flagships_decode_cost_structure():
    """`bench tiers --preset glm5.2-proportions` stands in for GLM-5.2 in the fixed-budget run: the
    ratio of weights to one request's cache reads per step must be GLM-5.2's, not tiny-bench's."""
    from sparsekv.tools.tiny import PRESETS
    cpu = Deployment(HW["h200"].with_node(gpus_per_node=1), tp=1, ep=False, weight_format="fp32",
                     latent_format="fp32", indexer_format="fp32")
    flagship = _weight_to_request_kv_ratio(model("glm-5.2"), Deployment(HW["h200"]))
    stand_in = _weight_to_request_kv_ratio(
        ModelConfig.from_dict({"model_type": "glm_moe_dsa", **PRESETS["glm5.2-proportions"]}), cpu)
    tiny = _weight_to_request_kv_ratio(ModelConfig.from_dict({"model_type": "glm_moe_dsa", **PRESETS["tiny-bench"]}), cpu)
    assert 100 < flagship < 200
    assert abs(stand_in / flagship - 1) < 0.25
    assert tiny < 2


def test_prefix_cache_tiers_count_warm_contexts_and_restore_time(capsys):
    """GLM-5.2 at 1M in FP8: a cached token is every layer's 656 B latent plus 132 B of indexer keys in
    its 21 indexer layers; 1.8 TB of host DRAM keeps 31 such contexts, restored over the 55 GB/s host
    link; 30 TB of disk at 6 GB/s keeps 530."""
    plan = json.loads(_json_plan("glm-5.2", "--context", "1M", "--prefix-cache-host-gb", "1800",
                                 "--prefix-cache-disk-tb", "30"))["prefix_cache"]
    assert plan["bytes_per_token"] == 78 * 656 + 21 * 132
    per_context = plan["bytes_per_token"] * (1 << 20)
    host, disk = plan["tiers"]["host"], plan["tiers"]["disk"]
    assert host["contexts"] == int(1800e9 // per_context) == 31 and disk["contexts"] == int(30e12 // per_context)
    assert host["restore_s"] == pytest.approx(per_context / 55e9) and disk["restore_s"] == pytest.approx(per_context / 6e9)
    assert host["speedup_vs_recompute"] == pytest.approx(plan["recompute_s"] / host["restore_s"])
    assert "disk" not in json.loads(_json_plan("glm-5.2", "--prefix-cache-host-gb", "10"))["prefix_cache"]["tiers"]
    assert "prefix_cache" not in json.loads(_json_plan("glm-5.2"))
    assert main(["glm-5.2", "--prefix-cache-disk-tb", "-1"]) == 2
    assert "--prefix-cache-disk-tb" in capsys.readouterr().err


# ---------------------------------------------------------------- parallel layout (--tp/--dp/--ep/--nodes)

def _parallel(*argv):
    return json.loads(_json_plan(*argv))["parallel"]


def test_parallel_weights_are_sizings_per_rank_bytes():
    from sparsekv.cache.sizing import Parallelism, weight_bytes_per_rank
    cfg = model("glm-5")
    for argv, par in ((("--tp", "8", "--dp", "1"), Parallelism(8, 1, True)),
                      ((), Parallelism(1, 8, True)), (("--nodes", "2"), Parallelism(1, 16, True)),
                      (("--tp", "2", "--no-ep"), Parallelism(2, 4, False))):
        w = _parallel("glm-5", *argv)["weights_per_gpu"]
        want = weight_bytes_per_rank(cfg, par, "fp8")
        assert (w["replicated"], w["sharded"], w["routed_experts"]) == (want.replicated, want.sharded, want.experts)
        assert w["total"] == want.total and w["mtp_layer"] > 0
    one, two = _parallel("glm-5")["weights_per_gpu"], _parallel("glm-5", "--nodes", "2")["weights_per_gpu"]
    assert two["routed_experts"] * 2 == one["routed_experts"] and two["experts_per_gpu"] == 16
    assert (two["replicated"], two["sharded"]) == (one["replicated"], one["sharded"])


def test_tp_does_not_divide_kv_dp_multiplies_requests():
    # GLM-5.2 in FP8: a token costs 78 x 656 B of latent + 21 x 132 B of indexer keys on every GPU that
    # holds its request, whatever tp is; requests per node = requests per dp rank x dp / nodes, and
    # per replica = requests per dp rank x dp where a TP group spans the nodes.
    per_token = 78 * 656 + 21 * 132
    layouts = [("--tp", "8"), ("--tp", "2", "--dp", "4"), (), ("--nodes", "2"), ("--nodes", "2", "--tp", "16")]
    for argv in layouts:
        par = _parallel("glm-5.2", *argv)
        dp, nodes = par["dp"], 1 if "16" in argv else par["nodes"]
        for row in par["kv_per_gpu"]:
            assert row["kv_per_request"] == row["context"] * per_token
            for policy in ("no_tiering", "tiering"):
                per_node = row["per_gpu"][policy] * dp // nodes
                assert row["per_node"][policy] == (per_node if policy == "no_tiering"
                                                   else min(per_node, row["host_limit"]))
    assert [r["context"] for r in _parallel("glm-5.2")["kv_per_gpu"]] == [K128, M1]
    # tiered, each of the 8 tp ranks keeps its own host copy of the latent history (0.9 of 2048 GB usable)
    host = [r["host_limit"] for r in _parallel("glm-5.2", "--tp", "8")["kv_per_gpu"]]
    assert host == [int(0.9 * 2048e9 // (8 * t * 78 * 656)) for t in (K128, M1)]


def test_collectives_in_the_plan_by_hand():
    # GLM-5, bf16 hidden states (6144 x 2 B). DP 8 + EP: 8 copies of each token there and back, 7/8 off-rank.
    (moe,) = _parallel("glm-5")["collectives"]
    assert (moe["op"], moe["ranks"], moe["times"]) == ("all_to_all", 8, 75)
    assert moe["per_token"] == 2 * 8 * 6144 * 2 * 7 / 8 == 172_032
    assert moe["per_step"] == moe["per_token"] * 75 * 2   # 16 requests per node over 8 dp ranks
    tp8 = {c["name"]: c for c in _parallel("glm-5", "--tp", "8")["collectives"]}
    assert tp8["attention output (o_proj)"]["per_token"] == 2 * 7 / 8 * 6144 * 2 == 21_504
    assert tp8["lm_head logits (vocab-parallel)"]["per_token"] == 7 / 8 * 154880 * 4
    assert not any(c["op"] == "all_to_all" for c in tp8.values())  # dp 1: every rank has every token
    # TP 8 x DP 2: a dp rank's 16 tokens are on all 8 of its tp ranks; each token is dispatched once
    a2a = _parallel("glm-5", "--nodes", "2", "--tp", "8")["collectives"][-1]
    assert a2a["op"] == "all_to_all" and a2a["per_step"] == 2 * 8 * 6144 * 2 * 15 / 16 * 75 * 16 / 8
    meet = _parallel("deepseek-v3.2", "--nodes", "2", "--concurrency", "32")["moe_meeting"]
    assert (meet["tokens_per_rank"], meet["tokens_all_ranks"], meet["expert_rows_per_rank"]) == (4, 64, 4 * 8)


def test_parallel_only_report(capsys):
    rc, out, err = run(capsys, "deepseek-v3.2", "--nodes", "2", "--tp", "2", "--parallel-only")
    assert rc == 0 and err == ""
    for words in ("2 nodes x 8x H200", "TP 2 x DP 8", "Weights per GPU", "KV cache per GPU", "all_to_all",
                  "tokens meet at the MoE"):
        assert words in out
    assert "Decode roofline" not in out


@pytest.mark.parametrize("argv, words", [
    (["glm-5", "--tp", "2", "--dp", "2"], "--tp 2 x --dp 2 = 4 ranks, but --nodes 1 x --gpus-per-node 8 = 8 GPUs"),
    (["glm-5", "--nodes", "2", "--tp", "32"], "--tp 32 must divide the 16 GPUs"),
    (["glm-5", "--gpus-per-node", "12", "--tp", "12"], "num_attention_heads (64) is not divisible by the "
                                                        "tensor-parallel size (--tp"),
    (["glm-5", "--gpus-per-node", "12"], "n_routed_experts (256) is not divisible by the world size 12"),
    (["deepseek-v3.2", "--nodes", "0"], "--nodes"),
])
def test_bad_parallel_layout_is_one_line_exit_2(capsys, argv, words):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and words in err and err.count("\n") == 1


# ---------------------------------------------------------------- review: inputs, host DRAM, layouts

@pytest.mark.parametrize("context", ["1M:nan", "1M:inf,128K:1", "1M:1e308,128K:1e308"])
def test_context_weights_must_be_finite(capsys, context):
    rc, out, err = run(capsys, "glm-5", "--context", context)
    assert rc == 2 and out == "" and "--context" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag, values", [
    ("--disk-gbps", ["inf", "nan", "0", "-1"]), ("--host-dram-gb", ["inf", "nan", "-1", "1e305"]),
    ("--prefix-cache-host-gb", ["nan", "inf", "-1"]), ("--prefix-cache-disk-tb", ["nan", "inf", "-1"]),
    ("--miss-rate", ["nan", "inf", "-0.1", "1.5"]), ("--mem-fraction", ["nan", "inf", "0", "1.1"]),
])
def test_float_flags_must_be_finite_and_in_range(capsys, flag, values):
    for value in values:
        argv = ["glm-5", "--tiering", "--prefix-cache-host-gb", "1", "--prefix-cache-disk-tb", "1", flag, value]
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "", (flag, value)
        assert f"argument {flag}:" in err and err.count("\n") == 1 and "Traceback" not in err


def _profile(tmp_path, **changes):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**HW["h200"].to_dict(), **changes}))
    return str(path)


@pytest.mark.parametrize("field, value", [
    ("mem_bw", 0), ("link_bw", 0), ("flops_fp8", 0), ("flops_bf16", -1), ("mem_bw", "4.8e12"),
    ("device_mem_bytes", -141e9), ("gpus_per_node", 8.5), ("host_dram_bytes", None), ("measured", "no"),
    ("name", 3), ("gpus_per_node", 0), ("threads", 1.5), ("mem_bw", float("inf")), ("host_dram_bytes", -1),
])
def test_bad_hardware_profile_names_file_and_field(capsys, tmp_path, field, value):
    path = _profile(tmp_path, **{field: value})
    rc, out, err = run(capsys, "glm-5", "--hardware", path)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert path in err and repr(field) in err


def test_hardware_profile_with_nan_is_refused(capsys, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(HW["h200"].to_dict()).replace("4800000000000.0", "NaN"))
    rc, _, err = run(capsys, "glm-5", "--hardware", str(path))
    assert rc == 2 and "'mem_bw'" in err


def test_host_dram_where_a_tp_group_spans_nodes():
    """GLM-5 in FP8 at 1M with tiering: a request's latent history is 78 x 656 B x 2^20 = 53.65 GB on
    the host per copy, and every TP rank keeps its own copy; a node has 0.9 x 2048 GB = 1843.2 GB usable.

    2 nodes, TP 16 (DP 1): --concurrency 3 counts the replica's requests, all on its one DP rank; each
    node holds 8 of that rank's 16 TP ranks, so 3 x 8 x 53.65 = 1287.7 GB per node. A node backs
    floor(1843.2 / (8 x 53.65)) = 4 requests of its DP rank: 4 per replica.

    4 nodes, TP 16 (DP 2): --concurrency 6 is 3 per DP rank; a node holds 8 TP ranks of one DP rank,
    so again 3 x 8 x 53.65 = 1287.7 GB per node (not 6 x 8), and the replica backs 4 x 2 = 8 requests;
    9 need 5 on one DP rank, 5 x 8 x 53.65 = 2146 GB on its nodes: host capacity binds.
    """
    copy = 78 * 656 * M1
    two = json.loads(_json_plan("glm-5", "--nodes", "2", "--tp", "16", "--context", "1M", "--tiering",
                                "--concurrency", "3"))
    assert two["deployment"]["capacity_unit"] == "replica"
    assert two["memory"]["host_needed"] == 3 * 8 * copy == pytest.approx(1287.7e9, rel=1e-4)
    assert two["memory"]["host_limit_requests"] == 4 and two["decode"]["requests_per_gpu"] == 3
    four = json.loads(_json_plan("glm-5", "--nodes", "4", "--tp", "16", "--context", "1M", "--tiering",
                                 "--concurrency", "6"))
    assert four["memory"]["host_needed"] == 3 * 8 * copy and four["memory"]["host_limit_requests"] == 8
    assert four["verdict"]["fits"]
    over = json.loads(_json_plan("glm-5", "--nodes", "4", "--tp", "16", "--context", "1M", "--tiering",
                                 "--concurrency", "9"))
    assert over["memory"]["host_needed"] == 5 * 8 * copy and over["verdict"]["binding"] == "host capacity"


def test_tp_group_must_fit_a_node_or_span_whole_nodes(capsys):
    rc, out, err = run(capsys, "glm-5", "--gpus-per-node", "12", "--nodes", "2", "--tp", "8", "--no-ep")
    assert rc == 2 and "--tp 8 must divide --gpus-per-node 12" in err and err.count("\n") == 1


def test_dense_attention_with_tiering_is_a_usage_error(capsys):
    rc, out, err = run(capsys, "glm-5", "--attention", "dense", "--tiering")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--tiering needs --attention sparse" in err
    assert main(["glm-5", "--attention", "dense", "--context", "8K", "--concurrency", "1", "--json"]) == 0


def test_dense_attention_plan_shows_no_tiered_figures(capsys):
    """Tiering selects from the indexer's top-k: with dense attention (which --tiering refuses) the
    tables and the sweep leave out the tiered rows and columns; sparse attention keeps them."""
    rc, out, _ = run(capsys, "glm-5.2", "--attention", "dense", "--context", "128K", "--sweep")
    assert rc == 0 and "no tiering" in out and "Sweep, no tiering" in out
    assert not re.search(r"│\s+tiering\s+│|tiered|Sweep, tiering", out), out
    rc, out, _ = run(capsys, "glm-5.2", "--context", "128K", "--sweep")
    assert rc == 0 and re.search(r"│\s+tiering\s+│", out) and "tiered max" in out and "Sweep, tiering" in out


def _keys(tree) -> set[str]:
    if isinstance(tree, dict):
        return set(tree) | set().union(*map(_keys, tree.values()))
    return set().union(*map(_keys, tree)) if isinstance(tree, list) else set()


def test_dense_attention_json_and_plot_hold_no_tiered_figures(capsys, tmp_path):
    """`--json` is what scripts read: with dense attention it carries the untiered figures only (no
    tiered capacity, host limit, hot buffer or tiered sweep point), and the plot draws without them."""
    tiered = {"tiering", "kv_per_request_tiering", "hot_buffer_per_request", "host_per_request",
              "host_limit", "host_limit_requests", "host_needed", "host_available", "device_buffer_tokens",
              "miss_rate", "link_bound_above_miss_rate"}
    png = tmp_path / "dense.png"
    rc, out, _ = run(capsys, "glm-5.2", "--attention", "dense", "--context", "128K", "--sweep", "--plot",
                     str(png), "--json")
    plan = json.loads(out)
    assert rc == 0 and png.stat().st_size > 0
    assert _keys(plan) & tiered == {"tiering"}  # the workload's "tiering": false and each sweep point's
    assert plan["workload"]["tiering"] is False and not any(p["tiering"] for p in plan["sweep"])
    assert all(set(plan["memory"][k]) == {"no_tiering"} for k in ("device_per_request", "max_requests_per_gpu"))
    assert all(set(r["per_node"]) == {"no_tiering"} for r in plan["parallel"]["kv_per_gpu"])
    sparse = json.loads(_json_plan("glm-5.2", "--context", "128K", "--sweep"))
    assert _keys(sparse) >= tiered and any(p["tiering"] for p in sparse["sweep"])


def test_dense_attention_misfit_does_not_suggest_tiering(capsys):
    """GLM-5.2 at 1M with dense attention does not fit 2 requests per GPU; the verdict must not send the user to
    --tiering, which dense attention refuses (exit 2), with a tiered max it cannot have."""
    argv = ["glm-5.2", "--attention", "dense", "--context", "1M", "--concurrency", "16"]
    rc, out, _ = run(capsys, *argv, "--json")
    v = json.loads(out)["verdict"]
    assert rc == 1 and v["binding"] == "HBM capacity" and v["message"].startswith("does not fit: 2 requests per GPU")
    assert "--tiering" not in v["message"] and "binding: HBM capacity" in v["message"]
    assert run(capsys, *argv, "--tiering")[0] == 2
    sparse = json.loads(_json_plan("glm-5.2", "--context", "1M", "--concurrency", "16"))["verdict"]["message"]
    assert "with --tiering max" in sparse


def test_capacity_is_per_replica_where_a_tp_group_spans_nodes(capsys):
    """GLM-5 on 2 nodes at TP 16 has one DP rank over both nodes: one 1M request fits on it, and
    --concurrency 1 is that one request, reported as 1 per replica (not 0 per node)."""
    rc, out, _ = run(capsys, "glm-5", "--nodes", "2", "--tp", "16", "--context", "1M", "--concurrency", "1",
                     "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["verdict"]["fits"] and "1 requests per replica" in plan["verdict"]["message"]
    assert plan["memory"]["max_requests_per_gpu"]["no_tiering"] == 1
    assert plan["memory"]["max_requests_per_node"]["no_tiering"] == 1
    rc, out, _ = run(capsys, "glm-5", "--nodes", "2", "--tp", "16", "--context", "1M", "--concurrency", "2")
    assert rc == 1 and "max 1 per replica" in out and "max/replica" in out
    one = json.loads(_json_plan("glm-5", "--nodes", "2", "--tp", "8"))
    assert one["deployment"]["capacity_unit"] == "node"


@pytest.mark.parametrize("argv, rc", [(["glm-5", "--nodes", "2", "--tp", "8"], 1), (["glm-5"], 1),
                                      (["glm-5.2", "--nodes", "2", "--concurrency", "8"], 0)])
def test_parallel_only_prints_the_verdict(capsys, argv, rc):
    got, out, _ = run(capsys, *argv, "--parallel-only")
    verdict = json.loads(_json_plan(*argv))["verdict"]
    assert got == rc and verdict["message"] in out
    assert ("does not fit" in out) == (rc == 1)


def test_layout_the_engine_refuses_gets_a_note(capsys):
    rc, out, _ = run(capsys, "glm-5", "--nodes", "2", "--tp", "8", "--parallel-only")
    assert "note: sparsekv's engine does not run TP 8 x DP 2 yet" in out
    assert json.loads(_json_plan("glm-5", "--nodes", "2", "--tp", "8"))["notes"]
    for argv in (("glm-5",), ("glm-5", "--tp", "8"), ("glm-5", "--nodes", "2", "--tp", "16")):
        assert json.loads(_json_plan(*argv))["notes"] == []
        assert "note:" not in run(capsys, *argv)[1]


# ---------------------------------------------------------------- review: what each misfit message says

def test_weights_misfit_suggests_fp8_only_when_weights_are_not_fp8(capsys):
    """GLM-5 on one GPU does not fit in either format; only bf16 weights are told to try fp8."""
    messages = {}
    for fmt in ("bf16", "fp8"):
        rc, out, _ = run(capsys, "glm-5", "--gpus-per-node", "1", "--weights", fmt, "--json")
        messages[fmt] = json.loads(out)["verdict"]["message"]
        assert rc == 1 and messages[fmt].startswith("does not fit: weights need")
    assert "or use --weights fp8" in messages["bf16"] and "--weights fp8" not in messages["fp8"]


def test_host_capacity_misfit_names_host_dram_and_the_max():
    plan = json.loads(_json_plan("glm-5.2", "--context", "1M", "--concurrency", "16", "--tiering",
                                 "--latent-cache", "bf16", "--indexer-cache", "bf16", "--host-dram-gb", "256"))
    mem, v = plan["memory"], plan["verdict"]
    assert v["binding"] == "host capacity"
    assert v["message"] == (f"does not fit even with tiering: 16 requests per node need {mem['host_needed'] / 1e9:.0f} "
                            f"GB of host DRAM per node, a node has {mem['host_available'] / 1e9:.0f} GB usable; max "
                            f"{mem['max_requests_per_node']['tiering']} per node (binding: host capacity)")


def test_tiered_hbm_misfit_counts_the_tiered_request_bytes():
    """With tiering a request's device bytes are its hot buffer plus indexer keys, not its whole latent
    history: the message's per-request figure and max are the tiered ones."""
    plan = json.loads(_json_plan("glm-5.2", "--context", "1M", "--concurrency", "512", "--tiering",
                                 "--latent-cache", "bf16", "--indexer-cache", "bf16"))
    mem, v = plan["memory"], plan["verdict"]
    per_rank = plan["decode"]["requests_per_gpu"]
    assert v["binding"] == "HBM capacity" and mem["device_per_request"]["tiering"] < mem["device_per_request"]["no_tiering"]
    assert v["message"].startswith(f"does not fit even with tiering: {per_rank} requests per GPU x "
                                   f"{mem['device_per_request']['tiering'] / 1e9:.2f} GB exceed")
    assert f"max {mem['max_requests_per_node']['tiering']} per node" in v["message"]


def test_deployment_validate_refuses_a_zero_mem_fraction():
    """The API checks what the CLI's --mem-fraction does: no usable device memory is not a deployment."""
    with pytest.raises(PlanError, match="--mem-fraction must be in"):
        Deployment(HW["h200"], mem_fraction=0.0).validate()
    Deployment(HW["h200"], tp=8, mem_fraction=1.0).validate()


def test_workload_validate_refuses_a_miss_rate_above_one():
    with pytest.raises(PlanError, match="--miss-rate must be in"):
        Workload(((1000, 1.0),), miss_rate=1.5).validate()
    Workload(((1000, 1.0),), miss_rate=1.0).validate()


@pytest.mark.parametrize("context", ["64K:0", "64K:0,1M:1"])
def test_context_weights_must_be_positive(capsys, context):
    rc, out, err = run(capsys, "glm-5", "--context", context)
    assert rc == 2 and out == "" and "weights in --context must be finite numbers > 0" in err
    assert err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- review: hardware profiles and presets

@pytest.mark.parametrize("changes, field", [({"gpus_per_node": True}, "gpus_per_node"),
                                            ({"mem_bw": False}, "mem_bw"),
                                            ({"hbm_gb": 141}, "hbm_gb")])
def test_hardware_profile_with_a_boolean_or_unknown_field_is_refused(capsys, tmp_path, changes, field):
    """JSON true is not a GPU count, nor false a bandwidth (bool is an int in Python); a field the
    profile does not have is a typo, not something to ignore."""
    path = _profile(tmp_path, **changes)
    rc, out, err = run(capsys, "glm-5", "--hardware", path)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert path in err and field in err


def test_hardware_profile_without_host_dram_is_accepted(tmp_path):
    """host_dram_bytes 0 is a node with no host DRAM for the cache: a valid profile (tiering backs nothing)."""
    hw = load_hardware(_profile(tmp_path, host_dram_bytes=0))
    assert hw.host_dram_bytes == 0 and hw.device_mem_bytes == HW["h200"].device_mem_bytes


def test_hardware_preset_names_ignore_case():
    assert load_hardware("H200") is HW["h200"] and load_hardware("GH200") is HW["gh200"]


def test_measure_this_cpu_restores_the_thread_count():
    """Measuring with the engine's thread count must not leave it set for the rest of the process."""
    import torch
    before = torch.get_num_threads()
    measure_this_cpu(quick=True, threads=before + 1)
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------- review: the tables print what the plan holds

def _render(renderable) -> str:
    import io
    from rich.console import Console
    con = Console(file=io.StringIO(), width=250)
    con.print(renderable)
    return con.file.getvalue()


def _row(text: str, first_cell: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("│") and ln.split("│")[1].strip() == first_cell)
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_sizes_switch_from_mb_to_gb_at_ten_megabytes():
    from sparsekv.tools.plan_report import _gb
    assert _gb(9_999_999) == "10.00 MB" and _gb(10_000_000) == "0.01 GB" and _gb(141e9) == "141.00 GB"


def test_header_names_nodes_and_context_weights_only_where_there_are_several():
    from sparsekv.tools.plan_report import header
    one = header(json.loads(_json_plan("glm-5")))
    assert "nodes x" not in one and "\n8x H200" in one and "context 128K, " in one and " x1.00" not in one
    two = header(json.loads(_json_plan("glm-5.2", "--nodes", "2", "--context", "64K:1,1M:3", "--concurrency", "8")))
    assert "\n2 nodes x 8x H200" in two and "context 64K x0.25, 1M x0.75, " in two


def test_cache_table_rows_hold_their_own_cache_kind():
    """GLM-5 in FP8: a latent row of 656 B x 78 layers, an indexer-key row of 132 B x 78 layers."""
    from sparsekv.tools.plan_report import cache_table
    text = _render(cache_table(json.loads(_json_plan("glm-5"))))
    assert _row(text, "latent (MLA)")[:5] == ["latent (MLA)", "fp8", "656", "78", f"{656 * 78:,}"]
    assert _row(text, "indexer keys")[:5] == ["indexer keys", "fp8", "132", "78", f"{132 * 78:,}"]


def test_capacity_table_shows_the_host_limit_on_the_tiered_row():
    from sparsekv.tools.plan_report import capacity_table
    plan = json.loads(_json_plan("glm-5"))
    row = _row(_render(capacity_table(plan)), "tiering")
    assert row[3] == f"{plan['memory']['max_requests_per_node']['tiering']} (host allows " \
                     f"{plan['memory']['host_limit_requests']})"


def test_parallel_kv_caption_marks_rows_beyond_the_model():
    """GLM-5's rows are 128K (within its 202,752 positions) and 1M (beyond): the * needs its caption."""
    from sparsekv.tools.plan_report import parallel_kv_table
    table = parallel_kv_table(json.loads(_json_plan("glm-5")))
    assert table.caption == "* beyond the model's max_position_embeddings: a what-if"


def test_collectives_table_of_a_single_rank():
    """One GPU per replica (GH200): no collective to list, a 'none' row, and no EP caption."""
    from sparsekv.tools.plan_report import collectives_table
    plan = json.loads(_json_plan("glm-5.2", "--hardware", "gh200", "--context", "8K", "--concurrency", "1"))
    assert plan["parallel"]["collectives"] == [] and plan["parallel"]["world"] == 1 and plan["parallel"]["ep"]
    table = collectives_table(plan)
    assert _row(_render(table), "none")[:4] == ["none", "-", "1", "one rank per replica"]
    assert table.caption is None
    assert collectives_table(json.loads(_json_plan("glm-5", "--tp", "8"))).caption.startswith("EP with DP 1")


def test_table_report_prints_warnings_and_the_prefix_cache(capsys):
    rc, out, _ = run(capsys, "deepseek-v3.2", "--context", "1M", "--concurrency", "8", "--tiering",
                     "--prefix-cache-host-gb", "100")
    assert rc == 0 and "warning: context 1,048,576 is beyond the model's max_position_embeddings" in out
    assert "Prefix cache tiers" in out and "recompute (prefill, ideal)" in out


# ---------------------------------------------------------------- mutation review: the parallel layout's figures

def test_parallel_mtp_layer_is_what_it_adds_to_a_ranks_weights():
    from sparsekv.cache.sizing import Parallelism, weight_bytes_per_rank
    cfg, par = model("glm-5"), Parallelism(1, 8, True)
    w = _parallel("glm-5")["weights_per_gpu"]
    assert w["mtp_layer"] == (weight_bytes_per_rank(cfg, par, "fp8", mtp=True).total
                              - weight_bytes_per_rank(cfg, par, "fp8").total)
    assert w["mtp_layer"] < w["total"]


def test_tokens_meet_at_the_moe_over_every_rank_of_the_world():
    """GLM-5 on 2 nodes at TP 8 x DP 2 with EP: a dp rank's 16 requests (32 per replica) are on all 8 of its
    tp ranks; the world of 16 ranks splits the 32 tokens' 8 experts each: 32 x 8 / 16 = 16 rows per rank."""
    meet = _parallel("glm-5", "--nodes", "2", "--tp", "8")["moe_meeting"]
    assert (meet["tokens_per_rank"], meet["tokens_all_ranks"], meet["expert_rows_per_rank"]) == (16, 32, 32 * 8 / 16)


# ---------------------------------------------------------------- mutation review: experts per GPU, bad sizes, the API's checks

@pytest.mark.parametrize("argv, experts", [(("--tp", "8"), 32), (("--tp", "2"), 32), (("--nodes", "2", "--tp", "8"), 16),
                                           (("--tp", "8", "--no-ep"), 256)])
def test_experts_per_gpu_are_split_over_every_rank_with_ep(argv, experts):
    """GLM-5's 256 routed experts with EP: whole experts over all tp x dp ranks (8, or 16 on 2 nodes), whatever
    the split between tp and dp; without EP every GPU holds a 1/tp slice of all 256."""
    w = _parallel("glm-5", *argv)["weights_per_gpu"]
    assert w["experts_per_gpu"] == experts


def test_gather_scatter_alternative_counts_every_rank_of_the_world():
    """TP 8 x DP 2 on 2 nodes: the all-gather + reduce-scatter alternative moves (16 - 1) hidden states of
    6144 bf16 values each way per token, over the world of 16 ranks (not the 2 dp ranks)."""
    meet = _parallel("glm-5", "--nodes", "2", "--tp", "8")["moe_meeting"]
    assert meet["gather_scatter_per_token"] == 2 * 15 * 6144 * 2


def test_the_apis_validate_what_the_cli_parser_would():
    """Deployment and Workload (and predict_decode_step_ms, which builds them) refuse what argparse keeps from
    the CLI: an unknown number format or attention mode, and host DRAM that is not a finite size >= 0."""
    with pytest.raises(PlanError, match="weight-format 'int4' is not one of"):
        Deployment(HW["h200"], weight_format="int4").validate()
    with pytest.raises(PlanError, match="latent-format 'e5m2' is not one of"):
        Deployment(HW["h200"], latent_format="e5m2").validate()
    for host_gb in (float("nan"), float("inf"), -1.0):
        with pytest.raises(PlanError, match="--host-dram-gb must be a finite number >= 0"):
            Deployment(HW["h200"].with_node(host_dram_gb=host_gb)).validate()
    with pytest.raises(PlanError, match="attention mode 'mla'"):
        Workload(((1000, 1.0),), attention_mode="mla").validate()
    cfg, hw = _tiny(), HW["h200"]
    with pytest.raises(PlanError, match="attention mode 'Sparse'"):
        predict_decode_step_ms(cfg, 1000, hw, attention_mode="Sparse")
    with pytest.raises(PlanError, match="weight-format 'int8'"):
        predict_decode_step_ms(cfg, 1000, hw, dtype="int8")


def test_prefix_cache_example_in_docs_plan_md():
    """docs/plan.md's example (GLM-5.2 at 1M on 8x H200, FP8): 56.6 GB per context; 1.8 TB of host DRAM keeps
    31, restored in 1.03 s, 12.5x faster than the 12.8 s ideal prefill; 30 TB of disk keeps 530, restored in
    9.4 s at 6 GB/s, 1.4x faster. The prefill counts GLM-5.2's own 21 indexer layers."""
    plan = json.loads(_json_plan("glm-5.2", "--context", "1M", "--prefix-cache-host-gb", "1800",
                                 "--prefix-cache-disk-tb", "30"))["prefix_cache"]
    host, disk = plan["tiers"]["host"], plan["tiers"]["disk"]
    assert f"{plan['bytes_per_context'] / 1e9:.1f}" == "56.6" and f"{plan['recompute_s']:.1f}" == "12.8"
    assert (host["contexts"], f"{host['restore_s']:.2f}", f"{host['speedup_vs_recompute']:.1f}") == (31, "1.03", "12.5")
    assert (disk["contexts"], f"{disk['restore_s']:.1f}", f"{disk['speedup_vs_recompute']:.1f}") == (530, "9.4", "1.4")
