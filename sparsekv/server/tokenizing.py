"""Tokenizing off the event loop and off the engine thread.

Tokenizing a prompt of a few MB takes seconds. On the engine thread that stalls every running stream;
on the event loop, every request, /health included. So the server turns text into token ids here, in
a small thread pool, and hands the engine ids only.

- Each worker has its own copy of the server's tokenizer: HF fast tokenizers are not safe to share
  across threads.
- `Encoder` calls the Rust tokenizer's `encode_batch_fast` and `decode_batch`, which drop the GIL
  while they run (a plain `encode` or `decode` holds it from start to end); the former also skips the
  offsets nobody reads. They are used only where they give what `tokenizer.encode` and `decode` give,
  which the engine uses (checked on probe texts when the worker starts).
- A prompt longer than a token limit (max_model_len) is refused after tokenizing prefixes of
  growing length (`Encoder.ids_within`), not the whole text.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

from ..input_processor import special_token_ends

log = logging.getLogger("sparsekv.server")
TOKENIZER_THREADS = 2
CHARS_PER_TOKEN_GUESS = 4  # the first prefix tried holds this many characters per token of the limit
# Cutting a text can change the tokens of the word the cut falls in; a prefix must exceed the limit by
# this much before the whole text is known to exceed it.
CUT_SLACK_TOKENS = 64
JSON_IDS_PER_PIECE = 16384  # token ids written to JSON per piece: the GIL is free between pieces
PROBE_TEXTS = ("hello world", "a , b . c ! d ? it 's, don't", "  two  spaces\tand a tab\n",
               "caf\u00e9 \u4e2d\u6587 \U0001f600 12345", "<|endoftext|> <s></s> <eos> [CLS] <|user|>", "")


class Encoder:
    """One worker's tokenizer and its fastest exact way to encode and decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast_encode = getattr(backend, "encode_batch_fast", None)
        self._fast_decode = getattr(backend, "decode_batch", None)
        if not (self._fast_encode and self._fast_decode and self._fast_is_exact()):
            log.info("tokenizer %s: tokenizing with encode/decode (holding the GIL)", type(tokenizer).__name__)
            self._fast_encode = self._fast_decode = None

    def _fast_is_exact(self) -> bool:
        for text in PROBE_TEXTS:
            for special in (False, True):
                ids = self.tokenizer.encode(text, add_special_tokens=special)
                if self._fast_encode([text], add_special_tokens=special)[0].ids != ids:
                    return False
                if self._fast_decode([ids], skip_special_tokens=False)[0] != self.tokenizer.decode(ids):
                    return False
        return True

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._fast_encode is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._fast_encode([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        if self._fast_decode is None:
            return self.tokenizer.decode(ids)
        return self._fast_decode([ids], skip_special_tokens=False)[0]

    @cached_property
    def special_ends(self) -> tuple[int, int]:
        """How many special tokens encoding with them adds before and after a text (input_processor)."""
        return special_token_ends(self.encode)

    def ids_within(self, text: str, limit: int, add_special_tokens: bool = False) -> list[int] | None:
        """The token ids of `text`, or None once it is known to have more than `limit` tokens.

        Prefixes four times longer each time are tokenized first; one with more than limit + slack
        tokens settles it. A long prompt is thus refused after tokenizing about what `limit` tokens
        take, and a prompt within the limit costs less than 2 1/3 times tokenizing it once (the
        prefixes before it add up to under 4/3 of its length). The ids returned may still be over
        `limit` (the caller reports the exact count)."""
        size = (limit + CUT_SLACK_TOKENS) * CHARS_PER_TOKEN_GUESS
        while size < len(text):
            if len(self.encode(text[:size], add_special_tokens)) > limit + CUT_SLACK_TOKENS:
                return None
            size *= 4
        return self.encode(text, add_special_tokens)


class TokenizerPool:
    """Runs `fn(encoder, *args)` on a worker thread that has its own copy of the tokenizer."""

    def __init__(self, tokenizer, threads: int = TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(threads, "sparsekv-tokenize", initializer=self._start_worker)

    def _start_worker(self) -> None:
        self._local.encoder = Encoder(copy.deepcopy(self.tokenizer))

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn, args):
        return fn(self._local.encoder, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def ids_json(ids: list[int]) -> str:
    """`ids` as a JSON array, written a piece at a time so that other threads get the GIL between
    pieces (one `json.dumps` of a million ids holds it for about half a second)."""
    pieces = [",".join(map(str, ids[i:i + JSON_IDS_PER_PIECE])) for i in range(0, len(ids), JSON_IDS_PER_PIECE)]
    return "[" + ",".join(pieces) + "]"
