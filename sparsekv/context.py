"""The per-step forward context: everything a layer needs besides its hidden states.

Layers keep the signature `forward(x, ctx)`; the runner builds one `ForwardContext` per step.

The flat batch holds the new tokens of every scheduled request back to back::

    rows:   [ req A: prefill chunk (S_A rows) | req B: 1 decode row | req C: ... ]
    seq.token_start .. seq.token_end   = this request's rows
    positions of those rows            = seq.context_len - seq.num_new_tokens .. seq.context_len - 1
    seq.slots[p]                       = cache slot of position p, for p < seq.context_len
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import numpy as np
import torch


@dataclass
class SeqSlice:
    """One request's part of the step."""

    request_id: str
    token_start: int
    token_end: int
    context_len: int          # tokens in the cache once this step has written its new tokens
    slots: torch.Tensor       # [context_len] int64 cache slot of every position
    # Runs of consecutive slots, (first position, first slot, length), covering positions
    # 0 .. context_len - 1 in order: long runs are read as views of the pool, with no copy.
    runs: tuple[tuple[int, int, int], ...] = ()
    num_drafts: int = 0       # draft tokens at the end of its rows (verified this step; a rejected one is rewritten)

    def host_slot(self, position: int) -> int:
        """The cache slot of `position`, from the runs (nothing read back from the device); the newest
        positions are found first."""
        for first, slot, length in reversed(self.runs):
            if first <= position < first + length:
                return slot + position - first
        return int(self.slots[position])

    @property
    def contiguous_start(self) -> int | None:
        """slots[p] == contiguous_start + p for every position: the whole history is one view."""
        return self.runs[0][1] if len(self.runs) == 1 else None

    @property
    def num_new_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def first_new_position(self) -> int:
        return self.context_len - self.num_new_tokens


@dataclass
class ForwardContext:
    input_ids: torch.Tensor       # [N]
    positions: torch.Tensor       # [N]
    slot_mapping: torch.Tensor    # [N] where each new token's cache entries are written
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor     # rows whose logits the step needs (last token of sampled requests)
    attention: str = "sparse"     # "sparse" or "dense" (baseline: selection off)
    # A request with at most this many new tokens is a decode (1, or 1 + drafts with speculative
    # decoding): in the sparse regime its rows attend in the step's decode batch.
    decode_rows: int = 1
    batch_dense_decodes: bool = True  # EngineConfig.batch_dense_decodes
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # Per request: sorted selected positions [S, k] and their validity, written by a full layer's
    # selector and reused by the shared layers after it (IndexShare).
    selection: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Optional hook the tiering layer installs: called with (layer, seq, selected positions).
    record_selection: object = None
    # A speculative draft step after the first (speculative.py): reads the cache, writes nothing, and
    # every layer reuses the selection given in `selection` (MTP index reuse).
    draft_step: bool = False
    # A decode graph's pieces (model/decode_graphs.py: fixed shapes, no seqs): each row's request's
    # first row, a padding row its own; None elsewhere.
    request_start: torch.Tensor | None = None
    # Device index tensors of token rows, made once per step and shared by the layers.
    row_indices: dict = field(default_factory=dict)
    # How the layers split this step's rows (model/attention.py's `DecodePlan`), made by the first layer.
    decode_plan: object = None
    # The batched decodes' selections [rows, k], in the plan's row order: the last full layer's.
    decode_selection: torch.Tensor | None = None
    # Called with each decoder layer's index once its forward has written its cache entries (a prefill
    # worker's layer-by-layer send, cache/layer_tap.py); None: nothing to call.
    after_layer: Callable[[int], None] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def rows_index(self, rows: list) -> torch.Tensor:
        """index_tensor(rows) on the step's device (rows: ints, or equal-length lists of ints), cached."""
        key = tuple(tuple(r) if isinstance(r, list) else r for r in rows)
        index = self.row_indices.get(key)
        if index is None:
            index = self.row_indices[key] = index_tensor(rows, self.input_ids.device)
        return index


@dataclass
class DecodePicks:
    """A batch of decode rows and the k positions each attends to, for one gather from the cache.

    `seqs` own consecutive rows of `selected` [rows, k] (seq.num_new_tokens each, in order). Row r's
    positions live in the flat history table `history` (every seq's `slots`, concatenated) from
    `row_start[r]` on, so `slots()` is one [rows, k] slot table built in two ops, whatever the batch."""

    seqs: list[SeqSlice]
    selected: torch.Tensor   # [rows, k] positions
    history: torch.Tensor    # [sum of context_len] slots of every seq's positions, back to back
    row_start: torch.Tensor  # [rows] where each row's request starts in `history`

    def slots(self) -> torch.Tensor:
        """[rows, k] cache slots of the selected positions."""
        return self.history[self.row_start[:, None] + self.selected]


def index_tensor(values, device: torch.device) -> torch.Tensor:
    """A small int64 index tensor (from ints, nested lists or a numpy array) on `device`, without
    draining the GPU queue: on an accelerator it goes through pinned memory with non_blocking (a plain
    torch.tensor(..., device=) would wait for every queued kernel)."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        t = torch.from_numpy(values)  # shares the array's memory: no copy, no op dispatched
    else:
        t = torch.as_tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def padded_rows(lengths: list[int], length: int, device) -> torch.Tensor:
    """[B, length] rows of the concatenated histories of `lengths` tokens each, every history padded to
    `length` by repeating its last row (callers mask the padding)."""
    offsets = index_tensor([0, *accumulate(lengths[:-1])], device)
    last = index_tensor(lengths, device) - 1
    return offsets[:, None] + torch.minimum(torch.arange(length, device=device)[None, :], last[:, None])


def padded_slots(seqs: list[SeqSlice], length: int | None = None) -> torch.Tensor:
    """[B, length] slots of each request's history (default length: the longest), padded by repeating
    its last slot (callers mask the padding): a few launches for the whole batch, not one copy per
    request."""
    lengths = [s.context_len for s in seqs]
    flat = torch.cat([s.slots for s in seqs])
    return flat[padded_rows(lengths, length or max(lengths), flat.device)]
