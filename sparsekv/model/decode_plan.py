"""How a step's rows go through attention: which run as one batch, which one request at a time.

The plan depends only on the step (its requests' lengths, the regime, the device), so the first
layer makes it and every later layer reuses it (`ForwardContext.decode_plan`), with the index tensors
it needs made once::

    ctx.seqs ──► single: prefill chunks (and every request when batching is off), one at a time
             ├─► dense:  decodes within top-k, one padded batch per length bucket
             └─► sparse: decodes past top-k, one batch: [ groups scored together | one at a time ]
                         ordered by scoring layout then length, so neighbours pad little

A decode's rows (1, or 1 + its drafts) are consecutive in the sparse batch; row r of the batch is
flat-batch row `rows[r]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..context import DecodePicks, ForwardContext, SeqSlice, index_tensor
from .indexer import INDEX_DECODE_BATCH_ELEMENTS_CPU, INDEX_SCORE_ELEMENTS_GPU, keys_major

# A group of decodes scored together pads each history to the group's longest: at most this factor
# longer than its shortest (or GROUP_PAD_FREE_KEYS, short histories cost little padded), so padding at
# most doubles a request's scoring work. The number of groups grows with the spread of lengths (log2
# of it), not with the number of requests.
GROUP_LENGTH_RATIO = 2
GROUP_PAD_FREE_KEYS = 4096


def dense_length(context_len: int, index_topk: int) -> int:
    """The padded history length of a dense-regime decode: the next power of two (at least 16), at
    most top-k (a dense-regime context is never longer)."""
    return min(index_topk, max(16, 1 << (context_len - 1).bit_length()))


def groups_within(seqs: list[SeqSlice], budget: int) -> list[list[SeqSlice]]:
    """Consecutive groups of `seqs` (sorted by length) whose padded size, rows x longest history,
    stays within `budget` elements."""
    groups, current = [], []
    for seq in seqs:
        if current and (len(current) + 1) * seq.context_len > budget:
            groups.append(current)
            current = []
        current.append(seq)
    return groups + [current] if current else groups


def length_buckets(seqs: list[SeqSlice], ratio: int = GROUP_LENGTH_RATIO,
                   pad_free: int = GROUP_PAD_FREE_KEYS) -> list[list[SeqSlice]]:
    """Consecutive runs of `seqs` (sorted by length) whose longest is at most `ratio` x their shortest
    or `pad_free` keys."""
    buckets: list[list[SeqSlice]] = []
    for seq in seqs:
        if buckets and seq.context_len <= max(ratio * buckets[-1][0].context_len, pad_free):
            buckets[-1].append(seq)
        else:
            buckets.append([seq])
    return buckets


@dataclass
class DecodePlan:
    single: list[SeqSlice]
    dense: dict[int, list[SeqSlice]]
    sparse: list[SeqSlice]
    # (keys-major, requests) groups covering a prefix of `sparse`, in order; the rest select alone
    groups: list[tuple[bool, list[SeqSlice]]]
    rows: list[int]
    _tensors: dict = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        return [s.num_new_tokens for s in self.sparse]

    def row_index(self, ctx: ForwardContext) -> torch.Tensor:
        return ctx.rows_index(self.rows)

    def positions(self, ctx: ForwardContext) -> torch.Tensor:
        """[rows] position of each sparse-batch row."""
        if "positions" not in self._tensors:
            self._tensors["positions"] = ctx.positions[self.row_index(ctx)]
        return self._tensors["positions"]

    def only_sparse(self, ctx: ForwardContext) -> bool:
        """Every row of the step is a sparse decode's, in flat-batch order (a plain decode step)."""
        return not self.single and not self.dense and self.rows == list(range(ctx.num_tokens))

    def picks(self, ctx: ForwardContext, selected: torch.Tensor) -> tuple[DecodePicks, torch.Tensor]:
        """The rows' slot table for `selected` [rows, k] and its mask of the picks past each row's position
        [rows, 1, k], made once per selection: the shared layers after a full layer reuse both."""
        made = self._tensors.get("picks")
        if made is None or made[0] is not selected:
            hidden = (selected > self.positions(ctx)[:, None]).unsqueeze(1)
            made = self._tensors["picks"] = (selected, _SlotTable(self.sparse, selected, *self.history(ctx)), hidden)
        return made[1], made[2]

    def history(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(every sparse decode's slots back to back, [rows] where each row's request starts in them)."""
        if "history" not in self._tensors:
            starts = [0, *accumulate(s.context_len for s in self.sparse[:-1])]
            row_start = [start for start, s in zip(starts, self.sparse) for _ in range(s.num_new_tokens)]
            flat = torch.cat([s.slots for s in self.sparse])
            self._tensors["history"] = (flat, index_tensor(row_start, flat.device))
        return self._tensors["history"]


class _SlotTable(DecodePicks):
    """DecodePicks whose [rows, k] slot table is made at the first read and kept."""

    _slots: torch.Tensor | None = None

    def slots(self) -> torch.Tensor:
        if self._slots is None:
            self._slots = super().slots()
        return self._slots


def make_plan(ctx: ForwardContext, cfg) -> DecodePlan:
    """The step's plan (see the module docstring). With batching off every request is `single`."""
    topk, batch = cfg.index_topk, ctx.batch_dense_decodes and ctx.attention != "dense"
    single, dense, sparse = [], {}, []
    for seq in ctx.seqs:
        if not batch or seq.num_new_tokens > ctx.decode_rows:
            single.append(seq)
        elif seq.context_len <= topk:
            dense.setdefault(dense_length(seq.context_len, topk), []).append(seq)
        else:
            sparse.append(seq)
    device = ctx.input_ids.device

    def order(s: SeqSlice):  # a row that sees at most k keys selects alone (no row of a group may)
        return s.first_new_position < topk, keys_major(device, s.num_new_tokens, s.context_len), s.context_len
    sparse.sort(key=order)
    return DecodePlan(single, dense, sparse, _groups(sparse, ctx, cfg),
                      [r for s in sparse for r in range(s.token_start, s.token_end)])


def _groups(sparse: list[SeqSlice], ctx: ForwardContext, cfg) -> list[tuple[bool, list[SeqSlice]]]:
    """Groups of the decodes whose every row sees more than k keys: one scoring layout each (see
    `keys_major`), lengths within GROUP_LENGTH_RATIO, padded scores and keys within the device's budget."""
    device, topk = ctx.input_ids.device, cfg.index_topk
    budget = INDEX_DECODE_BATCH_ELEMENTS_CPU if device.type == "cpu" else INDEX_SCORE_ELEMENTS_GPU
    per_position = ctx.decode_rows * max(cfg.index_n_heads, cfg.index_head_dim)
    out, layouts = [], {}
    for s in sparse:
        if s.first_new_position >= topk:
            layouts.setdefault(keys_major(device, s.num_new_tokens, s.context_len), []).append(s)
    for major, alike in layouts.items():
        for bucket in length_buckets(alike):
            out.extend((major, group) for group in groups_within(bucket, max(1, budget // per_position)))
    return out


def plan_of(ctx: ForwardContext, cfg) -> DecodePlan:
    if ctx.decode_plan is None:
        ctx.decode_plan = make_plan(ctx, cfg)
    return ctx.decode_plan
