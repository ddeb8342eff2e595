"""The indexer keys of every logical slot, kept on the device for the whole history (as SGLang does):
the lightning indexer scores all of them at every step, so they cannot be tiered. Optionally FP8."""
from __future__ import annotations

import numpy as np
import torch

from ..context import SeqSlice
from ..model.indexer import gather_rows
from .latent_format import e4m3_values
from .pool import history_pages, history_segments, padded_slots, page_counts, paged_keys

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class IndexKeyCache:
    """Indexer keys of every logical slot, device-resident. fp8: e4m3 bytes plus one fp32 scale per key."""

    def __init__(self, layers: list[int], num_slots: int, dim: int, dtype: torch.dtype, device, fp8: bool):
        self.dtype, self.fp8 = dtype, fp8
        store = torch.uint8 if fp8 else dtype  # fp8 rows are kept as raw bytes (CPU index ops lack fp8)
        self.keys = {l: torch.empty(num_slots, dim, dtype=store, device=device) for l in layers}
        self.scales = {l: torch.empty(num_slots, dtype=torch.float32, device=device) for l in layers} if fp8 else {}

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return [(t, 1) for t in list(self.keys.values()) + list(self.scales.values())]

    def layer_slot_tensors(self, layer: int) -> list[torch.Tensor]:
        return [t[layer] for t in (self.keys, self.scales) if layer in t]

    def bytes_per_token(self) -> int:
        return sum(t.shape[1] * t.element_size() + (4 if self.fp8 else 0) for t in self.keys.values())

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        if not self.fp8:
            self.keys[layer].index_copy_(0, slots, values.to(self.dtype))
            return
        v = values.float()
        scale = v.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
        q = (v / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        self.keys[layer].index_copy_(0, slots, q)
        self.scales[layer].index_copy_(0, slots, scale)

    def segments(self, layer: int, seq: SeqSlice) -> list[tuple[int | torch.Tensor, torch.Tensor]]:
        """The request's keys as (positions, keys) pieces (see pool.history_segments); fp8 dequantised."""
        pieces = history_segments(self.keys[layer], seq)
        if not self.fp8:
            return pieces
        return [(pos, self._dequantise(layer, seq, pos, k)) for pos, k in pieces]

    def padded(self, layer: int, seqs: list[SeqSlice], scratch=None) -> torch.Tensor:
        """Several requests' keys, padded (pool.padded_slots): [B, T_max, D_I]; fp8 dequantised. Plain
        keys go into `scratch`'s kept buffer when given (model/indexer.py: gather_rows)."""
        slots = padded_slots(seqs)
        raw = gather_rows(self.keys[layer], slots, None if self.fp8 else scratch)
        if not self.fp8:
            return raw
        scales = self.scales[layer].index_select(0, slots.reshape(-1)).view(slots.shape)
        return e4m3_values(raw).mul_(scales[..., None]).to(self.dtype)

    def pages(self, layer: int, seqs: list[SeqSlice], page_size: int) -> tuple[torch.Tensor, np.ndarray | None, list[int]]:
        """Several requests' keys by page (model/indexer.py: paged_keys; fp8 pages gathered and
        dequantised), and how many pages each."""
        if not self.fp8:
            return paged_keys(self.keys[layer], seqs, page_size)
        pages, counts = history_pages(seqs, page_size), page_counts(seqs, page_size)
        dim = self.keys[layer].shape[1]
        raw = self.keys[layer].view(-1, page_size * dim).index_select(0, pages).view(-1, page_size, dim)
        scales = self.scales[layer].view(-1, page_size).index_select(0, pages)
        return e4m3_values(raw).mul_(scales[..., None]).to(self.dtype), None, counts

    def _dequantise(self, layer: int, seq: SeqSlice, positions, raw: torch.Tensor) -> torch.Tensor:
        slots = seq.slots[positions:positions + raw.shape[0]] if isinstance(positions, int) else seq.slots[positions]
        scale = self.scales[layer].index_select(0, slots)
        return e4m3_values(raw).mul_(scale[:, None]).to(self.dtype)
