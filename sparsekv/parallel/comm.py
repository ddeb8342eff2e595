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


def all_true(flag: bool, device: torch.device, group) -> bool:
    """Whether `flag` holds on every rank of `group`."""
    votes = torch.tensor([int(flag)], device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    return bool(votes.item())


class SingleRank:
    """No other rank: collectives are identities."""

    world_size, rank, tp_size = 1, 0, 1  # tp_size: ranks that split each layer's heads and MLPs

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def vocab_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return F.linear(h, head).float()

    def ffn(self, ffn, x: torch.Tensor) -> torch.Tensor:
        return ffn(x)

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on every rank (a decision every rank must take alike)."""
        return flag


class TensorParallel:
    """Collectives of the tensor-parallel group. Every rank calls them in the same order."""

    def __init__(self, group, world_size: int, rank: int):
        self.group, self.world_size, self.rank, self.tp_size = group, world_size, rank, world_size
        self.bytes_sent = {"all_reduce": 0, "all_gather": 0}  # per rank, ring algorithms

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (row-parallel outputs), the same on every rank."""
        n = self.world_size
        self.bytes_sent["all_reduce"] += 2 * (n - 1) * x.numel() * x.element_size() // n
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over the ranks (a score over all query heads from each rank's)."""
        self.bytes_sent["all_reduce"] += 2 * (self.world_size - 1) * x.numel() * x.element_size() // self.world_size
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on every rank (a decision every rank must take alike)."""
        return all_true(flag, device, self.group)

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows give their embeddings, the others zeros; the sum is
        exact (one non-zero term per element)."""
        first = self.rank * table.shape[0]
        local = ids - first
        outside = (local < 0) | (local >= table.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside[:, None], 0)
        return self.all_reduce(e)

    def ffn(self, ffn, x: torch.Tensor) -> torch.Tensor:
        return ffn(x)  # this rank's partial output; the decoder layer all-reduces it

    def vocab_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary from this rank's rows of the head (all-gathered)."""
        local = F.linear(h, head).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.bytes_sent["all_gather"] += (self.world_size - 1) * local.numel() * local.element_size()
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


class ExpertParallelDP(SingleRank):
    """Data-parallel attention with expert parallelism, one rank per data-parallel group: attention,
    dense MLPs, shared experts and the vocabulary are whole on every rank (no collective), and the
    routed experts are spread over the ranks. At each MoE layer the ranks' tokens meet: an all-gather
    gives every rank every token, each runs its own experts on all of them (the router is replicated,
    so every rank routes a token the same way), and a reduce-scatter returns to each rank the sum of
    every rank's contribution for its own tokens.

    All-gather + reduce-scatter rather than all_to_all dispatch: no routing metadata crosses ranks and
    the layout is the same whatever the routing; at two ranks it sends what all_to_all would, at more
    ranks about world / (2 topk) times more (the planner prints both). A rank with no tokens still
    takes part (`DecoderLayer.idle`): every rank runs every MoE layer of a pass in lockstep.
    """

    def __init__(self, group, world_size: int, rank: int):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.bytes_sent = {"moe_all_gather": 0, "moe_reduce_scatter": 0}
        # every rank's pass has as many rows as this one's (the decode pieces of an agreed bucket): no
        # counts exchanged, so the exchange has fixed shapes and reads nothing back to the host
        self.uniform_rows = False

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on every rank (a decision every rank must take alike)."""
        return all_true(flag, device, self.group)

    def ffn(self, ffn, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(ffn, "routed"):  # a dense MLP: whole here
            return ffn(x)
        counts = [x.shape[0]] * self.world_size if self.uniform_rows else self._counts(x.shape[0], x.device)
        widest = max(counts)
        if widest == 0:
            return x
        everyone = self._all_gather(x, widest, counts)
        first = sum(counts[:self.rank])  # this rank's rows among everyone's (the ones its routing records)
        mine = self._reduce_scatter(ffn.routed(everyone, slice(first, first + counts[self.rank])), widest, counts)
        return mine + ffn.shared(x)

    def _counts(self, n: int, device: torch.device) -> list[int]:
        """Every rank's row count (on `device`: the group is NCCL on CUDA, which moves CUDA tensors only)."""
        out = torch.zeros(self.world_size, dtype=torch.long, device=device)
        dist.all_gather_single(out, torch.tensor([n], device=device), group=self.group)
        return out.tolist()

    def _all_gather(self, x: torch.Tensor, widest: int, counts: list[int]) -> torch.Tensor:
        padded = torch.zeros(widest, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:x.shape[0]] = x
        gathered = torch.empty(self.world_size * widest, x.shape[1], dtype=x.dtype, device=x.device)
        self.bytes_sent["moe_all_gather"] += (self.world_size - 1) * padded.numel() * padded.element_size()
        dist.all_gather_single(gathered, padded, group=self.group)
        return torch.cat([gathered[r * widest:r * widest + n] for r, n in enumerate(counts)])

    def _reduce_scatter(self, y: torch.Tensor, widest: int, counts: list[int]) -> torch.Tensor:
        padded = torch.zeros(self.world_size * widest, y.shape[1], dtype=y.dtype, device=y.device)
        start = 0
        for r, n in enumerate(counts):
            padded[r * widest:r * widest + n] = y[start:start + n]
            start += n
        mine = torch.empty(widest, y.shape[1], dtype=y.dtype, device=y.device)
        self.bytes_sent["moe_reduce_scatter"] += (self.world_size - 1) * mine.numel() * mine.element_size()
        dist.reduce_scatter_single(mine, padded, group=self.group)
        return mine[:counts[self.rank]]
