"""The config reader derives what transformers derives, and refuses bad configs with one clear line."""
from __future__ import annotations

import pytest

from sparsekv.config import ConfigError, ModelConfig
from tolerances import REGROUPED64

BASE = dict(model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
            kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            index_head_dim=16, n_routed_experts=4)


@pytest.mark.parametrize("extra", [
    {}, {"index_topk_freq": 4, "index_skip_topk_offset": 3}, {"index_topk_freq": 4, "index_skip_topk_offset": 2},
    {"index_topk_freq": 3}, {"index_topk_pattern": "FFSFSSSFSSFF"},
    {"indexer_types": ["full"] * 6 + ["shared"] * 6, "index_topk_pattern": "FSFSFSFSFSFS"},
])
def test_indexshare_schedule_matches_transformers(extra):
    from transformers import GlmMoeDsaConfig
    raw = {**BASE, **extra}
    ref = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert list(ModelConfig.from_dict(raw).indexer_types) == list(ref.indexer_types)


def test_glm52_schedule_has_21_full_layers():
    cfg = ModelConfig.from_dict({**BASE, "num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert cfg.full_layers == [0, 1, 2] + list(range(6, 78, 4)) and len(cfg.full_layers) == 21


def test_deepseek_defaults_and_yarn_scale():
    # model-spec §3.3: DeepSeek-V3.2 softmax scale 192^-0.5 * 1.873854 = 0.1352338
    raw = {**BASE, "model_type": "deepseek_v32", "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}, "index_head_dim": 128,
           "n_routed_experts": 256}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.softmax_scale == pytest.approx(0.1352338, abs=0.5e-7)  # the spec's 7 decimals, rounded
    assert not cfg.indexer_rope_interleave and cfg.n_group == 8 and cfg.topk_group == 4
    assert set(cfg.indexer_types) == {"full"}


def test_glm_scale_is_one_sixteenth():
    cfg = ModelConfig.from_dict({**BASE, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "index_head_dim": 128})
    assert cfg.softmax_scale == 0.0625 and cfg.indexer_rope_interleave


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "unknown model_type 'llama'"),
    ({"hidden_size": None}, "missing required field"),
    ({"index_topk_pattern": "SFFFFFFFFFFF"}, "layer 0 is 'shared'"),
    ({"index_topk_pattern": "FXF"}, "only 'F' and 'S'"),
    ({"indexer_types": ["full"] * 3}, "indexer_types has 3 entries"),
    ({"n_group": 3}, "not divisible by n_group"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_type 'longrope'"),
    ({"n_group": 2, "topk_group": 0}, r"topk_group 0 must be in \[1, n_group=2\]"),
    ({"n_group": 2, "topk_group": 3}, r"topk_group 3 must be in \[1, n_group=2\]"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"qk_rope_head_dim": 32}, "<= index_head_dim"),
    ({"index_topk": 0}, "index_topk must be >= 1"),
    ({"mlp_layer_types": ["dense"] * 11 + ["moe"]}, "mlp_layer_types must list 'dense'/'sparse'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4}}, "yarn rope needs"),
])
def test_bad_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_thread_default_is_one_per_gib_a_decode_token_reads():
    """None resolves by the model's size: small models 1 (small ops only wait on more threads), a big
    one a thread per BYTES_PER_THREAD up to the cores; an accelerator up to ACCELERATOR_THREADS cores (the
    host samples); 0 leaves torch's default."""
    from sparsekv.config import EngineConfig
    from sparsekv.threads import (ACCELERATOR_THREADS, BYTES_PER_THREAD, auto_num_threads, decode_weight_bytes,
                                  resolve_num_threads)
    small = ModelConfig.from_dict(BASE)
    big = ModelConfig.from_dict({**BASE, "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048,
                                 "num_hidden_layers": 4, "vocab_size": 32768})
    assert decode_weight_bytes(small, "float32") < BYTES_PER_THREAD
    per_token = decode_weight_bytes(big, "float32")
    assert per_token // BYTES_PER_THREAD >= 2 and decode_weight_bytes(big, "bfloat16") == per_token // 2
    assert auto_num_threads(small, "float32", "cpu", cores=64) == 1
    assert auto_num_threads(big, "float32", "cpu", cores=64) == per_token // BYTES_PER_THREAD
    assert auto_num_threads(big, "float32", "cpu", cores=2) == 2
    assert auto_num_threads(big, "float32", "cuda:0", cores=64) == ACCELERATOR_THREADS  # the host decides the logits
    assert auto_num_threads(small, "float32", "cuda", cores=2) == 2
    config = EngineConfig(model="m")
    assert resolve_num_threads(config, big, cores=64) == per_token // BYTES_PER_THREAD
    assert resolve_num_threads(EngineConfig(model="m", num_threads=3), big) == 3
    assert resolve_num_threads(EngineConfig(model="m", num_threads=0), small) is None


