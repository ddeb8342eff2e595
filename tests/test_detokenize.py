"""Incremental detokenization: the streamed text is always a prefix of the full decode, the final text
is exactly the full decode, and stop strings are found in the tail as a full search finds them."""
from __future__ import annotations

import random

import pytest
import torch

from sparsekv.detokenize import IncrementalDetokenizer, find_stop
from sparsekv.input_processor import load_tokenizer
from sparsekv.paths import default_model_path

TEXT = "def f(x):\n    return x  # héllo wörld — 日本語 ✓ naïve café\n\tprint('ok')  \n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_streamed_text_is_a_prefix_and_final_text_is_exact(tokenizer):
    rng = random.Random(0)
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    ids += [rng.randrange(tokenizer.vocab_size) for _ in range(200)]  # arbitrary tokens, split characters
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        new = detok.update(ids[:n])
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(detok.text) and detok.text.endswith(new)
        assert not new.endswith("\ufffd")  # half a character waits for the rest
    assert detok.finish(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_text_keeps_up_with_complete_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    assert detok.text == TEXT  # nothing left pending once the text ends on a whole character


def test_find_stop_in_the_tail_matches_a_full_search():
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        # simulate steps: the first step at which a stop appears must report its first occurrence
        seen = -1
        for end in range(1, len(text) + 1):
            found = find_stop(text[:end], 1, stops)
            if found >= 0:
                seen = found
                break
        first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        assert seen == first


def test_engine_text_is_the_full_decode_and_stops_cut_exactly(tokenizer):
    from sparsekv import LLM, SamplingParams
    llm = LLM(default_model_path(), max_model_len=256)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    out = llm.generate(["def fibonacci(n):"], greedy)[0]
    assert out.finish_reason == "length"
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    stop = out.text[len(out.text) // 2:len(out.text) // 2 + 3]
    cut = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.index(stop)]


def test_stop_strings_written_before_min_tokens_do_not_count():
    """vLLM's min_tokens: stop strings are looked for only after min_tokens are out, so an occurrence
    completed before then stays in the text and the cut is at the first one completed after (the
    text streamed before is never taken back)."""
    from sparsekv import LLM, SamplingParams
    llm = LLM(default_model_path(), max_model_len=256)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=5, temperature=0.0))[0]
    first_token_text = llm.engine.tokenizer.decode(out.token_ids[:1])
    assert "\n" in first_token_text  # the first token writes a newline: a stop string at once
    assert llm.generate(["def f(x):"], SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"]))[0].text == \
        out.text[:out.text.index("\n")]
    held = llm.generate(["def f(x):"], SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], min_tokens=2))[0]
    assert held.finish_reason == "stop" and len(held.token_ids) >= 3
    early = len(llm.engine.tokenizer.decode(out.token_ids[:2]))  # text out before the third token
    assert held.text == out.text[:out.text.index("\n", early - len("\n") + 1)]
    assert held.text.startswith(out.text[:early])


def _forcing(token_ids: list[int]):
    """A logits processor that makes the output exactly `token_ids` (then EOS)."""
    def force(output_ids, logits):
        forced = torch.full_like(logits, -float("inf"))
        forced[token_ids[len(output_ids)] if len(output_ids) < len(token_ids) else 0] = 0.0
        return forced
    return [force]


@pytest.fixture(scope="module")
def small_llm():
    from sparsekv import LLM
    return LLM(default_model_path(), max_model_len=256, num_threads=1)


def _forced(llm, token_ids: list[int], **params):
    from sparsekv import SamplingParams
    return llm.generate(["x"], SamplingParams(temperature=0.0, logits_processors=_forcing(token_ids), **params))[0]


def test_a_stop_string_counts_from_token_min_tokens_plus_one(small_llm, tokenizer):
    """vLLM's min_tokens: stop strings, like EOS and stop token ids, can end the output from token
    min_tokens + 1 on; one completed by token min_tokens stays in the text."""
    ab, newline, cd = tokenizer.encode("ab\ncd", add_special_tokens=False)
    tokens = [ab, newline, cd, newline, cd]
    assert _forced(small_llm, tokens, max_tokens=5, stop=["\n"], min_tokens=1).text == "ab"
    held = _forced(small_llm, tokens, max_tokens=5, stop=["\n"], min_tokens=2)
    assert held.text == "ab\ncd" and held.finish_reason == "stop" and len(held.token_ids) == 4


def test_a_stop_token_is_in_the_text_with_include_stop_str_in_output(small_llm, tokenizer):
    ab, newline, cd = tokenizer.encode("ab\ncd", add_special_tokens=False)
    cut = _forced(small_llm, [ab, newline, cd], max_tokens=5, stop_token_ids=[newline])
    assert cut.text == "ab" and cut.stop_reason == newline
    kept = _forced(small_llm, [ab, newline, cd], max_tokens=5, stop_token_ids=[newline],
                   include_stop_str_in_output=True)
    assert kept.text == "ab\n" and kept.stop_reason == newline and kept.token_ids == cut.token_ids


def test_special_tokens_are_in_the_text_with_skip_special_tokens_off(small_llm, tokenizer):
    ab, _, cd = tokenizer.encode("ab\ncd", add_special_tokens=False)
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    assert _forced(small_llm, [ab, user, cd], max_tokens=3).text == "abcd"
    assert _forced(small_llm, [ab, user, cd], max_tokens=3, skip_special_tokens=False).text == "ab<|user|>cd"


