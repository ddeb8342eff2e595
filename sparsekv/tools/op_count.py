"""Counting the torch ops a piece of code dispatches: how a decode step's cost grows with its batch.

On an accelerator every op is a kernel launch plus Python, so the number of ops a step dispatches,
not its arithmetic, sets a small-batch step's time. A count is exact and machine-independent, so
tests can assert it (tests/test_batched_decode.py) where they could never assert a time.

Every op reaching the dispatcher is counted once, views and factory functions included, at the level
torch's Python dispatch mode sees (after autograd, before the backend kernel); numpy and plain
Python work are not ops.
"""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as ops: ...`; then `ops.total` and `ops.by_kind` (op name -> count)."""

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_kind[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def decode_step_ops(engine, steps: int = 1) -> OpCounter:
    """The ops of the engine's next `steps` steps (callers make them decode steps), counted together."""
    with OpCounter() as ops:
        for _ in range(steps):
            engine.step()
    return ops


def fill_decoding(engine, prompts: list[list[int]], params) -> list[str]:
    """Add `prompts` and step until every one has its first token (prefill done, all decoding)."""
    ids = [f"ops-{len(p)}-{i}" for i, p in enumerate(prompts)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return ids
