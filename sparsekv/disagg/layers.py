"""The prefill side of the layer-by-layer send (docs/disaggregation.md, "Layer by layer"): the rows the
engine hands out layer by layer (cache/layer_tap.py) queued for the room's sends, and a look's named
pages split into those that go whole and those whose layers' rows went already."""
from __future__ import annotations

import asyncio
import collections
import threading

from ..parallel.dp_held import is_held, stack
from .wire import TransferError, pages_to_tensors

UNCLAIMED_MAX_BYTES = 256 << 20  # rows kept for a room no decode worker claimed yet; past it, its pages go whole


class LayerFeed:
    """A room's rows handed out layer by layer on the engine's thread (cache/layer_tap.py), queued for
    the event loop, which sends them once the room is claimed. `tapped`: the (prompt, page) pairs
    whose layer rows were taken; a prompt's tail goes whole when the choices' first tokens go too
    (`first_tokens`), else short (`short_tail`). Before the claim at most
    `unclaimed_max_bytes` are kept: past that (a decode worker slow to claim a long prompt) every row
    is dropped, and the room's pages go whole, by name, as they would without a feed. `discard(rows)`:
    told of deliveries dropped (a data-parallel rank > 0 keeps their rows until then: dp_held.py)."""

    def __init__(self, loop, num_kinds: int, unclaimed_max_bytes: int = UNCLAIMED_MAX_BYTES, first_tokens: bool = True,
                 discard=None):
        self.loop, self.num_kinds, self.unclaimed_max_bytes = loop, num_kinds, unclaimed_max_bytes
        self.discard = discard or (lambda rows: None)
        self.first_tokens = first_tokens  # whether the choices' first tokens go (else a tail goes short)
        self.items: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.tapped: set[tuple[int, int]] = set()
        self.tap_kinds: list[int] = []
        self.weights: dict | None = None
        self.batches = 0
        self.lock = threading.Lock()  # NOTE: the engine's thread delivers while the event loop claims and takes
        self.claimed = self.dropped = False
        self.unclaimed_bytes = 0

    def deliver_for(self, prompt: int):
        def deliver(rows) -> None:  # on the engine's thread
            if self._keep(prompt, rows):
                try:
                    self.loop.call_soon_threadsafe(self.wake.set)
                except RuntimeError:  # the event loop closed: nobody sends these
                    pass
        return deliver

    def _keep(self, prompt: int, rows) -> bool:
        with self.lock:
            if self.dropped or (rows.tail == 1 and not self.first_tokens):  # (a short tail of no rows)
                dropped = [rows]
            elif not self.claimed and self.unclaimed_bytes + _nbytes(rows) > self.unclaimed_max_bytes:
                self.dropped = True
                dropped = [kept for _, kept in self.items] + [rows]
                self.items.clear()
            else:
                self.unclaimed_bytes += 0 if self.claimed else _nbytes(rows)
                self.items.append((prompt, rows))
                return True
        self.discard(dropped)
        return False

    def claim(self) -> None:
        """The room is claimed: rows are kept whatever their size from now on."""
        with self.lock:
            self.claimed = True

    def take(self) -> list:
        """The queued deliveries as (prompt, first page, pages, deliveries), one per prompt and step (a
        prompt's tail apart: its page follows the named ones)."""
        with self.lock:
            items = list(self.items)
            self.items.clear()
        groups = []
        for prompt, rows in items:
            if groups and groups[-1][:3] == (prompt, rows.first, rows.count):
                groups[-1][3].append(rows)
            else:
                groups.append((prompt, rows.first, rows.count, [rows]))
            if not rows.tail:  # a tail's page is never named
                self.tapped.update((prompt, rows.first + i) for i in range(rows.count))
        return groups

    async def wait(self, aws: list, timeout: float | None) -> None:
        """Until a delivery is queued, one of `aws` is done, or `timeout`."""
        self.wake.clear()
        if self.items:
            return
        waiter = asyncio.ensure_future(self.wake.wait())
        try:
            await asyncio.wait([*aws, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()


def _nbytes(rows) -> int:
    return sum(r.numel() * r.element_size() for r in rows.rows)


def short_tail(rows: list, tail: int) -> list:
    """A tail's rows less its last (the prompt's last token's): without the first token sampled after it,
    that token's MTP-layer entry is not the decode side's, which computes that token itself. The
    rows before it hold the prompt's tokens only, so they are every choice's."""
    return [r[:, :tail - 1] for r in rows]


def named_parts(pages: list, per_prompt: list[int], sent: list[int], feed: LayerFeed | None) -> list:
    """The pages of a look as batches: (pages per prompt, pages, the kinds they carry, None: all). Pages
    whose layers' rows went layer by layer carry the other kinds only; they follow a prompt's pages
    that did not (a prompt's pages are tapped from some page on), so each batch keeps each prompt's
    pages in order."""
    if not pages:
        return []
    tapped = [[(p, sent[p] + i) in feed.tapped for i in range(n)] if feed is not None else [False] * n
              for p, n in enumerate(per_prompt)]
    whole = [flags.index(True) if True in flags else len(flags) for flags in tapped]
    if not all(all(flags[w:]) for flags, w in zip(tapped, whole)):
        raise TransferError("a prompt's pages were handed out layer by layer out of order")
    rest = [n - w for n, w in zip(per_prompt, whole)]
    starts = [sum(per_prompt[:p]) for p in range(len(per_prompt))]
    first = [page for p, w in enumerate(whole) for page in pages[starts[p]:starts[p] + w]]
    second = [page for p, w in enumerate(whole) for page in pages[starts[p] + w:starts[p] + per_prompt[p]]]
    parts = [(whole, first, None)] if first else []
    if second:
        parts.append((rest, second, [k for k in range(feed.num_kinds) if k not in feed.tap_kinds]))
    return parts


def kinds_of(pages: list, kinds: list[int] | None) -> list:
    """One tensor per kind of row for the pages (kinds: which, in order; None: all); for pages a
    data-parallel rank > 0 keeps, what that rank stacks (dp_held.Stacked)."""
    if kinds is not None:
        pages = [(name, [rows[k] for k in kinds]) for name, rows in pages]
    if pages and pages[0][1] and is_held(pages[0][1][0]):
        return [stack([rows[j] for _, rows in pages]) for j in range(len(pages[0][1]))]
    return pages_to_tensors(pages)
