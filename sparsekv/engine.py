"""The engine: request API (add / abort / step) over the scheduler, the cache and the runner."""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from .cache.pages import PageAllocator
from .cache.pool import KVPool
from .config import ConfigError, EngineConfig, ModelConfig
from .detokenize import IncrementalDetokenizer, find_stop, stop_match
from .model.checkpoint import load_model
from .request import InvalidRequest, Request, RequestOutput, RequestStatus, SamplingParams
from .runner import ModelRunner
from .sampling import (LogitAdjuster, draw_rows, filter_logits_rows, make_generator, sample_token, token_logprobs,
                       token_logprobs_rows)
from .scheduler import Scheduler

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_TOKENS = 1 << 21  # pool size when neither num_kv_pages nor a budget is given


def load_tokenizer(path: str):
    """The checkpoint's tokenizer through transformers, or None (token-id prompts still work)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype, self.device = DTYPES[config.dtype], torch.device(config.device)
        self.model = load_model(config.model, self.dtype, self.device, config.hf_overrides)
        self.model_config: ModelConfig = self.model.cfg
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.page_size = config.kv_page_size
        config.validate_for_model(self.model_config.index_topk)
        self.tiered = config.kv_tiering
        self.cache, self.allocator = self._build_cache()
        self._final_metrics: dict[str, dict] = {}  # a finished request's figures, until its output
        self.runner = ModelRunner(self.model, self.cache, self.page_size, config.attention,
                                  decode_rows=1 + config.num_speculative_tokens)
        self.prefix = self._build_prefix_cache() if config.enable_prefix_caching else None
        share = config.tenant_kv_share
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_chunk_tokens, self.prefix,
                                   tenant_pages=None if share is None else int(share * self.allocator.num_pages),
                                   optimistic=config.kv_admission == "optimistic")
        self.scheduler.on_preempt = self._preempted
        self.speculator = None
        if config.num_speculative_tokens:
            from .speculative import Speculator
            try:
                self.speculator = Speculator(self.model, self.runner, self.cache, config.num_speculative_tokens,
                                             self.max_model_len)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self._generators: dict[str, torch.Generator] = {}
        self._adjusters: dict[str, LogitAdjuster] = {}  # requests with penalties, a logit bias or min_tokens
        self._grammars: dict = {}  # request -> structured.GrammarState (structured outputs)
        self._grammar_compiler = None
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    def _build_cache(self):
        config, cfg = self.config, self.model_config
        if self.tiered:  # the tiered pool sizes the (logical) page table from its budgets
            from .cache.tiers import build_tiered_cache
            cache = build_tiered_cache(config, self.model, self.dtype, self.device, self._num_pages())
            return cache, PageAllocator(cache.sizes.num_pages, self.page_size)
        allocator = PageAllocator(self._num_pages(), self.page_size)
        mtp = [cfg.num_hidden_layers] if config.num_speculative_tokens and self.model.mtp is not None else []
        cache = KVPool(cfg, allocator.num_pages, self.page_size, self.dtype, self.device,
                       list(range(cfg.num_hidden_layers)) + mtp, cfg.full_layers + mtp, self._latent_format())
        if config.selector == "quest":
            from .model.selectors import install_quest
            install_quest(self.model, config, allocator.num_pages * self.page_size, self.device)
        return cache, allocator

    def _build_prefix_cache(self):
        from .cache.prefix import PrefixCache
        from .cache.prefix_host import PageRows, PrefixHostStore
        config, tiers = self.config, {}
        lookahead = 1 if config.num_speculative_tokens else 0
        rows = PageRows(self.cache.slot_tensors() + [t for s in self.runner.selectors() for t in s.slot_tensors()],
                        self.page_size)
        disk = None
        quotas = [q for q in (config.prefix_cache_max_pages_per_tenant, self._tenant_quota(self.allocator.num_pages))
                  if q is not None]
        self.allocator.max_cached_per_tenant = min(quotas, default=None)
        if config.prefix_cache_disk_path:
            disk = self._build_disk_tier(rows, lookahead)
        if config.prefix_cache_host_bytes:
            tiers["host"] = PrefixHostStore(rows, config.prefix_cache_host_bytes,
                                            spill=disk.save_rows if disk is not None else None,
                                            max_pages_per_tenant=self._tenant_quota(
                                                config.prefix_cache_host_bytes // rows.page_bytes))
        if disk is not None:
            tiers["disk"] = disk
        return PrefixCache(self.allocator, lookahead=lookahead, tiers=tiers,
                           before_copy=self.cache.link.flush if self.tiered else lambda: None,
                           ttl_s=config.prefix_cache_ttl_s)

    @staticmethod
    def _page_cipher(option: str, path: str, space: str):
        from .cache.page_cipher import PageCipher
        try:
            with open(path, "rb") as f:
                return PageCipher(f.read(), space)
        except (ValueError, OSError) as e:
            raise ConfigError(f"{option}: {e}") from None

    def _tenant_quota(self, tier_pages: int) -> int | None:
        """A tenant's share of a prefix-cache tier of `tier_pages` pages, in pages (None: no bound)."""
        share = self.config.prefix_cache_tenant_share
        return None if share is None else int(share * tier_pages)

    def _disk_key_file(self) -> str | None:
        """The disk tier's key file: the operator's, else one generated in the tier's directory
        (kept there, so a restart reads its earlier pages); None for an unencrypted tier."""
        from .cache.prefix_disk import default_key_file
        config = self.config
        if config.prefix_cache_disk_unencrypted or config.prefix_cache_disk_key_file is not None:
            return config.prefix_cache_disk_key_file
        try:
            path, made = default_key_file(config.prefix_cache_disk_path)
        except OSError as e:
            raise ConfigError(f"prefix_cache_disk_path: {e}") from None
        if made:
            logger.info("prefix cache disk tier: generated the encryption key %s (keep it with the tier; "
                        "prefix_cache_disk_key_file to keep one elsewhere)", path)
        return path

    def _build_disk_tier(self, rows, lookahead: int):
        from .cache.prefix_disk import PrefixDiskStore, namespace
        config, key = self.config, self._disk_key_file()
        space = namespace(config, rows, lookahead, sealed=key is not None)
        option = "prefix_cache_disk_key_file" if config.prefix_cache_disk_key_file else "prefix_cache_disk_path's key"
        cipher = None if key is None else self._page_cipher(option, key, space)
        old = [self._page_cipher("prefix_cache_disk_old_key_files", path, space)
               for path in config.prefix_cache_disk_old_key_files or ()]
        try:
            return PrefixDiskStore(rows, config.prefix_cache_disk_path, space, config.prefix_cache_disk_bytes, cipher,
                                   max_pages_per_tenant=self._tenant_quota(config.prefix_cache_disk_bytes // rows.page_bytes),
                                   old_ciphers=old)
        except (ValueError, OSError) as e:
            raise ConfigError(f"prefix_cache_disk_path: {e}") from None

    def close(self) -> None:
        """Save the prefix cache's pages to its disk tier, if any, and let go of it (a restart finds
        them there); the engine goes on without the disk tier. Safe to call more than once."""
        if self.prefix is not None and "disk" in self.prefix.tiers:
            self.prefix.persist()
            disk = self.prefix.tiers.pop("disk")
            if "host" in self.prefix.tiers:
                self.prefix.tiers["host"].spill = None
            disk.close()

    def _latent_format(self):
        from .cache.latent_format import latent_format
        return latent_format(self.config.kv_cache_dtype, self.model_config, self.dtype)

    def _num_pages(self) -> int:
        if self.config.num_kv_pages:
            return self.config.num_kv_pages
        if self.config.device_kv_budget_bytes and not self.config.kv_tiering:
            from .cache.lru import untiered_pages
            return untiered_pages(self.config, self.model_config, self.dtype.itemsize,
                                  self._latent_format().row_bytes)
        tokens = min(self.max_model_len * self.config.max_num_seqs, max(DEFAULT_KV_CACHE_TOKENS, self.max_model_len))
        return -(-tokens // self.page_size)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("text prompt given but the checkpoint has no tokenizer; pass token ids", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("prompt must be a string or a list of integer token ids", "prompt")
        return list(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise InvalidRequest("prompt is empty", "prompt")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest(f"prompt has {len(token_ids)} tokens, longer than max_model_len {self.max_model_len}", "prompt")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                                 f"max_model_len {self.max_model_len}", "max_tokens")
        pages = self.allocator.pages_for(len(token_ids) + params.max_tokens)
        if pages > self.allocator.num_pages:
            where = f"the pool has {self.allocator.num_pages}"
            if self.tiered:
                where = (f"the tiered cache holds {self.allocator.num_pages} pages "
                         f"({self.allocator.num_pages * self.page_size} tokens), bounded by {self.cache.sizes.limit}")
            raise InvalidRequest(f"request needs {pages} KV pages for {len(token_ids)} + {params.max_tokens} tokens "
                                 f"(prompt + max_tokens); {where}", "max_tokens")
        share = self.scheduler.tenant_pages
        if share is not None and pages > share and not self.scheduler.optimistic:  # optimistic: a guarantee, not a cap
            raise InvalidRequest(f"request needs {pages} KV pages for {len(token_ids)} + {params.max_tokens} tokens "
                                 f"(prompt + max_tokens); a tenant may hold {share} of the {self.allocator.num_pages} "
                                 f"(tenant_kv_share {self.config.tenant_kv_share})", "max_tokens")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this checkpoint has none", "stop")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            outside = [t for t in getattr(params, name) or () if t >= vocab]
            if outside:
                raise InvalidRequest(f"{name} token id {outside[0]} is outside the vocabulary [0, {vocab})", name)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    tenant: str = "default", cache_salt: str | None = None) -> Request:
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.find(request_id) is not None:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # vLLM's left truncation
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        self.validate_prompt(token_ids, params)
        grammar = self._grammar(params.structured_output) if params.structured_output is not None else None
        req = Request(request_id, token_ids, params, tenant=tenant, cache_salt=cache_salt)
        if grammar is not None:
            self._grammars[request_id] = grammar
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self._generators[request_id] = make_generator(seed)
        if params.adjusts_logits:
            vocab = self.model_config.vocab_size
            stops = {t for t in params.stop_token_ids or () if 0 <= t < vocab}
            stops |= set() if params.ignore_eos else {t for t in self.eos_token_ids if 0 <= t < vocab}
            self._adjusters[request_id] = LogitAdjuster(params, token_ids, vocab, stops)
        self.scheduler.add(req)
        return req

    def _grammar(self, spec: dict):
        if self.tokenizer is None:
            raise InvalidRequest("structured outputs need a tokenizer; this checkpoint has none", "structured_output")
        from .structured import GrammarCompiler, GrammarState
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     sorted(self.eos_token_ids))
        tokenizer = self.tokenizer
        return GrammarState(self._grammar_compiler, self._grammar_compiler.compile(spec), spec.get("after"),
                            lambda token: tokenizer.decode([token]))

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        self._release(req, RequestStatus.ABORTED, "abort")
        self._final_metrics.pop(request_id, None)
        self._free_idle_buffers()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step loop -------------------------------------------------------------------------
    def expire_prefix_cache(self) -> int:
        """Forget prefix-cache pages past their retention (`prefix_cache_ttl_s`); each step does it
        first, and the server's loop when idle. Returns how many."""
        return self.prefix.expire() if self.prefix is not None else 0

    def reset_prefix_cache(self, tenant: str | None = None) -> int:
        """Forget a tenant's prefix-cache pages in every tier (every tenant's with None); pages that
        running requests hold stay. Returns how many pages were forgotten."""
        return self.prefix.reset(tenant) if self.prefix is not None else 0

    def step(self) -> list[RequestOutput]:
        self.expire_prefix_cache()
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.prefix is not None:  # only requests waiting for disk reads: wait for one, do not spin
                self.prefix.wait_for_reads(0.01)
            return []
        now = time.monotonic()
        for ch in chunks:
            ch.request.first_scheduled_time = ch.request.first_scheduled_time or now
        if self.tiered:
            self.cache.begin_step(chunks)
        logits, hidden = self.runner.execute(chunks)
        self.counters["steps"] += 1
        plain = self._plain_batch(chunks, logits)
        outputs, row, first_row = [], 0, 0
        for ch in chunks:
            req = ch.request
            if req.params.prompt_logprobs is not None and ch.first_position < req.num_prompt_tokens:
                self._record_prompt_logprobs(req, ch, hidden[first_row:first_row + ch.num_new_tokens])
            first_row += ch.num_new_tokens
            req.num_computed_tokens += ch.num_new_tokens - ch.num_draft_tokens
            self.counters["prompt_tokens"] += max(0, min(ch.context_len, req.num_prompt_tokens) - ch.first_position)
            if ch.samples and req.request_id in plain:
                req.draft_token_ids.clear()
                outputs.append(self._output(req, self._emit(req, *plain[req.request_id])))
                row += 1
            elif ch.samples:
                rows = 1 + ch.num_draft_tokens
                outputs.append(self._sample(req, logits[row:row + rows]))
                row += rows
            if self.prefix is not None and not req.finished:
                self.prefix.register(req)
        if self.speculator is not None:
            self.speculator.draft(chunks, hidden, self._generators)
        self._free_idle_buffers()
        return outputs

    def _free_idle_buffers(self) -> None:
        """With no request left, free the indexer's prefill score buffer: it grows with the longest
        context prefilled (up to 512 MB on a CPU) and would otherwise stay with the process."""
        if not self.scheduler.has_unfinished():
            self.model.index_scratch.release()

    def _plain_batch(self, chunks, logits: torch.Tensor) -> dict[str, tuple]:
        """The step's plain rows (one row, no drafts, penalties, bias or grammar), decided for the whole
        batch at once: one argmax for the greedy ones, one filter and softmax for the sampled ones (each
        still drawn with its own generator), one log_softmax and top-k, one copy to the host; instead of
        a few launches and a device sync per request. Each row gets exactly what `_sample` would give
        it. request id -> (token, None, its logprobs or None)."""
        rows, reqs, row = [], [], 0
        for ch in chunks:
            req = ch.request
            if ch.samples and not ch.num_draft_tokens and req.request_id not in self._adjusters and \
                    req.request_id not in self._grammars:
                rows.append(row)
                reqs.append(req)
            row += (1 + ch.num_draft_tokens) if ch.samples else 0
        if len(rows) < 2:
            return {}
        picked = logits[torch.tensor(rows, device=logits.device)]
        tokens = picked.argmax(-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            probs = filter_logits_rows(picked[sampled], [reqs[i].params for i in sampled]).softmax(-1)
            tokens[sampled] = draw_rows(probs, [self._generators[reqs[i].request_id] for i in sampled]).to(tokens.device)
        tokens = tokens.tolist()
        logprobs = token_logprobs_rows(picked, tokens, [r.params.logprobs for r in reqs])
        return {r.request_id: (t, None, lp) for r, t, lp in zip(reqs, tokens, logprobs)}

    def _sample(self, req: Request, logits: torch.Tensor) -> RequestOutput:
        """The step's new token(s): one sampled, or a verified draft (speculative.py) plus one more."""
        gen, drafts, new = self._generators[req.request_id], logits.shape[0] - 1, []
        req.draft_token_ids.clear()
        if drafts:  # counted once fed to the target, whether or not each gets judged below
            self.speculator.begin_verification(req.request_id, drafts)
        for i in range(drafts):  # each row adjusted after the tokens before it are emitted
            row = self._adjusted(req, logits[i])
            if self._dead_end(req, row):
                return self._output(req, new)
            token, accepted = self.speculator.verify(req, row, i, gen)
            new += self._emit(req, token, logits[i])
            if not accepted or req.finished:
                return self._output(req, new)
            req.num_computed_tokens += 1  # the draft's position holds the accepted token's entries
        row = self._adjusted(req, logits[drafts])
        if not self._dead_end(req, row):
            new += self._emit(req, sample_token(row, req.params, gen), logits[drafts])
        return self._output(req, new)

    def _dead_end(self, req: Request, row: torch.Tensor) -> bool:
        """No token may come next (a grammar this vocabulary cannot continue, or one that must end while
        min_tokens holds EOS back): the request ends here, "stop", with the text it has."""
        if req.request_id not in self._grammars or bool(torch.isfinite(row).any()):
            return False
        logger.warning("request %s: its structured output admits no next token; ending it", req.request_id)
        self._final_text(req, req.output_token_ids)
        self._release(req, RequestStatus.FINISHED, "stop")
        return True

    def _record_prompt_logprobs(self, req: Request, ch, hidden: torch.Tensor, block: int = 256) -> None:
        """The logprob of each prompt token after the chunk's rows (row p predicts token p + 1), with
        the top alternatives, a block of rows at a time (a [rows, vocab] fp32 tensor is large)."""
        first, k = ch.first_position, req.params.prompt_logprobs
        if first == 0:
            req.prompt_logprobs.append(None)
        targets = req.prompt_token_ids[first + 1:min(ch.context_len + 1, req.num_prompt_tokens)]
        for start in range(0, len(targets), block):
            rows = torch.log_softmax(self.model.logits(hidden[start:start + block]), -1).cpu()
            for lp, token in zip(rows, targets[start:start + block]):
                req.prompt_logprobs.append(token_logprobs(lp, token, k))

    def _adjusted(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        adjust, grammar = self._adjusters.get(req.request_id), self._grammars.get(req.request_id)
        logits = logits if adjust is None else adjust(logits)
        return logits if grammar is None else grammar.mask(logits)

    def _emit(self, req: Request, token: int, logits: torch.Tensor | None, logprobs: dict | None = None) -> list[int]:
        """Append `token`; its logprobs from the raw `logits` row, or given (`_plain_batch`)."""
        params = req.params
        if params.logprobs is not None:
            req.output_logprobs.append(logprobs if logprobs is not None else
                                       token_logprobs(torch.log_softmax(logits, -1), token, params.logprobs))
        req.output_token_ids.append(token)
        if req.request_id in self._adjusters:
            self._adjusters[req.request_id].note(token)
        if req.request_id in self._grammars:
            self._grammars[req.request_id].accept(token)
        req.first_token_time = req.first_token_time or time.monotonic()
        self.counters["generation_tokens"] += 1
        reason = self._finish_reason(req, token)
        if reason:
            self._release(req, RequestStatus.FINISHED, reason)
        return [token]

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        may_stop = req.num_output_tokens >= params.min_tokens  # vLLM: no stop before min_tokens are out
        stop_token = (not params.ignore_eos and token in self.eos_token_ids) or token in (params.stop_token_ids or ())
        grammar = self._grammars.get(req.request_id)
        if grammar is not None and grammar.finished and token in self.eos_token_ids:  # the match is complete
            stop_token, may_stop = True, True
        if may_stop and stop_token:
            self._final_text(req, req.output_token_ids[:-1])  # the stop token is not part of the text
            return "stop"
        if self.tokenizer is not None and self._stop_string_completed(req, may_stop):
            return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            self._final_text(req, req.output_token_ids)
            return "length"
        return None

    def _final_text(self, req: Request, token_ids: list[int]) -> None:
        if self.tokenizer is not None:
            req.text = self._detokenizer(req).finish(token_ids)

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        return req.detokenizer

    def _stop_string_completed(self, req: Request, may_stop: bool = True) -> bool:
        """Update the request's text incrementally; on a stop string, cut the exact full text there."""
        new = self._detokenizer(req).update(req.output_token_ids)
        req.text = req.detokenizer.text
        if not may_stop:  # vLLM: stop strings are not looked for until min_tokens are out
            req.stop_search_from = len(req.text)
            return False
        if not new or find_stop(req.text, len(new), req.params.stop_strings) < 0:
            return False
        full = req.detokenizer.finish(req.output_token_ids)
        cut, stop = stop_match(full, len(full) - min(req.stop_search_from, len(full)), req.params.stop_strings)
        if cut < 0:  # the full decode placed the text differently from the incremental one: search it all
            cut, stop = stop_match(full, len(full), req.params.stop_strings)
        req.text = full[:cut + (len(stop) if req.params.include_stop_str_in_output else 0)]
        return True

    def _release(self, req: Request, status: RequestStatus, reason: str) -> None:
        # NOTE: figures are taken before the pages are freed; the final output reports them.
        self._final_metrics[req.request_id] = self.request_metrics(req)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        # Its last full pages: with drafting, only if aborted between steps (a step that finishes a
        # request skips its MTP pass, so those positions have no MTP entries).
        self._let_go_of_cache(req, name_pages=self.speculator is None or status is RequestStatus.ABORTED,
                              keep_counters=False)
        self.scheduler.finish(req, status, reason)
        self._generators.pop(req.request_id, None)
        self._adjusters.pop(req.request_id, None)
        self._grammars.pop(req.request_id, None)
        req.draft_token_ids.clear()

    def _preempted(self, req: Request) -> None:
        """What a preempted request lets go of besides its pages (scheduler.preempt): its full pages are
        named for the prefix cache first, so its recomputation hits them; its sampling state, counters
        and output stay."""
        if self.speculator is not None:
            self.speculator.drop_drafts(req.request_id)
        # the previous step's MTP pass, if any, has written its pages: they can be named
        self._let_go_of_cache(req, name_pages=True, keep_counters=True)
        req.prompt_logprobs.clear()  # recorded again as the prompt is recomputed

    def _let_go_of_cache(self, req: Request, name_pages: bool, keep_counters: bool) -> None:
        """A request leaving the running set (finished, aborted or preempted): its full pages named for the
        prefix cache (`name_pages`) before they are freed, its prefix chain, tier working set (its tier
        counters too unless `keep_counters`) and per-request runner and selector state let go."""
        if self.prefix is not None:
            if name_pages:
                self.prefix.register(req)
            self.prefix.forget_request(req.request_id)
        if self.tiered:
            self.cache.release(req.request_id, keep_counters=keep_counters)
        self.runner.forget(req.request_id)

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.text,
                             list(req.output_logprobs) if req.params.logprobs is not None else None,
                             req.finish_reason, new_tokens, req.num_cached_tokens, self.request_metrics(req),
                             req.prompt_logprobs if req.params.prompt_logprobs is not None else None)

    # -- observability -------------------------------------------------------------------------
    def request_metrics(self, req: Request) -> dict:
        final = self._final_metrics.pop(req.request_id, None) if req.finished else None
        if final:
            return final
        spec = self.speculator.request_metrics(req.request_id) if self.speculator is not None else {}
        return {**self._kv_metrics(req), **spec}

    def _kv_metrics(self, req: Request) -> dict:
        tokens = {"num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": req.num_output_tokens,
                  "num_preemptions": req.num_preemptions,
                  "prefix_cached_tokens_device":
                      req.num_cached_tokens - req.num_cached_tokens_host - req.num_cached_tokens_disk,
                  "prefix_cached_tokens_host": req.num_cached_tokens_host,
                  "prefix_cached_tokens_disk": req.num_cached_tokens_disk}
        if self.tiered:
            return {**tokens, **self.cache.request_metrics(req.request_id, len(req.page_ids) * self.page_size)}
        per_token = self.cache.latent_bytes_per_token() + self.cache.index_bytes_per_token()
        held = len(req.page_ids) * self.page_size
        return {**tokens, "device_kv_bytes": held * per_token,
                "device_latent_bytes": held * self.cache.latent_bytes_per_token(),
                "device_indexer_bytes": held * self.cache.index_bytes_per_token()}

    def cache_config(self) -> dict[str, str]:
        """How the KV cache is laid out, as strings (vLLM's `cache_config_info` labels, and ours)."""
        config, tiers = self.config, self.prefix.tiers if self.prefix is not None else {}
        return {"block_size": str(self.page_size), "cache_dtype": config.kv_cache_dtype,
                "num_gpu_blocks": str(self.allocator.num_pages), "enable_prefix_caching": str(self.prefix is not None),
                "kv_tiering": str(self.tiered), "host_store": self.cache.host.kind if self.tiered else "none",
                "device_buffer_tokens": str(self.cache.capacity if self.tiered else 0),
                "indexer_key_dtype": config.indexer_key_dtype, "selector": config.selector,
                "prefix_cache_tiers": ",".join(["device", *tiers]), "kv_admission": config.kv_admission,
                "num_speculative_tokens": str(config.num_speculative_tokens)}

    def stats(self) -> dict:
        spec = self.speculator.stats() if self.speculator is not None else {}
        prefix = self.prefix.stats() if self.prefix is not None else {}
        return {**self._kv_stats(), "indexer_scratch_bytes": self.model.index_scratch.nbytes,
                "preemptions": self.scheduler.num_preemptions, "kv_by_tenant": self.scheduler.tenant_stats(),
                **prefix, **spec}

    def _kv_stats(self) -> dict:
        used_tokens = (self.allocator.num_pages - self.allocator.num_free) * self.page_size
        if self.tiered:
            return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                    **self.cache.stats(used_tokens),
                    "kv_pages_total": self.allocator.num_pages, "kv_pages_free": self.allocator.num_free,
                    **self.counters}
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "device_latent_bytes": used_tokens * self.cache.latent_bytes_per_token(),
                "device_indexer_bytes": used_tokens * self.cache.index_bytes_per_token(),
                "device_kv_bytes": used_tokens * (self.cache.latent_bytes_per_token() + self.cache.index_bytes_per_token()),
                "kv_pages_total": self.allocator.num_pages, "kv_pages_free": self.allocator.num_free,
                **self.counters}

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.scheduler.check_integrity()
        holders: dict[int, int] = {}  # page -> running requests holding it (several: a shared prefix page)
        for r in self.scheduler.running:
            assert len(set(r.page_ids)) == len(r.page_ids), f"{r.request_id} holds a page twice"
            for p in r.page_ids:
                holders[p] = holders.get(p, 0) + 1
        assert len(holders) == self.allocator.num_pages - self.allocator.num_free, "allocator and requests disagree"
        assert all(self.allocator.num_owners(p) == n for p, n in holders.items()), "page owners and requests disagree"
        shared = [p for p, n in holders.items() if n > 1]
        assert not shared or (self.prefix is not None and self.prefix.names_all(shared)), "a shared page has no name"
        running = {r.request_id for r in self.scheduler.running}
        live = running | {r.request_id for r in self.scheduler.waiting}
        assert set(self._generators) | set(self._adjusters) | set(self._grammars) <= live, \
            "sampling state of a finished request"
        for selector in self.runner.selectors():
            selector.check_integrity(running)
        if self.tiered:
            self.cache.check_integrity(running, live - running)
        if self.prefix is not None:
            self.prefix.check_integrity(live)
