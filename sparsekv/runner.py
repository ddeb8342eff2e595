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
        self._tables: dict[str, tuple[int, torch.Tensor, int | None]] = {}

    def slots_of(self, page_ids: list[int], num_positions: int) -> torch.Tensor:
        pages = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)[:num_positions]

    def slot_table(self, request_id: str, page_ids: list[int]) -> tuple[torch.Tensor, int | None]:
        """All slots of a request's pages, extended incrementally (a 1M-token request has 16K pages),
        and the first slot when the pages are one consecutive run (then reads need no gather)."""
        known, slots, start = self._tables.get(request_id, (0, None, None))
        if known > len(page_ids):
            known, slots, start = 0, None, None
        if known < len(page_ids):
            new = page_ids[known:]
            run = all(b - a == 1 for a, b in zip(new, new[1:]))
            joins = slots is None or (start is not None and new[0] * self.page_size == int(slots[-1]) + 1)
            start = new[0] * self.page_size if slots is None and run else (start if run and joins else None)
            fresh = self.slots_of(new, len(new) * self.page_size)
            slots = fresh if slots is None else torch.cat([slots, fresh])
            self._tables[request_id] = (len(page_ids), slots, start)
        return slots, start

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)

    def build_context(self, chunks: list[ScheduledChunk]) -> ForwardContext:
        ids, positions, seqs, logits_rows = [], [], [], []
        row = 0
        for ch in chunks:
            req = ch.request
            start, end = ch.first_position, ch.context_len
            ids.extend(req.token_at(p) for p in range(start, end))
            positions.append(torch.arange(start, end))
            slots, start = self.slot_table(req.request_id, req.page_ids)
            seqs.append(SeqSlice(req.request_id, row, row + ch.num_new_tokens, end, slots[:end], contiguous_start=start))
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
        return self.model.forward(ctx, self.cache).cpu()  # sampling generators live on the CPU
