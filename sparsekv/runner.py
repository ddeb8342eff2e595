"""Scheduled chunks -> one flat batch of tensors -> model -> logits of the rows to sample.

Every flat varlen batch (input ids, positions, slot mapping, per-request slices) is built here and
only here: the target's, and the MTP layer's extend pass and draft steps (speculative.py).
"""
from __future__ import annotations

import torch

from .context import ForwardContext, SeqSlice
from .scheduler import ScheduledChunk


# A chunk of at most this many new tokens (a decode) has its new slots computed in Python and sent with
# the step's other ints; a longer one (a prefill chunk) takes them from its slot table, as one slice.
SMALL_CHUNK_TOKENS = 64


def clip_runs(runs: list[list[int]], num_positions: int) -> tuple[tuple[int, int, int], ...]:
    """The runs covering positions 0 .. num_positions - 1."""
    out = []
    for position, slot, length in runs:
        if position >= num_positions:
            break
        out.append((position, slot, min(length, num_positions - position)))
    return tuple(out)


class ModelRunner:
    def __init__(self, model, cache, page_size: int, attention: str, decode_rows: int = 1,
                 batch_dense_decodes: bool = True):
        self.model, self.cache, self.page_size, self.attention = model, cache, page_size, attention
        self.batch_dense_decodes = batch_dense_decodes
        self.decode_rows = decode_rows  # 1 + num_speculative_tokens
        self.device = model.device
        self._offsets = torch.arange(page_size, device=self.device)
        self._tables: dict[str, tuple[int, torch.Tensor, list]] = {}
        self.taps = None  # LayerTaps: prompt pages handed out layer by layer (a prefill worker's)
        self.graphs = None  # model/decode_graphs.py's DecodeGraphs: decode steps as fixed-shape pieces

    def slots_of(self, page_ids: list[int], num_positions: int) -> torch.Tensor:
        pages = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)[:num_positions]

    def slot_table(self, request_id: str, page_ids: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """All slots of a request's pages, extended incrementally (a 1M-token request has 16K pages),
        and their runs of consecutive slots as [first position, first slot, length]."""
        known, slots, runs = self._tables.get(request_id, (0, None, []))
        if known > len(page_ids):
            known, slots, runs = 0, None, []
        if known < len(page_ids):
            for i in range(known, len(page_ids)):
                first = page_ids[i] * self.page_size
                if runs and runs[-1][1] + runs[-1][2] == first:
                    runs[-1][2] += self.page_size
                else:
                    runs.append([i * self.page_size, first, self.page_size])
            fresh = self.slots_of(page_ids[known:], (len(page_ids) - known) * self.page_size)
            slots = fresh if slots is None else torch.cat([slots, fresh])
            self._tables[request_id] = (len(page_ids), slots, runs)
        return slots, runs

    def seq_slice(self, request_id: str, page_ids: list[int], token_start: int, token_end: int,
                  context_len: int, num_drafts: int = 0) -> SeqSlice:
        """A request's part of a batch: rows [token_start, token_end), cache positions < context_len, the
        last `num_drafts` rows draft tokens."""
        slots, runs = self.slot_table(request_id, page_ids)
        return SeqSlice(request_id, token_start, token_end, context_len, slots[:context_len],
                        runs=clip_runs(runs, context_len), num_drafts=num_drafts)

    def new_slots(self, page_ids: list[int], seq: SeqSlice) -> list[int] | torch.Tensor:
        """The slots of `seq`'s new positions: Python ints for a few, a view of its table for many."""
        if seq.num_new_tokens > SMALL_CHUNK_TOKENS:
            return seq.slots[seq.first_new_position:]
        ps = self.page_size
        return [page_ids[p // ps] * ps + p % ps for p in range(seq.first_new_position, seq.context_len)]

    def flat_tensors(self, ids: list[int], positions: list[int], slot_parts: list, logits_rows: list[int]):
        """(input ids, positions, slot mapping, logits rows) as device tensors, the ints in one transfer."""
        small = [s for part in slot_parts if isinstance(part, list) for s in part]
        everything = torch.tensor(ids + positions + logits_rows + small, dtype=torch.long, device=self.device)
        input_ids, pos, rows, small = everything.split([len(ids), len(positions), len(logits_rows), len(small)])
        if len(small) == len(positions):
            return input_ids, pos, small, rows
        pieces, used = [], 0
        for part in slot_parts:
            if isinstance(part, list):
                pieces.append(small[used:used + len(part)])
                used += len(part)
            else:
                pieces.append(part)
        return input_ids, pos, torch.cat(pieces), rows

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        for selector in self.model.selectors():
            selector.forget(request_id)

    def build_context(self, chunks: list[ScheduledChunk]) -> ForwardContext:
        ids, positions, seqs, slots, logits_rows = [], [], [], [], []
        row = 0
        for ch in chunks:
            start, end = ch.first_position, ch.context_len
            ids.extend(ch.token_ids)
            positions.extend(range(start, end))
            seqs.append(self.seq_slice(ch.request_id, ch.page_ids, row, row + ch.num_new_tokens, end,
                                       ch.num_draft_tokens))
            slots.append(self.new_slots(ch.page_ids, seqs[-1]))
            row += ch.num_new_tokens
            if ch.samples_token:  # the last known token's row, then one per draft token
                logits_rows.extend(range(row - 1 - ch.num_draft_tokens, row))
        input_ids, pos, slot_mapping, rows = self.flat_tensors(ids, positions, slots, logits_rows)
        return ForwardContext(input_ids, pos, slot_mapping, seqs, rows, self.attention,
                              decode_rows=self.decode_rows, batch_dense_decodes=self.batch_dense_decodes)

    def build_mtp_context(self, parts: list[tuple[str, list[int], int, list[int]]],
                          logits_rows: list[int]) -> ForwardContext:
        """The MTP layer's pass ("extend") over the positions whose next token became known. parts, one
        per request in batch order: (request id, its pages, first position, the next token of each)."""
        ids, positions, seqs, slots, row = [], [], [], [], 0
        for request_id, page_ids, start, next_tokens in parts:
            end = start + len(next_tokens)
            ids.extend(next_tokens)
            positions.extend(range(start, end))
            seqs.append(self.seq_slice(request_id, page_ids, row, row + len(next_tokens), end))
            slots.append(self.new_slots(page_ids, seqs[-1]))
            row += len(next_tokens)
        input_ids, pos, slot_mapping, rows = self.flat_tensors(ids, positions, slots, list(logits_rows))
        return ForwardContext(input_ids, pos, slot_mapping, seqs, rows, self.attention, decode_rows=self.decode_rows,
                              batch_dense_decodes=self.batch_dense_decodes)

    def build_draft_step_context(self, seqs: list[SeqSlice], step: int, tokens: list[int],
                                 selection: dict) -> ForwardContext:
        """Draft step `step` (1-based after the extend pass): one row per request past its history,
        reusing the extend row's `selection` (MTP index reuse); it writes no cache entry."""
        rows = [SeqSlice(s.request_id, i, i + 1, s.context_len, s.slots, runs=s.runs) for i, s in enumerate(seqs)]
        positions = torch.tensor([s.context_len - 1 + step for s in seqs], device=self.device)
        return ForwardContext(torch.tensor(tokens, device=self.device), positions, positions, rows,
                              torch.arange(len(seqs), device=self.device), self.attention, selection=dict(selection),
                              draft_step=True, batch_dense_decodes=self.batch_dense_decodes)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], graphs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the step. Returns fp32 logits on the model's device, 1 + drafts rows per chunk whose
        `samples_token` is True, in order (the output processor copies to the host what it samples
        there); and the final hidden states of every row (on the device, for the MTP drafter).
        `graphs`: a decode step may run as the decode graphs' pieces (False: a step whose layers
        are observed, e.g. its routed experts recorded)."""
        ctx = self.build_context(chunks)
        if graphs and self.graphs is not None and self.graphs.takes(chunks):
            return self.graphs.execute(ctx)
        if self.taps:
            ctx.after_layer, ctx.record_selection = self.taps.begin_step(chunks)
        hidden = self.model.hidden_states(ctx, self.cache)
        sampled = hidden if ctx.logits_rows.numel() == hidden.shape[0] else hidden[ctx.logits_rows]  # rows ascend
        logits = self.model.logits(sampled)
        return logits, hidden