def test_routed_experts_count_only_the_picked_ones():
    from sparsekv.threads import decode_weight_bytes
    two, four = (ModelConfig.from_dict({**BASE, "num_experts_per_tok": k}) for k in (2, 4))
    expert = 3 * 32 * ModelConfig.from_dict(BASE).moe_intermediate_size * 4
    moe_layers = two.mlp_layer_types.count("sparse")
    assert decode_weight_bytes(four, "float32") - decode_weight_bytes(two, "float32") == 2 * expert * moe_layers


@pytest.mark.parametrize("threads", [-1, 1.5])
def test_bad_thread_counts_are_config_errors(threads):
    from sparsekv.config import EngineConfig
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig(model="m", num_threads=threads).validate()


def test_a_numbered_gpu_with_several_ranks_or_past_the_machines_gpus_is_refused(monkeypatch):
    """Rank r takes GPU r % count, so `cuda:1` with two ranks would put ranks 0 and 1 on one GPU (NCCL:
    "Duplicate GPU detected"); and `cuda:N` past the machine's GPUs failed later as an invalid ordinal.
    (No CUDA here: torch is told there are two GPUs.)"""
    import torch
    from sparsekv.config import EngineConfig
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        EngineConfig(model="m", device="cuda:1", tensor_parallel_size=2).validate()
    EngineConfig(model="m", device="cuda", tensor_parallel_size=2).validate()
    with pytest.raises(ConfigError, match="has 2 CUDA device"):
        EngineConfig(model="m", device="cuda:2").validate()
    EngineConfig(model="m", device="cuda:1").validate()


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_fields_a_config_leaves_out_take_transformers_defaults(family):
    """A config.json without first_k_dense_replace, index_n_heads, n_group, ... reads as transformers
    reads it: GlmMoeDsaConfig's or DeepseekV32Config's defaults."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
    raw = {**BASE, "model_type": family, "n_routed_experts": 256}
    ref = (GlmMoeDsaConfig if family == "glm_moe_dsa" else DeepseekV32Config)(
        **{k: v for k, v in raw.items() if k != "model_type"})
    cfg = ModelConfig.from_dict(raw)
    assert cfg.mlp_layer_types.count("dense") == ref.first_k_dense_replace
    dense = ref.first_k_dense_replace
    assert cfg.mlp_layer_types == ("dense",) * dense + ("sparse",) * (12 - dense)
    for name in ("index_n_heads", "index_topk", "n_group", "topk_group", "intermediate_size", "moe_intermediate_size",
                 "rms_norm_eps", "max_position_embeddings", "n_shared_experts", "num_experts_per_tok",
                 "routed_scaling_factor"):
        assert getattr(cfg, name) == getattr(ref, name), name


def test_mtp_layer_sits_after_the_main_layers():
    """The MTP (next-token prediction) layer is layer num_hidden_layers of the checkpoint, only if it has one."""
    assert ModelConfig.from_dict({**BASE, "num_nextn_predict_layers": 1}).mtp_layer_index == 12
    assert ModelConfig.from_dict(BASE).mtp_layer_index is None


def test_eos_token_id_may_be_one_id_or_a_list():
    assert ModelConfig.from_dict({**BASE, "eos_token_id": 5}).eos_token_ids == (5,)
    assert ModelConfig.from_dict({**BASE, "eos_token_id": [5, 7]}).eos_token_ids == (5, 7)
    assert ModelConfig.from_dict(BASE).eos_token_ids == ()


def test_mla_latent_is_the_compressed_kv_plus_the_rope_key():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.latent_dim == 16 + 8 and cfg.qk_head_dim == 8 + 8


def test_older_rope_scaling_with_type_reads_as_rope_parameters():
    rope = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_dict({**BASE, "rope_scaling": rope, "rope_theta": 50.0})
    assert cfg.rope_parameters == {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                   "rope_theta": 50.0}


def test_deepseek_ignores_glms_schedule_fields():
    """DeepSeek-V3.2 runs an indexer in every layer; GLM's IndexShare fields do not apply to it."""
    cfg = ModelConfig.from_dict({**BASE, "model_type": "deepseek_v32", "n_routed_experts": 256,
                                 "index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert cfg.indexer_types == ("full",) * 12


def test_a_frequency_override_replaces_the_checkpoints_schedule(tmp_path):
    """hf_overrides {"index_topk_freq": 2} turns a checkpoint with an explicit indexer_types list (here all
    'full') into one indexer in two (offset 2 by default: layers 0, 1, 3, 5, ...), for either family."""
    import json
    raw = {**BASE, "indexer_types": ["full"] * 12}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_json(str(tmp_path), overrides={"index_topk_freq": 2})
    assert cfg.full_layers == [0, 1, 3, 5, 7, 9, 11]
    assert ModelConfig.from_json(str(tmp_path)).full_layers == list(range(12))


def test_an_offset_override_replaces_the_checkpoints_schedule_too(tmp_path):
    """hf_overrides {"index_skip_topk_offset": 1} on a freq-2 checkpoint gives transformers' freq-2,
    offset-1 schedule (layers 0, 2, 4, ...) also when its config.json lists the schedule it was saved
    with (transformers' save_pretrained writes indexer_types), as a frequency override does."""
    import json
    raw = {**BASE, "index_topk_freq": 2}
    saved = {**raw, "indexer_types": list(ModelConfig.from_dict(raw).indexer_types)}  # layers 0, 1, 3, 5, ...
    for name, config in (("derived", raw), ("saved", saved)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        cfg = ModelConfig.from_json(str(tmp_path / name), overrides={"index_skip_topk_offset": 1})
        assert cfg.full_layers == [0, 2, 4, 6, 8, 10], name


def test_num_local_experts_names_the_routed_experts_too():
    raw = {k: v for k, v in BASE.items() if k != "n_routed_experts"}
    assert ModelConfig.from_dict({**raw, "num_local_experts": 8}).n_routed_experts == 8


def test_max_model_len_may_reach_the_models_positions_not_pass_them():
    from sparsekv.config import EngineConfig
    cfg = ModelConfig.from_dict({**BASE, "max_position_embeddings": 4096})
    EngineConfig(model="m", max_model_len=4096).validate_for_model(cfg)
    with pytest.raises(ConfigError, match="beyond the model's max_position_embeddings"):
        EngineConfig(model="m", max_model_len=4097).validate_for_model(cfg)


MULTINODE = dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="127.0.0.1:1")  # validated only: nothing binds


@pytest.mark.parametrize("edge, past, message", [
    (dict(MULTINODE, node_rank=1), dict(MULTINODE, node_rank=2), r"node_rank must be in \[0, nnodes=2\)"),
    (dict(prefix_cache_host_bytes=1), dict(prefix_cache_host_bytes=1, enable_prefix_caching=False),
     "prefix_cache_host_bytes must be >= 1 and needs enable_prefix_caching"),
    (dict(prefix_cache_host_bytes=1), dict(prefix_cache_host_bytes=0), "prefix_cache_host_bytes must be >= 1"),
    (dict(prefix_cache_max_pages_per_tenant=0), dict(prefix_cache_max_pages_per_tenant=-1),
     "prefix_cache_max_pages_per_tenant must be >= 0"),
    (dict(prefix_cache_tenant_share=1.0), dict(prefix_cache_tenant_share=1.5), r"prefix_cache_tenant_share must be in \(0, 1\]"),
    (dict(prefix_cache_ttl_s=0.5), dict(prefix_cache_ttl_s=0.0), "prefix_cache_ttl_s must be > 0"),
    (dict(tenant_kv_share=1.0), dict(tenant_kv_share=0.0), r"tenant_kv_share must be in \(0, 1\]"),
    (dict(max_logprobs=0), dict(max_logprobs=-1), "max_logprobs must be an integer >= 0"),
    (dict(max_num_seqs=1), dict(max_num_seqs=True), "max_num_seqs must be int"),  # a bool is no count
    (dict(dist_init_addr="127.0.0.1:65535"), dict(dist_init_addr="127.0.0.1:65536"), "dist_init_addr must be HOST:PORT"),
    (dict(dist_init_addr="127.0.0.1:1"), dict(dist_init_addr="127.0.0.1:0"), "dist_init_addr must be HOST:PORT"),
    (dict(num_kv_pages=4, device_kv_budget_bytes=1 << 20, kv_tiering=True), dict(num_kv_pages=4, device_kv_budget_bytes=1 << 20),
     "give num_kv_pages or device_kv_budget_bytes, not both"),  # tiered, the two bound different pools
])
def test_each_engine_bound_admits_its_edge_and_refuses_one_past_it(edge, past, message):
    """Every bound of EngineConfig.validate at its edge: the last value it allows is a valid config, the
    first one past it a ConfigError naming the option."""
    from sparsekv.config import EngineConfig
    EngineConfig(model="m", **edge).validate()
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="m", **past).validate()


def test_a_working_set_of_exactly_index_topk_is_enough_and_one_less_is_refused():
    from sparsekv.config import EngineConfig
    cfg = ModelConfig.from_dict({**BASE, "index_topk": 8})
    EngineConfig(model="m", kv_tiering=True, device_buffer_tokens=8).validate_for_model(cfg)
    with pytest.raises(ConfigError, match=r"device_buffer_tokens \(7\) must be >= the model's index_topk \(8\)"):
        EngineConfig(model="m", kv_tiering=True, device_buffer_tokens=7).validate_for_model(cfg)


def test_yarn_scale_squares_the_mscale_of_mscale_all_dim():
    """YaRN's attention scale: qk_head_dim^-0.5 x m^2, m = 0.1 x mscale_all_dim x ln(factor) + 1."""
    import math
    raw = {**BASE, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "index_head_dim": 128,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 40,
                               "original_max_position_embeddings": 4096, "mscale_all_dim": 0.5}}
    m = 0.1 * 0.5 * math.log(40) + 1
    assert ModelConfig.from_dict(raw).softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=REGROUPED64)


