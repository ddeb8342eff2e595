"""The server's rules at their edges, each test failing on a small change to
sparsekv/server/{protocol,loop,serving,auth}.py that the end-to-end tests let through: request ranges
and the fields accepted only at their do-nothing value, the engine loop's queue bounds, aborts,
draining and failures, the status each refusal maps to, and which keys open which routes.

No live server and no model: request bodies go through `parse_body` (what every route calls first),
the engine loop runs on a fake engine that only queues (as in test_server_lifecycle), and the auth
middleware answers through an ASGI transport in this process. Each test runs in well under a second.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from sparsekv.sampling_params import MAX_N, InvalidRequest, SamplingParams
from sparsekv.server.errors import APIError
from sparsekv.server.protocol import (INT64_MAX, INT64_MIN, MAX_JSON_DEPTH, ChatCompletionRequest,
                                      CompletionRequest, TokenizeRequest, parse_body)

OK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f"}}


def _parse(body: dict, model=CompletionRequest):
    return parse_body(json.dumps(body).encode(), model)


def _refused(body: dict, model, param: str) -> str:
    with pytest.raises(APIError) as e:
        _parse(body, model)
    assert e.value.status == 400 and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    return e.value.message


# -- protocol.py: the edges of each range are in it ------------------------------------------------

@pytest.mark.parametrize("model,body", [
    (CompletionRequest, {**OK, "n": MAX_N}),
    (CompletionRequest, {**OK, "truncate_prompt_tokens": -1}),  # vLLM's "-1: truncate to max_model_len"
    (CompletionRequest, {**OK, "truncate_prompt_tokens": 1}),
    (ChatCompletionRequest, {**MSG, "logprobs": True, "top_logprobs": 0}),
    (ChatCompletionRequest, {**MSG, "top_logprobs": 0}),  # asks for nothing: no logprobs needed (vLLM)
], ids=["n-max", "truncate-minus-1", "truncate-1", "top_logprobs-0", "top_logprobs-0-alone"])
def test_the_edges_of_each_range_are_accepted(model, body):
    """The last value inside each range is a valid request (OpenAI and vLLM take it): an off-by-one in a
    bound would refuse n=128, truncate_prompt_tokens=-1, or top_logprobs 0. (The seed's edges are
    test_server_api's test_n_choices_and_seed_reproducible; top_logprobs' upper bound is the engine's
    max_logprobs, test_server_api's test_max_logprobs_bounds_each_request.)"""
    _parse(body, model)


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {**OK, "n": MAX_N + 1}, "n"),
    (CompletionRequest, {**OK, "seed": INT64_MAX + 1}, "seed"),
    (CompletionRequest, {**OK, "seed": INT64_MIN - 1}, "seed"),
    (CompletionRequest, {**OK, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    (CompletionRequest, {**OK, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),  # the server cuts first
    (ChatCompletionRequest, {**MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
], ids=["n-over", "seed-over", "seed-under", "truncate-minus-2", "truncate-0", "top_logprobs-negative"])
def test_one_past_each_edge_is_refused(model, body, param):
    _refused(body, model, param)


# -- protocol.py: UNSUPPORTED fields at their do-nothing value are accepted --------------------------

@pytest.mark.parametrize("field,harmless,harmful", [
    ("tool_choice", "none", "auto"),
    ("function_call", "none", "auto"),
    ("best_of", 1, 2),
    ("spaces_between_special_tokens", True, False),
    ("priority", 0, -1),
    ("detokenize", True, False),
    ("truncation_side", "left", "right"),
    ("length_penalty", 1, 2),
    ("echo", False, True),
])
def test_an_unsupported_field_at_its_do_nothing_value_is_accepted(field, harmless, harmful):
    """Clients that send every field send these at their default: refusing the default would break them,
    accepting anything else would answer a question the client did not ask. (echo: chat has none.)"""
    model, body = (ChatCompletionRequest, MSG) if field == "echo" else (CompletionRequest, OK)
    _parse({**body, field: harmless}, model)
    _refused({**body, field: harmful}, model, field)


def test_chat_add_special_tokens_false_is_accepted():
    """Chat's template writes the special tokens; add_special_tokens=false (vLLM's chat default) is the
    do-nothing value and must pass, true is refused."""
    _parse({**MSG, "add_special_tokens": False}, ChatCompletionRequest)
    _refused({**MSG, "add_special_tokens": True}, ChatCompletionRequest, "add_special_tokens")


@pytest.mark.parametrize("model,body,field,default", [
    (CompletionRequest, OK, "ignore_eos", False),
    (CompletionRequest, OK, "return_routed_experts", False),
    (ChatCompletionRequest, MSG, "include_reasoning", True),
    (ChatCompletionRequest, MSG, "parallel_tool_calls", True),
])
def test_null_means_the_default_for_every_nullable_field(model, body, field, default):
    """null is the default for each NULL_IS_DEFAULT field, not a 400 ("input should be a valid boolean")."""
    assert getattr(_parse({**body, field: None}, model), field) is default


def test_response_format_text_is_free_text():
    """{"type": "text"} is OpenAI's default: no grammar, and it may be combined with guided_* fields."""
    body = _parse({**MSG, "response_format": {"type": "text"}}, ChatCompletionRequest)
    assert body.engine_structured_output() is None
    both = _parse({**OK, "response_format": {"type": "text"}, "guided_regex": "a+"})
    assert both.engine_structured_output() == {"type": "regex", "pattern": "a+"}


def _message(**fields) -> dict:
    """The one message of a parsed chat request, as the chat template is given it."""
    body = _parse({**MSG, "messages": [{"role": "assistant", **fields}]}, ChatCompletionRequest)
    return body.messages[0].template_dict()


def test_a_text_part_without_text_is_refused_as_a_part_that_is_not_text():
    """Text parts join into the message's content; one without its text is the ValueError the chat
    route turns into a 400 on messages (not a TypeError, a 500)."""
    assert _message(content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])["content"] == "ab"
    with pytest.raises(ValueError, match="only text content parts"):
        _message(content=[{"type": "text", "text": "a"}, {"type": "text"}])


def test_earlier_reasoning_reaches_the_template_by_either_name_reasoning_content_first():
    """vLLM's `reasoning` and the older `reasoning_content` both reach the template as reasoning_content;
    given both, reasoning_content is the one rendered."""
    assert _message(content="2", reasoning="one plus one")["reasoning_content"] == "one plus one"
    assert _message(content="2", reasoning_content="r-c")["reasoning_content"] == "r-c"
    assert _message(content="2", reasoning_content="r-c", reasoning="r")["reasoning_content"] == "r-c"
    assert "reasoning_content" not in _message(content="2")


def test_an_earlier_calls_json_arguments_reach_the_template_as_a_mapping():
    """OpenAI sends a call's arguments as JSON text; templates iterate them as a mapping (DeepSeek-V3.2's
    writes one DSML parameter per key). Text that is not JSON reaches the template as it came."""
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris", "days": 3}'}}
    [rendered] = _message(content="", tool_calls=[call])["tool_calls"]
    assert rendered == {"id": "a", "type": "function",
                        "function": {"name": "f", "arguments": {"city": "Paris", "days": 3}}}
    broken = {**call, "function": {"name": "f", "arguments": "{not json"}}
    assert _message(content="", tool_calls=[broken])["tool_calls"][0]["function"]["arguments"] == "{not json"

def test_max_completion_tokens_wins_over_the_deprecated_max_tokens():
    """OpenAI's max_completion_tokens replaces max_tokens (vLLM reads it first): given both, it bounds the
    completion; max_tokens alone still does."""
    assert _parse({**MSG, "max_tokens": 5, "max_completion_tokens": 3}, ChatCompletionRequest).max_new_tokens == 3
    assert _parse({**MSG, "max_tokens": 5}, ChatCompletionRequest).max_new_tokens == 5

def test_a_json_schema_response_format_is_held_to_its_inner_schema():
    """OpenAI's {"type": "json_schema", "json_schema": {"name", "schema"}}: the grammar is the schema
    inside, not the wrapper (whose "name" and "schema" keys would constrain nothing)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    wrapped = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    body = _parse({**MSG, "response_format": wrapped}, ChatCompletionRequest)
    assert body.engine_structured_output() == {"type": "json_schema", "schema": schema}
    as_object = _parse({**OK, "response_format": {"type": "json_object"}})
    assert as_object.engine_structured_output() == {"type": "json_object"}

def test_a_tool_must_be_of_type_function():
    """A tool of another type (OpenAI's built-in ones) is not a function this server can call: refused,
    not treated as one."""
    _refused({**MSG, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, ChatCompletionRequest, "tools")


def test_continuous_usage_needs_include_usage():
    """vLLM's continuous_usage_stats adds usage to every chunk only with include_usage."""
    base = {**MSG, "stream": True}
    alone = _parse({**base, "stream_options": {"continuous_usage_stats": True}}, ChatCompletionRequest)
    assert not alone.include_usage and not alone.continuous_usage
    both = _parse({**base, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                  ChatCompletionRequest)
    assert both.include_usage and both.continuous_usage


def test_continue_final_message_needs_add_generation_prompt_false():
    """Both true would render a new assistant turn after the message to continue (vLLM refuses it too)."""
    with pytest.raises(APIError) as e:  # add_generation_prompt defaults to true
        _parse({**MSG, "continue_final_message": True}, ChatCompletionRequest)
    assert e.value.status == 400 and "continue_final_message" in e.value.message
    _parse({**MSG, "continue_final_message": True, "add_generation_prompt": False}, ChatCompletionRequest)


def test_chat_template_kwargs_cannot_set_what_the_server_decides():
    """chat_template_kwargs may add variables for the template, never override the messages or tools
    the template is given, nor add_generation_prompt (a request field)."""
    for key in ("messages", "tools", "add_generation_prompt"):
        _refused({**MSG, "chat_template_kwargs": {key: 1}}, ChatCompletionRequest, "chat_template_kwargs")
    assert _parse({**MSG, "chat_template_kwargs": {"thinking": True}},
                  ChatCompletionRequest).template_options()["thinking"] is True


def test_tokenize_takes_a_prompt_or_messages_not_both():
    _refused({"prompt": "hi", "messages": MSG["messages"]}, TokenizeRequest, "prompt")
    _parse({"prompt": "hi"}, TokenizeRequest)
    _parse({"messages": MSG["messages"]}, TokenizeRequest)


def _nested(depth: int, opening: bytes = b"[", leaf: bytes = b"1", closing: bytes = b"]") -> bytes:
    """A body whose field "foo" holds `depth` nested containers around a leaf: lists by default,
    objects with `opening=b'{"k": '` and `closing=b"}"`."""
    return b'{"prompt": "x", "foo": ' + opening * depth + leaf + closing * depth + b"}"


@pytest.mark.parametrize("opening, closing", [(b"[", b"]"), (b'{"k": ', b"}")], ids=["lists", "objects"])
@pytest.mark.parametrize("leaf", [b"1", b'"text"'])
def test_nesting_up_to_the_bound_is_accepted_and_one_deeper_is_refused(opening, closing, leaf):
    """A field may nest MAX_JSON_DEPTH containers, lists or objects alike, whatever leaf the innermost
    holds (keys and leaves are no level of their own); one more is a 400 naming the field."""
    parse_body(_nested(MAX_JSON_DEPTH, opening, leaf, closing), CompletionRequest)
    with pytest.raises(APIError) as e:
        parse_body(_nested(MAX_JSON_DEPTH + 1, opening, leaf, closing), CompletionRequest)
    assert e.value.status == 400 and e.value.param == "foo"


@pytest.mark.parametrize("field,value", [
    ("guided_json", {"type": "object", "properties": {"\ud800": {"type": "string"}}}),
    ("chat_template_kwargs", {"\udfff": True}),
])
def test_a_lone_surrogate_in_an_objects_key_is_refused_as_in_its_values(field, value):
    """A dict's keys reach grammar compilers and chat templates as its values do: a lone UTF-16
    surrogate escaped in a key ("\\ud800") is the same 400 naming the field, not an error from deep
    inside the compiler or the template."""
    model, base = (ChatCompletionRequest, MSG) if field == "chat_template_kwargs" else (CompletionRequest, OK)
    raw = json.dumps({**base, field: value}).encode()
    assert b"\\ud" in raw  # escaped, as a client's JSON encoder writes it
    with pytest.raises(APIError) as e:
        parse_body(raw, model)
    assert e.value.status == 400 and e.value.param == field and "lone UTF-16 surrogate" in e.value.message


def test_a_disaggregation_bootstrap_port_is_a_real_port():
    """Port 0 is no address to fetch KV from; 1 and 65535 are."""
    spec = {"room": "r1", "bootstrap_host": "10.0.0.1"}
    for port in (1, 65535):
        assert _parse({**OK, "disaggregation": {**spec, "bootstrap_port": port}}).disaggregation.bootstrap_port == port
    for port in (0, 65536):
        _refused({**OK, "disaggregation": {**spec, "bootstrap_port": port}}, CompletionRequest,
                 "disaggregation.bootstrap_port")


# -- loop.py: the engine loop's bookkeeping, on an engine that only queues -------------------------

class _QueueOnlyEngine:
    """What EngineLoop touches: requests queue and are never stepped (unless `step_error` is set, then
    the first step raises it, as a failing engine's would)."""

    def __init__(self, fail_add_at: int | None = None, step_error: BaseException | None = None):
        self.queued: list[tuple[str, str]] = []  # (request id, tenant)
        self.aborted: list[str] = []
        self.fail_add_at, self.step_error, self.adds = fail_add_at, step_error, 0

    def stats(self) -> dict:
        return {}

    def has_unfinished_requests(self) -> bool:
        return self.step_error is not None and bool(self.queued)

    def step(self):
        raise self.step_error

    def num_waiting_requests(self, tenant=None) -> int:
        return sum(tenant is None or t == tenant for _, t in self.queued)

    def add_request(self, rid, prompt, params, tenant, cache_salt, first_token):
        self.adds += 1
        if self.adds == self.fail_add_at:
            raise InvalidRequest("this prompt cannot be served", "prompt")
        self.queued.append((rid, tenant))
        return object()

    def abort(self, rid) -> bool:
        self.aborted.append(rid)
        before = len(self.queued)
        self.queued = [q for q in self.queued if q[0] != rid]
        return len(self.queued) < before

    def check_ranks(self) -> None:
        pass

    def expire_prefix_cache(self) -> int:
        return 0


class _Metrics:
    def __init__(self):
        self.aborted, self.rejected = [], []

    def abort(self, reason, count=1):
        self.aborted.append((reason, count))

    def reject(self, reason):
        self.rejected.append(reason)


@pytest.fixture
def on_loop(monkeypatch):
    """Runs `scenario(loop, engine, submit)` against a started EngineLoop on a _QueueOnlyEngine."""
    from sparsekv.server.loop import DELAY_ENV, FAULT_ENV, EngineLoop, RequestGroup, Submission
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.delenv(DELAY_ENV, raising=False)

    def go(scenario, engine=None, **loop_options):
        engine = engine or _QueueOnlyEngine()
        counter = iter(range(1000))

        async def main():
            loop = EngineLoop(engine, **loop_options)
            loop.start()

            async def submit(n, tenant="alice"):
                group = RequestGroup(f"g{next(counter)}", n)
                await loop.submit(group, [Submission([1, 2, 3], SamplingParams(max_tokens=2))] * n, tenant, None)
                return group
            try:
                await asyncio.wait_for(scenario(loop, engine, submit), 10)
            finally:
                loop.stop()
        asyncio.run(main())
        return engine
    return go


def test_with_both_queue_bounds_the_smaller_decides_what_can_never_fit(on_loop):
    """--max-queued-requests 4 and a per-tenant bound of 2: n = 3 can never be admitted for one tenant,
    so it is a 400 (InvalidRequest), not a 503 QueueFull that a client would retry forever."""
    async def scenario(loop, engine, submit):
        with pytest.raises(InvalidRequest, match="3 sequences.*more than the 2"):
            await submit(3)
        assert engine.queued == []
        await submit(2)
    on_loop(scenario, max_queued_requests=4, max_queued_per_tenant=2)


def test_health_generate_on_a_full_queue_of_a_stuck_engine_says_so(on_loop):
    """Nothing steps and --max-queued-requests is reached: the probe's one-token request is refused
    with QueueFull, which /health_generate answers as a 503 with that reason (not a 500 from an
    exception the probe let through); the refused probe leaves the engine's queue as it was."""
    from sparsekv.server.probe import GenerateProbe

    async def scenario(loop, engine, submit):
        await submit(1)
        probe = GenerateProbe(loop, timeout_s=5.0)
        failure = await probe.failure()
        assert failure is not None and "request queue is full (1 requests waiting)" in failure
        assert probe.generations == 1 and len(engine.queued) == 1
    on_loop(scenario, max_queued_requests=1)


def test_abort_takes_the_groups_requests_out_of_the_engine(on_loop):
    """A client gone (loop.abort) frees its requests in the engine, all n of them."""
    async def scenario(loop, engine, submit):
        kept, gone = await submit(1, "bob"), await submit(2)
        assert len(engine.queued) == 3 and loop.num_active == 3
        loop.abort(gone)
        await loop.call(lambda: None)  # commands run in order: the abort has run
        assert engine.queued == [(kept.request_ids[0], "bob")] and loop.num_active == 1
    on_loop(scenario)


def test_abort_all_aborts_every_request_and_tells_each_client_why(on_loop):
    """Shutdown's abort_all: every request leaves the engine (pages freed), each waiting client gets
    ShuttingDown with the reason, and the aborted requests are counted, each sequence once."""
    from sparsekv.server.loop import ShuttingDown
    metrics = _Metrics()

    async def scenario(loop, engine, submit):
        groups = [await submit(1), await submit(2, "bob")]
        await loop.abort_all("the server is going away")
        assert engine.queued == [] and sorted(engine.aborted) == sorted(r for g in groups for r in g.request_ids)
        assert loop.num_active == 0
        for g in groups:
            index, error = await g.queue.get()
            assert index is None and isinstance(error, ShuttingDown) and str(error) == "the server is going away"
        assert metrics.aborted == [("shutdown", 3)]
    on_loop(scenario, metrics=metrics)


def test_a_group_that_fails_to_add_leaves_none_of_its_requests(on_loop):
    """Submission is all or nothing: when the engine refuses the second of three, the first is aborted
    and no route is left behind (it would hold pages and a place in the queue bound)."""
    async def scenario(loop, engine, submit):
        with pytest.raises(InvalidRequest, match="cannot be served"):
            await submit(3)
        assert engine.queued == [] and loop.num_active == 0 and engine.aborted == ["g0-0"]
    on_loop(scenario, engine=_QueueOnlyEngine(fail_add_at=2))


def test_a_draining_loop_admits_nothing_even_what_was_sent_before_the_drain(on_loop):
    """After SIGTERM (draining) a submit is ShuttingDown; so is one that passed the check on the event
    loop but reaches the loop thread after the drain began."""
    from sparsekv.server.loop import ShuttingDown

    async def scenario(loop, engine, submit):
        hold, held = threading.Event(), threading.Event()

        def block():  # keeps the loop thread busy while the submit queues behind it
            held.set()
            hold.wait(5)
        blocker = asyncio.ensure_future(loop.call(block))
        await asyncio.get_running_loop().run_in_executor(None, held.wait, 5)
        late = asyncio.ensure_future(submit(1))
        await asyncio.sleep(0)  # the submit has passed its own check and queued its command
        loop.draining = True
        hold.set()
        await blocker
        with pytest.raises(ShuttingDown):
            await late
        with pytest.raises(ShuttingDown):
            await submit(1)
        assert engine.queued == []
    on_loop(scenario)


@pytest.mark.parametrize("rank_failure", [False, True])
def test_a_step_that_raises_kills_the_loop_and_reaches_every_client(on_loop, rank_failure):
    """engine.step raising: the waiting client gets EngineDead (503 when a rank failed, 500 otherwise),
    the loop reports itself unhealthy (/health 503) and refuses what comes next."""
    from sparsekv.parallel.launch import RankFailure
    from sparsekv.server.loop import EngineDead
    error = RankFailure("rank 1 is gone") if rank_failure else RuntimeError("boom")

    async def scenario(loop, engine, submit):
        assert loop.healthy
        group = await submit(1)
        index, dead = await group.queue.get()
        assert index is None and isinstance(dead, EngineDead) and dead.status == (503 if rank_failure else 500)
        assert not loop.healthy and loop.dead is error
        with pytest.raises(EngineDead):
            await submit(1)
    on_loop(scenario, engine=_QueueOnlyEngine(step_error=error))


class _RanksFailWhileIdle(_QueueOnlyEngine):
    """No request to step; the ranks fail in the call named `failing` (check_ranks or the prefix
    cache's expiry, both of which the idle loop runs)."""

    def __init__(self, failing: str, error: BaseException):
        super().__init__()
        self.failing, self.error, self.idle_calls = failing, error, []

    def check_ranks(self) -> None:
        self.idle_calls.append("check_ranks")
        if self.failing == "check_ranks":
            raise self.error

    def expire_prefix_cache(self) -> int:
        self.idle_calls.append("expire_prefix_cache")
        if self.failing == "expire_prefix_cache":
            raise self.error
        return 0


@pytest.mark.parametrize("failing", ["check_ranks", "expire_prefix_cache"])
def test_ranks_that_fail_while_nothing_runs_kill_the_loop(on_loop, failing):
    """Idle, the loop still looks at the ranks and runs the prefix cache's expiry: a rank that died
    while nothing ran turns /health to 503 and refuses the next request (503), with the loop thread
    still answering, rather than failing that request."""
    from sparsekv.parallel.launch import RankFailure
    from sparsekv.server.loop import EngineDead
    error = RankFailure("rank 1 is gone")
    engine = _RanksFailWhileIdle(failing, error)

    async def scenario(loop, engine, submit):
        while loop.dead is None:  # bounded by on_loop's wait
            await asyncio.sleep(0.01)
        assert loop.dead is error and not loop.healthy and loop._thread.is_alive()
        assert engine.idle_calls[:2] == (["check_ranks"] if failing == "check_ranks" else ["check_ranks", failing])
        with pytest.raises(EngineDead):
            await submit(1)
        await loop.abort_all("the server is going away")  # the loop thread still answers
    on_loop(scenario, engine=engine)


class _FailsOutsideAStep(_QueueOnlyEngine):
    """`has_unfinished_requests` raises once a request is queued: an engine error outside any step."""

    def has_unfinished_requests(self) -> bool:
        if self.queued:
            raise RuntimeError("the scheduler's state is broken")
        return False


def test_an_engine_error_outside_a_step_fails_the_requests_instead_of_ending_the_loop(on_loop):
    """Any error of the engine on the loop thread, not only a rank's failure, kills the loop as a failed
    step does: the waiting request gets the error (500), /health turns 503, the next request is refused,
    and the thread still answers. The loop thread ended before, and the request waited for ever."""
    from sparsekv.server.loop import EngineDead

    async def scenario(loop, engine, submit):
        group = await submit(1)
        index, dead = await group.queue.get()
        assert index is None and isinstance(dead, EngineDead) and dead.status == 500
        assert "scheduler's state is broken" in str(dead)
        assert not loop.healthy and loop._thread.is_alive()
        with pytest.raises(EngineDead):
            await submit(1)
        await loop.abort_all("the server is going away")  # the loop thread still answers
    on_loop(scenario, engine=_FailsOutsideAStep())


def test_paused_generation_steps_nothing_until_it_continues(on_loop):
    """/pause_generation: requests wait with their KV kept; the loop steps none of them (a step here
    raises) until generation continues."""
    from sparsekv.server.loop import EngineDead
    engine = _QueueOnlyEngine(step_error=RuntimeError("stepped"))
    engine.paused = True

    async def scenario(loop, engine, submit):
        group = await submit(1)
        for _ in range(3):  # each round trip is one more turn of the loop, which must not step
            await loop.call(lambda: None)
        assert loop.dead is None and loop.num_active == 1 and group.queue.empty()
        engine.paused = False
        await loop.call(lambda: None)
        index, dead = await group.queue.get()
        assert index is None and isinstance(dead, EngineDead) and "stepped" in str(dead)
    on_loop(scenario, engine=engine)


class _StepsThenRanksFail(_QueueOnlyEngine):
    """Each step outputs one token of every queued request, unfinished; the figures read after the
    first step find the ranks gone."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error, self.steps = error, 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.queued) and self.steps == 0

    def step(self):
        from types import SimpleNamespace
        self.steps += 1
        return [SimpleNamespace(request_id=rid, finished=False) for rid, _ in self.queued]

    def stats(self) -> dict:
        if self.steps:
            raise self.error
        return {}


def test_a_steps_outputs_reach_their_clients_when_the_ranks_fail_after_it(on_loop):
    """The step ran; reading the figures after it found a rank gone: the client gets the step's output,
    then EngineDead (503), and no request is left routed."""
    from sparsekv.parallel.launch import RankFailure
    from sparsekv.server.loop import EngineDead
    error = RankFailure("rank 1 is gone")

    async def scenario(loop, engine, submit):
        group = await submit(1)
        index, out = await group.queue.get()
        assert index == 0 and out.request_id == group.request_ids[0] and not out.finished
        index, dead = await group.queue.get()
        assert index is None and isinstance(dead, EngineDead) and dead.status == 503
        assert loop.dead is error and loop.num_active == 0
    on_loop(scenario, engine=_StepsThenRanksFail(error))


class _OneRequestAStep(_QueueOnlyEngine):
    """Step k schedules and finishes the k-th queued request, at time k + 1 (first_scheduled_time)."""

    def __init__(self):
        super().__init__()
        self.requests, self.steps = {}, 0

    def add_request(self, rid, prompt, params, tenant, cache_salt, first_token):
        from types import SimpleNamespace
        super().add_request(rid, prompt, params, tenant, cache_salt, first_token)
        self.requests[rid] = SimpleNamespace(first_scheduled_time=None)
        return self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        return self.steps < len(self.queued)

    def step(self):
        from types import SimpleNamespace
        rid = self.queued[self.steps][0]
        self.steps += 1
        self.requests[rid].first_scheduled_time = float(self.steps)
        return [SimpleNamespace(request_id=rid, finished=True)]


def test_a_groups_queue_time_ends_when_its_first_request_was_scheduled(on_loop):
    """n = 2 scheduled one step apart: the group's first_scheduled (its queue time in the workers'
    figures) is its first request's, not the last one's to output."""
    async def scenario(loop, engine, submit):
        group = await submit(2)
        got = [await group.queue.get() for _ in range(2)]
        assert [i for i, _ in got] == [0, 1] and group.done and loop.num_active == 0
        assert group.first_scheduled == 1.0
    on_loop(scenario, engine=_OneRequestAStep())


def test_a_client_gone_counts_only_the_sequences_the_engine_still_had(on_loop):
    """loop.abort of a group of 3 whose first request the engine no longer has: 2 counted as aborted."""
    metrics = _Metrics()

    async def scenario(loop, engine, submit):
        group = await submit(3)
        engine.queued = [q for q in engine.queued if q[0] != group.request_ids[0]]
        loop.abort(group)
        await loop.call(lambda: None)
        assert metrics.aborted == [("client_disconnect", 2)] and loop.num_active == 0
    on_loop(scenario, metrics=metrics)


def test_a_failed_step_counts_each_request_it_cut_as_an_engine_fault_abort(on_loop):
    """The requests a failed step leaves without an answer are counted, each sequence once, under
    requests_aborted_total{reason="engine_fault"}."""
    metrics = _Metrics()

    async def scenario(loop, engine, submit):
        group = await submit(2)
        got = [await group.queue.get() for _ in range(2)]
        assert [index for index, _ in got] == [None, None]
        assert metrics.aborted == [("engine_fault", 2)]
    on_loop(scenario, engine=_QueueOnlyEngine(step_error=RuntimeError("boom")), metrics=metrics)


class _Figures(_QueueOnlyEngine):
    """Its figures count what is queued and the prefix-cache pages left; the first idle expiry drops
    those pages (nothing is ever stepped)."""

    def __init__(self, cached_pages: int = 0):
        super().__init__()
        self.cached_pages = cached_pages

    def stats(self) -> dict:
        return {"waiting": len(self.queued), "prefix_cached_pages": self.cached_pages}

    def expire_prefix_cache(self) -> int:
        dropped, self.cached_pages = self.cached_pages, 0
        return dropped


def test_the_figures_are_read_again_after_the_commands_ran_with_nothing_to_step(on_loop):
    """/metrics reads the loop's snapshot of engine.stats(): a request queued while nothing steps
    (a full batch, paused generation) shows in num_requests_waiting without waiting for a step."""
    async def scenario(loop, engine, submit):
        assert loop.stats()["waiting"] == 0
        await submit(2)
        while loop.stats()["waiting"] != 2:  # bounded by on_loop's wait
            await asyncio.sleep(0.01)
    on_loop(scenario, engine=_Figures())


def test_an_idle_expiry_of_prefix_cache_pages_shows_in_the_figures(on_loop):
    """Pages the idle loop's expiry dropped leave prefix_cached_pages with no request and no command."""
    async def scenario(loop, engine, submit):
        while loop.stats()["prefix_cached_pages"] != 0:  # bounded by on_loop's wait
            await asyncio.sleep(0.01)
        assert engine.cached_pages == 0
    engine = _Figures(cached_pages=4)
    on_loop(scenario, engine=engine)


def test_wait_idle_is_false_while_a_request_is_in_flight_and_a_cut_short_drain_ends_at_once(on_loop):
    """The drain's wait: False past its timeout while a request is routed (the caller then aborts it),
    False at once when cut short (a second signal) however long the timeout, True once nothing is left."""
    async def scenario(loop, engine, submit):
        group = await submit(1)
        assert await loop.wait_idle(0) is False
        assert await loop.wait_idle(3600, lambda: True) is False  # a wait for the timeout: on_loop's bound fails it
        loop.abort(group)
        await loop.call(lambda: None)
        assert await loop.wait_idle(0) is True
    on_loop(scenario)


class _StepsAWhile(_QueueOnlyEngine):
    """Once a request is queued, `work` steps that output nothing yet (a long prefill, say)."""

    def __init__(self, work: int):
        super().__init__()
        self.work, self.steps = work, 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.queued) and self.steps < self.work

    def step(self):
        self.steps += 1
        return []


def test_the_loop_never_waits_for_a_command_while_it_has_work(on_loop):
    """Between steps the loop takes the commands already queued without waiting for one: a wait (the idle
    loop's poll) while requests are in flight would stall each of their steps. Counted, not timed: each
    wait for a command is recorded with whether the engine had work then."""
    async def scenario(loop, engine, submit):
        commands, waits = loop._commands, []

        class Watched:  # the loop's command queue, its waits recorded
            def put(self, item):
                commands.put(item)

            def get_nowait(self):
                return commands.get_nowait()

            def get(self, block=True, timeout=None):
                waits.append(engine.has_unfinished_requests())
                return commands.get(block, timeout)
        loop._commands = Watched()
        await submit(1)
        while engine.steps < engine.work:  # bounded by on_loop's wait
            await asyncio.sleep(0.01)
        await loop.call(lambda: None)
        assert waits and not any(waits)
    on_loop(scenario, engine=_StepsAWhile(20))


def test_the_idle_work_runs_only_between_requests_not_beside_each_step(on_loop):
    """The rank check and the prefix cache's expiry are the idle loop's work (a step expires the cache
    itself, and finds a dead rank itself): none runs between two steps of the requests in flight."""
    class Watched(_StepsAWhile):
        def __init__(self, work):
            super().__init__(work)
            self.mid_run = []  # for each idle call: whether it came between the first and the last step

        def check_ranks(self) -> None:
            self.mid_run.append(0 < self.steps < self.work)

        def expire_prefix_cache(self) -> int:
            self.mid_run.append(0 < self.steps < self.work)
            return 0

    async def scenario(loop, engine, submit):
        await submit(1)
        while engine.steps < engine.work:  # bounded by on_loop's wait
            await asyncio.sleep(0.01)
        await loop.call(lambda: None)
        assert engine.mid_run and not any(engine.mid_run)
    on_loop(scenario, engine=Watched(20))


def test_the_injected_fault_fails_exactly_the_nth_step():
    from sparsekv.server.loop import FAULT_ENV, install_test_hooks
    from types import SimpleNamespace
    steps = []
    engine = SimpleNamespace(step=lambda: steps.append(1) or [])
    install_test_hooks(engine, {FAULT_ENV: "3"})
    engine.step()
    engine.step()
    with pytest.raises(RuntimeError, match=FAULT_ENV):
        engine.step()
    assert len(steps) == 2


def test_a_group_is_done_only_when_each_request_finished():
    """An unfinished output must not count: a group counted done too early is never aborted when its
    client goes (loop.abort skips done groups), and its requests run on."""
    from types import SimpleNamespace

    from sparsekv.server.loop import EngineDead, RequestGroup, _put_all

    async def main():
        group = RequestGroup("g", 2)
        _put_all([(group, 0, SimpleNamespace(finished=False)), (group, 1, SimpleNamespace(finished=False)),
                  (group, None, EngineDead("x"))])
        assert group.num_finished == 0 and not group.done
        _put_all([(group, 0, SimpleNamespace(finished=True))])
        assert group.num_finished == 1 and not group.done
        _put_all([(group, 1, SimpleNamespace(finished=True))])
        assert group.done and group.queue.qsize() == 5
    asyncio.run(main())


# -- serving.py: admission refusals map to their status, headers and metrics -------------------------

class _RefusingLoop:
    def __init__(self, error):
        self.error, self.aborted = error, []

    async def submit(self, group, subs, tenant, cache_salt):
        raise self.error

    def abort(self, group):
        self.aborted.append(group)


def _job(param="guided_json"):
    from sparsekv.server.loop import RequestGroup
    from sparsekv.server.serving import Job
    return Job(RequestGroup("g", 1), [], "alice", None, builder=None, stream=False, include_usage=False,
               client_params={"structured_output": param})


def _admit_error(error, param="guided_json"):
    from sparsekv.server.serving import admit
    metrics, job = _Metrics(), _job(param)
    with pytest.raises(APIError) as e:
        asyncio.run(admit(_RefusingLoop(error), job, metrics))
    return e.value, metrics.rejected


def test_admission_refusals_map_to_status_retry_after_and_reason():
    """A full queue and a draining server are 503s a client should retry (Retry-After), each counted
    under its own reason; a dead engine is a 503 without Retry-After; bad input is a 400."""
    from sparsekv.server.loop import EngineDead, QueueFull, ShuttingDown
    full, reasons = _admit_error(QueueFull("full"))
    assert (full.status, full.headers.get("Retry-After"), reasons) == (503, "1", ["queue_full"])
    draining, reasons = _admit_error(ShuttingDown("bye"))
    assert (draining.status, draining.headers.get("Retry-After"), reasons) == (503, "1", ["shutting_down"])
    dead, reasons = _admit_error(EngineDead("gone"))
    assert (dead.status, "Retry-After" in dead.headers, reasons) == (503, False, ["engine_dead"])
    bad, reasons = _admit_error(ValueError("engine internals"))
    assert (bad.status, reasons) == (400, []) and "engine internals" not in bad.message


def test_a_grammar_error_names_the_field_the_client_gave_it_in():
    """The engine says "structured_output"; the client sent guided_json (or tools, response_format)."""
    err, _ = _admit_error(InvalidRequest("the schema does not compile", "structured_output"), "guided_json")
    assert (err.status, err.param) == (400, "guided_json")
    err, _ = _admit_error(InvalidRequest("too long", "max_tokens"), "guided_json")
    assert (err.status, err.param) == (400, "max_tokens")


def test_a_refused_admission_aborts_its_group():
    """run() aborts the group whenever admission fails: the add may have run on the loop thread."""
    from sparsekv.server.loop import QueueFull
    from sparsekv.server.serving import run
    loop, job = _RefusingLoop(QueueFull("full")), _job()
    with pytest.raises(APIError):
        asyncio.run(run(None, loop, job, _Metrics()))
    assert loop.aborted == [job.group]


def test_an_error_item_becomes_its_status():
    """On the group's queue: EngineDead keeps its status (503 for a failed rank, 500 otherwise);
    ShuttingDown (aborted on shutdown) is a 503."""
    from sparsekv.server.loop import EngineDead, ShuttingDown
    from sparsekv.server.serving import _apply
    for error, status in [(EngineDead("rank gone", 503), 503), (EngineDead("step failed", 500), 500),
                          (ShuttingDown("bye"), 503)]:
        with pytest.raises(APIError) as e:
            _apply([], (None, error))
        assert e.value.status == status and e.value.message == str(error)


class _AbortRecordingLoop:
    def __init__(self):
        self.aborted = []

    def abort(self, group):
        self.aborted.append(group)


def test_a_client_gone_before_its_answer_gets_499_and_its_group_is_aborted():
    """A plain (not streamed) response is not cancelled when the client leaves: collect sees the
    disconnect, answers 499 and aborts the group, so its requests stop and free their pages."""
    from types import SimpleNamespace

    from sparsekv.server.loop import RequestGroup
    from sparsekv.server.serving import collect

    async def gone():
        return {"type": "http.disconnect"}

    async def main():
        loop, group = _AbortRecordingLoop(), RequestGroup("g", 1)
        response = await collect(SimpleNamespace(receive=gone), loop, group, [SimpleNamespace(finished=False)], None)
        assert response.status_code == 499 and json.loads(response.body)["error"]["code"] == 499
        assert loop.aborted == [group]
    asyncio.run(main())


def test_a_stream_ends_with_done_after_an_error_and_aborts_its_group_however_it_ends():
    """An error item after the headers went: reported in-band, then [DONE]; the group is aborted when
    the stream ends that way and when the client leaves mid-stream (the generator closed)."""
    from types import SimpleNamespace

    from sparsekv.server.loop import RequestGroup, ShuttingDown
    from sparsekv.server.serving import sse

    class Builder:
        def chunk(self, state, first, include_usage):
            return {"first": first}

    def update(state):
        return lambda out: state.__setattr__("finished", out.finished)

    async def main():
        loop, group = _AbortRecordingLoop(), RequestGroup("g", 1)
        group.queue.put_nowait((None, ShuttingDown("the server is shutting down")))
        events = [e async for e in sse(loop, group, [SimpleNamespace(finished=False)], Builder(), True)]
        assert json.loads(events[0][len("data: "):])["error"]["code"] == 503
        assert events[1:] == ["data: [DONE]\n\n"] and loop.aborted == [group]

        loop, group = _AbortRecordingLoop(), RequestGroup("g", 1)
        state = SimpleNamespace(finished=False)
        state.update = update(state)
        for _ in range(2):
            group.queue.put_nowait((0, SimpleNamespace(finished=False)))
        stream = sse(loop, group, [state], Builder(), False)
        assert [json.loads((await stream.__anext__())[len("data: "):]) for _ in range(2)] == [{"first": True},
                                                                                            {"first": False}]
        await stream.aclose()  # the client went
        assert loop.aborted == [group]
    asyncio.run(main())


# -- auth.py: keys to tenants, admin keys, the middleware ------------------------------------------

def test_a_plain_key_gets_the_tenant_named_by_its_digest():
    """KEY alone: tenant key-<first 8 hex of sha256(KEY)>, as documented (dashboards and logs match it)."""
    import hashlib

    from sparsekv.server.auth import parse_api_keys, tenant_for
    keys = parse_api_keys(["sk-one", "sk-two:team"])
    assert tenant_for(keys, "Bearer sk-one") == "key-" + hashlib.sha256(b"sk-one").hexdigest()[:8]
    assert tenant_for(keys, "Bearer sk-two") == "team"
    assert parse_api_keys(["sk-two:team", "sk-two:team"]) == parse_api_keys(["sk-two:team"])  # the same twice: fine
    for bad in (["sk-two:team", "sk-two:other"], ["sk-x:"], [":team"], [""]):
        with pytest.raises(ValueError):
            parse_api_keys(bad)


def test_empty_admin_and_metrics_keys_are_refused():
    """An empty key would be matched by no header, yet looks like a configured one."""
    from sparsekv.server.auth import load_admin_keys, load_metrics_keys, parse_metrics_keys
    with pytest.raises(ValueError, match="admin-api-key must not be empty"):
        load_admin_keys([""], [], {})
    with pytest.raises(ValueError, match="metrics-api-key must not be empty"):
        parse_metrics_keys([""])
    with pytest.raises(ValueError, match="metrics-api-key must not be empty"):
        load_metrics_keys(["mk", ""], [], {})


def test_a_key_after_several_spaces_is_the_same_key():
    """RFC 9110 credentials are `scheme 1*SP token68`: `Bearer   KEY` is KEY, not KEY with leading
    spaces, so a client (or proxy) that pads the separator is not turned away with a 401."""
    from sparsekv.server.auth import parse_api_keys, tenant_for
    keys = parse_api_keys(["sk-a:alice"])
    assert [tenant_for(keys, f"Bearer{gap}sk-a") for gap in (" ", "  ", "    ")] == ["alice"] * 3
    assert tenant_for(keys, "Bearer  ") is None


def _through_auth(requests, keys=("sk-a:alice",), admin=("sk-admin",)):
    """(status, tenant the app saw or the error body, www-authenticate) for each (method, path, key)."""
    from sparsekv.server.auth import DEFAULT_TENANT, TENANT_SCOPE_KEY, AuthMiddleware, load_admin_keys, parse_api_keys

    async def app(scope, receive, send):  # reads the tenant as app.py's _tenant does
        body = json.dumps({"tenant": scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    middleware = AuthMiddleware(app, parse_api_keys(list(keys)), load_admin_keys(list(admin), [], {}) if admin else {})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://t") as client:
            out = []
            for method, path, key in requests:
                r = await client.request(method, path, headers={"Authorization": f"Bearer {key}"} if key else {})
                out.append((r.status_code, r.json().get("tenant") if r.status_code == 200 else None,
                            r.headers.get("www-authenticate")))
            return out
    return asyncio.run(main())


def test_admin_paths_open_to_admin_keys_only_and_run_as_the_default_tenant():
    """An admin key opens /flush_cache, a tenant key does not, and an admin key is no tenant key; a
    401 says how to authenticate (WWW-Authenticate: Bearer, RFC 6750)."""
    out = _through_auth([("POST", "/flush_cache", "sk-admin"), ("POST", "/flush_cache", "sk-a"),
                         ("POST", "/flush_cache", None), ("POST", "/v1/completions", "sk-admin"),
                         ("POST", "/v1/completions", "sk-a")])
    assert out == [(200, "default", None), (401, None, "Bearer"), (401, None, "Bearer"), (401, None, "Bearer"),
                   (200, "alice", None)]


def test_admin_paths_are_off_without_admin_keys_even_on_an_open_server():
    out = _through_auth([("POST", "/flush_cache", None), ("POST", "/flush_cache", "sk-a"),
                         ("POST", "/v1/completions", None)], keys=(), admin=())
    assert [o[0] for o in out] == [403, 403, 200] and out[2][1] == "default"


def test_only_options_and_the_public_paths_pass_without_a_key():
    """CORS preflights (OPTIONS, which carry no Authorization) pass, admin paths included; HEAD and GET
    of a protected path do not."""
    out = _through_auth([("OPTIONS", "/v1/completions", None), ("OPTIONS", "/flush_cache", None),
                         ("HEAD", "/v1/models", None), ("GET", "/v1/models", None), ("GET", "/health", None)])
    assert [o[0] for o in out] == [200, 200, 401, 401, 200]



def test_two_authorization_headers_are_a_400_even_when_both_hold_a_valid_key():
    """Authorization is a singleton field (RFC 9110): given twice, a proxy and the server could each
    read another one, so it is a 400 on every path, public ones included, behind either middleware;
    one header is served."""
    from sparsekv.server.auth import AuthMiddleware, OneAuthorization, parse_api_keys

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main():
        out = []
        for wrapped in (AuthMiddleware(app, parse_api_keys(["sk-a:alice"])), OneAuthorization(app)):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://t") as client:
                for path in ("/v1/models", "/health"):
                    two = await client.get(path, headers=[("Authorization", "Bearer sk-a")] * 2)
                    one = await client.get(path, headers=[("Authorization", "Bearer sk-a")])
                    out.append((two.status_code, one.status_code))
        return out
    assert asyncio.run(main()) == [(400, 200)] * 4

def _through_body_limit(max_bytes: int, chunks: list[bytes], content_length: int | None = None,
                        after: list | None = None):
    """What BodyLimitMiddleware sends for a body arriving as `chunks`, and what the app behind it read."""
    from sparsekv.server.limits import BodyLimitMiddleware
    read, sent = [], []

    async def app(scope, receive, send):
        read.append(await receive())
        if after is not None:
            after.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    asyncio.run(BodyLimitMiddleware(app, max_bytes)({"type": "http", "headers": headers}, receive, send))
    return sent, read


def test_a_body_of_exactly_the_limit_is_read_whole_and_one_byte_more_is_a_413():
    for chunks, declared in (([b"x" * 10], 10), ([b"xxxx", b"xxxxxx"], None)):
        sent, read = _through_body_limit(10, chunks, declared)
        assert sent[0]["status"] == 200 and read == [{"type": "http.request", "body": b"x" * 10, "more_body": False}]
    for chunks, declared in (([b"x" * 11], 11), ([b"xxxx", b"xxxxxxx"], None), ([b""], 11)):  # declared: not read
        sent, read = _through_body_limit(10, chunks, declared)
        start, body = sent
        assert start["status"] == 413 and read == [], chunks
        assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
        error = json.loads(body["body"])["error"]
        assert error["code"] == 413 and error["type"] == "RequestTooLargeError" and "10 bytes" in error["message"]


def test_after_the_body_the_app_reads_the_connection_again():
    """The disconnect watch: the body is handed out once, then receive() is the connection's own."""
    after = []
    sent, read = _through_body_limit(10, [b"ab", b"cd"], None, after)
    assert read[0]["body"] == b"abcd" and after == [{"type": "http.disconnect"}]


def test_every_error_is_the_openai_envelope_with_the_integer_status_and_its_headers():
    from sparsekv.server.errors import APIError, bad_request, error_body, error_response
    assert error_body(400, "no", "prompt") == {"error": {"message": "no", "type": "BadRequestError",
                                                          "param": "prompt", "code": 400}}
    err = bad_request("bad n", "n")
    assert (err.status, err.message, err.param) == (400, "bad n", "n")
    response = error_response(APIError(503, "busy", headers={"Retry-After": "2"}))
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert json.loads(response.body) == {"error": {"message": "busy", "type": "ServiceUnavailableError",
                                                   "param": None, "code": 503}}


def test_token_ids_are_written_as_one_json_array_across_pieces():
    from sparsekv.server.tokenizing import JSON_IDS_PER_PIECE, ids_json
    for n in (0, 1, JSON_IDS_PER_PIECE - 1, JSON_IDS_PER_PIECE, JSON_IDS_PER_PIECE + 1, 2 * JSON_IDS_PER_PIECE + 5):
        ids = list(range(n))
        assert json.loads(ids_json(ids)) == ids, n


def test_large_bodies_give_memory_back_and_a_bad_content_length_is_counted(monkeypatch):
    from sparsekv.server import limits
    trims = []
    monkeypatch.setattr(limits, "release_memory", lambda: trims.append(1))
    sent, _ = _through_body_limit(limits.TRIM_AFTER_BYTES, [b"x" * (limits.TRIM_AFTER_BYTES - 1)])
    assert sent[0]["status"] == 200 and trims == []
    sent, _ = _through_body_limit(limits.TRIM_AFTER_BYTES, [b"x" * limits.TRIM_AFTER_BYTES])
    assert sent[0]["status"] == 200 and trims == [1]
    from sparsekv.server.limits import _declared_length
    assert _declared_length({"headers": [(b"content-length", b"12x")]}) == 0


def test_a_body_message_without_more_body_is_the_last_and_the_disconnect_is_left_to_the_app():
    """ASGI: more_body defaults to False. The body is one message; the connection's next message (the
    disconnect the handler watches for) is not read by the middleware."""
    from sparsekv.server.limits import BodyLimitMiddleware
    messages = [{"type": "http.request", "body": b"abc"}, {"type": "http.disconnect"}]
    read = []

    async def receive():
        return messages.pop(0)

    async def app(scope, receive, send):
        read.extend([await receive(), await receive()])

    async def send(message):
        pass
    asyncio.run(BodyLimitMiddleware(app, 10)({"type": "http", "headers": []}, receive, send))
    assert read == [{"type": "http.request", "body": b"abc", "more_body": False}, {"type": "http.disconnect"}]


def test_memory_goes_back_after_a_large_request_whose_handler_raised(monkeypatch):
    from sparsekv.server import limits
    trims = []
    monkeypatch.setattr(limits, "release_memory", lambda: trims.append(1))

    async def app(scope, receive, send):
        await receive()
        raise RuntimeError("the handler failed")
    messages = [{"type": "http.request", "body": b"x" * limits.TRIM_AFTER_BYTES}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass
    with pytest.raises(RuntimeError, match="the handler failed"):
        asyncio.run(limits.BodyLimitMiddleware(app, limits.TRIM_AFTER_BYTES)({"type": "http", "headers": []},
                                                                               receive, send))
    assert trims == [1]


def test_a_prompt_within_the_limit_is_never_refused_for_what_a_cut_adds():
    """ids_within: a prefix cut mid-word may tokenize into more tokens than its part of the whole text;
    only a prefix over limit + CUT_SLACK_TOKENS settles that the text is over the limit."""
    from sparsekv.server.tokenizing import CHARS_PER_TOKEN_GUESS, CUT_SLACK_TOKENS, Encoder

    class CutCostsTokens:  # 8 characters a token; a text not ending in "." costs CUT_SLACK_TOKENS more
        def encode(self, text, add_special_tokens=False):
            return [0] * (len(text) // 8 + (0 if text.endswith(".") else CUT_SLACK_TOKENS))
    limit = 100
    text = "a" * (8 * limit - 1) + "."  # exactly `limit` tokens
    assert (limit + CUT_SLACK_TOKENS) * CHARS_PER_TOKEN_GUESS < len(text)  # a prefix is tried first
    encoder = Encoder(CutCostsTokens())
    assert len(encoder.ids_within(text, limit)) == limit
    assert encoder.ids_within(text * 4, limit) is None


class _CharTokenizer:
    """Token ids are code points, BOS (0, text "<s>") in front with special tokens. It is its own
    `backend_tokenizer`: the fast path, faithful, or with `fast_adds_bos=False` never adding BOS."""

    def __init__(self, fast_adds_bos: bool = True):
        self.backend_tokenizer, self.fast_adds_bos, self.fast_calls = self, fast_adds_bos, 0

    def encode(self, text, add_special_tokens=False):
        return [0] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids):
        return "".join("<s>" if i == 0 else chr(i) for i in ids)

    def encode_batch_fast(self, texts, add_special_tokens=False):
        self.fast_calls += 1
        return [type("Encoding", (), {"ids": self.encode(t, add_special_tokens and self.fast_adds_bos)}) for t in texts]

    def decode_batch(self, batch, skip_special_tokens=False):
        self.fast_calls += 1
        return [self.decode([i for i in ids if not (skip_special_tokens and i == 0)]) for ids in batch]


def test_the_fast_tokenizer_path_is_taken_only_where_it_gives_what_encode_and_decode_give():
    """Encoder uses encode_batch_fast/decode_batch (GIL-free) only once they match encode and decode with
    and without special tokens; decoding keeps special tokens, as tokenizer.decode does."""
    from sparsekv.server.tokenizing import Encoder
    faithful = _CharTokenizer()
    encoder = Encoder(faithful)
    faithful.fast_calls = 0
    assert encoder.encode("ab", True) == [0, 97, 98] and encoder.encode("ab") == [97, 98]
    assert encoder.decode([0, 97]) == "<s>a"
    assert faithful.fast_calls == 3
    unfaithful = _CharTokenizer(fast_adds_bos=False)  # right without special tokens only
    encoder = Encoder(unfaithful)
    unfaithful.fast_calls = 0
    assert encoder.encode("ab", True) == [0, 97, 98] and encoder.decode([0, 97]) == "<s>a"
    assert unfaithful.fast_calls == 0

def test_every_status_the_server_sends_has_its_error_type():
    """The admin endpoints' 409 (docs/rl.md) and the auth middleware's 403 are typed as OpenAI's SDK
    names them, like every other status, not the generic "Error"."""
    from sparsekv.server.errors import error_body
    assert error_body(409, "x")["error"]["type"] == "ConflictError"
    assert error_body(403, "x")["error"]["type"] == "PermissionDeniedError"
