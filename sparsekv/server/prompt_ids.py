"""A request's prompts as token ids, tokenized off the engine thread (`ServerState.pooled`): within
max_model_len, or cut as the engine cuts them. The OpenAI routes (app.py) and SGLang's /generate
(native.py) share it."""
from __future__ import annotations

import logging

from ..input_processor import truncate_left
from ..request import InvalidRequest
from .tokenizing import Encoder

log = logging.getLogger("sparsekv.server")


def encode_text(encoder: Encoder, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    try:
        return encoder.encode(text, add_special_tokens)
    except Exception:  # the tokenizer's own message names its types, not the client's mistake
        log.warning("tokenizing a request's %s failed", param, exc_info=True)
        raise InvalidRequest(f"the {param} could not be tokenized", param) from None


def encode_within(encoder: Encoder, text: str, limit: int, param: str, add_special_tokens: bool = False) -> list[int]:
    try:
        ids = encoder.ids_within(text, limit, add_special_tokens)
    except Exception:
        log.warning("tokenizing a request's %s failed", param, exc_info=True)
        raise InvalidRequest(f"the {param} could not be tokenized", param) from None
    if ids is None:
        raise InvalidRequest(f"the prompt is longer than max_model_len ({limit} tokens)", param)
    check_length(ids, limit, param)
    return ids


def check_length(ids: list[int], limit: int, param: str) -> None:
    if len(ids) > limit:  # the engine's message; checked here so that the engine thread never walks the ids
        raise InvalidRequest(f"prompt has {len(ids)} tokens, longer than max_model_len {limit}", param)


def completion_prompt_ids(encoder: Encoder | None, prompts: list, limit: int, truncate: int | None,
                          add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt's token ids, cut to its last `truncate` tokens as the engine would (vLLM's left
    truncation; -1: the last `limit`). Without truncation a prompt over `limit` is refused here. Text
    is tokenized with the tokenizer's special tokens (BOS) unless `add_special_tokens` is false."""
    out = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            ids = prompt
        elif encoder is None:
            raise InvalidRequest("text prompt given but the checkpoint has no tokenizer; pass token ids", "prompt")
        elif truncate is None:
            ids = encode_within(encoder, prompt, limit, "prompt", add_special_tokens)
        else:
            ids = encode_text(encoder, prompt, "prompt", add_special_tokens)
        if truncate is not None:  # a text prompt keeps the special tokens the tokenizer put at its ends
            ends = encoder.special_ends if isinstance(prompt, str) and add_special_tokens else (0, 0)
            ids = truncate_left(ids, limit if truncate == -1 else truncate, ends)
        check_length(ids, limit, "prompt")
        out.append(ids)
    return out
