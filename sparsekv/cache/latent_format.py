"""How a token's latent (c_KV, then the rope key k_R: `latent_dim` numbers) is stored in a KV slot.

Two formats:

* `PlainLatent` ("auto"): the model dtype as is. Encoding and decoding are no-ops.
* `FP8Latent` ("fp8"): FlashMLA's FP8 layout for DeepSeek-V3.2 (vLLM's `fp8_ds_mla`): the
  `kv_lora_rank` numbers of c_KV as float8 e4m3 in tiles of 128 (fewer when the rank is not a
  multiple of 128), one float32 scale per tile (the tile's largest magnitude / 448, e4m3's largest
  finite value), and the `qk_rope_head_dim` numbers of k_R in bfloat16: 512 + 4 x 4 + 64 x 2 = 656 B
  per token and layer for GLM-5 and DeepSeek-V3.2, against 1,152 B in bfloat16. One row of uint8.

Every latent reaches attention through the cache (a step writes its tokens' latents first, then
reads them back with the rest), so with FP8 every read sees the same rounded values whatever the
chunking, batching, tier or prefix-cache hit: those stay exact against FP8 without them. FP8
against the model dtype is a quantization, measured by `sparsekv bench kv-dtype`.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig

E4M3_MAX = 448.0
TILE = 128


class PlainLatent:
    """Latents stored in the model dtype."""

    name, encoded = "auto", False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        self.dtype, self.row_dtype, self.row_width = dtype, dtype, cfg.latent_dim
        self.row_bytes = cfg.latent_dim * dtype.itemsize

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def as_stored(self, values: torch.Tensor) -> torch.Tensor:
        """The values a read will return for `values` written now."""
        return values


class FP8Latent:
    """Latents stored as FlashMLA's 656-byte FP8 rows (see the module docstring)."""

    name, encoded = "fp8", True  # encoded: a read pays for decoding what it gathered

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        self.dtype, self.row_dtype = dtype, torch.uint8
        self.rank, self.rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.tile = math.gcd(self.rank, TILE)
        self.tiles = self.rank // self.tile
        self.scale_at, self.rope_at = self.rank, self.rank + 4 * self.tiles
        self.row_width = self.row_bytes = self.rope_at + 2 * self.rope

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """[N, latent_dim] -> [N, row_bytes] uint8."""
        n = values.shape[0]
        nope = values[:, :self.rank].float().view(n, self.tiles, self.tile)
        scale = nope.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
        quantized = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(n, self.rank)
        rope = values[:, self.rank:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([quantized, scale.contiguous().view(torch.uint8), rope], dim=1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., row_bytes] uint8 -> [..., latent_dim] in the model dtype."""
        shape, flat = rows.shape[:-1], rows.reshape(-1, self.row_bytes)
        n = flat.shape[0]
        out = torch.empty(n, self.rank + self.rope, dtype=self.dtype, device=rows.device)
        nope = e4m3_values(flat[:, :self.rank]).view(n, self.tiles, self.tile)
        scale = _as(flat[:, self.scale_at:self.rope_at], torch.float32)
        torch.mul(nope, scale[..., None], out=out[:, :self.rank].view(n, self.tiles, self.tile))
        out[:, self.rank:] = _as(flat[:, self.rope_at:], torch.bfloat16)
        return out.view(*shape, -1)

    def as_stored(self, values: torch.Tensor) -> torch.Tensor:
        """The values a read will return for `values` written now (Quest bounds what attention reads)."""
        return self.decode(self.encode(values))

_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code -> its value


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> float32 of the same shape, the values `.view(float8_e4m3fn).float()` gives.
    A CPU converts float8 one element at a time; a 256-entry table is several times faster there. An
    accelerator converts natively."""
    if codes.device.type != "cpu":
        return codes.view(torch.float8_e4m3fn).float()
    return _E4M3_TABLE.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns reinterpreted as `dtype` (a copy first where they are not aligned for it)."""
    try:
        return columns.view(dtype)
    except RuntimeError:
        return columns.contiguous().view(dtype)


def latent_format(kv_cache_dtype: str, cfg: ModelConfig, dtype: torch.dtype) -> PlainLatent | FP8Latent:
    if kv_cache_dtype == "fp8":
        return FP8Latent(cfg, dtype)
    return PlainLatent(cfg, dtype)
