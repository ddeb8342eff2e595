"""A prompt's page rows handed out layer by layer while the step that computes them runs: a prefill
worker sends layer i's rows of a chunk's pages while layer i + 1 computes (docs/disaggregation.md).

A tap is set per request (`LayerTaps.add`). For each step, `begin_step` finds the prompt pages each
tapped chunk completes; after every decoder layer's forward (`ForwardContext.after_layer`) the rows of
those pages in the tensors that layer wrote (its latents, its indexer keys) are copied out of the
pool and handed to the tap's `deliver`. Each page is handed out once per layer, and never a page
before `skip`; of the page the prefix cache does not name (the prompt's last token's), the rows
through that token, once (a tail: the decode side, given the first token sampled here, then computes
from that token on). The kinds
(indices into the cache's `PageRows` tensors, the order a page's rows are exported in) name what each
delivery holds; the other kinds (the MTP layer's entries, a selector's page state) are left to the
page's export once it is named::

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

    def ready(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.rows


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
                 page_size: int, slots_of: Callable[[list[int], int], torch.Tensor], flush: Callable[[], None]):
        position = {id(t): j for j, (t, per_row) in enumerate(tensors) if per_row == 1}
        self.layer_kinds = {l: [position[id(t)] for t in ts if id(t) in position] for l, ts in layer_tensors.items()}
        self.tensors = [t for t, _ in tensors]
        self.page_size, self.slots_of, self.flush = page_size, slots_of, flush
        self._taps: dict[str, _Tap] = {}

    @property
    def kinds(self) -> list[int]:
        """Every kind some layer hands out (a tapped page's export carries the others)."""
        return sorted({j for kinds in self.layer_kinds.values() for j in kinds})

    @property
    def every_kind(self) -> bool:
        """Whether the layers hand out every kind of a page's rows (no MTP layer, no selector page state)."""
        return len(self.kinds) == len(self.tensors)

    def add(self, request_id: str, num_pages: int, skip: int, deliver: Callable[[LayerRows], None],
            tail: int = 0) -> None:
        """Hand out pages [skip, num_pages) of the request's prompt as its steps complete them, then
        the first `tail` rows of page num_pages (the prompt's last token's page, through that token)."""
        self._taps[request_id] = _Tap(deliver, skip, num_pages, tail)

    def remove(self, request_id: str) -> None:
        self._taps.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._taps)

    def begin_step(self, chunks) -> Callable[[int], None] | None:
        """The step's `after_layer` hook, or None when no tapped chunk completes a page to hand out."""
        work = []
        for ch in chunks:
            tap = self._taps.get(ch.request_id)
            if tap is None:
                continue
            first = max(ch.first_position // self.page_size, tap.next_page)
            end = min(ch.context_len // self.page_size, tap.num_pages)
            if end > first:
                tap.next_page = end
                count = end - first
                work.append((tap, first, count, 0, self.slots_of(ch.page_ids[first:end], count * self.page_size)))
            tail_end = tap.num_pages * self.page_size + tap.tail
            if tap.tail and ch.context_len >= tail_end and ch.first_position < tail_end:
                page = ch.page_ids[tap.num_pages:tap.num_pages + 1]
                work.append((tap, tap.num_pages, 1, tap.tail, self.slots_of(page, tap.tail)))
                tap.tail = 0
        if not work:
            return None
        return lambda layer: self._after_layer(layer, work)

    def _after_layer(self, layer: int, work: list) -> None:
        kinds = self.layer_kinds.get(layer, [])
        if not kinds:
            return
        self.flush()
        for tap, first, count, tail, slots in work:
            rows = [self.tensors[j].index_select(0, slots) for j in kinds]
            rows = [r.view(count, tail or self.page_size, *r.shape[1:]) for r in rows]
            event = None
            if rows and rows[0].device.type == "cuda":  # NOTE: the engine's thread does not wait for the copy
                rows = [torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True) for r in rows]
                event = torch.cuda.Event()
                event.record()
            tap.deliver(LayerRows(layer, first, count, kinds, rows, event, tail))
