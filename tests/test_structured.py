"""Structured outputs (xgrammar): every output matches its JSON schema, regex or choice list, sampled
or greedy, with speculative decoding exactly as without; bad specs are clear errors."""
from __future__ import annotations

import json
import re

import pytest
import torch

from sparsekv import LLM, InvalidRequest, SamplingParams
from sparsekv.paths import default_model_path

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
def _matches_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"ok", "n"} and isinstance(value["ok"], bool) \
        and 0 <= value["n"] <= 9


SPECS = {
    "choice": ({"type": "choice", "choices": ["alpha", "beta", "gamma delta"]},
               lambda text: text in ("alpha", "beta", "gamma delta")),
    "regex": ({"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    "json_schema": ({"type": "json_schema", "schema": SCHEMA}, _matches_schema),
}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:"]


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(default_model_path(), max_model_len=512, max_num_seqs=3)


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_outputs_match_their_spec(llm, kind, temperature):
    spec, matches = SPECS[kind]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=temperature, seed=3, structured_output=spec))
    for out in outs:
        assert out.finish_reason == "stop" and matches(out.text), (kind, out.text)
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert not matches(plain.text)  # unconstrained, the model writes code
    llm.engine.check_integrity()


def test_json_object_is_an_object_prefix_or_a_whole_object(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=64, temperature=0.0,
                                                   structured_output={"type": "json_object"}))[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_drafting_under_a_grammar_equals_plain_decoding():
    spec = SPECS["json_schema"][0]
    options = dict(max_model_len=512, max_num_seqs=3, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=1, structured_output=spec)
    plain = LLM(default_model_path(), **options).generate(PROMPTS, params)
    spec_llm = LLM(default_model_path(), num_speculative_tokens=2, **options)
    drafted = spec_llm.generate(PROMPTS, params)
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
    assert spec_llm.stats()["spec_decode_num_draft_tokens"] > 0
    spec_llm.engine.check_integrity()


@pytest.mark.parametrize("spec, match", [
    ({"type": "yaml"}, "structured_output"), ({"type": "regex"}, "pattern"), ({"type": "choice", "choices": []}, "choices"),
    ({"type": "choice", "choices": ["a", ""]}, "choices"), ("json", "structured_output"),
    ({"type": "json_object", "after": ""}, "after"),
])
def test_malformed_specs_are_refused(spec, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(structured_output=spec)


@pytest.mark.parametrize("spec", [{"type": "json_schema", "schema": "{not json"}, {"type": "regex", "pattern": "(ab"}])
def test_specs_that_do_not_compile_are_clear_errors(llm, spec):
    with pytest.raises(InvalidRequest, match="does not compile"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_output=spec))
    llm.engine.check_integrity()


def test_a_checkpoint_without_tokenizer_refuses_structured_outputs(glm_ckpt):
    with pytest.raises(InvalidRequest, match="tokenizer"):
        LLM(glm_ckpt[0], max_model_len=64).generate([[1, 2, 3]], SamplingParams(structured_output={"type": "json_object"}))


def test_a_grammar_that_cannot_go_on_ends_the_request_cleanly(llm):
    """min_tokens holds EOS back after a complete match: no token may come next, so the request ends
    ("stop", the matched text) instead of emitting a token against its grammar; others are unaffected."""
    spec = {"type": "choice", "choices": ["yes"]}
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=16, temperature=0.0, min_tokens=8, structured_output=spec),
                                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert outs[0].text == "yes" and outs[0].finish_reason == "stop"
    assert len(outs[1].token_ids) == 6 and outs[1].finish_reason == "length"
    llm.engine.check_integrity()


def test_a_grammar_that_cannot_go_on_ends_a_drafting_request_at_the_verified_row():
    """The same dead end with MTP drafts: the row after the complete match is a draft's verification
    row, and there too no token may come next; the output is plain decoding's, token for token."""
    spec = {"type": "choice", "choices": ["yes"]}
    params = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=8, structured_output=spec)
    options = dict(max_model_len=512, max_num_seqs=3, enable_prefix_caching=False)
    plain = LLM(default_model_path(), **options).generate(PROMPTS[:1], params)[0]
    spec_llm = LLM(default_model_path(), num_speculative_tokens=2, **options)
    drafted = spec_llm.generate(PROMPTS[:1], params)[0]
    assert (drafted.token_ids, drafted.text, drafted.finish_reason) == (plain.token_ids, "yes", "stop")
    assert spec_llm.stats()["spec_decode_num_draft_tokens"] > 0
    spec_llm.engine.check_integrity()


