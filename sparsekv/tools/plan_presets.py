"""Built-in model shapes for the planner, as raw config.json dicts (values from their published config.json files).

They go through `ModelConfig.from_dict` exactly like a downloaded config.json, so the IndexShare
schedule of GLM-5.2 is derived by the same rule transformers uses (freq 4, offset 3 -> 21 full).
"""
from __future__ import annotations

import os

from sparsekv.config import ConfigError, ModelConfig

_GLM5 = {
    "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "rms_norm_eps": 1e-5, "first_k_dense_replace": 3,
    "max_position_embeddings": 202752, "num_nextn_predict_layers": 1, "index_topk_freq": 1,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": False,
    "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "attention_bias": False,
    "rope_interleave": True, "indexer_rope_interleave": True, "eos_token_id": [154820, 154827, 154829],
    "dtype": "bfloat16",
}

_GLM52 = {**_GLM5, "index_topk_freq": 4, "index_skip_topk_offset": 3,
          "max_position_embeddings": 1048576, "moe_router_dtype": "float32", "index_share_for_mtp_iteration": True,
          "pad_token_id": 154820,
          "rope_parameters": {"rope_theta": 8e6, "rope_type": "default"}}

_DEEPSEEK_V32 = {
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "rms_norm_eps": 1e-6, "first_k_dense_replace": 3,
    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_theta": 10000.0, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "attention_bias": False, "eos_token_id": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
}

# The IndexCache paper's "30B DSA model, 47 DSA layers" is not published. Its layer count matches
# the GLM-4.7-Flash backbone (transformers glm4_moe_lite defaults: hidden 2048, 20 heads, 64
# experts, top-4, first layer dense); we add GLM-5's indexer shape and keep 1 indexer in 4
# (layers 0, 4, ..., 44 = 12 of 47, "75 % of indexer compute removed"). An assumption, used only
# to put the paper's measured speed-ups next to a FLOP and roofline estimate.
_INDEXCACHE_30B = {
    **_GLM5, "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536,
    "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20,
    "n_routed_experts": 64, "num_experts_per_tok": 4, "q_lora_rank": 768,
    "routed_scaling_factor": 1.8, "first_k_dense_replace": 1, "index_topk_freq": 4,
    "index_skip_topk_offset": 1,
}

PRESETS: dict[str, dict] = {
    "glm-5": _GLM5,
    "glm-5.2": _GLM52,
    "deepseek-v3.2": _DEEPSEEK_V32,
    "indexcache-30b": _INDEXCACHE_30B,
}


def load_model(spec: str) -> tuple[str, ModelConfig]:
    """(display name, config) for a preset name, a config.json path, or a checkpoint directory."""
    if spec.lower() in PRESETS:
        return spec.lower(), ModelConfig.from_dict(dict(PRESETS[spec.lower()]), where=f"preset {spec}")
    if os.path.exists(spec):
        return os.path.basename(os.path.normpath(spec)), ModelConfig.from_json(spec)
    raise ConfigError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file")
