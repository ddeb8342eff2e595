"""The device KV pools: one latent tensor per layer and one indexer-key tensor per full layer.

Slot s = page_id * page_size + offset. Attention reads through the methods below, so a tiered
cache can substitute its own placement without touching the model.
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from ..config import ModelConfig
from ..context import SeqSlice, index_tensor, padded_slots
from ..model.indexer import gather_rows
from .latent_format import PlainLatent


MIN_VIEW_RUN = 1024  # shorter runs of consecutive slots are gathered together (one copy, one op)


def history_segments(table: torch.Tensor, seq: SeqSlice) -> list[tuple[int | torch.Tensor, torch.Tensor]]:
    """A request's rows of `table` as (positions, rows) pieces covering its whole history.

    Long runs of consecutive slots are views (positions: the first one, an int), so a scan over the
    history copies nothing even when pages were appended out of order (concurrent decodes interleave
    their page allocations); the short runs are gathered into one piece (positions: a tensor).
    """
    pieces, starts, lengths = [], [], []
    for position, slot, length in seq.runs:
        if length >= MIN_VIEW_RUN:
            pieces.append((position, table.narrow(0, slot, length)))
        else:
            starts.append(position)
            lengths.append(length)
    if starts:
        positions = _concat_ranges(starts, lengths).to(seq.slots.device)
        pieces.append((positions, table.index_select(0, seq.slots[positions])))
    return pieces


def paged_keys(table: torch.Tensor, seqs: list[SeqSlice], page_size: int) -> tuple[torch.Tensor, np.ndarray | None, list[int]]:
    """Several requests' rows of a slot-indexed `table` by page ([m, page_size, D]), for scoring page by
    page (model/indexer.py: select_decode_pages): where each (request, page) pair's page is among
    them (None: the i-th pair is the i-th), and how many pages each request has. On a CPU, when the
    pages are distinct and fill at least half of the pool span they cover, that span itself (a view:
    no row is copied); else the pages gathered. Worked out from the requests' runs, on the host."""
    counts = page_counts(seqs, page_size)
    runs = [(slot // page_size, -(-length // page_size)) for s in seqs for _, slot, length in s.runs]
    dim = table.shape[1]
    if table.device.type == "cpu" and sum(n for _, n in runs) == sum(counts):
        lo, hi = min(f for f, _ in runs), max(f + n for f, n in runs)
        span = table[lo * page_size:hi * page_size].view(hi - lo, page_size, dim)
        if len(seqs) == 1 and all(f + n == nxt for (f, n), (nxt, _) in zip(runs, runs[1:])):
            return span, None, counts  # one request's pages in order: the span is its history
        ordered = sorted(runs)
        if hi - lo <= 2 * sum(counts) and all(f + n <= nxt for (f, n), (nxt, _) in zip(ordered, ordered[1:])):
            return span, np.concatenate([np.arange(f - lo, f - lo + n) for f, n in runs]), counts
    pages = history_pages(seqs, page_size)
    return table.view(-1, page_size * dim).index_select(0, pages).view(-1, page_size, dim), None, counts


def page_counts(seqs: list[SeqSlice], page_size: int) -> list[int]:
    """How many pages each request's history spans."""
    return [-(-s.context_len // page_size) for s in seqs]


def history_pages(seqs: list[SeqSlice], page_size: int) -> torch.Tensor:
    """The pages holding each request's history, in order, concatenated (page ids): the slots of each
    history's page-aligned positions, in a fixed number of ops however many requests."""
    counts = page_counts(seqs, page_size)
    if len(seqs) == 1:
        return seqs[0].slots[::page_size] // page_size
    flat = torch.cat([s.slots for s in seqs])
    device, per = flat.device, index_tensor(counts, flat.device)
    history = torch.repeat_interleave(index_tensor([0, *accumulate(s.context_len for s in seqs[:-1])], device), per)
    first = torch.repeat_interleave(index_tensor([0, *accumulate(counts[:-1])], device), per)
    page = torch.arange(sum(counts), device=device) - first  # each pair's page index within its request
    return flat.index_select(0, history + page * page_size) // page_size


def distinct_positions(flat: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct positions among `flat` (ascending) and each pick's index among them, through a mask
    over the history instead of a sort (torch.unique's sort is the slow part on a CPU)."""
    seen = torch.zeros(context_len, dtype=torch.bool, device=flat.device)
    seen[flat] = True
    rank = torch.cumsum(seen, 0) - 1
    return seen.nonzero()[:, 0], rank[flat]


def _concat_ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """cat(arange(s, s + n) for s, n) in a fixed number of ops, however many ranges."""
    start, length = torch.tensor(starts), torch.tensor(lengths)
    offset = length.cumsum(0) - length
    return torch.arange(int(length.sum())) + torch.repeat_interleave(start - offset, length)


class KVPool:
    """`fmt` (latent_format.py): how latent rows are stored; reads decode what they gathered.

    `padding_page`: one more page past the allocator's, zeroed, which no request holds: the padding
    rows of a decode step padded to its bucket (model/decode_graphs.py) write and read its first slot,
    `padding_slot`, and a real row's masked picks may point there."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, layers: list[int], indexer_layers: list[int], fmt=None,
                 padding_page: bool = False):
        self.num_slots = num_pages * page_size
        self.page_size, self.dtype = page_size, dtype
        self.padding_slot = self.num_slots if padding_page else None
        rows = self.num_slots + (page_size if padding_page else 0)
        self.fmt = fmt = fmt or PlainLatent(cfg, dtype)
        self.latent = {i: torch.empty(rows, fmt.row_width, dtype=fmt.row_dtype, device=device) for i in layers}
        self.index_keys = {i: torch.empty(rows, cfg.index_head_dim, dtype=dtype, device=device) for i in indexer_layers}
        for table in [*self.latent.values(), *self.index_keys.values()]:
            table[self.num_slots:].zero_()
        self._latent_bpt = sum(t.shape[1] * t.element_size() for t in self.latent.values())
        self._index_bpt = sum(t.shape[1] * t.element_size() for t in self.index_keys.values())

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor indexed by slot, with its tokens per row (1): what a page's contents are (the
        prefix cache's host copies)."""
        return [(t, 1) for t in list(self.latent.values()) + list(self.index_keys.values())]

    def layer_slot_tensors(self, layer: int) -> list[torch.Tensor]:
        """The slot-indexed tensors layer `layer`'s forward writes (its latents, its indexer keys)."""
        return [self.latent[layer]] + ([self.index_keys[layer]] if layer in self.index_keys else [])

    # -- sizes ---------------------------------------------------------------------------------
    def latent_bytes_per_token(self) -> int:
        return self._latent_bpt

    def index_bytes_per_token(self) -> int:
        return self._index_bpt

    # -- writes --------------------------------------------------------------------------------
    def write_latent(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.latent[layer].index_copy_(0, slots, self.fmt.encode(values))

    def write_index_keys(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.index_keys[layer].index_copy_(0, slots, values.to(self.dtype))

    # -- the step protocol (TieredKVPool's; a device-only pool has nothing to stage) --------------
    def begin_step(self, chunks) -> None:
        """The tiered pool resolves working sets here."""

    def begin_mtp_pass(self, seqs: list[SeqSlice], page_ids: dict[str, list[int]]) -> None:
        """The tiered pool sets up the MTP layer's working sets here."""

    def flush(self) -> None:
        """The tiered pool finishes pending host writes here: every slot row is current already."""

    def release(self, request_id: str, keep_counters: bool = False) -> dict:
        """The tiered pool frees a request's working set here; a request holds nothing but its pages."""
        return {}

    # -- observability -------------------------------------------------------------------------
    def request_metrics(self, request_id: str, held_tokens: int) -> dict:
        return self._device_bytes(held_tokens)

    def stats(self, used_tokens: int) -> dict:
        return self._device_bytes(used_tokens)

    def _device_bytes(self, tokens: int) -> dict:
        latent, indexer = tokens * self._latent_bpt, tokens * self._index_bpt
        return {"device_kv_bytes": latent + indexer, "device_latent_bytes": latent, "device_indexer_bytes": indexer}

    def layout(self) -> dict[str, str]:
        return {"kv_tiering": "False", "host_store": "none", "device_buffer_tokens": "0"}

    def check_integrity(self, active: set[str] | None = None, waiting: set[str] = frozenset()) -> None:
        """Slots belong to pages, which the allocator checks; nothing else is held per request."""

    # -- reads ---------------------------------------------------------------------------------
    @staticmethod
    def _history(table: torch.Tensor, seq: SeqSlice) -> torch.Tensor:
        if seq.contiguous_start is not None:  # one run of pages: a view, no copy of T entries
            return table.narrow(0, seq.contiguous_start, seq.context_len)
        return table.index_select(0, seq.slots)

    def latent_for(self, layer: int, seq: SeqSlice) -> torch.Tensor:
        return self.fmt.decode(self._history(self.latent[layer], seq))

    def index_key_segments(self, layer: int, seq: SeqSlice) -> list[tuple[int | torch.Tensor, torch.Tensor]]:
        return history_segments(self.index_keys[layer], seq)

    def index_keys_batch(self, layer: int, seqs: list[SeqSlice], scratch=None) -> torch.Tensor:
        """Indexer keys of several requests' histories, padded: [B, T_max, D_I] (index_select on the flat
        slots: a CPU runs it several times faster than the same [B, T_max] advanced index), into
        `scratch`'s kept buffer when given (model/indexer.py: gather_rows)."""
        return gather_rows(self.index_keys[layer], padded_slots(seqs), scratch)

    def index_key_pages(self, layer: int, seqs: list[SeqSlice]) -> tuple[torch.Tensor, np.ndarray | None, list[int]]:
        """Indexer keys of several requests' histories by page (model/indexer.py: paged_keys), and how
        many pages each."""
        return paged_keys(self.index_keys[layer], seqs, self.page_size)

    def gather_latent(self, layer: int, seq: SeqSlice, positions: torch.Tensor) -> torch.Tensor:
        """Latents of the selected positions [S, k] -> [S, k, latent_dim]: only k entries are read."""
        flat = positions.reshape(-1)
        if self.fmt.encoded and positions.shape[0] > 1:  # a prefill block: decode each distinct entry once
            distinct, inverse = distinct_positions(flat, seq.context_len)
            latents = self.fmt.decode(self.latent[layer].index_select(0, seq.slots[distinct]))
            return latents.index_select(0, inverse).view(*positions.shape, -1)
        return self.fmt.decode(self.latent[layer].index_select(0, seq.slots[flat])).view(*positions.shape, -1)

    def dense_decode_latents(self, layer: int, seqs: list[SeqSlice], length: int) -> torch.Tensor:
        """Decoding requests' whole histories, each padded to `length` entries: [B, length, latent_dim]."""
        return gather_picked(self.latent[layer], padded_slots(seqs, length), self.fmt)

    def gather_decode_latents(self, layer: int, picks) -> torch.Tensor:
        """A batch of decode rows' selected entries (context.DecodePicks) -> [rows, k, latent_dim]: one
        gather through the batch's [rows, k] slot table."""
        return gather_picked(self.latent[layer], picks.slots(), self.fmt)

    def piece_reads(self, rows: int, mtp: bool = False) -> PoolPieceReads:
        """How the decode pieces of a `rows`-row bucket (model/decode_graphs.py) address this pool."""
        return PoolPieceReads(self)

    def decode_pieces_unbuilt(self) -> str | None:
        """The decode pieces read any step of this pool."""
        return None

    def pieces_read(self, request_ids: list[str], mtp: bool = False) -> bool:
        """The decode pieces read any request's rows."""
        return True


def gather_picked(rows: torch.Tensor, table: torch.Tensor, fmt) -> torch.Tensor:
    """The stored `rows` a [n, k] table names, decoded: [n, k, latent_dim]."""
    latents = fmt.decode(rows.index_select(0, table.reshape(-1)))
    return latents.view(*table.shape, latents.shape[-1])


class PoolPieceReads:
    """The decode pieces' view of a KVPool (model/decode_graphs.py): they write and read the pool
    itself, and a bucket's [rows, k] table holds pool slots: a selection's, or a dense-regime
    request's whole history padded to k (the same for every layer, so loaded once per step, and
    for a draft chain once per chain)."""

    resolves = False

    def __init__(self, pool: KVPool):
        self.cache, self.padding_pick = pool, pool.padding_slot

    def load(self, step) -> None:
        """Nothing to place before the first piece."""

    def table(self, layer: int, picks) -> torch.Tensor:
        """[rows, k] pool slots of a selection's picks (context.DecodePicks)."""
        return picks.slots()

    def history(self, layer: int, seqs: list[SeqSlice], k: int) -> torch.Tensor:
        """[len(seqs), k] pool slots of each request's whole history, padded by repeating its last."""
        return padded_slots(seqs, k)

    def finish(self, step) -> None:
        """Nothing to move after the last piece: the pieces wrote the pool."""
