"""Bytes per token of every KV store, and the tier sizes a budget allows: the one place they are computed.

Torch-free arithmetic on `ModelConfig` fields, shared by the engine (which allocates what these say)
and the planner (which sizes machines we do not have). Number formats are named as the planner names
them: fp32, bf16, fp16, fp8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ConfigError, EngineConfig, ModelConfig

ELEMENT_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
FP8_TILE = 128  # one fp32 scale per 128 latent values (FlashMLA's cache layout)


def element_bytes(fmt: str) -> int:
    if fmt not in ELEMENT_BYTES:
        raise ValueError(f"unknown number format {fmt!r}; use one of fp32, bf16, fp16, fp8")
    return ELEMENT_BYTES[fmt]


def format_of(itemsize: int, fp8: bool = False) -> str:
    """The format name of a stored element: fp8, or the model dtype's by its size."""
    return "fp8" if fp8 else {4: "fp32", 2: "bf16"}[itemsize]


def latent_bytes_per_token_layer(cfg: ModelConfig, fmt: str) -> int:
    """One MLA cache entry: the latent c (C values) and the rope key (R values).

    FP8 is FlashMLA's layout: C x e4m3, one fp32 scale per tile of 128 latent values, and the rope key
    kept in bf16 (512 + 16 + 128 = 656 B for C = 512, R = 64). Tiles are gcd(C, 128) values when C is
    not a multiple of 128, as the engine stores them (latent_format.py).
    """
    if fmt == "fp8":
        tiles = cfg.kv_lora_rank // math.gcd(cfg.kv_lora_rank, FP8_TILE)
        return cfg.kv_lora_rank + 4 * tiles + 2 * cfg.qk_rope_head_dim
    return cfg.latent_dim * element_bytes(fmt)


def indexer_bytes_per_token_layer(cfg: ModelConfig, fmt: str) -> int:
    """One indexer key: D_I values; FP8 adds one fp32 scale per key (DeepSeek: 128 + 4 = 132 B)."""
    if fmt == "fp8":
        return cfg.index_head_dim + 4
    return cfg.index_head_dim * element_bytes(fmt)


def quest_bytes_per_token(cfg: ModelConfig, page_tokens: int) -> int:
    """Quest's device metadata per cached token over the full layers (fp32 min and max per page)."""
    return 2 * cfg.latent_dim * 4 * len(cfg.full_layers) // page_tokens


def latent_bytes_per_token(cfg: ModelConfig, row_bytes: int) -> int:
    """One token's latents in every layer, at `row_bytes` per layer (latent_format.py's row_bytes)."""
    return row_bytes * cfg.num_hidden_layers


def index_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    """One token's indexer keys over the layers that keep them (the full layers)."""
    return indexer_bytes_per_token_layer(cfg, fmt) * len(cfg.full_layers)


@dataclass(frozen=True)
class TierSizes:
    """What the budgets allow. Logical pages bound the host rows and the device indexer keys."""

    num_pages: int
    num_buffers: int
    device_buffer_tokens: int
    limit: str  # the binding budget, for admission errors


def plan_tier_sizes(config: EngineConfig, cfg: ModelConfig, latent_per_token: int, selector_per_token: int,
                    default_pages: int) -> TierSizes:
    page, n = config.kv_page_size, config.device_buffer_tokens or 2 * cfg.index_topk
    buffers = config.max_num_seqs
    limits = []
    if config.num_kv_pages:
        limits.append((config.num_kv_pages, f"num_kv_pages={config.num_kv_pages}"))
    if config.host_kv_budget_bytes:
        limits.append((config.host_kv_budget_bytes // (page * latent_per_token),
                       f"host_kv_budget_bytes={config.host_kv_budget_bytes}"))
    rows = n + 1 + config.num_speculative_tokens  # LRU slots + the step's new tokens
    if config.device_kv_budget_bytes:
        left = config.device_kv_budget_bytes - buffers * rows * latent_per_token
        if left < page * max(selector_per_token, 1):
            raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} cannot hold {buffers} working "
                              f"sets of {rows} tokens ({rows * latent_per_token} B each, max_num_seqs={buffers}) "
                              f"plus one page of indexer keys; raise it or lower max_num_seqs / device_buffer_tokens")
        limits.append((left // (page * max(selector_per_token, 1)),
                       f"device_kv_budget_bytes={config.device_kv_budget_bytes} (indexer keys after working sets)"))
    pages, limit = min(limits) if limits else (default_pages, "the default cache size")
    if pages < 1:
        raise ConfigError(f"{limit} holds less than one {page}-token page of host KV "
                          f"({page * latent_per_token} B); raise it")
    return TierSizes(pages, buffers, n, limit)


def untiered_pages(config: EngineConfig, cfg: ModelConfig, key_fmt: str, latent_row_bytes: int) -> int:
    """Pages of a fully device-resident cache that fit in `device_kv_budget_bytes`."""
    per_token = latent_bytes_per_token(cfg, latent_row_bytes) + index_bytes_per_token(cfg, key_fmt)
    if config.num_speculative_tokens:  # the MTP layer's own latent and indexer keys
        per_token += latent_row_bytes + indexer_bytes_per_token_layer(cfg, key_fmt)
    per_page = config.kv_page_size * per_token
    if config.device_kv_budget_bytes < per_page:
        raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} holds less than one "
                          f"{config.kv_page_size}-token page ({per_page} B)")
    return config.device_kv_budget_bytes // per_page