def test_a_grammar_after_a_marker_leaves_the_text_before_it_free(llm):
    """`"after": TEXT` (the server's "</think>" for reasoning models): the output is the model's own
    until it writes TEXT, then the grammar's; here a call's "(" and then three digits."""
    prompt = "def fibonacci(n):\n    return fib"
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    spec = {"type": "regex", "pattern": "[0-9]{3}", "after": "("}
    out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, structured_output=spec))[0]
    head, marker, tail = out.text.partition("(")
    assert marker and free.startswith(head + "(") and re.fullmatch("[0-9]{3}", tail) and out.finish_reason == "stop"
    unconstrained = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                          structured_output={**spec, "after": "never written"}))[0]
    assert unconstrained.text == free  # the marker never comes: the grammar never holds
    llm.engine.check_integrity()


def _ids(llm, text: str) -> list[int]:
    return llm.engine.outputs.tokenizer.encode(text, add_special_tokens=False)


def test_a_marker_written_in_short_tokens_starts_the_grammar(llm):
    """A marker split into tokens shorter than itself ("</", "th", "ink", ">"): the text kept while
    waiting is its last len(marker) - 1 characters, so the marker is found across them."""
    grammar = llm.engine.outputs.grammar_for({"type": "json_object", "after": "</think>"})
    tokens = _ids(llm, "</think>")
    assert len(tokens) == 4
    for token in tokens:
        grammar.accept(token)
    assert grammar.active and grammar.dead_end is None


