"""`sparsekv plan`'s formulas (docs/plan.md), each checked against a count written out here from a small
config's dimensions: parameters from the checkpoint's tensor shapes, FLOPs per token, the device and host
bytes of a request, the stages of a decode step, the prefix-cache restore and the sweep's link crossing.

Tiny config (TINY below), by hand: hidden d 128, vocab V 1000, 4 layers (1 dense MLP + 3 MoE), H 4 heads,
q_lora 64, MLA latent C 64 + rope R 16, nope 32, v 32; indexer H_I 2 heads x D_I 32, top-k 64, in layers
0 and 2 (freq 2, offset 1); 8 routed experts of 64 (top-2) + 1 shared, dense MLP 256.
No weights, no GPU.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from sparsekv.config import ModelConfig
from sparsekv.tools.hardware import PRESETS as HW
from sparsekv.tools.hardware import Hardware
from sparsekv.tools.plan_capacity import device_bytes_per_request
from sparsekv.tools.plan_costs import flops_per_token, param_counts, with_variant
from sparsekv.tools.plan_decode import FUSED, EngineProfile, estimate_step
from sparsekv.tools.plan_prefix import prefix_cache_section
from sparsekv.tools.plan_presets import load_model
from sparsekv.tools.plan_sweep import link_bound_miss_rate, run_sweep, sweep_point
from sparsekv.tools.plan_workload import Deployment, PlanError, Workload, format_tokens, parse_tokens
from tolerances import REGROUPED64

V, D, L, H, Q, C, R, NOPE, VH = 1000, 128, 4, 4, 64, 64, 16, 32, 32
TOPK, DI, HI, E, K, MOE, INTER = 64, 32, 2, 8, 2, 64, 256
FULL = 2              # indexer layers 0 and 2
N_MOE, N_DENSE = 3, 1
FP32 = 4
LATENT_FP32 = (C + R) * FP32   # 320 B per token per layer
INDEXER_FP32 = DI * FP32       # 128 B per token per indexer layer
TINY = dict(model_type="glm_moe_dsa", vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
            q_lora_rank=Q, kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, v_head_dim=VH,
            index_topk=TOPK, index_head_dim=DI, index_n_heads=HI, n_routed_experts=E, num_experts_per_tok=K,
            moe_intermediate_size=MOE, intermediate_size=INTER, first_k_dense_replace=N_DENSE,
            index_topk_freq=2, index_skip_topk_offset=1)

# parameters by the checkpoint's tensor shapes
ATTN = (D * Q + Q                      # q_a_proj, q_a_layernorm
        + Q * H * (NOPE + R)           # q_b_proj
        + D * (C + R) + C              # kv_a_proj_with_mqa, kv_a_layernorm
        + C * H * (NOPE + VH)          # kv_b_proj
        + H * VH * D                   # o_proj
        + 2 * D)                       # input and post-attention norms
INDEXER = Q * HI * DI + D * DI + 2 * DI + D * HI   # wq_b, wk, k_norm (weight + bias), weights_proj
EXPERT = 3 * D * MOE                               # gate, up, down
MOE_ALWAYS = E * D + E + EXPERT                    # router, its correction bias, one shared expert
LM_HEAD = V * D + D                                # lm_head and the final norm
# what one token multiplies: every layer's attention, the indexers, the dense MLP, the MoE's router,
# shared expert and top-2 experts, and lm_head; not the embedding (a lookup)
ACTIVE = L * ATTN + FULL * INDEXER + N_DENSE * 3 * D * INTER + N_MOE * (MOE_ALWAYS + K * EXPERT) + LM_HEAD
TOTAL = ACTIVE - N_MOE * K * EXPERT + N_MOE * E * EXPERT + V * D


def tiny(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **changes})


def machine(gpus=1, **changes) -> Hardware:
    """A made-up accelerator whose rates are round numbers."""
    hw = Hardware("test", "test", 1e12, 1e11, 1e10, "link", 1e14, 4e14, gpus, 1e12)
    return dataclasses.replace(hw, **changes)


def fp32(hw: Hardware, **changes) -> Deployment:
    return Deployment(hw, **{"tp": 1, "ep": False, "weight_format": "fp32", "latent_format": "fp32",
                             "indexer_format": "fp32", **changes})


def stage(step, name):
    return next(s for s in step.stages if s.name == name)


def unique_experts(tokens: int) -> float:
    """Distinct experts `tokens` tokens activate, each routing uniformly to K of E: E (1 - (1 - K/E)^tokens)."""
    return E * (1 - (1 - K / E) ** tokens)


# ---------------------------------------------------------------- parameters and FLOPs

def test_parameter_counts_by_tensor_shapes():
    c = param_counts(tiny())
    assert c.active == ACTIVE
    assert c.total == TOTAL
    assert c.routed_total == N_MOE * E * EXPERT


@pytest.mark.parametrize("T", [50, 64, 1000])
def test_decode_flops_per_token_by_hand(T):
    """Decode: 2 x active params; absorbed MLA over C + R dims for the scores and C for the values, over
    all T keys (dense) or min(T, top-k) (DSA); the indexer's H_I x (2 D_I + 2) per earlier key per layer."""
    cfg = tiny()
    n = min(T, TOPK)
    dense = flops_per_token(cfg, T, "dense-mla", "decode")
    assert dense.attention == L * 2 * H * T * ((C + R) + C) and dense.indexer == 0
    assert dense.weights == 2 * (ACTIVE - FULL * INDEXER)       # no indexer weights in dense MLA
    every = flops_per_token(cfg, T, "dsa-every-layer", "decode")
    assert every.attention == L * 2 * H * n * ((C + R) + C)
    assert every.indexer == L * HI * T * (2 * DI + 2)
    assert every.weights == 2 * (ACTIVE + (L - FULL) * INDEXER)
    shared = flops_per_token(cfg, T, "dsa-indexshare", "decode")   # the config's own schedule
    assert shared.indexer == FULL * HI * T * (2 * DI + 2) and shared.weights == 2 * ACTIVE


