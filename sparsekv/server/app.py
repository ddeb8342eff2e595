"""The FastAPI app: OpenAI-compatible routes over one engine loop.

Bodies are parsed by hand (`protocol.parse_body`) rather than by FastAPI's signature binding so that
malformed JSON and wrong types are a 400 in the OpenAI envelope (FastAPI would answer 422 in its own
shape). The server keeps a copy of the engine's tokenizer for logprob and echo text: the engine thread uses
the engine's own, and HF fast tokenizers are not safe to share across threads. Prompts are tokenized and
chat templates rendered in the tokenizer pool (tokenizing.py), whose workers have copies of their own;
the engine gets token ids.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.metadata
import importlib.resources
import logging
import time
import uuid
from dataclasses import dataclass, field

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..disagg import roles as disagg
from ..disagg.worker import DisaggSettings
from ..request import InvalidRequest, SamplingParams
from ..sampling_params import choice_seed
from .auth import DEFAULT_TENANT, TENANT_SCOPE_KEY, AuthMiddleware, tenant_for
from .errors import APIError, bad_request, error_body, error_response
from .limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from .loop import EngineDead, EngineLoop, RequestGroup, ShuttingDown, Submission
from .native import generate
from .prompt_ids import completion_prompt_ids, encode_text, encode_within
from .probe import GenerateProbe
from .weight_groups import WEIGHT_GROUP_ROUTES, WeightGroups
from .metrics import ServerMetrics
from .protocol import (AbortRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       SamplingFields, TokenizeRequest, parse_body)
from .reasoning import THINK_CLOSE, prompt_opens_reasoning
from .responses import Echo, Reasoning, ResponseBuilder, TokenText
from .tool_calls import FORMATS as TOOL_CALL_FORMATS
from .tool_calls import CallFormat
from .serving import Job, run
from .tokenizing import Encoder, TokenizerPool, ids_json

log = logging.getLogger("sparsekv.server")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_keys: dict[bytes, str] = field(default_factory=dict)  # sha256(key) -> tenant (auth.parse_api_keys)
    max_queued_requests: int | None = None
    default_max_tokens: int | None = None
    chat_template: str | None = None  # Jinja text replacing the tokenizer's (vLLM's --chat-template)
    max_queued_per_tenant: int | None = None  # a tenant's waiting requests beyond this get 503
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: <think>...</think> -> reasoning_content
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # past it, 413 before the body is read
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # a completion's batch of prompts
    metrics_api_keys: dict[bytes, str] = field(default_factory=dict)  # these see /metrics' per-tenant series
    disaggregation: DisaggSettings | None = None  # a prefill or decode worker's role (None: colocated)
    admin_api_keys: dict[bytes, str] = field(default_factory=dict)  # open the admin endpoints (admin.py)
    weight_update_policy: str = "drain"  # running requests on /update_weights_from_disk: "drain" or "abort"
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag: tool_choice "none" renders no tools


class ServerState:
    """What the routes share: the engine loop, metrics, the server's tokenizer and the settings."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.model_name = settings.served_model_names[0]
        self.max_model_len = engine.max_model_len
        pool_tokens = engine.kv_capacity_tokens
        self.context_limit = min(engine.max_model_len, pool_tokens)
        # The engine reserves pages for prompt + max_tokens at admission, so an unbounded default would let
        # one chat request hold the pool; cap it so a full batch of such requests still fits.
        # with optimistic admission a large max_tokens costs no reservation: vLLM's default, the rest of the context
        self.chat_default_cap = (self.context_limit if engine.config.kv_admission == "optimistic"
                                 else max(1, pool_tokens // engine.config.max_num_seqs))
        # a copy of the engine's (the engine thread uses that one; HF fast tokenizers are not thread-safe)
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        if settings.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("--chat-template needs a tokenizer (the checkpoint has none; give --tokenizer)")
            self.tokenizer.chat_template = settings.chat_template
        elif self.tokenizer is not None and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = bundled_chat_template(engine.model_config.model_type)
        self.token_text = TokenText(self.tokenizer)
        self.tokenizing = TokenizerPool(self.tokenizer) if self.tokenizer is not None else None
        self.loop = EngineLoop(engine, None, settings.max_queued_requests, settings.max_queued_per_tenant)
        self.probe = GenerateProbe(self.loop)
        self.weight_groups = WeightGroups()  # the trainers' process groups joined (weight_groups.py)
        self.cache_config = engine.cache_config()
        self.metrics = ServerMetrics(self.model_name, self.loop.stats, lambda: self.loop.healthy, self.cache_config)
        self.loop.metrics = self.metrics
        self.disagg = disagg.build_worker(self, settings.disaggregation)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(self.settings.served_model_names)}", "model")

    def chat_prompt(self, body, tools: list[dict] | None = None) -> tuple[list[int], str]:
        """A chat request's messages rendered by the chat template: (token ids, text). Here, on the
        caller's thread; the routes render in the tokenizer pool (`pooled`)."""
        return chat_prompt_ids(Encoder(self.tokenizer), *self.chat_inputs(body, tools), None)

    def chat_inputs(self, body, tools: list[dict] | None) -> tuple:
        """What `chat_prompt_ids` needs besides the encoder and the token limit."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("this model has no tokenizer with a chat template; use /v1/completions", "messages")
        try:
            msgs = [m.template_dict() for m in body.messages]
        except ValueError as e:  # a content part that is not text
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
        if body.continue_final_message and (not msgs or msgs[-1].get("role") != "assistant"):
            raise bad_request("continue_final_message continues the last message, which must be the assistant's",
                              "messages")
        return msgs, tools, body.add_generation_prompt, body.template_options()

    async def pooled(self, fn, *args):
        """`fn(encoder, *args)` in the tokenizer pool: off the event loop and off the engine thread."""
        try:
            if self.tokenizing is None:  # token-id prompts only; there is nothing to tokenize
                return fn(None, *args)
            return await self.tokenizing.run(fn, *args)
        except InvalidRequest as e:
            raise APIError(400, str(e), e.param) from None


def chat_prompt_ids(encoder: Encoder, msgs: list[dict], tools, add_generation_prompt: bool, kwargs: dict,
                    limit: int | None) -> tuple[list[int], str]:
    """The chat template's text and its token ids; with `limit`, InvalidRequest once the prompt is
    known to have more tokens than that (without tokenizing all of a long one)."""
    try:
        text = encoder.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.TemplateError as e:  # the template refuses roles or orders: its message is for the client
        raise InvalidRequest(f"the chat template could not render these messages: {e}", "messages") from None
    except Exception:
        log.warning("the chat template failed on a request's messages", exc_info=True)
        raise InvalidRequest("the chat template could not render these messages", "messages") from None
    ids = encode_text(encoder, text, "messages") if limit is None else encode_within(encoder, text, limit, "messages")
    return ids, text


def bundled_chat_template(model_type: str) -> str | None:
    """The chat template sparsekv ships for a model family whose checkpoints come without one."""
    name = {"deepseek_v32": "deepseek_v32.jinja"}.get(model_type)
    if name is None:
        return None
    return importlib.resources.files(__package__).joinpath("chat_templates", name).read_text(encoding="utf-8")


def sampling_params(body: SamplingFields, choice: int, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, grammar_after: str | None = None) -> SamplingParams:
    """The engine's parameters for choice `choice` of n; seeds are seed + choice so choices differ.
    `grammar_after`: the structured output holds only after this text (the end of the reasoning)."""
    grammar = body.engine_structured_output()
    if grammar is not None and grammar_after is not None:
        grammar = {**grammar, "after": grammar_after}
    top_k = body.top_k if body.top_k is not None else 0
    given = {name: getattr(body, name) for name in ("min_p", "presence_penalty", "frequency_penalty",
                                                     "repetition_penalty", "min_tokens", "allowed_token_ids",
                                                     "truncate_prompt_tokens", "include_stop_str_in_output",
                                                     "skip_special_tokens", "return_routed_experts")
             if getattr(body, name) is not None}
    bias = {int(token): value for token, value in body.logit_bias.items()} if body.logit_bias else None
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if top_k == -1 else top_k,
            seed=choice_seed(body.seed, choice), logprobs=logprobs, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logit_bias=bias,
            prompt_logprobs=prompt_logprobs, structured_output=grammar, **given)
    except InvalidRequest as e:
        raise APIError(400, str(e), body.client_params().get(e.param, e.param)) from None


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _tenant(request: Request) -> str:
    return request.scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)


async def _body(request: Request, model):
    return parse_body(await request.body(), model)


async def _generate(request: Request, body: SamplingFields, kind: str, prompts: list, max_tokens: int,
                    logprobs: int | None, top_logprobs: int | None = None, echo: Echo | None = None,
                    tools: CallFormat | None = None, reasoning: Reasoning | None = None, forced: str | None = None,
                    grammar_after: str | None = None):
    """Prompts x n choices -> one group of engine requests, answered as one response or stream."""
    state = _state(request)
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    group_id, client_id = prefix + uuid.uuid4().hex, body.client_request_id()
    rid = client_id or group_id  # the response's id
    prompt_logprobs = logprobs if echo is not None else None
    subs = [Submission(p, sampling_params(body, i, max_tokens, logprobs, prompt_logprobs, grammar_after))
            for p in prompts for i in range(body.n)]
    builder = ResponseBuilder(kind, rid, body.model or state.model_name, int(time.time()), body.n,
                              state.token_text, _tenant(request), top_logprobs, echo, tools, reasoning, forced)
    builder.continuous_usage = body.continuous_usage
    builder.max_calls = None if getattr(body, "parallel_tool_calls", True) else 1
    job = Job(RequestGroup(group_id, len(subs), client_id), subs, _tenant(request), body.cache_salt, builder, body.stream,
              body.include_usage, body.client_params())
    if state.disagg is not None or body.disaggregation is not None:
        return await disagg.serve(state, request, job, body.disaggregation, prompts)
    return await run(request, state.loop, job, state.metrics)


async def completions(request: Request):
    state = _state(request)
    body = await _body(request, CompletionRequest)
    state.check_model(body.model)
    prompts = body.prompts()
    limit = state.settings.max_prompts_per_request
    if len(prompts) > limit:
        raise bad_request(f"a request may carry at most {limit} prompts (--max-prompts-per-request), got "
                          f"{len(prompts)}", "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else (
        state.settings.default_max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
    ids = await state.pooled(completion_prompt_ids, prompts, state.max_model_len, body.truncate_prompt_tokens,
                             body.add_special_tokens)
    echo = None
    if body.echo:  # vLLM: max_tokens 0 scores the prompt only (one token is generated, then dropped)
        echo = Echo([p if isinstance(p, str) else state.token_text.text(p) for p in prompts], max_tokens == 0)
        max_tokens = max(max_tokens, 1)
    return await _generate(request, body, "completion", ids, max_tokens, body.logprobs, echo=echo)


async def chat_completions(request: Request):
    state = _state(request)
    body = await _body(request, ChatCompletionRequest)
    state.check_model(body.model)
    forced = body.forced_tool  # a forced call is JSON under a schema, not the model's own call format
    call_format = TOOL_CALL_FORMATS.get(state.engine.model_config.model_type) if body.parse_tool_calls else None
    if body.parse_tool_calls and forced is None and call_format is None:
        raise bad_request(f"tools: no tool-call parser for model_type {state.engine.model_config.model_type!r} "
                          f"(parsed: {', '.join(TOOL_CALL_FORMATS)})", "tools")
    if call_format is not None:  # each value read as the type its parameter declares (a string stays one)
        call_format = call_format.for_tools(body.tools)
    truncate = body.truncate_prompt_tokens
    in_prompt = body.tools_in_prompt(state.settings.exclude_tools_when_tool_choice_none)
    prompt, text = await state.pooled(chat_prompt_ids, *state.chat_inputs(body, body.tools if in_prompt else None),
                                      None if truncate is not None else state.max_model_len)
    if truncate is not None:  # the engine's left truncation, done here so that it never walks a long prompt
        prompt = prompt[-(state.max_model_len if truncate == -1 else truncate):]
    reasoning = after = None
    if state.settings.reasoning_parser is not None:
        reasoning = Reasoning(prompt_opens_reasoning(text), body.include_reasoning)
        grammar = body.engine_structured_output()
        if reasoning.opened and grammar is not None and grammar["type"] in ("json_object", "json_schema"):
            after = THINK_CLOSE  # vLLM's way: think freely, then answer under the JSON grammar
    max_tokens = body.max_new_tokens
    if max_tokens is None:  # vLLM: the rest of the context; here also capped by the KV pool
        max_tokens = state.settings.default_max_tokens or max(
            1, min(state.context_limit - len(prompt), state.chat_default_cap))
    return await _generate(request, body, "chat", [prompt], max_tokens, body.num_logprobs, body.top_logprobs,
                           tools=None if forced is not None else call_format, reasoning=reasoning, forced=forced,
                           grammar_after=after)


async def tokenize(request: Request):
    """vLLM's /tokenize. No token limit (a client asks how long its prompt is); the body cap bounds
    the work, done in the tokenizer pool, JSON included."""
    state = _state(request)
    body = await _body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        if body.add_special_tokens:
            raise bad_request("add_special_tokens: the chat template writes the special tokens; only false is "
                              "accepted with messages", "add_special_tokens")
        inputs = state.chat_inputs(body, body.tools)
        content = await state.pooled(_tokenize_answer, inputs, None, False, state.max_model_len)
    elif state.tokenizer is None:
        raise bad_request("this model has no tokenizer", "prompt")
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        content = await state.pooled(_tokenize_answer, None, body.prompt, special, state.max_model_len)
    return Response(content, media_type="application/json")


def _tokenize_answer(encoder: Encoder, chat_inputs: tuple | None, prompt: str | None, add_special_tokens: bool,
                     max_model_len: int) -> str:
    if chat_inputs is not None:
        tokens, _ = chat_prompt_ids(encoder, *chat_inputs, None)
    else:
        tokens = encode_text(encoder, prompt, "prompt", add_special_tokens)
    return f'{{"count":{len(tokens)},"max_model_len":{max_model_len},"tokens":{ids_json(tokens)}}}'


async def reset_prefix_cache(request: Request):
    """vLLM's POST /reset_prefix_cache (SGLang: /flush_cache), scoped to the caller: it forgets the
    caller's tenant's cached prompts in every tier (pool, host, disk), never another tenant's."""
    tenant, state = _tenant(request), _state(request)
    try:
        pages = await state.loop.call(state.engine.reset_prefix_cache, tenant)
    except (ShuttingDown, EngineDead) as e:
        raise APIError(503, str(e)) from None
    return {"tenant": tenant, "pages_removed": pages}


async def abort_request(request: Request):
    """SGLang's POST /abort_request, scoped to the caller: it ends the caller's tenant's request named
    `rid` (or, with `abort_all`, every one of them) with finish_reason "abort" and what it generated so
    far, and frees its pages. An RL trainer ends the rollouts it no longer needs this way. A request
    that already finished is not an error: it is not counted (`aborted`: how many were in flight). On a
    decode worker that includes requests still in their KV transfer (docs/disaggregation.md)."""
    body = await _body(request, AbortRequest)
    tenant, state = _tenant(request), _state(request)
    client_id = None if body.abort_all else body.rid
    # NOTE: the rooms first, with no await before the engine's abort is queued: a request leaving its
    # transfer is either still a room here or already added to the engine, ahead of that abort
    in_transfer = state.disagg.abort_in_transfer(tenant, client_id) if state.disagg is not None else 0
    try:
        aborted = in_transfer + await state.loop.abort_requests(tenant, client_id)
    except (ShuttingDown, EngineDead) as e:
        raise APIError(503, str(e)) from None
    return {"success": True, "aborted": aborted}


async def detokenize(request: Request):
    state = _state(request)
    body = await _body(request, DetokenizeRequest)
    state.check_model(body.model)
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    return {"prompt": await state.pooled(_detokenize, body.tokens, state.engine.model_config.vocab_size)}


def _detokenize(encoder: Encoder, tokens: list[int], vocab: int) -> str:
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return encoder.decode(tokens)


async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.settings.served_model_names]}


