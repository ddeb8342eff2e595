"""Reasoning split out of a chat completion: `<think>...</think>` becomes `reasoning_content`.

GLM-5 and DeepSeek-V3.2 both think inside `<think>...</think>` before they answer. Either the chat
template opens the block at the end of the prompt (DeepSeek-V3.2 with `thinking`, GLM's templates
when thinking is on), so the completion starts inside it, or the model writes `<think>` itself as
its first text. The block ends at `</think>`; a completion cut off before it is all reasoning.
Text after the block is the message's content, where tool calls are looked for. A `<think>` later
in the content is content (only the start of a completion can open the block).

`--reasoning-parser` takes vLLM's names for these models; they share this one format.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("glm45", "deepseek_v3", "deepseek_r1")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered chat prompt leaves the model inside a think block."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning, or None when the completion has no think block; content)."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN):]
    reasoning, _, content = text.partition(THINK_CLOSE)
    return reasoning, content


def undecided_chars(text: str, opened: bool) -> int:
    """How many trailing characters of a growing completion cannot be placed yet: all of it while
    it may still become `<think>`, or the start of a `</think>` at the end of unfinished reasoning."""
    if not opened:
        stripped = text.lstrip()
        if THINK_OPEN.startswith(stripped):  # only whitespace so far, or a piece of `<think>`
            return len(text)
        if not stripped.startswith(THINK_OPEN):
            return 0
    return 0 if THINK_CLOSE in text else marker_start(text, THINK_CLOSE)


def marker_start(text: str, marker: str) -> int:
    """Length of the longest proper start of `marker` that `text` ends with (0: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