@pytest.mark.parametrize("T", [50, 64, 65, 1000])
def test_prefill_flops_per_token_average_over_the_prompt(T):
    """Prefill is averaged over positions t = 1..T: position t attends min(t, k) keys (DSA, absorbed) or t
    (dense MLA, MHA mode: qk_head_dim + v_head_dim per key and head), and its indexer scores t keys."""
    cfg = tiny()
    mean_t = sum(range(1, T + 1)) / T
    mean_sel = sum(min(t, TOPK) for t in range(1, T + 1)) / T
    dense = flops_per_token(cfg, T, "dense-mla", "prefill")
    assert dense.attention == pytest.approx(L * 2 * H * mean_t * ((NOPE + R) + VH), rel=REGROUPED64)
    every = flops_per_token(cfg, T, "dsa-every-layer", "prefill")
    assert every.attention == pytest.approx(L * 2 * H * mean_sel * ((C + R) + C), rel=REGROUPED64)
    assert every.indexer == pytest.approx(L * HI * mean_t * (2 * DI + 2), rel=REGROUPED64)


def test_indexshare_variant_of_glm5_is_glm52s_schedule():
    """GLM-5 has an indexer in every layer; its IndexShare variant takes GLM-5.2's schedule (freq 4,
    offset 3, the transformers rule test_config.py checks): the same 21 of 78 layers."""
    glm5, glm52 = load_model("glm-5")[1], load_model("glm-5.2")[1]
    variant, n = with_variant(glm5, "dsa-indexshare")
    assert variant.indexer_types == glm52.indexer_types and n == 21


# ---------------------------------------------------------------- memory per request

@pytest.mark.parametrize("T, slots", [(100, 128), (128, 128), (129, 192), (130, 192), (10_000, 192)])
def test_tiered_request_device_bytes_by_hand(T, slots):
    """Tiered (HiSparse): latent slots grow page by page (64 tokens) up to the buffer (default 2 x top-k =
    128), then the buffer plus one page; the indexer keys of all T tokens stay on the device."""
    cfg, dep = tiny(), fp32(machine())
    assert slots == (math.ceil(T / 64) * 64 if T <= 2 * TOPK else 2 * TOPK + 64)
    wl = Workload(((T, 1.0),), tiering=True)
    assert device_bytes_per_request(cfg, dep, wl, tiered=True) == slots * L * LATENT_FP32 + T * FULL * INDEXER_FP32
    assert device_bytes_per_request(cfg, dep, wl, tiered=False) == T * (L * LATENT_FP32 + FULL * INDEXER_FP32)