async def model(request: Request):
    """OpenAI's retrieve-a-model (`client.models.retrieve`): one of the served names, else 404."""
    state = _state(request)
    name = request.path_params["model"]
    state.check_model(name)
    return _model_card(state, name)


def _model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sparsekv",
            "root": state.engine.config.model, "max_model_len": state.max_model_len,
            "vocab_size": state.engine.model_config.vocab_size}


async def disaggregation(request: Request):
    """This worker's prefill/decode role and load, for `sparsekv router`."""
    return disagg.describe(_state(request))


async def server_info(request: Request):
    """SGLang's GET /server_info (older name /get_server_info): the server's settings and its live
    state. SGLang's `bench_serving` reads `internal_states[0]["avg_spec_accept_length"]` (vLLM's mean
    acceptance length; 0 before any drafting, or without it); an RL trainer reads `tp_size` and `dp_size`."""
    state = _state(request)
    stats = state.loop.stats()
    total = stats.get("kv_pages_total") or 0
    live = {"avg_spec_accept_length": stats.get("spec_decode_mean_acceptance_length", 0.0),
            "num_running_reqs": stats.get("running", 0), "num_waiting_reqs": stats.get("waiting", 0),
            "kv_cache_usage": 1.0 - stats.get("kv_pages_free", total) / total if total else 0.0,
            "weights_version": stats.get("weights_version", 0), "paused": stats.get("paused", False)}
    role = state.settings.disaggregation
    return {"version": importlib.metadata.version("sparsekv"), "model_path": state.engine.config.model,
            "served_model_names": list(state.settings.served_model_names), "max_model_len": state.max_model_len,
            "disaggregation_mode": role.mode if role is not None else "null", **state.cache_config,
            # SGLang's names: a trainer sizes its weights update group from them (each process joins it)
            "tp_size": state.engine.config.tensor_parallel_size, "dp_size": state.engine.config.data_parallel_size,
            "internal_states": [live]}