@pytest.mark.parametrize("theta, orig, truncate", [(5.0, 256, True), (5.0, 256, False), (5.0, 256, None),
                                                   (10000.0, 32, True), (50.0, 64, False), (10000.0, 1000, None)])
def test_yarn_rotary_tables_are_transformers(theta, orig, truncate):
    """YaRN's inverse frequencies, attention factor (here not 1: no mscale given) and the cos/sin it
    scales equal transformers' own (`truncate` either way or left out; a small rope_theta puts the
    ramp's upper end past the rotary dims, where it is clamped)."""
    import torch
    from transformers import DeepseekV32Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding
    from sparsekv.model.layers import RotaryTable, rope_inv_freq
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": orig,
            "beta_fast": 32, "beta_slow": 1, **({} if truncate is None else {"truncate": truncate})}
    raw = {**BASE, "model_type": "deepseek_v32", "n_routed_experts": 256, "rope_parameters": rope,
           "max_position_embeddings": 4 * orig}
    ref = DeepseekV32Config(**{k: v for k, v in raw.items() if k != "model_type"})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](ref)
    cfg = ModelConfig.from_dict(raw)
    ours, our_factor = rope_inv_freq(cfg)
    assert torch.equal(ours, inv_freq) and our_factor == factor != 1
    positions = torch.tensor([0, 1, 7, 4 * orig - 1])
    cos, sin = DeepseekV32RotaryEmbedding(ref)(torch.zeros(1, dtype=torch.float32), positions[None])
    our_cos, our_sin = RotaryTable(cfg, torch.float32, torch.device("cpu")).cos_sin(positions)
    half = cfg.qk_rope_head_dim // 2
    assert torch.equal(our_cos[:, 0], cos[0, :, :half]) and torch.equal(our_sin[:, 0], sin[0, :, :half])
