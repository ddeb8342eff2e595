"""Incremental detokenization: each step decodes a few tokens, not the whole output (no torch).

A token's text can depend on its neighbours: byte-level BPE splits a multi-byte character across
tokens, and SentencePiece-style tokenizers drop or keep a leading space by context. So the new text
of a step is the difference between decoding a short window of recent tokens with and without the new
ones (vLLM's prefix/read offsets). While that window ends in half a character (U+FFFD), the tokens
wait; when the request finishes, one full decode gives the final text exactly.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output tokens, kept up to date one step at a time."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.text = ""
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0    # tokens whose text is already in `self.text`

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: list[int]) -> str:
        """`token_ids`: every output token so far. Appends and returns the text that became final."""
        before = self._decode(token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(token_ids[self.prefix_offset:])
        if len(window) <= len(before) or window.endswith(REPLACEMENT_CHAR):
            return ""
        new = window[len(before):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return new

    def finish(self, token_ids: list[int]) -> str:
        """The exact text of all of `token_ids` (one full decode, once per request)."""
        self.text = self._decode(token_ids)
        self.read_offset = len(token_ids)
        return self.text


def find_stop(text: str, new_chars: int, stop_strings: list[str]) -> int:
    """Index of the first stop string that the last `new_chars` characters completed, or -1.

    Earlier steps already searched everything before, so only the tail a new match can touch is read.
    """
    return stop_match(text, new_chars, stop_strings)[0]


def stop_match(text: str, new_chars: int, stop_strings: list[str]) -> tuple[int, str]:
    """(index, stop string) of the first stop string the last `new_chars` characters completed, or
    (-1, ""); at one index the first stop string listed."""
    found, which = -1, ""
    for stop in stop_strings:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        cut = text.find(stop, start)
        if cut >= 0 and (found < 0 or cut < found):
            found, which = cut, stop
    return found, which
