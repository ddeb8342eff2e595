"""Logits -> tokens -> request outputs: sampling state, logprobs, stop conditions and finish decisions.

The processor writes what a request outputs (its tokens, logprobs, text, finish reason) and nothing
else: how far the cache has been computed and which pages a request holds are the scheduler's to
advance (`Scheduler.update`), from the `StepResult` returned here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer, find_stop, stop_match
from .outputs import FirstToken
from .request import InvalidRequest, Request, RequestOutput
from .sampling import (LogitAdjuster, draw_rows, filter_logits_rows, make_generator, sample_token, skip_draw,
                       token_logprobs, token_logprobs_rows)

logger = logging.getLogger(__name__)


@dataclass
class OutputState:
    """What a request outputs besides its tokens (kept here, not on the request): its text, the
    incremental detokenizer making it, and its logprobs."""

    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    stop_search_from: int = 0  # output text before min_tokens were out: stop strings there do not count
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: None for the first prompt token, then one entry per prompt token
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    routed_experts: list[list[list[int]]] = field(default_factory=list)  # params.return_routed_experts


@dataclass
class StepResult:
    """What a step decided, for the scheduler to apply."""

    outputs: list[RequestOutput] = field(default_factory=list)
    accepted_drafts: dict[str, int] = field(default_factory=dict)  # request -> drafts whose entries hold its tokens
    finished: list[Request] = field(default_factory=list)          # requests with a finish reason this step
    num_generated_tokens: int = 0


def on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU: itself when it is there (`Tensor.cpu()` dispatches an op even then)."""
    return t if t.device.type == "cpu" else t.cpu()