def test_eos_ends_the_output_after_min_tokens_with_no_stop_reason(small_llm, tokenizer):
    """EOS (made the most probable by a bias): the output ends there, stop_reason None (vLLM: set
    for a stop string or a stop token id only); min_tokens holds EOS back for that many tokens."""
    from sparsekv import SamplingParams
    eos = min(small_llm.engine.outputs.eos_token_ids)
    for min_tokens in (0, 3):
        out = small_llm.generate(["x"], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0},
                                                       min_tokens=min_tokens))[0]
        assert out.token_ids[-1] == eos and len(out.token_ids) == min_tokens + 1, (min_tokens, out.token_ids)
        assert out.finish_reason == "stop" and out.stop_reason is None


class _SentencePieceLike:
    """A SentencePiece-style tokenizer: pieces joined, "▁" a space, and the decoded text's leading space
    dropped, so a piece's text depends on what comes before it ("▁world" is " world" after "▁Hello",
    "world" alone). <s> is special."""

    PIECES = ["▁Hello", "▁world", "<s>", ","]
    HELLO, WORLD, SPECIAL, COMMA = range(4)

    def decode(self, token_ids, skip_special_tokens=True):
        text = "".join(self.PIECES[t] for t in token_ids
                       if not (skip_special_tokens and t == self.SPECIAL)).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_streamed_text_keeps_the_spaces_a_context_dependent_tokenizer_decodes_by_context():
    """The new text of a step is decoded with the tokens before it in the window: decoding the new
    tokens alone (no context window), or moving the window past a token that added no text (a skipped
    special token), would drop the space that "▁world" has after a word: "Helloworld"."""
    sp = _SentencePieceLike()
    for ids in ([sp.HELLO, sp.WORLD, sp.COMMA, sp.WORLD], [sp.HELLO, sp.SPECIAL, sp.WORLD, sp.SPECIAL, sp.WORLD]):
        detok = IncrementalDetokenizer(sp)
        streamed = "".join(detok.update(ids[:n]) for n in range(1, len(ids) + 1))
        assert streamed == detok.text == sp.decode(ids), ids
        assert detok.finish(ids) == sp.decode(ids)


def test_stop_match_takes_the_earliest_stop_and_the_first_listed_at_one_index():
    """A stop string completed at a lower index wins over one listed before it; at one index (a
    stop string and its own prefix completed by one token) the first listed wins, which decides the
    stop_reason and, with include_stop_str_in_output, the text kept."""
    from sparsekv.detokenize import stop_match
    assert stop_match("xabc", 3, ["c", "b"]) == (2, "b")
    assert stop_match("x\n\n", 2, ["\n\n", "\n"]) == (1, "\n\n")
    assert stop_match("x\n\n", 2, ["\n", "\n\n"]) == (1, "\n")
    # the new text is all the text: a stop string as long as the text is found at index 0
    assert stop_match("ab", 2, ["ab"]) == (0, "ab") and find_stop("ab", 2, ["ab"]) == 0
    assert stop_match("ab", 1, ["ab"]) == (0, "ab") and stop_match("ab", 2, ["abc"]) == (-1, "")


def test_stop_strings_completed_together_end_at_the_first_listed(small_llm, tokenizer):
    """One token ("\\n\\n") completes two stop strings at one index: the first listed is the
    stop_reason and, with include_stop_str_in_output, the text kept."""
    x, blank = tokenizer.encode("x\n\n", add_special_tokens=False)
    assert tokenizer.decode([blank]) == "\n\n"
    out = _forced(small_llm, [x, blank, x], max_tokens=3, stop=["\n\n", "\n"], include_stop_str_in_output=True)
    assert (out.text, out.stop_reason, out.finish_reason) == ("x\n\n", "\n\n", "stop")
    out = _forced(small_llm, [x, blank, x], max_tokens=3, stop=["\n", "\n\n"], include_stop_str_in_output=True)
    assert (out.text, out.stop_reason, out.finish_reason) == ("x\n", "\n", "stop")


def test_a_stop_string_inside_one_tokens_text_is_found(small_llm, tokenizer):
    """The search covers all of a step's new text, not only its last character: a stop string at
    the start of a multi-character token's text ends the output there."""
    ab, newline, cd = tokenizer.encode("ab\ncd", add_special_tokens=False)
    out = _forced(small_llm, [ab, newline, cd], max_tokens=3, stop=["a"])
    assert (out.text, out.stop_reason, out.finish_reason, out.token_ids) == ("", "a", "stop", [ab])


def test_an_output_cut_by_max_tokens_mid_character_has_the_full_decode_as_text(small_llm, tokenizer):
    """max_tokens can end the output inside a multi-byte character: the final text is the full
    decode of the tokens (its half character a U+FFFD), not the incremental text that held it back."""
    ab = tokenizer.encode("ab", add_special_tokens=False)
    half = tokenizer.encode("日", add_special_tokens=False)[:2]
    assert tokenizer.decode(half).endswith("\ufffd")
    out = _forced(small_llm, ab + half, max_tokens=len(ab) + len(half))
    assert out.finish_reason == "length" and out.token_ids == ab + half
    assert out.text == tokenizer.decode(ab + half) and out.text.startswith("ab") and out.text.endswith("\ufffd")


def test_eos_named_as_a_stop_token_with_ignore_eos_is_the_stop_reason(small_llm, tokenizer):
    """vLLM: with ignore_eos, EOS ends the output only as a listed stop token id, and then it is the
    stop_reason (None is for EOS ending it as EOS)."""
    ab = tokenizer.encode("ab", add_special_tokens=False)
    eos = min(small_llm.engine.outputs.eos_token_ids)
    out = _forced(small_llm, ab + [eos], max_tokens=5, ignore_eos=True, stop_token_ids=[eos])
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == (ab + [eos], "stop", eos, "ab")
    plain = _forced(small_llm, ab + [eos], max_tokens=5)
    assert (plain.token_ids, plain.finish_reason, plain.stop_reason) == (ab + [eos], "stop", None)
