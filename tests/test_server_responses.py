"""Response bodies, stream chunks and per-request metrics, from made-up engine outputs (no model).

What a client or a dashboard reads: choices in order with their own index, text, finish and stop
reasons; usage counting each prompt once however many choices it has; logprobs in the completions
and chat shapes; the stream's role, usage, error and [DONE] events; the latency histograms and the
finish-reason counter.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from sparsekv.outputs import RequestOutput
from sparsekv.server.loop import EngineDead, RequestGroup
from sparsekv.server.metrics import RequestTimer, ServerMetrics
from sparsekv.server.responses import Echo, ResponseBuilder, TokenText
from sparsekv.server.serving import sse

VOCAB = {0: "z", 1: "a", 2: "bc", 3: "\u00e9", 4: "d", 5: "ef", 6: "g", 7: "hij", 8: "k"}


class _Tokenizer:
    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)


TEXT = TokenText(_Tokenizer())


def _out(prompt, tokens, finish=None, stop_reason=None, cached=0, logprobs=None, prompt_logprobs=None, new=None):
    """An engine output whose step made `new` tokens (default: the last of `tokens`)."""
    text = "".join(VOCAB[t] for t in tokens)
    return RequestOutput("r", list(prompt), list(tokens), text, logprobs, finish, num_cached_tokens=cached,
                         prompt_logprobs=prompt_logprobs, stop_reason=stop_reason,
                         new_token_ids=list(tokens[-1:] if new is None else new))


def _lp(tokens, chosen=-1.0):
    """One entry per token: the token at `chosen`, a likelier alternative and a less likely one."""
    return [{8: -0.1, 0: -3.0, t: chosen} for t in tokens]  # 0 and 8 are never chosen here


# two prompts x n=2; each choice its own tokens, reasons and cached count (prompt A: [1, 2], B: [4, 5, 6])
PROMPTS = [[1, 2], [4, 5, 6]]
CHOICES = [  # (prompt, tokens, finish, stop_reason, cached)
    (PROMPTS[0], [1], "stop", "STOP", 16),
    (PROMPTS[0], [2, 4, 5], "length", None, 32),
    (PROMPTS[1], [6, 7], "stop", 7, 8),
    (PROMPTS[1], [4, 4, 4, 4], "length", None, 48),
]


def _states(builder, with_logprobs=False):
    states = []
    for i, (prompt, tokens, finish, stop, cached) in enumerate(CHOICES):
        s = builder.choice_state(i, [])
        s.update(_out(prompt, tokens, finish, stop, cached, _lp(tokens) if with_logprobs else None,
                      [None] + _lp(prompt[1:]) if with_logprobs else None))
        states.append(s)
    return states


def _builder(kind="completion", n=2, **kw):
    return ResponseBuilder(kind, "id", "m", 0, n, TEXT, "t", **kw)


def test_choices_keep_their_order_index_and_own_reasons_with_several_prompts():
    for kind in ("completion", "chat"):
        body = _builder(kind).response(_states(_builder(kind)))
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop", "length"]
        assert [c["stop_reason"] for c in body["choices"]] == ["STOP", None, 7, None]
        texts = [c["text"] if kind == "completion" else c["message"]["content"] for c in body["choices"]]
        assert texts == ["a", "bcdef", "ghij", "dddd"]
        assert [c["index"] for c in body["sparsekv"]["choices"]] == [0, 1, 2, 3]
        assert [c["token_ids"] for c in body["sparsekv"]["choices"]] == [c[1] for c in CHOICES]


def test_usage_counts_each_prompt_once_and_every_choices_tokens():
    """prompt_tokens and cached_tokens: one choice per prompt (the first); completion_tokens: all."""
    usage = _builder().response(_states(_builder()))["usage"]
    assert usage == {"prompt_tokens": 2 + 3, "completion_tokens": 1 + 3 + 2 + 4, "total_tokens": 5 + 10,
                     "prompt_tokens_details": {"cached_tokens": 16 + 8}}
    chunk = _builder().usage_chunk(_states(_builder()))
    assert chunk["choices"] == [] and chunk["usage"] == usage


def test_a_bytes_figure_keeps_its_peak_and_every_other_figure_its_latest():
    """The engine reports 0 bytes once a request's pages are released: the response carries the most
    the request held, while counters are the latest reported."""
    builder = _builder(n=1)
    s = builder.choice_state(0, [])
    for held, hits in ((4096, 1), (8192, 2), (0, 3)):
        out = _out([1], [1])
        out.metrics = {"device_bytes": held, "hits": hits}
        s.update(out)
    assert s.peak == {"device_bytes": 8192, "hits": 3}
    assert builder.response([s])["sparsekv"]["tiers"] == {"device_bytes": 8192, "hits": 3}


def _with_metrics(builder, metrics: list[dict]):
    states = []
    for i, figures in enumerate(metrics):
        s = builder.choice_state(i, [])
        out = _out([1], [1])
        out.metrics = figures
        s.update(out)
        states.append(s)
    return states


def test_the_top_level_tiers_add_up_integer_figures_over_choices_and_leave_out_the_rest():
    """Bytes, hits and token counts add up over the choices; a rate or a flag is per choice only."""
    builder = _builder(n=2)
    states = _with_metrics(builder, [{"device_bytes": 4096, "miss_rate": 0.5, "spilled": True},
                                     {"device_bytes": 8192, "miss_rate": 0.25, "spilled": True}])
    body = builder.response(states)["sparsekv"]
    assert body["tiers"] == {"device_bytes": 12288}
    assert [c["tiers"]["spilled"] for c in body["choices"]] == [True, True]

def test_echo_puts_each_prompt_before_its_own_choices_with_prompt_logprobs():
    texts = ["A-text", "B-text"]
    builder = _builder(echo=Echo(texts, False))
    body = builder.response(_states(builder, with_logprobs=True))
    assert [c["text"] for c in body["choices"]] == ["A-texta", "A-textbcdef", "B-textghij", "B-textdddd"]
    for choice, (prompt, tokens, *_) in zip(body["choices"], CHOICES):
        lp = choice["logprobs"]
        assert lp["tokens"] == [VOCAB[t] for t in prompt + tokens]
        assert lp["token_logprobs"] == [None] + [-1.0] * (len(prompt) - 1 + len(tokens))
        assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {VOCAB[prompt[1]]: -1.0, "k": -0.1, "z": -3.0}
        lengths = [len(VOCAB[t]) for t in prompt + tokens]
        assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert body["usage"]["completion_tokens"] == 10


def test_echo_of_the_prompt_only_counts_and_returns_no_generated_token():
    builder = _builder(echo=Echo(["A-text", "B-text"], True))
    states = _states(builder, with_logprobs=True)
    body = builder.response(states)
    assert [c["text"] for c in body["choices"]] == ["A-text", "A-text", "B-text", "B-text"]
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [2, 2, 3, 3]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == 5
    assert [c["token_ids"] for c in body["sparsekv"]["choices"]] == [[]] * 4
    builder.continuous_usage = True
    s = builder.choice_state(0, [])
    s.update(_out([1, 2], [4], "length"))
    assert builder.chunk(s, True, True)["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_completion_logprobs_are_the_chosen_tokens_not_the_likeliest():
    builder = _builder(n=1)
    s = builder.choice_state(0, [])
    s.update(_out([1], [3, 7], "length", logprobs=_lp([3, 7], chosen=-2.0)))
    lp = builder.response([s])["choices"][0]["logprobs"]
    assert lp["tokens"] == ["\u00e9", "hij"] and lp["token_logprobs"] == [-2.0, -2.0]
    assert lp["top_logprobs"] == [{"\u00e9": -2.0, "k": -0.1, "z": -3.0}, {"hij": -2.0, "k": -0.1, "z": -3.0}]
    assert lp["text_offset"] == [0, 1]


def test_chat_logprobs_top_n_likeliest_first_with_utf8_bytes():
    builder = _builder("chat", n=1, top_logprobs=2)
    s = builder.choice_state(0, [])
    s.update(_out([1], [3, 7], "length", logprobs=_lp([3, 7], chosen=-2.0)))
    content = builder.response([s])["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "\u00e9", "logprob": -2.0, "bytes": [0xC3, 0xA9],
                          "top_logprobs": [{"token": "k", "logprob": -0.1, "bytes": [ord("k")]},
                                           {"token": "\u00e9", "logprob": -2.0, "bytes": [0xC3, 0xA9]}]}
    assert content[1]["token"] == "hij" and content[1]["bytes"] == [ord(c) for c in "hij"]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["k", "hij"]
    none = _builder("chat", n=1, top_logprobs=0)
    assert none.response([s])["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def _stream(builder, outputs, include_usage, index=0):
    s = builder.choice_state(index, [])
    chunks = []
    for i, out in enumerate(outputs):
        s.update(out)
        chunks.append(builder.chunk(s, i == 0, include_usage))
    return chunks


def test_stream_chunks_reasons_offsets_and_usage_so_far():
    steps = [_out([1, 2, 4], [5]), _out([1, 2, 4], [5, 3]), _out([1, 2, 4], [5, 3, 7], "stop", "X")]
    for kind in ("completion", "chat"):
        builder = _builder(kind, n=1)
        builder.continuous_usage = True
        chunks = _stream(builder, steps, True, index=0)
        choices = [c["choices"][0] for c in chunks]
        assert [c["finish_reason"] for c in choices] == [None, None, "stop"]
        assert [c["stop_reason"] for c in choices] == [None, None, "X"]
        assert [c["usage"] for c in chunks] == [{"prompt_tokens": 3, "completion_tokens": k, "total_tokens": 3 + k}
                                                for k in (1, 2, 3)]
        assert ["sparsekv" in c for c in chunks] == [False, False, True] and chunks[-1]["sparsekv"]["index"] == 0
        if kind == "chat":
            assert [c["delta"].get("role") for c in choices] == ["assistant", None, None]
            assert "".join(c["delta"]["content"] for c in choices) == "ef\u00e9hij"
    builder = _builder("completion", n=1, top_logprobs=None)
    steps = [_out([1], [5], logprobs=_lp([5])), _out([1], [5, 3], logprobs=_lp([5, 3])),
             _out([1], [5, 3, 7], "length", logprobs=_lp([5, 3, 7]))]
    chunks = _stream(builder, steps, False)
    assert all("usage" not in c for c in chunks)  # neither include_usage nor continuous_usage_stats
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [2], [3]]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["ef"], ["\u00e9"], ["hij"]]
    with_usage = _stream(_builder("completion", n=1), steps, True)
    assert [c["usage"] for c in with_usage] == [None, None, None]  # include_usage: null until the last chunk



def test_a_streamed_text_offset_counts_the_text_a_stop_string_holds_back():
    """A chunk's text may hold back the start of a stop string ("c" of "cdx"); the next chunk's token
    offsets still count it, as the whole response's offsets do."""
    builder = _builder("completion", n=1)
    s = builder.choice_state(0, ["cdx"])
    s.update(_out([1], [1, 2], logprobs=_lp([1, 2])))
    first = builder.chunk(s, True, False)["choices"][0]
    assert first["text"] == "ab" and first["logprobs"]["text_offset"] == [0, 1]
    s.update(_out([1], [1, 2, 4], "length", logprobs=_lp([1, 2, 4])))
    last = builder.chunk(s, False, False)["choices"][0]
    assert last["text"] == "cd" and last["logprobs"]["text_offset"] == [3]