def test_host_capacity_binds_only_past_what_host_dram_holds():
    """GLM-5 in FP8 at 1M, 2 nodes at TP 16: each node keeps 8 copies of a request's 78 x 656 B latent
    history per token; 0.9 of 2048 GB backs floor(1843.2e9 / (8 x 78 x 656 x 2^20)) requests."""
    copy = 78 * 656 * (1 << 20)
    host_limit = int(0.9 * 2048e9 // (8 * copy))
    argv = ["glm-5", "--nodes", "2", "--tp", "16", "--context", "1M", "--tiering", "--json"]
    fits = _plan(*argv, "--concurrency", str(host_limit))
    assert fits["memory"]["host_limit_requests"] == host_limit and fits["verdict"]["fits"]
    over = _plan(*argv, "--concurrency", str(host_limit + 1))
    assert over["verdict"]["binding"] == "host capacity"


# ---------------------------------------------------------------- decode step stages

def test_decode_stages_by_hand():
    """3 requests of 1000 tokens on one fp32 device, fused kernels, no tiering."""
    cfg, b, T = tiny(), 3, 1000
    step = estimate_step(cfg, fp32(machine()), Workload(((T, 1.0),), concurrency=b), FUSED)
    weights, experts = stage(step, "weights"), stage(step, "experts")
    assert weights.flops == 2 * b * (ACTIVE - N_MOE * K * EXPERT)
    assert weights.bytes == FP32 * (ACTIVE - N_MOE * K * EXPERT)
    assert experts.flops == 2 * b * K * EXPERT * N_MOE
    assert experts.bytes == pytest.approx(FP32 * N_MOE * unique_experts(b) * EXPERT, rel=REGROUPED64)
    attn, idx = stage(step, "attention"), stage(step, "indexer")
    assert attn.flops == b * L * 2 * H * TOPK * ((C + R) + C) and attn.bytes == b * L * TOPK * LATENT_FP32
    # every key of each indexer layer, plus 8 B of fp32 logits written and read back by top-k
    assert idx.flops == b * FULL * HI * T * (2 * DI + 2) and idx.bytes == b * FULL * T * (INDEXER_FP32 + 8)
    assert stage(step, "host->device").link_bytes == 0


def test_fused_decode_skips_the_indexer_until_the_context_exceeds_top_k():
    cfg = tiny()
    at = lambda T: stage(estimate_step(cfg, fp32(machine()), Workload(((T, 1.0),)), FUSED), "indexer")  # noqa: E731
    assert at(TOPK).flops == 0 and at(TOPK).bytes == 0
    assert at(TOPK + 1).bytes == FULL * (TOPK + 1) * (INDEXER_FP32 + 8)


@pytest.mark.parametrize("T, miss", [(1000, 0.25), (1000, 0.0), (100, 0.5), (2 * TOPK, 0.5)])
def test_tiered_decode_link_bytes_by_hand(T, miss):
    """Each layer brings in miss_rate x min(T, k) selected latent rows and backs the newest token up;
    a context within the device buffer (2 x top-k) has no misses."""
    b = 2
    wl = Workload(((T, 1.0),), concurrency=b, tiering=True, miss_rate=miss)
    link = stage(estimate_step(tiny(), fp32(machine()), wl, FUSED), "host->device").link_bytes
    misses = miss * min(T, TOPK) if T > 2 * TOPK else 0
    assert link == pytest.approx(b * L * (misses + 1) * LATENT_FP32, rel=REGROUPED64)


def test_decode_with_tensor_parallelism_by_hand():
    """TP 2 with FP8 weights: each rank computes half the heads; an unfused profile's score passes cover
    its H/2 heads and each gather pass re-reads the selected rows; the embedding (bf16 in FP8 releases,
    split over TP) is looked up, not read; one fp32 scale per 128x128 tile of FP8 expert weights."""
    from sparsekv.cache.sizing import Parallelism, weight_bytes_per_rank
    cfg, b, T = tiny(), 2, 1000
    dep = Deployment(machine(gpus=2), tp=2, ep=False, weight_format="fp8", latent_format="fp32",
                     indexer_format="fp32")
    profile = EngineProfile("test", attention_score_passes=1, gather_passes=1)
    step = estimate_step(cfg, dep, Workload(((T, 1.0),), concurrency=b), profile)
    attn = stage(step, "attention")
    assert attn.flops == b * L * 2 * H * TOPK * ((C + R) + C) / 2
    assert attn.bytes == b * L * TOPK * (2 * LATENT_FP32 + FP32 * (H // 2))
    rank = weight_bytes_per_rank(cfg, Parallelism(2, 1, False), "fp8")
    assert stage(step, "weights").bytes == rank.replicated + rank.sharded - 2 * (V * D // 2)
    per_rank_expert = EXPERT / 2
    assert stage(step, "experts").bytes == pytest.approx(
        N_MOE * unique_experts(b) * per_rank_expert * (1 + 4 / (128 * 128)), rel=REGROUPED64)


@pytest.mark.parametrize("ep, tp, dp, shards", [(True, 1, 2, 2), (False, 1, 2, 1), (False, 2, 1, 2)])
def test_experts_meet_over_expert_parallel_ranks(ep, tp, dp, shards):
    """2 GPUs, 4 requests: with EP every rank's tokens (4) meet at experts split over both ranks; without,
    a rank runs its own tokens on whole experts (DP) or on its half of every expert (TP)."""
    cfg = tiny()
    dep = fp32(machine(gpus=2), tp=tp, dp=dp, ep=ep)
    experts = stage(estimate_step(cfg, dep, Workload(((1000, 1.0),), concurrency=4), FUSED), "experts")
    tokens = 4 if ep or dp == 1 else 2
    assert experts.flops == 2 * tokens * K * EXPERT * N_MOE / shards
    assert experts.bytes == pytest.approx(FP32 * N_MOE * unique_experts(tokens) / shards * EXPERT, rel=REGROUPED64)


def test_dispatch_overhead_counts_launches_per_layer_and_per_step():
    profile = EngineProfile("test", ops_per_layer=10, ops_per_step=5)
    step = estimate_step(tiny(), fp32(machine(op_overhead_s=1e-6)), Workload(((1000, 1.0),)), profile)
    assert stage(step, "overhead").fixed_s == pytest.approx((10 * L + 5) * 1e-6, rel=REGROUPED64)
    assert step.times["overhead"] == pytest.approx((10 * L + 5) * 1e-6, rel=REGROUPED64)


def test_fp8_weights_run_at_the_fp8_peak():
    """A machine with unbounded bandwidth is compute bound: the step is the FLOPs over the FP8 rate
    (4e14 here, against 1e14 in bf16) when the weights are FP8."""
    dep = Deployment(machine(mem_bw=1e30, link_bw=1e30), tp=1, ep=False, weight_format="fp8")
    step = estimate_step(tiny(), dep, Workload(((1000, 1.0),), concurrency=2), FUSED)
    assert step.times["compute"] == pytest.approx(sum(s.flops for s in step.stages) / 4e14, rel=REGROUPED64)


# ---------------------------------------------------------------- prefix cache, sweep

def test_prefix_restore_against_recompute_on_every_gpu():
    """A cached context costs its latents and indexer keys; recomputing it costs T x the mean prefill
    FLOPs per token (with the config's own indexer schedule, here one in every layer) at the fp32 peak of
    all 2 GPUs of the node."""
    cfg = tiny(index_topk_freq=1)          # every layer runs its own indexer
    T = 1000
    dep = fp32(machine(gpus=2), dp=2)
    pc = prefix_cache_section(cfg, dep, Workload(((T, 1.0),)), host_gb=1.0, disk_tb=0.0, disk_gbps=6.0)
    per_token = L * LATENT_FP32 + L * INDEXER_FP32
    assert pc["bytes_per_context"] == T * per_token
    weights = 2 * (ACTIVE + (L - FULL) * INDEXER) * T
    attention = L * 2 * H * sum(min(t, TOPK) for t in range(1, T + 1)) * ((C + R) + C)
    indexer = L * HI * sum(range(1, T + 1)) * (2 * DI + 2)
    assert pc["prefill_flops"] == pytest.approx(weights + attention + indexer, rel=REGROUPED64)
    assert pc["recompute_s"] == pytest.approx((weights + attention + indexer) / (2 * 1e14), rel=REGROUPED64)
    assert pc["tiers"]["host"]["restore_s"] == pytest.approx(T * per_token / 1e10, rel=REGROUPED64)


def _tiered(T=1000, n=4, miss=0.1):
    return Workload(((T, 1.0),), concurrency=n, tiering=True, miss_rate=miss)


def test_link_bound_miss_rate_is_where_link_time_overtakes_the_rest():
    """Link time is linear in the miss rate: b L (m k + 1) rows / link bandwidth; it binds above the miss
    rate where it equals the largest other resource's time."""
    cfg, b = tiny(), 4
    dep = fp32(machine(link_bw=1e8))
    rest = max(v for name, v in estimate_step(cfg, dep, _tiered(miss=0.0), FUSED).times.items() if name != "link")
    base = b * L * LATENT_FP32 / 1e8
    slope = b * L * TOPK * LATENT_FP32 / 1e8
    assert base < rest < base + slope                   # crosses between 0 and 1
    # rest - base cancels: the two sides' rounding, relative to rest, grows by rest / (rest - base)
    assert link_bound_miss_rate(cfg, dep, _tiered(), FUSED) == pytest.approx((rest - base) / slope,
                                                                             rel=REGROUPED64 * rest / (rest - base))
    assert link_bound_miss_rate(cfg, fp32(machine(link_bw=1e15)), _tiered(), FUSED) is None   # never binds
    assert link_bound_miss_rate(cfg, fp32(machine(link_bw=1e3)), _tiered(), FUSED) == 0.0     # binds at once


def test_sweep_link_crossing_is_taken_at_the_largest_load_that_fits():
    cfg, dep = tiny(), fp32(machine(link_bw=1e8))
    points = run_sweep(cfg, dep, _tiered(), FUSED, contexts=(1000,), concurrencies=(1, 2, 4))
    tiered = [p for p in points if p["tiering"]]
    assert all(p["fits"] for p in tiered)
    want = link_bound_miss_rate(cfg, dep, _tiered(n=4), FUSED)
    assert want != link_bound_miss_rate(cfg, dep, _tiered(n=1), FUSED)
    assert all(p["link_bound_above_miss_rate"] == want for p in tiered)


def test_sweep_says_when_host_dram_is_what_limits_tiering():
    """With 1 MB of host DRAM the node backs 0.9e6 // (1000 x 4 x 320 B) = 0 tiered requests of 1000
    tokens, though the device holds many: the limit is the host's; untiered, the device's."""
    cfg = tiny()
    dep = fp32(machine(host_dram_bytes=1e6))
    tiered = sweep_point(cfg, dep, _tiered(n=1), FUSED)
    assert tiered["max_per_node"] == 0 == tiered["host_limit"] and tiered["max_limited_by"] == "host"
    plain = sweep_point(cfg, dep, dataclasses.replace(_tiered(n=1), tiering=False), FUSED)
    assert plain["max_limited_by"] == "device" and plain["max_per_node"] > 0


# ---------------------------------------------------------------- CLI figures and inputs

def _plan(*argv):
    import contextlib
    import io
    from sparsekv.tools.plan import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main([*argv, "--json"] if "--json" not in argv else list(argv))
    return json.loads(buf.getvalue())


def test_json_plan_summary_fields():
    plan = _plan("glm-5.2")
    assert plan["model"]["indexer_layers"] == 21 and plan["model"]["layers"] == 78
    assert plan["workload"]["device_buffer_tokens"] == 2 * 2048       # SGLang's default: 2 x top-k
    assert plan["workload"]["concurrency"] == 16


def test_host_dram_gb_is_decimal_gigabytes():
    plan = _plan("glm-5.2", "--host-dram-gb", "100")
    assert plan["hardware"]["host_dram_bytes"] == 100e9
    assert plan["memory"]["host_available"] == pytest.approx(0.9 * 100e9, rel=REGROUPED64)


def test_cache_budget_is_zero_not_negative_when_weights_overflow():
    assert _plan("glm-5", "--weights", "bf16")["memory"]["cache_budget_per_gpu"] == 0.0


def test_without_ep_each_gpu_holds_a_slice_of_every_expert():
    par = _plan("glm-5", "--tp", "2", "--no-ep")["parallel"]
    assert par["weights_per_gpu"]["experts_per_gpu"] == 256


def test_fp32_weights_send_fp32_hidden_states():
    """DP 8 + EP: each token's hidden state (6144 values) goes to its 8 experts and back, 7/8 off-rank;
    4 B per value when the engine computes in fp32."""
    (moe,) = _plan("glm-5", "--weights", "fp32")["parallel"]["collectives"]
    assert moe["per_token"] == 2 * 8 * 6144 * 4 * 7 / 8


def test_context_at_the_models_limit_is_no_warning():
    assert _plan("deepseek-v3.2", "--context", "163840", "--concurrency", "1")["warnings"] == []
    assert _plan("deepseek-v3.2", "--context", "163841", "--concurrency", "1")["warnings"]


def test_device_buffer_must_hold_top_k(capsys):
    from sparsekv.tools.plan import main
    assert main(["glm-5.2", "--device-buffer-tokens", "2047", "--tiering"]) == 2
    assert "must be >= top-k 2048" in capsys.readouterr().err
    assert _plan("glm-5.2", "--device-buffer-tokens", "2048", "--tiering")["workload"]["device_buffer_tokens"] == 2048


def test_measured_profile_defaults_to_fp32_everything(tmp_path):
    """A measured machine (a CPU profile) runs the engine in fp32: weights and both caches default to it."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({**dataclasses.asdict(machine()), "measured": True}))
    dep = _plan("glm-5.2", "--hardware", str(path), "--context", "8K", "--concurrency", "1")["deployment"]
    assert (dep["weights"], dep["latent_cache"], dep["indexer_cache"]) == ("fp32", "fp32", "fp32")


def test_token_counts_parse_and_print_in_binary_units():
    assert parse_tokens("128K") == 128 * 1024 and parse_tokens("1.5M") == 1536 * 1024
    for text in ("0", "0.5"):
        with pytest.raises(PlanError, match="at least 1 token"):
            parse_tokens(text)
    for text in ("1.9", "1.1K"):  # 1,126.4 tokens
        with pytest.raises(PlanError, match="not a whole number of tokens"):
            parse_tokens(text)
    assert format_tokens(1 << 20) == "1M" and format_tokens(1536 * 1024) == "1536K"
    assert format_tokens(100_000) == "100,000"


def test_top_k_must_be_positive(capsys):
    with pytest.raises(PlanError, match="--topk"):
        Workload(((1000, 1.0),), topk=0).validate()
    from sparsekv.tools.plan import main
    assert main(["glm-5", "--topk", "0"]) == 2 and "--topk" in capsys.readouterr().err


def test_gh200_host_link_is_one_direction_of_nvlink_c2c():
    # NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s bidirectional, so 450 GB/s host to device.
    assert HW["gh200"].link_bw == 450e9 and HW["gh200"].link_name == "NVLink-C2C"


def test_tokens_meet_at_the_moe_only_with_several_dp_ranks():
    """TP 8 x DP 1: every rank already has every token, so there is no meeting; DP 8 + EP: a rank's 2
    requests (16 per node over 8 ranks) meet the other 14, and each rank's 32 experts compute
    16 x 8 / 8 = 16 rows per MoE layer."""
    assert _plan("glm-5", "--tp", "8")["parallel"]["moe_meeting"] is None
    meet = _plan("glm-5")["parallel"]["moe_meeting"]
    assert (meet["tokens_per_rank"], meet["tokens_all_ranks"], meet["expert_rows_per_rank"]) == (2, 16, 16 * 8 / 8)


def test_parallel_kv_rows_flag_contexts_beyond_the_model():
    rows = _plan("glm-5")["parallel"]["kv_per_gpu"]     # GLM-5: 202,752 positions
    assert [(r["context"], r["beyond_model"]) for r in rows] == [(128 * 1024, False), (1 << 20, True)]


# ---------------------------------------------------------------- review: bounds, defaults and what the JSON holds

def test_fractions_at_their_upper_bound_are_accepted():
    """--mem-fraction and --miss-rate take their closed upper bound 1 (all of device memory; every
    selected token missing the device)."""
    plan = _plan("glm-5.2", "--tiering", "--mem-fraction", "1", "--miss-rate", "1")
    assert plan["deployment"]["mem_fraction"] == 1.0 and plan["workload"]["miss_rate"] == 1.0


def test_weights_that_fill_the_usable_memory_exactly_leave_no_cache_budget(tmp_path):
    """Device memory exactly the weights per GPU, all usable: a cache budget of 0 B is the weights'
    fault, so the verdict says the weights need more GPUs (not that requests exceed a 0 GB budget)."""
    weights = _plan("glm-5.2", "--weights", "fp32")["memory"]["weights_per_gpu"]
    path = tmp_path / "exact.json"
    path.write_text(json.dumps({**HW["h200"].to_dict(), "device_mem_bytes": weights}))
    plan = _plan("glm-5.2", "--weights", "fp32", "--hardware", str(path), "--mem-fraction", "1")
    assert plan["memory"]["weights_per_gpu"] == weights and plan["memory"]["cache_budget_per_gpu"] == 0.0
    assert plan["memory"]["max_requests_per_gpu"] == {"no_tiering": 0, "tiering": 0}
    v = plan["verdict"]
    assert not v["fits"] and v["binding"] == "HBM capacity"
    assert v["message"].startswith("does not fit: weights need") and "--weights fp8" in v["message"]


def test_a_mixed_context_warns_about_its_longest_context():
    """DeepSeek-V3.2 has 163,840 positions: half the requests at 1M are beyond it, whatever the other half."""
    (warning,) = _plan("deepseek-v3.2", "--context", "64K:0.5,1M:0.5", "--concurrency", "1", "--tiering")["warnings"]
    assert "context 1,048,576 is beyond" in warning


def test_host_dram_is_needed_only_with_tiering():
    """Without tiering the whole cache stays on the device: no host DRAM needed (the capacity figure
    per request is still reported, for the tiered row)."""
    flat, tiered = _plan("glm-5.2"), _plan("glm-5.2", "--tiering")
    assert flat["memory"]["host_needed"] == 0.0 and flat["memory"]["host_per_request"] > 0
    assert tiered["memory"]["host_needed"] == 16 * tiered["memory"]["host_per_request"]


def test_prefix_cache_section_with_a_disk_tier_alone():
    plan = _plan("glm-5.2", "--prefix-cache-disk-tb", "1")
    assert list(plan["prefix_cache"]["tiers"]) == ["disk"]
    assert plan["prefix_cache"]["tiers"]["disk"]["capacity_bytes"] == 1e12
    assert "prefix_cache" not in _plan("glm-5.2")


def test_measured_profile_defaults_to_the_torch_eager_engine(tmp_path):
    """A measured machine runs the eager torch engine (docs/plan.md): its decode is predicted with that
    profile unless --profile says otherwise; datasheet presets default to the fused one."""
    from sparsekv.tools.plan_decode import TORCH_EAGER
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({**dataclasses.asdict(machine()), "measured": True}))
    argv = ("glm-5.2", "--hardware", str(path), "--context", "8K", "--concurrency", "1")
    assert _plan(*argv)["decode"]["profile"] == TORCH_EAGER.name
    assert _plan(*argv, "--profile", "fused")["decode"]["profile"] == FUSED.name
    assert _plan("glm-5.2")["decode"]["profile"] == FUSED.name


def test_sweep_is_in_the_json_without_a_plot():
    plan = _plan("glm-5.2", "--sweep")
    assert plan["sweep"] and all({"context", "concurrency"} <= set(p) for p in plan["sweep"])
    assert "sweep" not in _plan("glm-5.2")


def test_plot_title_names_the_nodes(tmp_path, monkeypatch):
    from sparsekv.tools import plan_sweep
    titles = []
    monkeypatch.setattr(plan_sweep, "plot_sweep", lambda points, path, title: titles.append(title))
    _plan("glm-5.2", "--nodes", "2", "--concurrency", "8", "--plot", str(tmp_path / "a.png"))
    _plan("glm-5.2", "--plot", str(tmp_path / "b.png"))
    assert titles == ["glm-5.2 on 2x8x h200", "glm-5.2 on 8x h200"]


def test_zero_host_dram_means_no_host_store():
    """--host-dram-gb 0 is a node without host DRAM for the cache (not "the preset's"): tiering backs no
    request, and host capacity binds."""
    plan = _plan("glm-5.2", "--tiering", "--host-dram-gb", "0")
    assert plan["hardware"]["host_dram_bytes"] == 0.0 and plan["memory"]["host_available"] == 0.0
    assert plan["memory"]["host_limit_requests"] == 0 and plan["memory"]["max_requests_per_node"]["tiering"] == 0
    assert not plan["verdict"]["fits"] and plan["verdict"]["binding"] == "host capacity"


# ---------------------------------------------------------------- mutation review: what the formulas above left open

@pytest.mark.parametrize("changes, buffer", [({"device_buffer_tokens": 256}, 256), ({"topk": 32}, 2 * 32)])
def test_tiered_request_holds_the_buffer_asked_for_or_twice_the_workloads_top_k(changes, buffer):
    """--device-buffer-tokens sets the hot buffer; without it SGLang's 2 x top-k takes the workload's --topk
    (not the config's index_topk). A long request holds the buffer plus one page (64) of latent slots."""
    cfg, dep, T = tiny(), fp32(machine()), 10_000
    wl = Workload(((T, 1.0),), tiering=True, **changes)
    assert device_bytes_per_request(cfg, dep, wl, tiered=True) == (buffer + 64) * L * LATENT_FP32 + T * FULL * INDEXER_FP32


def test_top_k_selection_time_counts_every_key_of_each_indexer_layer():
    """Top-k runs once per indexer layer over all T scores: b x FULL x T keys at the machine's time per key."""
    cfg, b, T = tiny(), 3, 1000
    step = estimate_step(cfg, fp32(machine(topk_s_per_key=1e-9)), Workload(((T, 1.0),), concurrency=b), FUSED)
    assert stage(step, "top-k").fixed_s == pytest.approx(b * FULL * T * 1e-9, rel=REGROUPED64)


def test_indexer_is_replicated_on_every_tensor_parallel_rank():
    """TP splits the attention heads, not the indexer: each of 2 ranks scores every key with all H_I heads."""
    cfg, b, T = tiny(), 2, 1000
    dep = fp32(machine(gpus=2), tp=2)
    idx = stage(estimate_step(cfg, dep, Workload(((T, 1.0),), concurrency=b), FUSED), "indexer")
    assert idx.flops == b * FULL * HI * T * (2 * DI + 2)
    assert idx.bytes == b * FULL * T * (INDEXER_FP32 + 8)


def test_predicted_step_is_one_device_whatever_the_node():
    """predict_decode_step_ms is one device (no TP/DP): a batch of 8 on a preset of 8 GPUs per node is the
    same step as on a node of one GPU, not 1 request on each of 8 ranks."""
    from sparsekv.tools.plan_decode import predict_decode_step_ms
    cfg, eight = tiny(), machine(gpus=8)
    one = dataclasses.replace(eight, gpus_per_node=1)
    assert predict_decode_step_ms(cfg, 1000, eight, batch=8, profile=FUSED) == \
        predict_decode_step_ms(cfg, 1000, one, batch=8, profile=FUSED)
    assert predict_decode_step_ms(cfg, 1000, one, batch=8, profile=FUSED) > \
        predict_decode_step_ms(cfg, 1000, one, batch=1, profile=FUSED)


def test_predicted_step_on_a_measured_machine_defaults_to_the_torch_eager_profile():
    """`sparsekv bench decode` calls predict_decode_step_ms without a profile: a measured machine gets
    TORCH_EAGER (its dispatch overhead counts), a datasheet machine FUSED."""
    from sparsekv.tools.plan_decode import TORCH_EAGER, predict_decode_step_ms
    cfg = tiny()
    measured = machine(op_overhead_s=1e-6, measured=True)
    datasheet = dataclasses.replace(measured, measured=False)
    eager = predict_decode_step_ms(cfg, 1000, measured, profile=TORCH_EAGER)
    assert predict_decode_step_ms(cfg, 1000, measured) == eager
    assert predict_decode_step_ms(cfg, 1000, datasheet) == predict_decode_step_ms(cfg, 1000, datasheet, profile=FUSED)
    assert eager > predict_decode_step_ms(cfg, 1000, measured, profile=FUSED)


def test_sweep_link_crossing_skips_loads_that_do_not_fit():
    """Host DRAM of 3 MB backs 0.9 x 3e6 // (1000 x 4 x 320 B) = 2 tiered requests: the row's crossing is
    taken at 2, the largest load that fits, not at 4."""
    cfg, dep = tiny(), fp32(machine(link_bw=1e8, host_dram_bytes=3e6))
    points = run_sweep(cfg, dep, _tiered(), FUSED, contexts=(1000,), concurrencies=(1, 2, 4))
    tiered = {p["concurrency"]: p for p in points if p["tiering"]}
    assert [n for n, p in tiered.items() if p["fits"]] == [1, 2] and tiered[4]["limit"] == "host capacity"
    want = link_bound_miss_rate(cfg, dep, _tiered(n=2), FUSED)
    assert want != link_bound_miss_rate(cfg, dep, _tiered(n=4), FUSED)
    assert all(p["link_bound_above_miss_rate"] == want for p in tiered.values())


def test_sweep_link_crossing_is_each_contexts_own():
    """Each context's tiering row carries the crossing at that context, whatever the workload's own context."""
    cfg, dep = tiny(), fp32(machine(link_bw=1e8))
    points = run_sweep(cfg, dep, _tiered(T=1000), FUSED, contexts=(500, 4000), concurrencies=(1, 4))
    want = {T: link_bound_miss_rate(cfg, dep, _tiered(T=T, n=4), FUSED) for T in (500, 4000)}
    assert want[500] != want[4000]
    for p in points:
        if p["tiering"]:
            assert p["link_bound_above_miss_rate"] == want[p["context"]]


def test_sweep_throughput_counts_every_ranks_requests():
    """4 requests per node over 2 DP ranks: a step serves all 4 (2 per GPU), so the aggregate is 4 / step."""
    cfg, dep = tiny(), fp32(machine(gpus=2))
    wl = Workload(((1000, 1.0),), concurrency=4)
    point = sweep_point(cfg, dep, wl, FUSED)
    step = estimate_step(cfg, dep, wl, FUSED)
    assert step.batch_per_gpu == 2 and point["tok_s_aggregate"] == 4 / step.step_s


def test_unknown_phase_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown phase 'decoding'"):
        flops_per_token(tiny(), 1000, "dsa-every-layer", "decoding")


def test_tied_embeddings_are_counted_once():
    """With tie_word_embeddings lm_head is the embedding matrix: V x D parameters fewer in the total, and
    in what a token multiplies (the final norm stays)."""
    c = param_counts(tiny(tie_word_embeddings=True))
    assert c.lm_head == D
    assert c.total == TOTAL - V * D and c.active == ACTIVE - V * D


def test_flop_table_ratio_is_dsa_every_layer_over_the_variant():
    """vs_dsa_every_layer is how many times fewer FLOPs than DSA in every layer: above 1 for IndexShare."""
    from sparsekv.tools.plan_costs import flop_table
    cfg = tiny()
    rows = flop_table(cfg, contexts=(1000,))
    assert len(rows) == 2 * 3
    for r in rows:
        every = flops_per_token(cfg, 1000, "dsa-every-layer", r["phase"]).total
        assert r["vs_dsa_every_layer"] == every / r["total"]
    shared = [r for r in rows if r["variant"] == "dsa-indexshare"]
    assert all(r["vs_dsa_every_layer"] > 1 for r in shared)


def test_parallel_kv_row_at_the_models_limit_is_within_it():
    """A model of exactly 128K positions: the 128K row is within it, the 1M row beyond."""
    from sparsekv.tools.plan_parallel import kv_rows
    rows = kv_rows(tiny(max_position_embeddings=128 * 1024), fp32(machine()), Workload(((1000, 1.0),)))
    assert [(r["context"], r["beyond_model"]) for r in rows] == [(128 * 1024, False), (1 << 20, True)]


def test_max_requests_are_zero_not_negative_when_weights_overflow():
    """GLM-5 in bf16 does not fit one node: no request fits (0), never a negative count."""
    mem = _plan("glm-5", "--weights", "bf16")["memory"]
    assert mem["cache_budget_per_gpu"] == 0.0
    assert mem["max_requests_per_gpu"] == {"no_tiering": 0, "tiering": 0}
    assert mem["max_requests_per_node"] == {"no_tiering": 0, "tiering": 0}


def test_host_dram_limits_only_a_tiered_workload():
    """Without tiering the cache never goes to the host: a node with no host DRAM still fits the workload."""
    plan = _plan("glm-5.2", "--host-dram-gb", "0")
    assert plan["memory"]["host_limit_requests"] == 0
    assert plan["verdict"]["fits"] and plan["verdict"]["binding"] != "host capacity"


# ---------------------------------------------------------------- mutation review: the step's time, the eager engine, recompute

def test_each_stage_takes_the_larger_of_its_compute_and_memory_time():
    """On a machine of 1e12 FLOP/s and 1e12 B/s, 3 requests of 1000 tokens: the weights (2 x 3 FLOPs per 4 B)
    and attention (2 H (C + R + C) FLOPs per 320 B row) are compute bound, the indexer (H_I (2 D_I + 2) FLOPs
    per 136 B key) and the experts (12 FLOPs per 4 x 4.6 B) memory bound; each adds only its larger time."""
    cfg, b, T = tiny(), 3, 1000
    step = estimate_step(cfg, fp32(machine(flops_bf16=1e12, mem_bw=1e12)), Workload(((T, 1.0),), concurrency=b), FUSED)
    weights, attn, idx, experts = (stage(step, n) for n in ("weights", "attention", "indexer", "experts"))
    assert weights.flops > weights.bytes > 0 and attn.flops > attn.bytes > 0
    assert 0 < idx.flops < idx.bytes and 0 < experts.flops < experts.bytes
    assert step.times["compute"] == pytest.approx((weights.flops + attn.flops) / 1e12, rel=REGROUPED64)
    assert step.times["hbm"] == pytest.approx((idx.bytes + experts.bytes) / 1e12, rel=REGROUPED64)


def test_the_host_link_time_is_added_on_top_of_the_step():
    """HiSparse v1 swaps misses in on the compute stream: the step is compute + HBM + link time (+ overhead),
    not the largest of them. 4 tiered requests at miss rate 0.1 bring in 4 x L x (0.1 x 64 + 1) rows."""
    cfg, b = tiny(), 4
    step = estimate_step(cfg, fp32(machine(link_bw=1e8)), _tiered(n=b, miss=0.1), FUSED)
    link = b * L * (0.1 * TOPK + 1) * LATENT_FP32 / 1e8
    assert step.times["link"] == pytest.approx(link, rel=REGROUPED64) and step.times["hbm"] > 0
    assert step.step_s == pytest.approx(step.times["compute"] + step.times["hbm"] + link, rel=REGROUPED64)


def test_the_eager_engine_skips_the_indexer_until_the_context_exceeds_top_k():
    """sparsekv's indexer selects all keys without scoring them while a row sees at most top-k
    (model/indexer.py, the dense regime): the TORCH_EAGER profile it is calibrated with skips the indexer
    stage there too, its scores, its keys and the top-k selection."""
    from sparsekv.tools.plan_decode import TORCH_EAGER
    dep = fp32(machine(topk_s_per_key=1e-9))
    at = lambda T: estimate_step(tiny(), dep, Workload(((T, 1.0),)), TORCH_EAGER)  # noqa: E731
    assert (stage(at(TOPK), "indexer").flops, stage(at(TOPK), "indexer").bytes, stage(at(TOPK), "top-k").fixed_s) == (0, 0, 0)
    assert stage(at(TOPK + 1), "indexer").flops > 0 and stage(at(TOPK + 1), "top-k").fixed_s > 0


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_prefix_recompute_follows_the_configs_indexers_and_attention(attention):
    """TINY's own schedule runs 2 indexers in 4 layers: a sparse recompute runs those 2 (not one per layer),
    a dense one none, in MHA mode over all t keys, with no indexer weights; a dense cached token holds no
    indexer keys. A 1 GB host tier keeps 1e9 / (bytes per token) tokens."""
    cfg, T = tiny(), 1000
    pc = prefix_cache_section(cfg, fp32(machine()), Workload(((T, 1.0),), attention_mode=attention),
                              host_gb=1.0, disk_tb=0.0, disk_gbps=6.0)
    if attention == "sparse":
        per_token = L * LATENT_FP32 + FULL * INDEXER_FP32
        flops = (2 * ACTIVE * T + L * 2 * H * sum(min(t, TOPK) for t in range(1, T + 1)) * ((C + R) + C)
                 + FULL * HI * sum(range(1, T + 1)) * (2 * DI + 2))
    else:
        per_token = L * LATENT_FP32
        flops = 2 * (ACTIVE - FULL * INDEXER) * T + L * 2 * H * sum(range(1, T + 1)) * ((NOPE + R) + VH)
    assert pc["bytes_per_token"] == per_token and pc["tiers"]["host"]["tokens"] == 1e9 / per_token
    assert pc["prefill_flops"] == pytest.approx(flops, rel=REGROUPED64)
    assert pc["recompute_s"] == pytest.approx(flops / 1e14, rel=REGROUPED64)


def test_a_context_mix_costs_its_expectation():
    """--context 100:1,1000:3: a quarter of the requests at 100 tokens, three quarters at 1000 (mean 775). A
    request's device bytes, a step's cache reads and a cached context are each the mix's expectation, not the
    sum over its contexts nor its first context's. Tiered, the 100-token quarter holds 2 pages (128 slots),
    the rest the 128-slot buffer + a page."""
    cfg, dep, b = tiny(), fp32(machine()), 2
    mix = ((100, 0.25), (1000, 0.75))
    per_token = L * LATENT_FP32 + FULL * INDEXER_FP32
    wl = Workload(mix, concurrency=b, tiering=True, miss_rate=0.0)
    assert device_bytes_per_request(cfg, dep, wl, tiered=False) == pytest.approx(775 * per_token, rel=REGROUPED64)
    tiered = 0.25 * (128 * L * LATENT_FP32 + 100 * FULL * INDEXER_FP32) + 0.75 * (192 * L * LATENT_FP32 + 1000 * FULL * INDEXER_FP32)
    assert device_bytes_per_request(cfg, dep, wl, tiered=True) == pytest.approx(tiered, rel=REGROUPED64)
    step = estimate_step(cfg, dep, dataclasses.replace(wl, tiering=False), FUSED)
    assert stage(step, "attention").bytes == pytest.approx(b * L * TOPK * LATENT_FP32, rel=REGROUPED64)
    assert stage(step, "indexer").bytes == pytest.approx(b * FULL * 775 * (INDEXER_FP32 + 8), rel=REGROUPED64)
    pc = prefix_cache_section(cfg, dep, wl, host_gb=1.0, disk_tb=0.0, disk_gbps=6.0)
    assert pc["context"] == 775 and pc["bytes_per_context"] == pytest.approx(775 * per_token, rel=REGROUPED64)
