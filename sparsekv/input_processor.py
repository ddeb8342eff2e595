"""Prompts -> checked token ids: tokenization, vLLM's left truncation, and every check a request must
pass before it is queued (vocabulary, lengths, what the KV cache can ever hold)."""
from __future__ import annotations

import os
from functools import cached_property

from .request import InvalidRequest, SamplingParams


def load_tokenizer(path: str):
    """The checkpoint's tokenizer through transformers, or None (token-id prompts still work)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def check_prompt_tokens(token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """A prompt's token ids against the vocabulary, and its length with max_tokens against max_model_len
    (InvalidRequest naming the first that fails)."""
    if not token_ids:
        raise InvalidRequest("prompt is empty", "prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    if len(token_ids) > max_model_len:
        raise InvalidRequest(f"prompt has {len(token_ids)} tokens, longer than max_model_len {max_model_len}", "prompt")
    if len(token_ids) + max_tokens > max_model_len:
        raise InvalidRequest(f"prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {max_model_len}", "max_tokens")


# apply_chat_template's arguments that chat() sets itself (the server refuses the same in chat_template_kwargs)
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                               "add_generation_prompt", "continue_final_message", "padding", "truncation",
                               "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                               "tokenizer_kwargs"})


def special_token_ends(encode) -> tuple[int, int]:
    """How many special tokens `encode(text, True)` puts before and after the text's own tokens (a BOS,
    an EOS), found by encoding a short text with and without them."""
    plain, full = encode("a", False), encode("a", True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return start, len(full) - start - len(plain)
    return 0, 0


def truncate_left(ids: list[int], keep: int, ends: tuple[int, int] = (0, 0)) -> list[int]:
    """vLLM's left truncation to `keep` tokens (truncate_prompt_tokens): the last ones, and the special
    tokens the tokenizer put at either end (`ends`: how many) kept, as a tokenizer that truncates does."""
    if len(ids) <= keep:
        return ids
    head, tail = ends
    body = max(keep - head - tail, 0)
    text = ids[head:len(ids) - tail]
    return ids[:head] + (text[len(text) - body:] if body else []) + ids[len(ids) - tail:]


class InputProcessor:
    """`check_fits(num_prompt_tokens, max_tokens)`: the cache manager's capacity check; `max_logprobs`:
    the most alternatives per token a request may ask for (EngineConfig.max_logprobs)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, check_fits, max_logprobs: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.check_fits, self.max_logprobs = check_fits, max_logprobs

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if params.n != 1:
            raise InvalidRequest(f"n={params.n}: an engine request is one choice; LLM.generate and the server run "
                                 f"one request per choice", "n")
        token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # vLLM's left truncation
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = truncate_left(token_ids, keep, self._special_ends if isinstance(prompt, str) else (0, 0))
        self.validate(token_ids, params)
        return token_ids

    @cached_property
    def _special_ends(self) -> tuple[int, int]:
        """The special tokens the tokenizer adds before and after a text."""
        return special_token_ends(lambda text, special: self.tokenizer.encode(text, add_special_tokens=special))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("text prompt given but the checkpoint has no tokenizer; pass token ids", "prompt")
            return self.tokenizer.encode(prompt)  # with its special tokens (BOS), as vLLM's LLM.generate
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("prompt must be a string or a list of integer token ids", "prompt")
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        check_prompt_tokens(token_ids, params.max_tokens, vocab, self.max_model_len)
        self.check_fits(len(token_ids), params.max_tokens)
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this checkpoint has none", "stop")
        self._check_logprobs(params)
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            outside = [t for t in getattr(params, name) or () if t >= vocab]
            if outside:
                raise InvalidRequest(f"{name} token id {outside[0]} is outside the vocabulary [0, {vocab})", name)

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = min(self.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > limit:
                bound = (f"max_logprobs ({self.max_logprobs}; --max-logprobs raises it)" if self.max_logprobs <= self.vocab_size
                         else f"the vocabulary's {self.vocab_size} tokens")
                raise InvalidRequest(f"invalid sampling parameter {name}: {asked} alternatives per token asked, more than "
                                     f"{bound}", name)
