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


class PieceSplit(OpCounter):
    """An OpCounter that also counts the ops dispatched inside the decode graphs' pieces (model/decode_graphs.py):
    on CUDA those replay as one graph per piece, and only the rest are launched one by one."""

    def __init__(self):
        super().__init__()
        self.inside, self.in_piece, self.pieces = 0, False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.inside += self.in_piece
        return super().__torch_dispatch__(func, types, args, kwargs)

    def piece(self, run):
        def counted():
            self.in_piece, self.pieces = True, self.pieces + 1
            try:
                run()
            finally:
                self.in_piece = False
        return counted

    @property
    def launches(self) -> int:
        """What a step dispatches with the pieces replayed: the ops outside them, and a graph per piece."""
        return self.total - self.inside + self.pieces


def decode_graph_step_ops(engine) -> PieceSplit:
    """The ops of the engine's next step (a decode step of a decode-graphs engine, with its MTP extend
    pass and draft steps where it drafts), split by the pieces they run in."""
    from ..model.decode_graphs import BucketPieces, DraftPieces, ExtendPieces
    real = {cls: cls.pieces for cls in (BucketPieces, DraftPieces, ExtendPieces)}
    split = PieceSplit()
    for cls in real:
        cls.pieces = lambda self, cls=cls: [split.piece(p) for p in real[cls](self)]
    try:
        with split:
            engine.step()
    finally:
        for cls, pieces in real.items():
            cls.pieces = pieces
    return split


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
