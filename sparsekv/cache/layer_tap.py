"""A prompt's page rows handed out layer by layer while the step that computes them runs: a prefill
worker sends layer i's rows of a chunk's pages while layer i + 1 computes (docs/disaggregation.md).

A tap is set per request (`LayerTaps.add`). For each step, `begin_step` finds the prompt pages each
tapped chunk completes; after every decoder layer's forward (`ForwardContext.after_layer`) the rows of
those pages in the tensors that layer wrote (its latents, its indexer keys) are copied out of the
pool and handed to the tap's `deliver`. Each page is handed out once per layer, and never a page
before `skip`; of the page the prefix cache does not name (the prompt's last token's), the rows
through that token, once (a tail: the decode side, given the first token sampled here, then computes
from that token on). A full layer's tail delivery also carries the positions the tail's rows
selected (their union, and the last row's), which warm the decode side's device working set as the
rows of a last chunk computed there would (cache/tiers.py, `TieredKVPool.begin_step`). The kinds
(indices into the cache's `PageRows` tensors, the order a page's rows are exported in) name what each
delivery holds; the other kinds (the MTP layer's entries, a selector's page state) are left to the
page's export once it is named, except a tail's MTP layer's rows, handed out after the step's MTP
pass has written them (`after_mtp`)::

    chunk [first_position, context_len)     pages completed: first_position // P .. context_len // P - 1
    layer 0 forward -> deliver(0, pages, [latent_0, index_keys_0])
    layer 1 forward -> deliver(1, pages, [latent_1])                 (a shared layer: no keys of its own)
    ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LayerRows:
    """One delivery: pages [first, first + count) of a prompt, `rows[i]` the rows of kind `kinds[i]`,
    shaped [count, page_size, ...]; or, with `tail` > 0, the first `tail` rows of page `first` (count
    1), shaped [1, tail, ...]. On CUDA the copy is asynchronous: `ready()` waits for it."""

    layer: int
    first: int
    count: int
    kinds: list[int]
    rows: list[torch.Tensor]
    event: object = None
    tail: int = 0
    # a tail's on a full layer (sparse regime): the distinct positions its rows selected, ascending,
    # and the last row's selection (int64, on the CPU); None otherwise
    selected: tuple[torch.Tensor, torch.Tensor] | None = None

    def ready(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.rows

    def done(self) -> bool:
        """Whether `ready()` would return at once (the copies landed), without waiting: an event
        loop polls this rather than block in `ready()` while the GPU works through the step."""
        return self.event is None or self.event.query()


@dataclass
class _Tap:
    deliver: Callable[[LayerRows], None]
    next_page: int  # the first page not handed out yet
    num_pages: int  # the prompt's pages a prefix cache names (every full page but its last token's)
    tail: int = 0  # rows of page num_pages through the prompt's last token, handed out once computed


class LayerTaps:
    """The taps of an engine's runner. `layer_kinds[l]`: the kinds layer l writes (the positions of its
    tensors in `tensors`, a cache's `PageRows.tensors`); `slots_of(pages, n)`: the first n slots of
    those pages (the runner's); `flush` makes every slot row current."""

    def __init__(self, tensors: list[tuple[torch.Tensor, int]], layer_tensors: dict[int, list[torch.Tensor]],
                 page_size: int, slots_of: Callable[[list[int], int], torch.Tensor], flush: Callable[[], None],
                 full_layers: frozenset[int] = frozenset(), mtp_tensors: dict[int, list[torch.Tensor]] | None = None):
        position = {id(t): j for j, (t, per_row) in enumerate(tensors) if per_row == 1}
        self.layer_kinds = {l: [position[id(t)] for t in ts if id(t) in position] for l, ts in layer_tensors.items()}
        self.mtp_kinds = {l: [position[id(t)] for t in ts if id(t) in position] for l, ts in (mtp_tensors or {}).items()}
        self.tensors = [t for t, _ in tensors]
        self.page_size, self.slots_of, self.flush, self.full_layers = page_size, slots_of, flush, full_layers
        self._taps: dict[str, _Tap] = {}
        self._tails: dict[str, int] = {}  # this step's tails: request -> the tail's first position
        self._selected: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (request, layer) -> its tail's
        self._mtp_tails: list = []  # this step's tails, whose MTP layer's rows its MTP pass writes (`after_mtp`)

    @property
    def kinds(self) -> list[int]:
        """Every kind some layer hands out (a tapped page's export carries the others)."""
        return sorted({j for kinds in self.layer_kinds.values() for j in kinds})

    @property
    def every_kind(self) -> bool:
        """Whether a tail's rows come in every kind: the layers' and the MTP pass's (no selector page state)."""
        mtp = {j for kinds in self.mtp_kinds.values() for j in kinds}
        return len(set(self.kinds) | mtp) == len(self.tensors)

    def add(self, request_id: str, num_pages: int, skip: int, deliver: Callable[[LayerRows], None],
            tail: int = 0) -> None:
        """Hand out pages [skip, num_pages) of the request's prompt as its steps complete them, then
        the first `tail` rows of page num_pages (the prompt's last token's page, through that token)."""
        self._taps[request_id] = _Tap(deliver, skip, num_pages, tail)

    def remove(self, request_id: str) -> None:
        self._taps.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._taps)

    def begin_step(self, chunks) -> tuple[Callable[[int], None] | None, Callable | None]:
        """The step's `after_layer` hook, or None when no tapped chunk completes a page to hand out; and
        its `record_selection` hook, or None when no tapped chunk completes a tail."""
        work = []
        self._tails.clear()
        self._selected.clear()
        self._mtp_tails.clear()
        for ch in chunks:
            tap = self._taps.get(ch.request_id)
            if tap is None:
                continue
            first = max(ch.first_position // self.page_size, tap.next_page)
            end = min(ch.context_len // self.page_size, tap.num_pages)
            if end > first:
                tap.next_page = end
                count = end - first
                work.append((tap, ch.request_id, first, count, 0, self.slots_of(ch.page_ids[first:end], count * self.page_size)))
            tail_end = tap.num_pages * self.page_size + tap.tail
            if tap.tail and ch.context_len >= tail_end and ch.first_position < tail_end:
                page = ch.page_ids[tap.num_pages:tap.num_pages + 1]
                work.append((tap, ch.request_id, tap.num_pages, 1, tap.tail, self.slots_of(page, tap.tail)))
                self._mtp_tails.append(work[-1])
                self._tails[ch.request_id] = tap.num_pages * self.page_size
                tap.tail = 0
        if not work:
            return None, None
        return (lambda layer: self._after_layer(layer, work)), (self._record if self._tails else None)

    def _record(self, layer: int, seq, selected: torch.Tensor) -> None:
        """A layer's selections [rows, k] of a chunk's rows (ForwardContext.record_selection): a full
        layer's for a tail completed this step are kept for its delivery, as (the distinct positions
        the tail's rows selected, ascending; the last row's selection)."""
        start = self._tails.get(seq.request_id)
        if start is None or layer not in self.full_layers:
            return
        first_row = seq.context_len - selected.shape[0]  # the position of selected's first row
        rows = selected[max(0, start - first_row):]
        positions = torch.arange(seq.context_len - rows.shape[0], seq.context_len, device=rows.device)
        # NOTE: on CUDA the union's size waits for the layer's kernels: once per full layer, in the step
        # that ends a tapped prompt
        union = torch.unique(rows[rows <= positions[:, None]])  # an early row's selection past itself is padding
        self._selected[(seq.request_id, layer)] = (union.to("cpu", torch.int64), rows[-1].to("cpu", torch.int64))

    def after_mtp(self) -> None:
        """After the step's MTP pass (its extend, which writes the MTP layer's entries of the rows whose
        next token is known: a tail's, the last with the token sampled here): hand out the tails'
        rows of the MTP layer."""
        work, self._mtp_tails = self._mtp_tails, []
        for layer in self.mtp_kinds:
            self._after_layer(layer, work, self.mtp_kinds)

    def _after_layer(self, layer: int, work: list, layer_kinds: dict | None = None) -> None:
        kinds = (self.layer_kinds if layer_kinds is None else layer_kinds).get(layer, [])
        if not kinds or not work:
            return
        self.flush()
        for tap, request_id, first, count, tail, slots in work:
            # a tiered pool's latents are in host memory and its indexer keys on the device: each kind
            # is read where it is
            rows = [self.tensors[j].index_select(0, slots.to(self.tensors[j].device)) for j in kinds]
            rows = [r.view(count, tail or self.page_size, *r.shape[1:]) for r in rows]
            rows, event = _off_device(rows)
            selected = self._selected.pop((request_id, layer), None) if tail else None
            tap.deliver(LayerRows(layer, first, count, kinds, rows, event, tail, selected))


def _off_device(rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """The rows in host memory: those on a CUDA device copied into pinned memory without waiting (the
    engine's thread goes on), with the event that marks the copies done, recorded on that device's
    stream (the engine's thread may have another current device); None when nothing was copied."""
    on_device = [r.device for r in rows if r.device.type == "cuda"]
    if not on_device:
        return rows, None
    rows = [torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True)
            if r.device.type == "cuda" else r for r in rows]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(on_device[0]))
    return rows, event
