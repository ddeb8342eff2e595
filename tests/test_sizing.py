"""cache/sizing.py is the one place bytes per token are computed: the pools the engine allocates hold
exactly what it says, so the planner (which calls the same functions) sizes what the engine stores."""
import pytest

from sparsekv import LLM
from sparsekv.cache.sizing import (index_bytes_per_token, indexer_bytes_per_token_layer, latent_bytes_per_token,
                                   latent_bytes_per_token_layer)

LAYOUTS = [  # (dtype, kv_cache_dtype, indexer_key_dtype, kv_tiering); FP8 indexer keys exist only tiered
    ("float32", "auto", "auto", False), ("bfloat16", "auto", "auto", False), ("float32", "fp8", "auto", False),
    ("float32", "auto", "auto", True), ("bfloat16", "fp8", "fp8_e4m3", True), ("float32", "auto", "fp8_e4m3", True)]


@pytest.mark.parametrize("dtype,kv_cache_dtype,indexer_key_dtype,tiered", LAYOUTS)
def test_engine_pools_hold_what_sizing_says(glm_ckpt, dtype, kv_cache_dtype, indexer_key_dtype, tiered):
    path, _ = glm_ckpt
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, indexer_key_dtype=indexer_key_dtype,
              max_model_len=256, max_num_seqs=2, kv_page_size=16, enable_prefix_caching=False, kv_tiering=tiered)
    cfg, pool = llm.engine.model_config, llm.engine.kv.pool
    latent_fmt = "fp8" if kv_cache_dtype == "fp8" else {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    key_fmt = "fp8" if indexer_key_dtype == "fp8_e4m3" else {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    row = latent_bytes_per_token_layer(cfg, latent_fmt)
    assert pool.latent_bytes_per_token() == latent_bytes_per_token(cfg, row)
    assert pool.index_bytes_per_token() == index_bytes_per_token(cfg, key_fmt)
    assert pool.index_bytes_per_token() == len(cfg.full_layers) * indexer_bytes_per_token_layer(cfg, key_fmt)


@pytest.mark.parametrize("tiered", [False, True])
def test_a_quest_pool_keeps_no_indexer_keys_and_its_budget_counts_the_bounds(glm_ckpt, tiered):
    """Quest reads no indexer keys: neither pool keeps them, and an untiered budget pays for the latents
    and Quest's page bounds (as the tiered pool's does)."""
    from sparsekv.cache.sizing import quest_bytes_per_token
    path, _ = glm_ckpt
    quest = dict(selector="quest", quest_page_tokens=4, max_model_len=256, kv_page_size=4)
    llm = LLM(path, **quest, kv_tiering=tiered)
    cfg, pool = llm.engine.model_config, llm.engine.kv.pool
    assert pool.index_bytes_per_token() == 0
    if not tiered:
        per_page = 4 * (pool.latent_bytes_per_token() + quest_bytes_per_token(cfg, 4))
        for budget in (50 * per_page, 51 * per_page - 1):
            assert LLM(path, **quest, device_kv_budget_bytes=budget).engine.kv.allocator.num_pages == 50


# ------------------------------------------------------------------ one rank of a parallel layout

def _tiny_cfg():
    from sparsekv.config import ModelConfig
    from sparsekv.tools.tiny import TINY_GLM
    return ModelConfig.from_dict({"model_type": "glm_moe_dsa", **TINY_GLM})


# TINY_GLM by hand: hidden 64, 4 layers (1 dense + 3 MoE), 4 heads, q_lora 32, C 32 + R 8, nope 16, v 16,
# indexer 8 heads x 16 in 2 layers (FSSF), 4 experts of 32, 1 shared expert, dense MLP 128, vocab 256.
TINY_REPLICATED = (4 * (2 * 64 + 32 * 64 + 32 + 40 * 64 + 32)   # norms, q_a, q_a norm, kv_a, kv_a norm
                   + 2 * (8 * 16 * 32 + 16 * 64 + 2 * 16 + 8 * 64)  # indexer: wq_b, wk, k_norm, weights_proj
                   + 3 * (4 * 64 + 4)                               # router and correction bias
                   + 64)                                            # final norm
TINY_SHARDED = (4 * (4 * 24 * 32 + 4 * 32 * 32 + 64 * 4 * 16)  # q_b, kv_b, o_proj
                + 3 * 128 * 64 + 3 * (3 * 32 * 64)               # dense MLP, shared experts
                + 2 * 256 * 64)                                   # embedding, lm_head
TINY_EXPERTS = 3 * 4 * 3 * 32 * 64


def test_rank_weights_are_replicated_plus_split_parts_by_hand():
    from sparsekv.cache.sizing import Parallelism, params_per_rank, weight_bytes_per_rank
    cfg = _tiny_cfg()
    one = params_per_rank(cfg, Parallelism())
    assert (one.replicated, one.sharded, one.experts) == (TINY_REPLICATED, TINY_SHARDED, TINY_EXPERTS)
    tp2 = weight_bytes_per_rank(cfg, Parallelism(tp=2), "fp32")
    assert tp2.total == 4 * (TINY_REPLICATED + TINY_SHARDED // 2 + TINY_EXPERTS // 2)
    # expert parallelism over dp ranks: 2 whole experts each, the rest replicated at tp = 1
    ep = params_per_rank(cfg, Parallelism(tp=1, dp=2, ep=True))
    assert (ep.replicated, ep.sharded, ep.experts) == (TINY_REPLICATED, TINY_SHARDED, TINY_EXPERTS // 2)
    assert params_per_rank(cfg, Parallelism(tp=1, dp=2)).experts == TINY_EXPERTS  # no EP: whole replicas
    # bf16: the router's correction bias (3 x 4) and the indexer's weights_proj (2 x 8 x 64) stay fp32
    bf16 = weight_bytes_per_rank(cfg, Parallelism(), "bf16").total
    assert bf16 == 2 * one.total + 2 * (3 * 4 + 2 * 8 * 64)


def test_rank_weights_at_tp1_are_the_planners_parameter_count():
    from sparsekv.cache.sizing import Parallelism, params_per_rank
    from sparsekv.tools.plan_costs import param_counts
    from sparsekv.tools.plan_presets import load_model
    for name in ("glm-5", "glm-5.2", "deepseek-v3.2"):
        cfg = load_model(name)[1]
        assert params_per_rank(cfg, Parallelism()).total == param_counts(cfg).total


def test_fp8_weights_keep_one_scale_per_128x128_block_of_the_slice():
    from sparsekv.cache.sizing import _tensor_bytes
    assert _tensor_bytes((300, 200), "quantized", "fp8") == 300 * 200 + 4 * 3 * 2
    assert _tensor_bytes((300, 200), "plain", "fp8") == 2 * 300 * 200       # bf16 in FP8 releases
    assert _tensor_bytes((300,), "fp32", "bf16") == 4 * 300
    assert _tensor_bytes((300, 200), "quantized", "bf16") == 2 * 300 * 200


def test_bad_parallel_sizes_name_the_option():
    from sparsekv.cache.sizing import Parallelism
    from sparsekv.config import ConfigError
    cfg = _tiny_cfg()
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible .*--tp.*3"):
        Parallelism(tp=3).check(cfg)
    with pytest.raises(ConfigError, match=r"n_routed_experts \(4\) .* world size 3 \(--tp 1 x --dp 3\) .*--ep"):
        Parallelism(tp=1, dp=3, ep=True).check(cfg)
    Parallelism(tp=1, dp=3).check(cfg)  # no EP: every dp rank holds all experts
    with pytest.raises(ConfigError, match="--dp"):
        Parallelism(tp=1, dp=0).check(cfg)


def test_collective_bytes_by_hand():
    from sparsekv.cache.sizing import Parallelism, collectives
    cfg = _tiny_cfg()
    assert collectives(cfg, Parallelism(), "fp32") == []
    assert collectives(cfg, Parallelism(tp=1, dp=2), "fp32") == []  # replicas without EP never talk
    tp2 = {c.name: c for c in collectives(cfg, Parallelism(tp=2), "fp32")}
    # ring all-reduce of one fp32 hidden state over 2 ranks sends 2 x 1/2 x 64 x 4 = 256 B per rank
    assert [(c.op, c.per_token, c.times) for c in tp2.values()] == [
        ("all_reduce", 256, 4), ("all_reduce", 256, 4), ("all_reduce", 256, 1), ("all_gather", 256 * 4 / 2, 1)]
    # EP over dp = 2: k = 2 copies of 64 fp32 values, half of them off-rank, there and back
    (moe,) = collectives(cfg, Parallelism(tp=1, dp=2, ep=True), "fp32")
    assert (moe.op, moe.ranks, moe.times, moe.per_token) == ("all_to_all", 2, 3, 2 * 2 * 64 * 4 / 2)
    assert collectives(cfg, Parallelism(tp=2, ep=True), "bf16")[1].per_token == 128  # dp 1: no all_to_all
    assert len(collectives(cfg, Parallelism(tp=2, ep=True), "bf16")) == 4


def _with_mtp_layer(src: str, dst: str) -> str:
    """A copy of the checkpoint with a NextN layer: layer 1 (MoE) plus layer 0's indexer, and the MTP glue."""
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    hidden, n = tensors["model.norm.weight"].shape[0], 1 + max(int(k.split(".")[2]) for k in tensors if ".layers." in k)
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1.") or name.startswith("model.layers.0.self_attn.indexer."):
            tensors[name.replace(f"layers.{name.split('.')[2]}.", f"layers.{n}.")] = t.clone()
    for glue, shape in (("enorm", (hidden,)), ("hnorm", (hidden,)), ("eh_proj", (hidden, 2 * hidden)),
                        ("shared_head.norm", (hidden,))):
        tensors[f"model.layers.{n}.{glue}.weight"] = torch.ones(shape)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("family", ["glm", "ds"])
def test_engine_loads_what_sizing_says_per_rank(request, tmp_path, family):
    """The tensors the engine loads on each rank weigh what weight_bytes_per_rank says, MTP layer included."""
    import torch

    from sparsekv.cache.sizing import Parallelism, weight_bytes_per_rank
    from sparsekv.config import ModelConfig
    from sparsekv.model.checkpoint import load_tensors
    path, _ = request.getfixturevalue(f"{family}_ckpt")
    mtp_path = _with_mtp_layer(path, str(tmp_path / "mtp"))
    cfg = ModelConfig.from_json(path)

    def loaded_bytes(where, dtype, **layout):
        return sum(t.numel() * t.element_size() for t in load_tensors(where, cfg, dtype, torch.device("cpu"),
                                                                      **layout).values())
    for dtype, fmt in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        assert loaded_bytes(path, dtype) == weight_bytes_per_rank(cfg, Parallelism(), fmt).total
        assert loaded_bytes(mtp_path, dtype) == weight_bytes_per_rank(cfg, Parallelism(), fmt, mtp=True).total
    layout = pytest.importorskip("sparsekv.parallel.layout")
    for tp, ep in ((2, False), (2, True)):
        for where, mtp in ((path, False), (mtp_path, True)):
            want = weight_bytes_per_rank(cfg, Parallelism(tp=tp, ep=ep), "fp32", mtp=mtp).total
            for rank in range(tp):
                assert loaded_bytes(where, torch.float32, layout=layout.ParallelLayout(tp, 1, ep, rank)) == want


# ------------------------------------------------------------------ the tiers and pages a budget allows

def _engine_config(**options):
    from sparsekv.config import EngineConfig
    return EngineConfig(model="unused", kv_page_size=16, max_num_seqs=2, **options)


def test_tier_sizes_take_the_tightest_budget_by_hand():
    """plan_tier_sizes with 100 B of latent and 10 B of indexer keys per token, 16-token pages, 2 working
    sets of 2 x index_topk = 16 slots each plus 1 new-token row (17 rows): every budget by hand, the
    smallest one binding and named (a larger or a rounded-up count would overrun a budget)."""
    from sparsekv.cache.sizing import TierSizes, plan_tier_sizes
    cfg = _tiny_cfg()
    plan = lambda **options: plan_tier_sizes(_engine_config(**options), cfg, 100, 10, 7)  # noqa: E731
    assert plan() == TierSizes(7, 2, 16, "the default cache size")
    assert plan(device_buffer_tokens=12) == TierSizes(7, 2, 12, "the default cache size")
    host = 40 * 16 * 100 + 1599  # 40 pages of host latent, not quite 41
    assert plan(host_kv_budget_bytes=host) == TierSizes(40, 2, 16, f"host_kv_budget_bytes={host}")
    assert plan(host_kv_budget_bytes=host, num_kv_pages=39).num_pages == 39
    assert plan(host_kv_budget_bytes=host, num_kv_pages=41).limit == f"host_kv_budget_bytes={host}"
    # the device holds 2 working sets of 17 rows (3400 B), then whole pages of indexer keys (160 B each)
    device = 2 * 17 * 100 + 30 * 16 * 10 + 159
    sizes = plan(device_kv_budget_bytes=device, host_kv_budget_bytes=host)
    assert (sizes.num_pages, sizes.device_buffer_tokens) == (30, 16)
    assert sizes.limit.startswith(f"device_kv_budget_bytes={device} ")
    # a drafted token takes one more row per working set: 2 x 100 B less for indexer keys
    assert plan(device_kv_budget_bytes=2 * 18 * 100 + 30 * 16 * 10, num_speculative_tokens=1).num_pages == 30
    assert plan(device_kv_budget_bytes=2 * 18 * 100 + 30 * 16 * 10 - 1, num_speculative_tokens=1).num_pages == 29


def test_tier_budgets_of_exactly_one_page_are_enough_and_one_byte_less_is_refused():
    """The boundaries of plan_tier_sizes' errors: a budget holding exactly one page (after the working
    sets, for the device) is valid; one byte less is a ConfigError naming the option."""
    from sparsekv.cache.sizing import plan_tier_sizes
    from sparsekv.config import ConfigError
    cfg = _tiny_cfg()
    plan = lambda **options: plan_tier_sizes(_engine_config(**options), cfg, 100, 10, 7)  # noqa: E731
    assert plan(host_kv_budget_bytes=16 * 100).num_pages == 1
    with pytest.raises(ConfigError, match="host_kv_budget_bytes=1599 holds less than one 16-token page"):
        plan(host_kv_budget_bytes=16 * 100 - 1)
    assert plan(device_kv_budget_bytes=2 * 17 * 100 + 16 * 10).num_pages == 1
    with pytest.raises(ConfigError, match=r"device_kv_budget_bytes=3559 cannot hold 2 working sets of 17 tokens"):
        plan(device_kv_budget_bytes=2 * 17 * 100 + 16 * 10 - 1)
    # no indexer keys on the device (selector bytes 0) still counts a byte per token, never divides by 0
    assert plan_tier_sizes(_engine_config(device_kv_budget_bytes=3400 + 5 * 16), cfg, 100, 0, 7).num_pages == 5


def test_untiered_pages_and_quest_metadata_by_hand():
    """A device-resident cache of the tiny model in fp32 (40-value latents, 160 B a layer): 4 layers of
    latent + 2 full layers of 16 fp32 indexer keys = 768 B a token, 992 B with the MTP layer's own; a
    budget of exactly one page fits one page, a byte less is refused. Quest keeps an fp32 min and max
    of every latent value per page in the 2 full layers: 640 B a page."""
    from sparsekv.cache.sizing import quest_bytes_per_token, untiered_bytes_per_token, untiered_pages
    from sparsekv.config import ConfigError
    cfg = _tiny_cfg()
    assert untiered_bytes_per_token(_engine_config(), cfg, "fp32", 160) == 4 * 160 + 2 * 16 * 4 == 768
    assert untiered_bytes_per_token(_engine_config(num_speculative_tokens=1), cfg, "fp32", 160) == 768 + 160 + 64
    page = 16 * 768
    assert untiered_pages(_engine_config(device_kv_budget_bytes=page), cfg, "fp32", 160) == 1
    assert untiered_pages(_engine_config(device_kv_budget_bytes=6 * page - 1), cfg, "fp32", 160) == 5
    with pytest.raises(ConfigError, match=f"device_kv_budget_bytes={page - 1} holds less than one 16-token page"):
        untiered_pages(_engine_config(device_kv_budget_bytes=page - 1), cfg, "fp32", 160)
    assert quest_bytes_per_token(cfg, 16) == 2 * 40 * 4 * 2 // 16 == 40
    assert quest_bytes_per_token(cfg, 64) == 10
