"""Scheduled chunks -> one flat batch of tensors -> model -> logits of the rows to sample.

The flat varlen batch (input ids, positions, slot mapping, per-request slices) is built here and
only here.
"""
from __future__ import annotations

import torch

from .context import ForwardContext, SeqSlice
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model, cache, page_size: int, attention: str):
        self.model, self.cache, self.page_size, self.attention = model, cache, page_size, attention
        self.device = model.device
        self._offsets = torch.arange(page_size, device=self.device)

    def slots_of(self, page_ids: list[int], num_positions: int) -> torch.Tensor:
        pages = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)[:num_positions]

    def build_context(self, chunks: list[ScheduledChunk]) -> ForwardContext:
        ids, positions, seqs, logits_rows = [], [], [], []
        row = 0
        for ch in chunks:
            req = ch.request
            start, end = ch.first_position, ch.context_len
            ids.extend(req.token_at(p) for p in range(start, end))
            positions.append(torch.arange(start, end))
            seqs.append(SeqSlice(req.request_id, row, row + ch.num_new_tokens, end, self.slots_of(req.page_ids, end)))
            row += ch.num_new_tokens
            if ch.samples:
                logits_rows.append(row - 1)
        pos = torch.cat(positions).to(self.device)
        slot_mapping = torch.cat([s.slots[s.first_new_position:] for s in seqs])
        return ForwardContext(torch.tensor(ids, dtype=torch.long, device=self.device), pos, slot_mapping, seqs,
                              torch.tensor(logits_rows, dtype=torch.long, device=self.device), self.attention)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs the step; returns fp32 logits, one row per chunk whose `samples` is True, in order."""
        ctx = self.build_context(chunks)
        return self.model.forward(ctx, self.cache)