def test_text_after_the_marker_that_cannot_start_the_grammar_ends_that_request_only(llm):
    """The token closing the marker also writes ">" (">>" after "</think"), which no JSON starts with:
    the model's doing, so that request ends ("stop", its text), not the engine (it raised in the step)."""
    spec = {"type": "json_object", "after": "</think>"}
    prompt, closing = _ids(llm, "reasoning"), _ids(llm, "</think")
    double = _ids(llm, ">>")
    assert len(double) == 1
    forced = closing + double  # each step may take only the next forced token

    def force(output_ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[forced[min(len(output_ids), len(forced) - 1)]] = 0.0
        return out
    outs = llm.generate([prompt, PROMPTS[0]], [
        SamplingParams(max_tokens=16, temperature=0.0, structured_output=spec, logits_processors=[force]),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert outs[0].token_ids == forced and outs[0].finish_reason == "stop" and outs[0].text == "</think>>"
    assert len(outs[1].token_ids) == 6 and outs[1].finish_reason == "length"
    llm.engine.check_integrity()
    assert len(llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids) == 3


def _state(llm, spec: dict, texts: dict[int, str] | None = None):
    """A grammar state for `spec` on the engine's compiler; `texts`: made-up token texts for `after`."""
    from sparsekv.structured import GrammarState
    llm.engine.outputs.grammar_for(spec)  # compiles it (and makes the engine's compiler)
    compiler = llm.engine.outputs._grammar_compiler
    return GrammarState(compiler, compiler.compile(spec), spec.get("after"), (texts or {}).get)


def test_whitespace_after_the_marker_in_its_token_is_skipped(llm):
    """The token closing the marker may carry whitespace ("</think>\\n") and the answer's start: the
    whitespace is dropped and the rest starts the grammar (compact JSON takes no leading whitespace)."""
    spec = {"type": "json_object", "after": "</think>"}
    grammar = _state(llm, spec, {0: "hm</think>\n\n{"})
    grammar.accept(0)
    assert grammar.active and grammar.dead_end is None and not grammar.finished
    assert grammar.matcher.accept_string('"a": 1}')
    only_space = _state(llm, spec, {0: "</think>", 1: "\n"})
    only_space.accept(0)
    assert only_space.active and only_space.dead_end is None


def test_choices_are_literal_text(llm):
    """A choice is matched as written, not as a regular expression."""
    spec = {"type": "choice", "choices": ["a+b", "c.d"]}
    assert _state(llm, spec).matcher.accept_string("a+b")
    assert not _state(llm, spec).matcher.accept_string("aab")
    assert not _state(llm, spec).matcher.accept_string("cxd")


def test_json_grammars_take_no_free_whitespace(llm):
    """JSON is compact: a model cannot pad an object with whitespace forever."""
    grammar = _state(llm, {"type": "json_object"})
    assert grammar.matcher.accept_string("{")
    assert not grammar.matcher.accept_string("\n")


def test_a_schema_given_as_json_text_is_the_same_schema(llm):
    spec = {"type": "json_schema", "schema": json.dumps(SCHEMA)}
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec))[0]
    assert out.finish_reason == "stop" and _matches_schema(out.text)


def test_compiler_errors_keep_the_reason_and_drop_internals():
    from sparsekv.structured import _reason
    assert _reason(RuntimeError("[12:00:00] /src/x.cc:94: Check failed: (ok) is false: bad range\nmore")) == \
        ": bad range"
    assert _reason(RuntimeError("[12:00:00] /src/x.cc:94: failed in /src/y.cc:12")) == ""  # still internals
    assert _reason(RuntimeError("Traceback (most recent call last):")) == ""
    assert _reason(RuntimeError("")) == ""


def test_a_spec_compiles_once_whatever_text_its_grammar_waits_for(llm):
    """`after` only delays a grammar: specs that differ only in it share one compiled grammar (each
    engine compiles a spec once)."""
    outputs = llm.engine.outputs
    spec = {"type": "regex", "pattern": "[a-c]{2}x"}
    outputs.grammar_for(spec)
    compiled = len(outputs._grammar_compiler._compiled)
    for after in ("</think>", "END"):
        outputs.grammar_for({**spec, "after": after})
    assert len(outputs._grammar_compiler._compiled) == compiled


def test_compiled_grammars_are_bounded_however_many_specs_clients_send(llm, monkeypatch):
    """Each client's spec is a key of the engine's compiled grammars: a server that met every spec
    kept them all for its life. The least recently used go past the bound; a spec in use stays."""
    from sparsekv import structured
    monkeypatch.setattr(structured, "MAX_COMPILED_GRAMMARS", 4, raising=False)
    hot = {"type": "choice", "choices": ["alpha", "beta"]}
    for i in range(10):
        for spec in (hot, {"type": "choice", "choices": [f"alpha{i}", f"beta{i}"]}):
            out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0, structured_output=spec))[0]
            assert out.text in spec["choices"]
    compiled = llm.engine.outputs._grammar_compiler._compiled
    assert len(compiled) == 4
    assert structured.spec_key(hot) in compiled  # used at every other request: never the least recent


def test_a_spec_in_steady_use_compiles_once_however_many_others_pass_through(llm, monkeypatch):
    """The compiled grammars are dropped least recently used first, not oldest first: a spec asked for
    between every two others is never the least recent, so it compiles once while many more distinct
    specs than the bound pass through (a first-in-first-out bound would compile it again every
    MAX_COMPILED_GRAMMARS specs, on a server's hot path)."""
    from sparsekv import structured
    monkeypatch.setattr(structured, "MAX_COMPILED_GRAMMARS", 4, raising=False)
    compiled_keys = []
    compile_spec = structured.GrammarCompiler._compile

    def counted(self, spec):
        compiled_keys.append(structured.spec_key(spec))
        return compile_spec(self, spec)

    monkeypatch.setattr(structured.GrammarCompiler, "_compile", counted)
    outputs = llm.engine.outputs
    hot = {"type": "choice", "choices": ["steady-use", "hot"]}
    others = [{"type": "choice", "choices": [f"passing-{i}"]} for i in range(12)]
    for spec in others:
        outputs.grammar_for(hot)
        outputs.grammar_for(spec)
    assert compiled_keys.count(structured.spec_key(hot)) == 1
    assert len(compiled_keys) == 1 + len(others)
