"""Requests, with every length named. No torch here.

Index ranges of one request (positions in its token sequence)::

    0                num_computed_tokens          num_tokens
    |---- cached in KV pages ----|---- not yet run ----|
    |------ prompt (num_prompt_tokens) ------|-- output --|
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .outputs import RequestOutput  # noqa: F401  (public names, importable from here too)
from .sampling_params import InvalidRequest, SamplingParams  # noqa: F401


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One sequence being generated. Owns its token list and its page ids; no tensors."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (as first admitted)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0  # times its pages were taken back (kv_admission="optimistic") and it recomputed
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it (None: EOS, length)
    first_scheduled_time: float | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # MTP drafts after the known tokens: run, never output
    warm: tuple = ()  # FirstToken.warm, until its first chunk is scheduled (ScheduledChunk.warm)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may ever hold in the cache: prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        i = position - self.num_prompt_tokens
        if i < self.num_output_tokens:
            return self.output_token_ids[i]
        return self.draft_token_ids[i - self.num_output_tokens]
