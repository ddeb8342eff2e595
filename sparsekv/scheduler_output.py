"""What the scheduler decides each step, as plain data: the executor's input. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions [first_position, context_len) of a request run this step (a snapshot at scheduling).

    Every field but `request` is plain data: what an executor needs to run the chunk. `request` is the
    engine side's handle on the request, dropped by `SchedulerOutput.for_executor()`."""

    request_id: str
    first_position: int
    num_new_tokens: int
    token_ids: tuple[int, ...]  # the tokens at the chunk's positions (drafts last)
    page_ids: list[int]  # the request's pages (read only; in process, the request's own list)
    samples_token: bool  # the chunk reaches the end of the known tokens, so the step samples a new one
    num_draft_tokens: int = 0  # speculative tokens at the chunk's end (verified, not sampled from)
    # a request's first chunk after a disaggregated prefill: per full layer, (layer, the distinct
    # positions its prompt's tail rows selected, its last row's selection), to warm a tiered cache
    warm: tuple = field(default=(), compare=False)
    request: Request | None = field(default=None, compare=False)

    @property
    def context_len(self) -> int:
        return self.first_position + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, decided by the scheduler: the chunks to run, in batch order, and the pool pages
    whose rows a prefix-cache restore wrote while it was scheduled (an executor with a copy of the pool
    per rank sends those pages' rows to the others before it runs the step)."""

    chunks: list[ScheduledChunk]
    restored_page_ids: list[int] = field(default_factory=list)

    def for_executor(self) -> SchedulerOutput:
        """The same step as plain, picklable data (no engine-side request objects). Page lists are
        shared, not copied: the executor only reads them, and a remote one receives a pickled copy."""
        return SchedulerOutput([replace(ch, request=None) for ch in self.chunks], self.restored_page_ids)
