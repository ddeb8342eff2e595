"""The config reader derives what transformers derives, and refuses bad configs with one clear line."""
from __future__ import annotations

import pytest

from sparsekv.config import ConfigError, ModelConfig

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
