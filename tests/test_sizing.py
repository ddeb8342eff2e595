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
