"""SGLang's native POST /generate, the API RL frameworks drive rollouts through (slime and AReaL send
token ids and read each output token's logprob and id back): `text` or `input_ids` (one prompt or a
batch), `sampling_params` (SGLang's names), `return_logprob` with `top_logprobs_num` and
`logprob_start_len`, `rid` (a batch's: one for all its prompts, or a list with one per prompt, as
SGLang takes it), `stream`.

An answer per prompt and choice: `text`, `output_ids` and `meta_info` (`id`, `finish_reason` as SGLang
gives it: {"type": "length", "length": N}, {"type": "stop", "matched": token id or string},
{"type": "abort"}; token counts; with logprobs `output_token_logprobs` as [logprob, token id, text or
null] and `output_top_logprobs`, and from `logprob_start_len` the prompt's `input_token_logprobs`). One
prompt with n = 1 answers an object, else a list in prompt-major order. A stream sends each choice's
answer so far (cumulative, as SGLang streams), with its `index` in that order, then `[DONE]`.

The request runs as a completion does (serving.respond: admission, the engine loop, abort on
disconnect), under the caller's tenant; its `rid` names it to /abort_request (a batch given a `rid` per
prompt: each prompt with its choices, and each answer's `meta_info.id` is its prompt's). Behind
`sparsekv router` it runs as a completion does there too: the prefill worker computes the prompts and
each choice's first token, the decode worker answers with the transfer's figures in each answer's
`meta_info.disaggregation` (every prompt then takes the same `n`, as a completion's do).
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from pydantic import model_validator

from ..disagg import roles as disagg
from ..outputs import RequestOutput
from ..request import InvalidRequest, SamplingParams
from .auth import DEFAULT_TENANT, TENANT_SCOPE_KEY
from .errors import bad_request
from .loop import RequestGroup, Submission
from ..sampling_params import MAX_N
from .prompt_ids import completion_prompt_ids
from .protocol import INT64_MAX, INT64_MIN, Disaggregation, _Body, check_request_id, parse_body
from .responses import ResponseBuilder
from .serving import Job, answer, queue_item

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# SGLang's sampling parameters -> the engine's (None: accepted at SGLang's default only)
SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                  "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                  "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
                  "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "include_stop_str_in_output",
                  "sampling_seed": "seed", "n": None, "json_schema": None, "regex": None, "logit_bias": None,
                  "spaces_between_special_tokens": None, "stream_interval": None}


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    disaggregation: Disaggregation | None = None  # set by `sparsekv router` for prefill/decode workers

    @model_validator(mode="after")
    def _check(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text or input_ids")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num: must be >= 0, got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len: -1 (no prompt logprobs) or a prompt position, got {self.logprob_start_len}")
        prompts = self.prompts()
        if not prompts or any(isinstance(p, list) and not p for p in prompts):
            raise ValueError(f"{'text' if self.text is not None else 'input_ids'}: a prompt must not be empty")
        self._check_rids()
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(self.sampling_params)} given for {len(prompts)} prompts")
        return self

    def _check_rids(self) -> None:
        rids = self.rid if isinstance(self.rid, list) else [self.rid]
        for rid in rids:
            check_request_id(rid, "rid")
        if not isinstance(self.rid, list):
            return
        if not self.batched or len(self.rid) != len(self.prompts()):
            raise ValueError(f"rid: a list names each prompt of a batch, {len(self.prompts()) if self.batched else 1} "
                             f"prompt(s) here, {len(self.rid)} rid(s) given")
        if len(set(self.rid)) != len(self.rid):
            raise ValueError("rid: each prompt of a batch needs an id of its own")

    def rid_of(self, prompt: int) -> str | None:
        return self.rid[prompt] if isinstance(self.rid, list) else self.rid

    @property
    def batched(self) -> bool:
        given = self.text if self.text is not None else self.input_ids
        return isinstance(given, list) and (self.text is not None or isinstance(given[0], list))

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        if self.input_ids and isinstance(self.input_ids[0], list):
            return [list(p) for p in self.input_ids]
        return [list(self.input_ids)]

    def params_of(self, prompt: int) -> dict:
        given = self.sampling_params or {}
        return dict(given[prompt] if isinstance(given, list) else given)


def engine_params(given: dict, body: GenerateRequest, choice: int) -> SamplingParams:
    """The engine's parameters for one choice of one prompt, from SGLang's names; a name this server
    does not take (or takes at its default only) is a 400 naming it."""
    unknown = sorted(set(given) - set(SAMPLING_NAMES))
    if unknown:
        raise bad_request(f"sampling_params: unknown parameter(s) {', '.join(unknown)}", "sampling_params")
    kwargs = {SAMPLING_NAMES[k]: v for k, v in given.items() if SAMPLING_NAMES[k] is not None and v is not None}
    kwargs.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0
    if kwargs.get("seed") is not None:
        kwargs["seed"] = _seed(kwargs["seed"]) + choice  # the choices of a prompt differ, as with OpenAI's n
    grammar = _grammar(given)
    if given.get("logit_bias"):
        kwargs["logit_bias"] = _bias(given["logit_bias"])
    if given.get("spaces_between_special_tokens", True) is not True:
        raise bad_request("sampling_params: spaces_between_special_tokens is only supported at true", "sampling_params")
    logprobs = body.top_logprobs_num if body.return_logprob else None
    prompt_logprobs = body.top_logprobs_num if body.return_logprob and body.logprob_start_len >= 0 else None
    try:
        return SamplingParams(**kwargs, logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_output=grammar,
                              return_routed_experts=body.return_routed_experts)
    except (InvalidRequest, TypeError, ValueError) as e:
        raise bad_request(f"sampling_params: {e}", "sampling_params") from None


def _seed(seed) -> int:
    if type(seed) is not int or not INT64_MIN <= seed <= INT64_MAX - MAX_N:
        raise bad_request(f"sampling_params: sampling_seed must be an integer that fits in 64 bits, got {seed!r}",
                          "sampling_params")
    return seed


def _grammar(given: dict) -> dict | None:
    schema, regex = given.get("json_schema"), given.get("regex")
    if schema is not None and regex is not None:
        raise bad_request("sampling_params: give one of json_schema and regex", "sampling_params")
    if schema is not None:
        try:
            return {"type": "json_schema", "schema": json.loads(schema) if isinstance(schema, str) else schema}
        except json.JSONDecodeError as e:
            raise bad_request(f"sampling_params: json_schema is not JSON: {e}", "sampling_params") from None
    return {"type": "regex", "pattern": regex} if regex is not None else None


def _bias(bias) -> dict[int, float]:
    try:
        return {int(token): float(value) for token, value in dict(bias).items()}
    except (TypeError, ValueError):
        raise bad_request("sampling_params: logit_bias maps token ids to numbers", "sampling_params") from None


async def generate(request: Request):
    state = request.app.state.server
    body = parse_body(await request.body(), GenerateRequest)
    prompts = body.prompts()
    limit = state.settings.max_prompts_per_request
    if len(prompts) > limit:
        raise bad_request(f"a request may carry at most {limit} prompts (--max-prompts-per-request), got "
                          f"{len(prompts)}", "text" if body.text is not None else "input_ids")
    ids = await state.pooled(completion_prompt_ids, prompts, state.max_model_len, None, True)
    subs, owners = [], []
    for i, prompt_ids in enumerate(ids):
        given = body.params_of(i)
        n = given.get("n", 1)
        if type(n) is not int or not 1 <= n <= MAX_N:
            raise bad_request(f"sampling_params: n must be an integer in [1, {MAX_N}], got {n!r}", "sampling_params")
        for choice in range(n):
            subs.append(Submission(prompt_ids, engine_params(given, body, choice)))
            owners.append(i)
    group_id = "gen-" + uuid.uuid4().hex
    per_prompt = isinstance(body.rid, list)
    group = RequestGroup(group_id, len(subs), None if per_prompt else body.rid,
                         [body.rid_of(i) for i in owners] if per_prompt else None)
    tenant = request.scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)
    job = Job(group, subs, tenant, None, None, body.stream, False,
              {**{name: "sampling_params" for name in SAMPLING_NAMES.values() if name},
               "prompt": "text" if body.text is not None else "input_ids"})
    job.replies = Answers(state, body, [group.client_id_of(i) for i in range(len(subs))], [len(p) for p in ids],
                          owners, single=not body.batched and len(subs) == 1)
    if state.disagg is not None or body.disaggregation is not None:
        return await _disaggregated(request, state, job, body, ids, group_id, owners)
    return await answer(request, state.loop, job, state.metrics)


async def _disaggregated(request: Request, state, job: Job, body: GenerateRequest, ids: list[list[int]],
                         group_id: str, owners: list[int]):
    """/generate on a prefill or decode worker (disagg.serve, as a completion): the prefill worker's
    own answer, which only the router reads, is a completion's (`job.builder`); the client's comes from
    the decode worker's Answers, with the transfer's figures."""
    n = len(owners) // len(ids)
    if any(owners.count(i) != n for i in range(len(ids))):
        raise bad_request("sampling_params: behind `sparsekv router` every prompt of a batch takes the same n",
                          "sampling_params")
    job.builder = ResponseBuilder("completion", group_id, state.model_name, int(time.time()), n, state.token_text,
                                  job.tenant)
    job.replies.builder = job.builder  # the decode worker sets the figures there
    return await disagg.serve(state, request, job, body.disaggregation, ids)


class Answers:
    """Each choice's latest output, answered as SGLang answers (the serving.Replies of /generate)."""

    def __init__(self, state, body: GenerateRequest, rids: list[str], prompt_lens: list[int], owners: list[int],
                 single: bool):
        self.body, self.rids, self.token_text = body, rids, state.token_text  # rids: each choice's id
        self.outputs: list[RequestOutput | None] = [None] * len(rids)
        self.prompt_lens, self.owners = prompt_lens, owners
        self.single = single  # one prompt, one choice: the body is that answer, not a list of one
        self.builder: ResponseBuilder | None = None  # a decode worker's: its `disaggregation` figures
        self.first_output_at: list[float | None] = [None] * len(rids)  # monotonic, for those figures

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.outputs)

    def take(self, item) -> int:
        """One queue item of the group; an error becomes an APIError."""
        index, payload = queue_item(item)
        self.outputs[index] = payload
        if self.first_output_at[index] is None:
            self.first_output_at[index] = time.monotonic()
        return index

    def answer(self, index: int) -> dict:
        out = self.outputs[index]
        meta = {"id": self.rids[index], "finish_reason": _finish_reason(out),
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(out.token_ids), "cached_tokens": out.num_cached_tokens,
                "weight_version": out.metrics.get("weights_version")}
        if self.body.return_logprob:
            meta.update(self._logprobs(out))
        if self.body.return_routed_experts:
            meta["routed_experts"] = out.routed_experts
        figures = self.builder.disaggregation if self.builder is not None else None
        if figures is not None:
            meta["disaggregation"] = figures([t for t in self.first_output_at if t is not None])
        return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}

    def response(self) -> dict | list:
        answers = [self.answer(i) for i in range(len(self.outputs))]
        return answers[0] if self.single else answers

    def chunk(self, index: int) -> dict:
        """Choice `index`'s answer so far (SGLang streams them cumulative), with its place in the body's order."""
        return {**self.answer(index), "index": index}

    def closing(self) -> list[dict]:
        return []

    def _logprobs(self, out: RequestOutput) -> dict:
        top = self.body.top_logprobs_num
        found = {"output_token_logprobs": [self._entry(lp[token], token) for token, lp in zip(out.token_ids, out.logprobs)],
                 "output_top_logprobs": [self._top(lp, top) for lp in out.logprobs]}
        start = self.body.logprob_start_len
        if start >= 0 and out.prompt_logprobs is not None:
            prompt = out.prompt_token_ids[start:]
            entries = out.prompt_logprobs[start:]
            found["input_token_logprobs"] = [self._entry(None if lp is None else lp[token], token)
                                             for token, lp in zip(prompt, entries)]
            found["input_top_logprobs"] = [None if lp is None else self._top(lp, top) for lp in entries]
        return found

    def _entry(self, logprob: float | None, token: int) -> list:
        return [logprob, token, self.token_text(token) if self.body.return_text_in_logprobs else None]

    def _top(self, logprobs: dict[int, float], n: int) -> list:
        best = sorted(logprobs.items(), key=lambda item: (-item[1], item[0]))[:n]
        return [self._entry(value, token) for token, value in best]


def _finish_reason(out: RequestOutput) -> dict | None:
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == "stop":
        matched = out.stop_reason if out.stop_reason is not None else (out.token_ids[-1] if out.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": out.finish_reason, "message": None}