async def version(request: Request):
    return {"version": importlib.metadata.version("sparsekv")}


async def health(request: Request):
    return _unhealthy(_state(request).loop) or {"status": "ok"}


def _unhealthy(loop) -> JSONResponse | None:
    if loop.dead is not None:
        return JSONResponse({"status": "engine_dead", "error": repr(loop.dead)}, status_code=503)
    if loop.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not loop.healthy:
        return JSONResponse({"status": "engine_stopped"}, status_code=503)
    return None


async def health_generate(request: Request):
    """SGLang's: /health, and then whether the engine generates (probe.py): 200 `{"status": "ok"}`,
    else 503 with the error envelope saying why."""
    state = _state(request)
    down = _unhealthy(state.loop)
    if down is not None:
        return down
    failure = await state.probe.failure()
    if failure is not None:
        return JSONResponse({**error_body(503, failure), "status": "not_generating"}, status_code=503)
    return {"status": "ok"}


async def metrics(request: Request):
    """Aggregate series for anyone, as in vLLM. Per-tenant series tell one tenant's prompt lengths and
    cache hits to whoever scrapes, so they go only to a scrape with a --metrics-api-key, or to any
    scrape when the server has no --api-key (one tenant, nobody else's activity to tell)."""
    state = _state(request)
    keys = state.settings.metrics_api_keys
    per_tenant = not state.settings.api_keys or tenant_for(keys, request.headers.get("authorization")) is not None
    return Response(state.metrics.render(per_tenant), media_type=CONTENT_TYPE_LATEST)