class OutputProcessor:
    """`metrics(req)` gives a request's figures for its outputs; `speculator` verifies MTP drafts."""

    def __init__(self, tokenizer, eos_token_ids: set[int], vocab_size: int, max_model_len: int, seed: int,
                 metrics, speculator=None):
        self.tokenizer, self.eos_token_ids, self.vocab_size = tokenizer, eos_token_ids, vocab_size
        self.max_model_len, self.metrics, self.speculator = max_model_len, metrics, speculator
        self._generators: dict[str, torch.Generator] = {}
        self._adjusters: dict[str, LogitAdjuster] = {}  # requests with penalties, a logit bias or min_tokens
        self._grammars: dict = {}  # request -> structured.GrammarState (structured outputs)
        self._grammar_compiler = None
        self._states: dict[str, OutputState] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    # -- per-request state ---------------------------------------------------------------------
    def grammar_for(self, spec: dict):
        """A compiled grammar state for a structured-output spec (InvalidRequest if it cannot be)."""
        if self.tokenizer is None:
            raise InvalidRequest("structured outputs need a tokenizer; this checkpoint has none", "structured_output")
        from .structured import GrammarCompiler, GrammarState
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        tokenizer = self.tokenizer
        return GrammarState(self._grammar_compiler, self._grammar_compiler.compile(spec), spec.get("after"),
                            lambda token: tokenizer.decode([token]))

    def add(self, req: Request, grammar=None, first: FirstToken | None = None) -> None:
        """A new request's sampling state; with `first`, its first token appended as if sampled here
        (its generator moved past that token's draw; output with `carried_output`)."""
        params, rid = req.params, req.request_id
        if first is not None:
            self.check_first(params, first)
        self._states[rid] = OutputState()
        if grammar is not None:
            self._grammars[rid] = grammar
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        self._generators[rid] = make_generator(seed)
        if params.adjusts_logits:
            vocab = self.vocab_size
            stops = {t for t in params.stop_token_ids or () if 0 <= t < vocab}
            stops |= {t for t in self.eos_token_ids if 0 <= t < vocab}  # with ignore_eos too, as vLLM's min_tokens
            self._adjusters[rid] = LogitAdjuster(params, req.prompt_token_ids, vocab, stops)
        if first is not None:
            self._carry(req, first)

    def check_first(self, params, first: FirstToken) -> None:
        """InvalidRequest unless `first` could be the token these params sampled (in the vocabulary, with
        logprobs and routed experts exactly when they are asked for)."""
        if not 0 <= first.token_id < self.vocab_size:
            raise InvalidRequest(f"first token {first.token_id} is outside the vocabulary", "first_token")
        if (first.logprobs is None) != (params.logprobs is None) or \
                (first.logprobs is not None and first.token_id not in first.logprobs):
            raise InvalidRequest("a first token's logprobs must come with it exactly when the request asks for "
                                 "logprobs", "first_token")
        if (first.routed_experts is None) == params.return_routed_experts:
            raise InvalidRequest("a first token's routed experts must come with it exactly when the request asks "
                                 "for them", "first_token")

    def _carry(self, req: Request, first: FirstToken) -> None:
        params, rid = req.params, req.request_id
        if not params.greedy:
            skip_draw(self._generators[rid])
        if first.routed_experts is not None:
            self._states[rid].routed_experts.append(first.routed_experts)
        self._emit(req, first.token_id, None, first.logprobs)

    def preempted(self, request_id: str) -> None:
        """A preempted request's prompt logprobs are recorded again as its prompt is recomputed."""
        self._states[request_id].prompt_logprobs.clear()

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._adjusters.pop(request_id, None)
        self._grammars.pop(request_id, None)

    @property
    def generators(self) -> dict[str, torch.Generator]:
        return self._generators

    def check_integrity(self, live: set[str]) -> None:
        assert set(self._states) | set(self._generators) | set(self._adjusters) | set(self._grammars) <= live, \
            "sampling state of a finished request"

    # -- the step ------------------------------------------------------------------------------
    def process(self, chunks, logits: torch.Tensor, hidden: torch.Tensor, logits_of,
                routed: torch.Tensor | None = None) -> StepResult:
        """The step's tokens. `logits`: 1 + drafts rows per sampling chunk, in order; `hidden`: every
        row's final hidden state; `logits_of(hidden rows)`: their fp32 logits (prompt logprobs);
        `routed`: the routed experts of the logits rows (routing.py), when a request asked for them."""
        result = StepResult()
        plain = self._decide_plain_rows(chunks, logits)
        own = self._rows_on_host(chunks, logits, plain)
        row, first_row = 0, 0
        for ch in chunks:
            req = ch.request
            if req.params.prompt_logprobs is not None and ch.first_position < req.num_prompt_tokens:
                self._record_prompt_logprobs(req, ch, hidden[first_row:first_row + ch.num_new_tokens], logits_of)
            first_row += ch.num_new_tokens
            if not ch.samples_token:
                continue
            req.draft_token_ids.clear()
            if req.request_id in plain:
                new, rows = self._emit(req, *plain[req.request_id]), 1
            else:
                rows = 1 + ch.num_draft_tokens
                new = self._sample(req, own[req.request_id], result)
            if req.params.return_routed_experts:  # token j was sampled from the chunk's row j
                self._states[req.request_id].routed_experts.extend(routed[row:row + len(new)].tolist())
            row += rows
            result.outputs.append(self._output(req, new))
            result.num_generated_tokens += len(new)
            if req.finish_reason is not None:
                result.finished.append(req)
        return result

    def _decide_plain_rows(self, chunks, logits: torch.Tensor) -> dict[str, tuple]:
        """The step's plain rows (one row, no drafts, penalties, bias or grammar), decided for the whole
        batch at once: one argmax for the greedy ones, one filter and softmax for the sampled ones (each
        still drawn with its own generator), one log_softmax and top-k, one copy to the host; instead of
        a few launches and a device sync per request. Each row gets exactly what `_sample` would give
        it. request id -> (token, None, its logprobs or None)."""
        rows, reqs, row = [], [], 0
        for ch in chunks:
            req = ch.request
            if ch.samples_token and not ch.num_draft_tokens and req.request_id not in self._adjusters and \
                    req.request_id not in self._grammars:
                rows.append(row)
                reqs.append(req)
            row += (1 + ch.num_draft_tokens) if ch.samples_token else 0
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

    @staticmethod
    def _rows_on_host(chunks, logits: torch.Tensor, plain: dict) -> dict[str, torch.Tensor]:
        """The logits rows of the requests sampled one at a time (drafts to verify, penalties, bias,
        grammars, logits processors), copied to the host in one transfer: request id -> its 1 + drafts
        rows. The plain rows stay where the model computed them (`_decide_plain_rows` copies only their
        tokens and logprobs), so a device step does not copy its [rows, vocab] logits."""
        spans, row = {}, 0
        for ch in chunks:
            if ch.samples_token:
                if ch.request.request_id not in plain:
                    spans[ch.request.request_id] = (row, 1 + ch.num_draft_tokens)
                row += 1 + ch.num_draft_tokens
        if len(spans) < 2:
            return {rid: on_host(logits[start:start + n]) for rid, (start, n) in spans.items()}
        index = torch.tensor([r for start, n in spans.values() for r in range(start, start + n)], device=logits.device)
        return dict(zip(spans, on_host(logits[index]).split([n for _, n in spans.values()])))

    def _sample(self, req: Request, logits: torch.Tensor, result: StepResult) -> list[int]:
        """The step's new token(s): one sampled, or the verified drafts (speculative.py) plus one more."""
        gen, drafts, new = self._generators[req.request_id], logits.shape[0] - 1, []
        if drafts:  # counted once fed to the target, whether or not each gets judged below
            self.speculator.begin_verification(req.request_id, drafts)
        for i in range(drafts):  # each row adjusted after the tokens before it are emitted
            row = self._adjusted(req, logits[i])
            if self._no_next_token(req, row):
                return new
            token, accepted = self.speculator.verify(req, row, i, gen)
            new += self._emit(req, token, logits[i])
            if not accepted or req.finish_reason is not None:
                return new
            result.accepted_drafts[req.request_id] = i + 1  # the draft's position holds the accepted token's entries
        row = self._adjusted(req, logits[drafts])
        if not self._no_next_token(req, row):
            new += self._emit(req, sample_token(row, req.params, gen), logits[drafts])
        return new

    def _no_next_token(self, req: Request, row: torch.Tensor) -> bool:
        """No token may come next (a grammar this vocabulary cannot continue, one that must end while
        min_tokens holds EOS back, allowed_token_ids that min_tokens all holds back, a logits processor
        that masks every token): the request ends here, "stop", with the text it has."""
        masks = req.request_id in self._grammars or req.request_id in self._adjusters
        if not masks or bool(torch.isfinite(row).any()):
            return False
        logger.warning("request %s: its logits admit no next token; ending it", req.request_id)
        self._final_text(req, req.output_token_ids)
        req.finish_reason = "stop"
        return True

    def _record_prompt_logprobs(self, req: Request, ch, hidden: torch.Tensor, logits_of, block: int = 256) -> None:
        """The logprob of each prompt token after the chunk's rows (row p predicts token p + 1), with
        the top alternatives, a block of rows at a time (a [rows, vocab] fp32 tensor is large)."""
        first, k = ch.first_position, req.params.prompt_logprobs
        recorded = self._states[req.request_id].prompt_logprobs
        if first == 0:
            recorded.append(None)
        targets = req.prompt_token_ids[first + 1:min(ch.context_len + 1, req.num_prompt_tokens)]
        for start in range(0, len(targets), block):
            rows = torch.log_softmax(logits_of(hidden[start:start + block]), -1).cpu()
            for lp, token in zip(rows, targets[start:start + block]):
                recorded.append(token_logprobs(lp, token, k))

    def _adjusted(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        adjust, grammar = self._adjusters.get(req.request_id), self._grammars.get(req.request_id)
        if req.params.logits_processors:
            logits = logits.clone()  # the raw row stays as it is (its logprobs are reported)
            for process in req.params.logits_processors:
                logits = process(req.output_token_ids, logits)
        logits = logits if adjust is None else adjust(logits)
        return logits if grammar is None else grammar.mask(logits)

    def _emit(self, req: Request, token: int, logits: torch.Tensor | None, logprobs: dict | None = None) -> list[int]:
        """Append `token`; its logprobs from the raw `logits` row, or given (`_decide_plain_rows`)."""
        params = req.params
        if params.logprobs is not None:
            logprobs = logprobs if logprobs is not None else \
                token_logprobs(torch.log_softmax(logits, -1), token, params.logprobs)
            self._states[req.request_id].logprobs.append(logprobs)
        req.output_token_ids.append(token)
        if req.request_id in self._adjusters:
            self._adjusters[req.request_id].note(token)
        grammar = self._grammars.get(req.request_id)
        if grammar is not None:
            grammar.accept(token)
        if grammar is not None and grammar.dead_end is not None:
            logger.warning("request %s: %s; ending it", req.request_id, grammar.dead_end)
            self._final_text(req, req.output_token_ids)
            req.finish_reason = "stop"
        else:
            req.finish_reason = self._finish_reason(req, token)
        return [token]

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        may_stop = req.num_output_tokens >= params.min_tokens  # vLLM: no stop before min_tokens are out
        stop_token = (not params.ignore_eos and token in self.eos_token_ids) or token in (params.stop_token_ids or ())
        grammar = self._grammars.get(req.request_id)
        if grammar is not None and grammar.finished and token in self.eos_token_ids:  # the match is complete
            stop_token, may_stop = True, True
        if may_stop and stop_token:
            # vLLM: the stop token's text is the output's only with include_stop_str_in_output (EOS, a
            # special token, decodes to nothing unless skip_special_tokens is off)
            self._final_text(req, req.output_token_ids if params.include_stop_str_in_output else req.output_token_ids[:-1])
            eos = token in self.eos_token_ids and (not params.ignore_eos or (grammar is not None and grammar.finished))
            req.stop_reason = None if eos else token  # vLLM: EOS first, then a stop token id
            return "stop"
        # vLLM: a stop string counts from token min_tokens + 1, where EOS and stop ids can first come
        if self.tokenizer is not None and self._stop_string_completed(req, req.num_output_tokens > params.min_tokens):
            return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            self._final_text(req, req.output_token_ids)
            return "length"
        return None

    def _final_text(self, req: Request, token_ids: list[int]) -> None:
        if self.tokenizer is not None:
            state = self._text_state(req)
            state.text = state.detokenizer.finish(token_ids)

    def _text_state(self, req: Request) -> OutputState:
        state = self._states[req.request_id]
        if state.detokenizer is None:
            state.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        return state

    def _stop_string_completed(self, req: Request, may_stop: bool = True) -> bool:
        """Update the request's text incrementally; on a stop string, cut the exact full text there."""
        state = self._text_state(req)
        new = state.detokenizer.update(req.output_token_ids)
        state.text = state.detokenizer.text
        if not may_stop:  # vLLM: stop strings are not looked for until min_tokens are out
            state.stop_search_from = len(state.text)
            return False
        if not new or find_stop(state.text, len(new), req.params.stop_strings) < 0:
            return False
        full = state.detokenizer.finish(req.output_token_ids)
        cut, stop = stop_match(full, len(full) - min(state.stop_search_from, len(full)), req.params.stop_strings)
        if cut < 0:  # the full decode placed the text differently from the incremental one: search it all
            cut, stop = stop_match(full, len(full), req.params.stop_strings)
        state.text = full[:cut + (len(stop) if req.params.include_stop_str_in_output else 0)]
        req.stop_reason = stop
        return True

    def carried_output(self, req: Request) -> RequestOutput:
        """The output of a request's given first token (`add`), before any step of it."""
        return self._output(req, list(req.output_token_ids))

    def final_output(self, req: Request) -> RequestOutput:
        """The output of a request ended outside a step (aborted for a weight update), before it is forgotten."""
        return self._output(req, [])

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        state, params = self._states[req.request_id], req.params
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), state.text,
                             list(state.logprobs) if params.logprobs is not None else None,
                             req.finish_reason, new_tokens, req.num_cached_tokens, self.metrics(req),
                             state.prompt_logprobs if params.prompt_logprobs is not None else None,
                             state.routed_experts if params.return_routed_experts else None, req.stop_reason)
