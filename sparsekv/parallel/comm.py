"""The collectives the model calls, over torch.distributed (gloo on CPU, NCCL on CUDA).

`SingleRank` is the one-process case: every collective is the identity, so a one-rank model computes
exactly what it did before parallelism existed. `TensorParallel` runs them on the world's group and
counts the bytes each collective sends per rank (`sparsekv bench parallel` prints them next to the
planner's prediction).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SingleRank:
    """No other rank: collectives are identities."""

    world_size, rank = 1, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def vocab_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return F.linear(h, head).float()


class TensorParallel:
    """Collectives of the tensor-parallel group. Every rank calls them in the same order."""

    def __init__(self, group, world_size: int, rank: int):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.bytes_sent = {"all_reduce": 0, "all_gather": 0}  # per rank, ring algorithms

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (row-parallel outputs), the same on every rank."""
        n = self.world_size
        self.bytes_sent["all_reduce"] += 2 * (n - 1) * x.numel() * x.element_size() // n
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows give their embeddings, the others zeros; the sum is
        exact (one non-zero term per element)."""
        first = self.rank * table.shape[0]
        local = ids - first
        outside = (local < 0) | (local >= table.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside[:, None], 0)
        return self.all_reduce(e)

    def vocab_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary from this rank's rows of the head (all-gathered)."""
        local = F.linear(h, head).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.bytes_sent["all_gather"] += (self.world_size - 1) * local.numel() * local.element_size()
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)