ROUTES = [("/v1/completions", completions, ["POST"]), ("/v1/chat/completions", chat_completions, ["POST"]),
          ("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"]),
          ("/reset_prefix_cache", reset_prefix_cache, ["POST"]), ("/abort_request", abort_request, ["POST"]),
          ("/generate", generate, ["POST"]),
          ("/v1/models", models, ["GET"]), ("/v1/models/{model:path}", model, ["GET"]), ("/health", health, ["GET", "HEAD"]),
          ("/ping", health, ["GET", "POST"]), ("/health_generate", health_generate, ["GET", "POST"]),
          ("/metrics", metrics, ["GET"]), ("/server_info", server_info, ["GET"]), ("/get_server_info", server_info, ["GET"]),
          ("/version", version, ["GET"]), ("/disaggregation", disaggregation, ["GET"])]


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The app for one engine. The engine loop thread starts and stops with the app's lifespan."""
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        try:
            yield
        except asyncio.CancelledError:  # a forced exit (a third signal): uvicorn skips the lifespan's end
            log.warning("forced exit: the requests in flight were cut off")
        finally:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.loop.abort_all("the server is shutting down"), 5.0)
            state.loop.stop()
            with contextlib.ExitStack() as stack:  # run last-registered first, each also when one before it raised
                if not state.loop.healthy:  # the loop thread is gone: nothing else touches the engine
                    stack.callback(engine.close)
                if state.tokenizing is not None:
                    stack.callback(state.tokenizing.close)
                if state.disagg is not None:
                    stack.callback(state.disagg.close)
                stack.callback(state.weight_groups.close)

    app = FastAPI(title="sparsekv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    from .admin import ADMIN_ROUTES
    for path, fn, methods in ROUTES + ADMIN_ROUTES + WEIGHT_GROUP_ROUTES:
        app.add_api_route(path, fn, methods=methods)
    app.add_exception_handler(APIError, lambda req, exc: error_response(exc))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, keys=settings.api_keys, admin_keys=settings.admin_api_keys)  # added last: runs first, before any body is read
    return app


def _http_error(request: Request, exc: StarletteHTTPException):
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _internal_error(request: Request, exc: Exception):
    return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)
