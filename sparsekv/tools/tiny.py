"""Tiny random checkpoints built with transformers' own model classes (for tests, benches, the default model)."""
from __future__ import annotations

import torch

TINY_GLM = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1, index_topk_pattern="FSSF",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=1 << 20,
    eos_token_id=None,
)

# The "tiny-bench" configuration (benchmarks of issue 2).
TINY_BENCH = {**TINY_GLM, **dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    index_topk=64, index_head_dim=32, index_n_heads=4, index_topk_pattern="FSSS", max_position_embeddings=1 << 21)}

# GLM-5 per-head attention geometry with head counts scaled by 1/8 (issue 2).
GLM5_GEOMETRY = {**TINY_BENCH, **dict(
    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=8,
    kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
    index_topk=2048, index_head_dim=128, index_n_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6})}

# tiny-bench's attention and indexer (IndexShare FSSS) with GLM-5.2's decode cost structure: the
# weights read per decode step are ~140x the latent and indexer keys one 64K request reads per step
# (the planner's count for GLM-5.2, 4 requests per attention rank on an H200 node; this preset: 136).
# That takes ~300M fp32 parameters of dense MLP, read once per step whatever the batch. tiny-bench
# itself is the opposite extreme (weights ~1x one request's reads): per-request work dominates.
GLM52_PROPORTIONS = {**TINY_BENCH, **dict(
    hidden_size=2048, intermediate_size=12288, first_k_dense_replace=4, n_routed_experts=4)}

PRESETS = {"tiny": TINY_GLM, "tiny-bench": TINY_BENCH, "glm5-geometry": GLM5_GEOMETRY,
           "glm5.2-proportions": GLM52_PROPORTIONS}


def reference_model(family: str = "glm_moe_dsa", seed: int = 0, **overrides):
    """A transformers model with random weights (init std raised so that top-k selection is not flat)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    opts = {**TINY_GLM, **overrides}
    torch.manual_seed(seed)
    if family == "deepseek_v32":
        opts.pop("index_topk_pattern", None)
        opts.pop("indexer_types", None)
        opts.setdefault("n_group", 1)  # transformers' defaults (8 groups, 4 kept) do not divide a tiny model's experts
        opts.setdefault("topk_group", 1)
        cfg, cls = DeepseekV32Config(**opts), DeepseekV32ForCausalLM
    else:
        cfg, cls = GlmMoeDsaConfig(**opts), GlmMoeDsaForCausalLM
    cfg.initializer_range = overrides.get("initializer_range", 0.1)
    model = cls(cfg).eval()
    with torch.no_grad():  # a non-zero bias exercises "bias for choosing experts only"
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def save_reference_checkpoint(path: str, family: str = "glm_moe_dsa", seed: int = 0, **overrides):
    model = reference_model(family, seed, **overrides)
    model.save_pretrained(path)
    return model