def test_a_stream_holds_back_half_a_character_until_it_is_whole():
    """A trailing U+FFFD is half of a multi-byte character: it is not sent, its whole character is."""
    builder = _builder("completion", n=1)
    s = builder.choice_state(0, [])
    chunks = []
    for text, finish in (("a\ufffd", None), ("a\u00e9", "length")):
        s.update(RequestOutput("r", [1], [1, 3], text, None, finish))
        chunks.append(builder.chunk(s, not chunks, False)["choices"][0]["text"])
    assert chunks == ["a", "\u00e9"]


def test_chat_content_is_null_only_when_reasoning_took_all_of_the_text():
    """With a reasoning parser, a completion that only thought has content null; one with no think block
    keeps its (here empty) text as content, reasoning_content null."""
    from sparsekv.server.responses import Reasoning
    builder = _builder("chat", n=1, reasoning=Reasoning(opened=False))

    def message(text):
        s = builder.choice_state(0, [])
        s.update(RequestOutput("r", [1], [1], text, None, "stop"))
        return builder.response([s])["choices"][0]["message"]
    assert message("<think>hmm</think>") == {"role": "assistant", "content": None, "reasoning_content": "hmm"}
    assert message("") == {"role": "assistant", "content": "", "reasoning_content": None}
    assert message("<think>hmm</think>ok") == {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}

