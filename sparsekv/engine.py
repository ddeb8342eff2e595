"""The engine: the request API (add / abort / step) over the scheduler, the cache manager and an executor.

A step flows one way::

    scheduler.schedule() -> SchedulerOutput -> executor.execute() -> ModelOutput
        -> output_processor.process() -> StepResult -> scheduler.update()   (then MTP drafts, if any)
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from .config import ConfigError, EngineConfig, ModelConfig
from .engine_weights import WeightControl
from .hub import resolve_config
from .input_processor import InputProcessor, load_tokenizer
from .parallel.executor import start_executor
from .output_processor import OutputProcessor
from .outputs import FirstToken, check_warm, token_counts
from .request import InvalidRequest, Request, RequestOutput, RequestStatus, SamplingParams
from .scheduler import Scheduler
from .threads import resolve_num_threads
from .weights import UpdateOutcomes

RANK_PROBE_S = 2.0  # how often an idle parallel engine asks its ranks whether they are there (check_ranks)


logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine(WeightControl):
    def __init__(self, config: EngineConfig, lane: int | None = None):
        """`lane`: this engine is that data-parallel rank's (parallel/data_parallel.py starts it)."""
        config.validate()
        config = resolve_config(config)  # a model or tokenizer given as a Hub repo id -> a local snapshot
        self.config = config
        threads = resolve_num_threads(config, ModelConfig.from_json(config.model, config.hf_overrides))
        if threads:
            torch.set_num_threads(threads)
        self.dtype, self.device = DTYPES[config.dtype], torch.device(config.device)
        self.executor, self.kv = start_executor(config, self.dtype, self.device, lane)
        try:
            self._build(config)
        except BaseException:
            try:
                self.kv.close()  # its disk tier's directory lock goes now, not whenever gc finds the cycle
            finally:
                self.executor.close()  # a parallel engine's ranks stop with it
            raise

    def _build(self, config: EngineConfig) -> None:
        self.model = self.executor.model  # this rank's shard
        self.model_config: ModelConfig = self.model.cfg
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        if self.tokenizer is None and config.tokenizer is not None:  # asked for: never silently none
            raise ConfigError(f"tokenizer {config.tokenizer!r}: no tokenizer.json or tokenizer_config.json there")
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.scheduler = Scheduler(self.kv.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_tokens, self.kv.prefix, tenant_pages=self.kv.tenant_pages,
                                   optimistic=config.kv_admission == "optimistic")
        self.scheduler.on_preempt, self.scheduler.on_release = self._preempted, self._released
        self.speculator = self._build_speculator() if config.num_speculative_tokens else None
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                     self.kv.check_fits, config.max_logprobs)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size,
                                       self.max_model_len, config.seed, self.request_metrics, self.speculator)
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.weights_version = 0  # weight updates applied since the engine started
        self.paused = False
        self._pending_update = None  # (update, checkpoint) waiting for the running requests to finish (drain)
        self.weights_lost: BaseException | None = None  # a failed update left a mix of two versions: no more steps
        self._held: deque[Request] = deque()  # requests not started, kept out of the scheduler while it drains
        self._ready: list[RequestOutput] = []  # outputs of given first tokens (add_request), for the next step
        self._ready_step = False  # the last step only output those
        self.weight_update_error: Exception | None = None  # why the last deferred update failed to load
        self.weight_updates = UpdateOutcomes()  # each accepted update's result, for the one who asked for it
        self._ranks_probed = time.monotonic()  # when check_ranks last asked every rank

    def _build_speculator(self):
        from .speculative import Speculator
        try:
            return Speculator(self.executor, self.model.mtp is not None, self.model_config.num_hidden_layers,
                              self.config.num_speculative_tokens, self.max_model_len)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def close(self) -> None:
        """Save the prefix cache's pages to its disk tier, if any, and let go of it (a restart finds
        them there); the engine goes on without the disk tier. A parallel engine stops its worker ranks
        and cannot step again. Safe to call more than once."""
        self.kv.close()
        self.executor.close()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    tenant: str = "default", cache_salt: str | None = None,
                    first_token: FirstToken | None = None) -> Request:
        """Queue a request. `first_token`: its first token, sampled by another engine from the same
        prompt and weights (a disaggregated prefill worker), output by the next `step()` with no
        compute of its own; the request then computes from there. A token of weights this engine no
        longer has, or will not run the request under (an update waits), is dropped: the request
        samples its first token itself, and so does a request with prompt logprobs (it computes every
        prompt row for them, and would end at a first token that ends it with none computed)."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.find(request_id) is not None or any(r.request_id == request_id for r in self._held):
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.inputs.process(prompt, params)
        grammar = self.outputs.grammar_for(params.structured_output) if params.structured_output is not None else None
        req = Request(request_id, token_ids, params, tenant=tenant, cache_salt=cache_salt)
        if first_token is not None and not self._same_weights(first_token):
            logger.info("request %s: its first token was sampled under other weights; sampling it again", request_id)
            first_token = None
        if first_token is not None and params.prompt_logprobs is not None:
            first_token = None  # the same token, sampled after the prompt rows its logprobs need
        if first_token is not None:
            cfg = self.model_config
            check_warm(first_token.warm, cfg.full_layers, cfg.index_topk, len(token_ids))
        self.outputs.add(req, grammar, first_token)
        if first_token is not None:
            req.warm = first_token.warm
            self._ready.append(self.outputs.carried_output(req))
        if req.finish_reason is not None:  # its first token ended it: nothing to compute
            req.status = RequestStatus.FINISHED
            self.outputs.forget(request_id)
            return req
        if self._pending_update is not None:
            self._held.append(req)  # the scheduler drains the requests that run under the old weights first
        else:
            self.scheduler.add(req)
        return req

    def _same_weights(self, first_token: FirstToken) -> bool:
        """Whether the request would run under the weights that sampled its given first token."""
        version = first_token.weights_version
        return version is None or (version == self.weights_version and self._pending_update is None)

    def abort(self, request_id: str) -> bool:
        held = next((r for r in self._held if r.request_id == request_id), None)
        if held is not None:  # never scheduled: nothing of it is in the cache
            self._held.remove(held)
            held.status, held.finish_reason = RequestStatus.ABORTED, "abort"
            self.outputs.forget(request_id)
            return True
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.ABORTED, "abort")
        self._release_idle_buffers()
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or a drain weight update waiting: its update loads in the next step once no
        started request is left, also when the last of them was aborted (as the data-parallel engine's)."""
        return (self.scheduler.has_unfinished() or bool(self._held) or self.has_ready_outputs
                or self._pending_update is not None)

    @property
    def has_ready_outputs(self) -> bool:
        """Outputs of given first tokens wait for the next step (which computes nothing for them)."""
        return bool(self._ready)

    def num_waiting_requests(self, tenant: str | None = None) -> int:
        return self.scheduler.num_waiting(tenant) + sum(tenant is None or r.tenant == tenant for r in self._held)

    def waiting_requests(self) -> list[Request]:
        """Queued in the scheduler, and held out of it until a weight update loads."""
        return [*self.scheduler.waiting, *self._held]

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache can hold at once (the pool's, or the tiered cache's page table)."""
        return self.kv.capacity_tokens

    def check_ranks(self) -> None:
        """RankFailure if a worker rank of a parallel engine exited or a call across the ranks failed,
        or a weight update left a mix of two versions (`weights_lost`); nothing else for an engine of
        one rank. A rank on another node has no process here to look at, so every RANK_PROBE_S this also
        asks every rank for its figures (a round trip; the idle server calls it, so a dead node is found
        without a request)."""
        if self.weights_lost is not None:
            raise self.weights_lost
        ranks = getattr(self.executor, "ranks", None)
        if ranks is None:
            return
        ranks.check_alive()
        now = time.monotonic()
        if now - self._ranks_probed >= RANK_PROBE_S:
            self._ranks_probed = now
            self.executor.rank_stats()

    def expire_prefix_cache(self) -> int:
        """Forget prefix-cache pages past their retention (`prefix_cache_ttl_s`); each step does it
        first, and the server's loop when idle. Returns how many."""
        return self.kv.expire()

    def reset_prefix_cache(self, tenant: str | None = None) -> int:
        """Forget a tenant's prefix-cache pages in every tier (every tenant's with None); pages that
        running requests hold stay. Returns how many pages were forgotten."""
        return self.kv.reset(tenant)

    def tap_layers(self, request_id: str, num_prompt_tokens: int, skip: int, deliver) -> list[int]:
        """Hand the rows of request `request_id`'s cacheable prompt pages after its first `skip` to
        `deliver` layer by layer, as the steps that complete them run (cache/layer_tap.py), until
        `untap_layers`; then, when the layers hand out every kind of row, the rows of the last token's
        page through that token (a tail). Returns the kinds (positions in `kv.page_tensors()`) handed out."""
        from .cache.prefix import cacheable_pages, tail_tokens
        taps, page_size = self.executor.layer_taps(self.kv.page_tensors()), self.config.kv_page_size
        tail = tail_tokens(num_prompt_tokens, page_size) if taps.every_kind else 0
        taps.add(request_id, cacheable_pages(num_prompt_tokens, page_size), skip, deliver, tail)
        return taps.kinds

    def untap_layers(self, request_id: str) -> None:
        self.executor.layer_taps(self.kv.page_tensors()).remove(request_id)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.weights_lost is not None:
            raise self.weights_lost
        ready, self._ready = self._ready, []  # given first tokens: out at once, not after a step's compute
        if (ready and not self._ready_step) or self.paused:
            self._ready_step = True  # NOTE: the next call computes, whatever tokens arrive meanwhile
            return ready
        self._ready_step = False
        self.kv.expire()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:  # requests waiting for disk reads (wait for one, do not spin), or held for
            self._apply_pending_update()  # an update whose last started request was aborted: it loads now
            if not ready:
                self.kv.wait_for_reads(0.01)
            return ready
        now = time.monotonic()
        for ch in scheduled.chunks:
            ch.request.first_scheduled_time = ch.request.first_scheduled_time or now
        self.executor.capture_routed_experts(any(ch.request.params.return_routed_experts for ch in scheduled.chunks))
        out = self.executor.execute(scheduled.for_executor())
        result = self.outputs.process(scheduled.chunks, out.logits, out.hidden, self.executor.logits,
                                      out.routed_experts)
        self.scheduler.update(scheduled, result.accepted_drafts, result.finished)
        if self.speculator is not None:
            self.speculator.draft(scheduled.chunks, self.outputs.generators)
        self._count(scheduled, result.num_generated_tokens)
        self._release_idle_buffers()
        self._apply_pending_update()
        return ready + result.outputs

    def _count(self, scheduled, generated: int) -> None:
        self.counters["steps"] += 1
        self.counters["generation_tokens"] += generated
        self.counters["prompt_tokens"] += sum(max(0, min(ch.context_len, ch.request.num_prompt_tokens) - ch.first_position)
                                              for ch in scheduled.chunks)

    def _release_idle_buffers(self) -> None:
        if not self.scheduler.has_unfinished():
            self.executor.release_idle_buffers()

    def _released(self, req: Request, status: RequestStatus) -> None:
        """A request's end (scheduler.finish), before its pages are freed. Its last full pages are named:
        with drafting only if aborted between steps (a step that finishes a request skips its MTP pass,
        so those positions have no MTP entries)."""
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.kv.release(req, name_pages=self.speculator is None or status is RequestStatus.ABORTED,
                        keep_counters=False)
        self.kv.hold_ended(req)
        self.executor.forget(req.request_id)
        self.outputs.forget(req.request_id)
        req.draft_token_ids.clear()

    def _preempted(self, req: Request) -> None:
        """A preemption (scheduler.preempt): its full pages are named for the prefix cache first, so its
        recomputation hits them; its sampling state, counters and output stay."""
        self.kv.release(req, name_pages=True, keep_counters=True)  # the last MTP pass wrote its pages
        self.executor.forget(req.request_id)
        self.outputs.preempted(req.request_id)  # its prompt logprobs are recorded again

    # -- observability -------------------------------------------------------------------------
    def request_metrics(self, req: Request) -> dict:
        spec = self.speculator.request_metrics(req.request_id) if self.speculator is not None else {}
        return {**token_counts(req), **self.kv.request_metrics(req), **spec, "weights_version": self.weights_version}

    def cache_config(self) -> dict[str, str]:
        return {**self.kv.layout(), "num_speculative_tokens": str(self.config.num_speculative_tokens)}

    def stats(self) -> dict:
        """Engine-wide figures; `ranks`: each rank's (weights, peak memory, bytes sent per collective)."""
        spec = self.speculator.stats() if self.speculator is not None else {}
        return {"running": len(self.scheduler.running), "waiting": len(self.waiting_requests()), **self.kv.stats(),
                **self.counters, "indexer_scratch_bytes": self.model.index_scratch.nbytes,
                "preemptions": self.scheduler.num_preemptions, "kv_by_tenant": self.scheduler.tenant_stats(self._held),
                "ranks": self.executor.rank_stats(), "weights_version": self.weights_version,
                "paused": self.paused, "weight_update_pending": self._pending_update is not None, **spec,
                **self.executor.decode_graph_stats()}

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        running = {r.request_id for r in self.scheduler.running}
        waiting = {r.request_id for r in self.waiting_requests()}
        self.kv.check_integrity(self.scheduler.running, waiting)
        self.outputs.check_integrity(running | waiting)
        self.executor.check_integrity(running)