def test_a_stream_chunk_carries_its_own_choices_index():
    builder = _builder("completion", n=2)
    chunks = _stream(builder, [_out([1], [5], "length")], False, index=3)
    assert chunks[0]["choices"][0]["index"] == 3 and chunks[0]["sparsekv"]["index"] == 3


class _Loop:
    def __init__(self):
        self.aborted = []

    def abort(self, group):
        self.aborted.append(group)


def _events(builder, items, n_choices, include_usage):
    async def go():
        group = RequestGroup("g", n_choices)
        for item in items:
            group.queue.put_nowait(item)
        loop = _Loop()
        states = [builder.choice_state(i, []) for i in range(n_choices)]
        events = [e async for e in sse(loop, group, states, builder, include_usage)]
        assert loop.aborted == [group]
        return [e[len("data: "):].strip() for e in events]
    raw = asyncio.run(go())
    assert all(e == "[DONE]" or isinstance(json.loads(e), dict) for e in raw)
    return [e if e == "[DONE]" else json.loads(e) for e in raw]


def test_sse_role_per_choice_usage_last_then_done():
    builder = _builder("chat", n=2)
    items = [(0, _out([1, 2], [5])), (1, _out([1, 2], [4])), (0, _out([1, 2], [5, 6], "length")),
             (1, _out([1, 2], [4, 4, 4], "stop"))]
    events = _events(builder, items, 2, True)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks, usage = events[:4], events[4]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("role")) for c in chunks] == \
        [(0, "assistant"), (1, "assistant"), (0, None), (1, None)]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                                                          "prompt_tokens_details": {"cached_tokens": 0}}
    plain = _events(_builder("chat", n=2), items, 2, False)
    assert len(plain) == 5 and plain[-1] == "[DONE]" and all(c["choices"] for c in plain[:4])


def test_sse_an_error_mid_stream_is_one_error_event_then_done_without_usage():
    builder = _builder("completion", n=1)
    items = [(0, _out([1], [5])), (None, EngineDead("engine gone", 500)), (0, _out([1], [5, 6], "length"))]
    events = _events(builder, items, 1, True)
    assert len(events) == 3 and events[0]["choices"][0]["text"] == "ef"
    assert events[1]["error"]["code"] == 500 and "engine gone" in events[1]["error"]["message"]
    assert events[2] == "[DONE]"


# -- metrics -------------------------------------------------------------------------------------

def _metrics():
    return ServerMetrics("m", lambda: {}, lambda: True)


def _sample(m, name, **labels):
    return m.registry.get_sample_value("sparsekv:" + name, {"model_name": "m", **labels}) or 0.0


def test_latency_histograms_observe_once_per_request_and_between_outputs():
    m = _metrics()
    t = RequestTimer(arrival=100.0, tenant="alice")
    steps = [(100.5, [5]), (100.75, [5, 6]), (101.5, [5, 6, 7, 8]), (103.5, [5, 6, 7, 4, 1])]
    for i, (now, tokens) in enumerate(steps):
        m.observe(t, _out([1], tokens, "length" if i == len(steps) - 1 else None), now, scheduled=100.25)
    assert _sample(m, "time_to_first_token_seconds_count") == 1
    assert _sample(m, "time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _sample(m, "tenant_time_to_first_token_seconds_count", tenant="alice") == 1
    assert _sample(m, "inter_token_latency_seconds_count") == 3
    assert _sample(m, "inter_token_latency_seconds_sum") == pytest.approx(0.25 + 0.75 + 2.0)
    assert _sample(m, "inter_token_latency_seconds_bucket", le="0.5") == 1  # 0.25 alone; 0.75 and 2.0 above
    assert _sample(m, "tenant_inter_token_latency_seconds_sum", tenant="alice") == pytest.approx(3.0)
    assert _sample(m, "e2e_request_latency_seconds_sum") == pytest.approx(3.5)
    assert _sample(m, "request_time_per_output_token_seconds_sum") == pytest.approx(3.0 / 4)
    assert _sample(m, "request_queue_time_seconds_count") == 1
    assert _sample(m, "request_queue_time_seconds_sum") == pytest.approx(0.25)


def test_request_success_is_counted_once_by_its_finish_reason():
    m = _metrics()
    for reason in ("stop", "length", "length", "abort"):
        t = RequestTimer(arrival=0.0)
        m.observe(t, _out([1], [5]), 0.1, None)
        m.observe(t, _out([1], [5, 6], reason), 0.2, None)
    assert _sample(m, "request_success_total", finished_reason="stop") == 1
    assert _sample(m, "request_success_total", finished_reason="length") == 2
    assert _sample(m, "request_success_total", finished_reason="abort") == 1
    m.abort("client_gone", 3)
    m.abort("client_gone", 0)
    assert _sample(m, "requests_aborted_total", reason="client_gone") == 3


def test_a_two_token_request_observes_its_time_per_output_token():
    """TPOT is the decode time over the tokens after the first (vLLM's): a request of two tokens has one
    such interval and is observed; a one-token request has none and is not."""
    m = _metrics()
    t = RequestTimer(arrival=10.0)
    m.observe(t, _out([1], [5]), 10.5, None)
    m.observe(t, _out([1], [5, 6], "length"), 11.25, None)
    one = RequestTimer(arrival=20.0)
    m.observe(one, _out([1], [5], "length"), 20.5, None)
    assert _sample(m, "request_time_per_output_token_seconds_count") == 1
    assert _sample(m, "request_time_per_output_token_seconds_sum") == pytest.approx(0.75)
    assert _sample(m, "e2e_request_latency_seconds_count") == 2


def test_an_aborted_requests_final_output_observes_no_token_latency():
    """/abort_request ends a request with an output that carries no token: its wait is neither an
    inter-token latency nor (before any token) a time to first token; the request is still counted as
    finished ("abort"), with its time per output token up to its last token."""
    m = _metrics()
    t = RequestTimer(arrival=10.0)
    m.observe(t, _out([1], [5]), 10.5, None)
    m.observe(t, _out([1], [5, 6]), 11.0, None)
    m.observe(t, _out([1], [5, 6], "abort", new=[]), 30.0, None)
    waiting = RequestTimer(arrival=20.0)
    m.observe(waiting, _out([1], [], "abort", new=[]), 25.0, None)
    assert _sample(m, "time_to_first_token_seconds_count") == 1
    assert _sample(m, "inter_token_latency_seconds_count") == 1
    assert _sample(m, "inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert _sample(m, "request_time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert _sample(m, "request_success_total", finished_reason="abort") == 2
    assert _sample(m, "e2e_request_latency_seconds_sum") == pytest.approx(20.0 + 5.0)


def test_queue_time_is_never_negative():
    """A request another rank scheduled in a step that rank 0 started before the request's arrival (data
    parallel: the step's clock) is observed as queued for 0 s, not a negative time."""
    m = _metrics()
    m.observe(RequestTimer(arrival=10.0), _out([1], [5]), 10.5, scheduled=9.75)
    assert _sample(m, "request_queue_time_seconds_count") == 1
    assert _sample(m, "request_queue_time_seconds_sum") == 0.0


def test_a_series_labelled_by_tenant_is_left_out_of_the_public_view_whatever_its_name():
    """The public exposition drops every family with a `tenant` label, not only those named tenant_*: a new
    per-tenant series stays private without being listed anywhere."""
    from prometheus_client import Counter
    from prometheus_client.parser import text_string_to_metric_families
    m = _metrics()
    Counter("sparsekv:lookups", "a per-tenant series not named for tenants", ["model_name", "tenant"],
            registry=m.registry).labels("m", "alice").inc()

    def names(text):
        return {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert "sparsekv:lookups_total" in names(m.render())
    public = names(m.render(per_tenant=False))
    assert "sparsekv:lookups_total" not in public and "sparsekv:request_success_total" not in public
    assert "sparsekv:engine_healthy" in public


def test_every_engine_figure_is_exported_once_under_one_name():
    """Each stats key reaches /metrics once: the tables' figures under their metric names, per-tier hits as
    one counter labelled by tier, the speculative counters as counters, other numbers as gauges, and no
    booleans or strings. No family is declared twice (Prometheus refuses a scrape with a second TYPE line
    for a name)."""
    from collections import Counter

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparsekv.server.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, EngineStatsCollector, P
    stats = {**{key: 1 for key in ENGINE_GAUGES}, **{key: 2 for key in ENGINE_COUNTERS},
             "kv_pages_total": 8, "kv_pages_free": 2,
             "prefix_cache_hits_device": 3, "prefix_cache_hits_host": 2, "prefix_cache_preempted_hits_device": 1,
             "prefix_host_pages": 4, "tier_miss_rate": 0.25, "paused": False, "weight_update_pending": True,
             "host_store": "ram", "spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 8,
             "spec_decode_num_accepted_tokens": 4, "spec_decode_num_accepted_tokens_per_pos": [3, 1],
             "spec_decode_acceptance_rate": 0.5, "spec_decode_mean_acceptance_length": 2.0 + 1 / 3,
             "ranks": [{"rank": 0, "weight_bytes": 5, "kv_pool_bytes": 6, "peak_rss_bytes": 7}],
             "kv_by_tenant": {"alice": {"running": 1, "waiting": 0, "kv_pages": 4}},
             "prefix_cache_by_tenant": {"alice": {"queries": 9, "hits": 3, "cached_pages": 1}}}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("m", lambda: stats, lambda: True))
    text = generate_latest(registry).decode()
    declared = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    assert [name for name, n in declared.items() if n > 1] == []
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    keys = Counter((s.name, tuple(sorted(s.labels.items()))) for s in samples)
    assert [key for key, n in keys.items() if n > 1] == []
    expected = ({P + "engine_healthy", P + "kv_cache_usage_perc"} | {P + name for name, _ in ENGINE_GAUGES.values()}
                | {P + name + "_total" for name, _ in ENGINE_COUNTERS.values()}
                | {P + name for name in ("prefix_cache_hits_total", "prefix_cache_preempted_hits_total",
                                         "prefix_host_pages", "tier_miss_rate", "spec_decode_num_drafts_total",
                                         "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                                         "spec_decode_num_accepted_tokens_per_pos_total", "spec_decode_acceptance_rate",
                                         "spec_decode_mean_acceptance_length", "rank_weight_bytes",
                                         "rank_kv_pool_bytes", "rank_peak_rss_bytes", "tenant_requests",
                                         "tenant_kv_pages", "prefix_cache_tenant_queries_total",
                                         "prefix_cache_tenant_hits_total", "prefix_cache_tenant_cached_pages")})
    assert {s.name for s in samples} == expected
    hits = {s.labels["tier"]: s.value for s in samples if s.name == P + "prefix_cache_hits_total"}
    assert hits == {"device": 3, "host": 2}
    assert {s.labels["tier"]: s.value for s in samples if s.name == P + "prefix_cache_preempted_hits_total"} == \
        {"device": 1}


def test_each_labelled_engine_figure_carries_its_own_value_under_its_own_labels():
    """Per rank, per tenant and tier, per draft position: each value reaches the series its labels name
    (a dashboard reads rank 1's KV pool, alice's host-tier pages, the second draft's acceptances)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from sparsekv.server.metrics import EngineStatsCollector, P
    stats = {"ranks": [{"rank": 0, "weight_bytes": 5, "kv_pool_bytes": 6, "peak_rss_bytes": 7},
                       {"rank": 1, "weight_bytes": 8, "kv_pool_bytes": 9, "peak_rss_bytes": 10}],
             "prefix_cache_by_tenant": {"alice": {"queries": 9, "hits": 3, "cached_pages": 1, "host_pages": 2,
                                                  "disk_pages": 4},
                                        "bob": {"queries": 6, "hits": 0, "cached_pages": 5}},
             "spec_decode_num_accepted_tokens_per_pos": [3, 1]}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("m", lambda: stats, lambda: True))
    samples = [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]

    def by(name, *labels):
        return {tuple(s.labels[k] for k in labels): s.value for s in samples if s.name == P + name}
    assert by("rank_weight_bytes", "rank") == {("0",): 5, ("1",): 8}
    assert by("rank_kv_pool_bytes", "rank") == {("0",): 6, ("1",): 9}
    assert by("rank_peak_rss_bytes", "rank") == {("0",): 7, ("1",): 10}
    assert by("prefix_cache_tenant_queries_total", "tenant") == {("alice",): 9, ("bob",): 6}
    assert by("prefix_cache_tenant_hits_total", "tenant") == {("alice",): 3, ("bob",): 0}
    assert by("prefix_cache_tenant_cached_pages", "tenant", "tier") == {
        ("alice", "device"): 1, ("alice", "host"): 2, ("alice", "disk"): 4, ("bob", "device"): 5}
    assert by("spec_decode_num_accepted_tokens_per_pos_total", "position") == {("0",): 3, ("1",): 1}


def test_the_public_view_names_no_per_tenant_series_even_before_one_has_a_sample():
    """Before any request the per-tenant families have no sample yet: the public exposition still
    leaves them out, HELP and TYPE lines included (it names no tenant series at all)."""
    public = _metrics().render(per_tenant=False).decode()
    assert "sparsekv:engine_healthy" in public
    assert [line for line in public.splitlines() if "tenant" in line] == []
    assert "sparsekv:tenant_time_to_first_token_seconds" in _metrics().render().decode()


def test_an_engine_without_data_parallel_ranks_exports_no_per_rank_family():
    """The per-rank (dp_rank) families come only with a data-parallel engine's figures: one engine's
    exposition names none, not even an empty HELP/TYPE pair."""
    assert "dp_rank" not in _metrics().render().decode()


def test_an_abort_of_no_sequence_adds_no_series():
    """A client gone after its requests finished aborts none: no requests_aborted_total series appears for it."""
    m = _metrics()
    m.abort("client_disconnect", 0)
    assert m.registry.get_sample_value("sparsekv:requests_aborted_total",
                                       {"model_name": "m", "reason": "client_disconnect"}) is None
    m.abort("client_disconnect", 2)
    assert _sample(m, "requests_aborted_total", reason="client_disconnect") == 2


def test_the_engines_token_counters_are_exported_under_their_own_names():
    m = ServerMetrics("m", lambda: {"prompt_tokens": 11, "generation_tokens": 7, "kv_pages_total": 4,
                                    "kv_pages_free": 1}, lambda: True)
    assert _sample(m, "prompt_tokens_total") == 11 and _sample(m, "generation_tokens_total") == 7
    assert _sample(m, "kv_cache_usage_perc") == pytest.approx(0.75)


def test_the_top_level_tiers_never_add_up_the_choices_weights_version():
    """weights_version names the weights that computed a choice (docs/rl.md), not an amount: two choices
    computed by version 3 are not version 6 in the response's top-level tiers."""
    builder = _builder(n=2)
    states = []
    for i, held in enumerate((4096, 8192)):
        s = builder.choice_state(i, [])
        out = _out([1], [1])
        out.metrics = {"device_bytes": held, "weights_version": 3}
        s.update(out)
        states.append(s)
    for ext in (builder.response(states)["sparsekv"], builder.usage_chunk(states)["sparsekv"]):
        assert [c["weights_version"] for c in ext["choices"]] == [3, 3]
        assert ext["tiers"]["device_bytes"] == 4096 + 8192 and ext["tiers"].get("weights_version", 3) == 3
