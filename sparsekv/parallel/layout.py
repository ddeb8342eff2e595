"""Which rank holds which slice of the model. Torch-free: the planner and config checks read it too.

A world of `tensor_parallel_size x data_parallel_size` ranks (docs/parallel.md):

- Tensor parallelism shards the query heads (`q_b_proj` and `kv_b_proj` by head rows, `o_proj` by its
  input columns, then one all-reduce), every dense MLP and shared expert on its intermediate
  dimension (gate/up rows, down columns, then one all-reduce), and the embedding and lm_head by
  vocabulary rows. Routed experts are sharded on their intermediate dimension too, unless expert
  parallelism is on: then each rank holds E / world whole experts.
- Replicated: the MLA down-projections and norms (each rank computes the same latent, which the
  cache stores once per rank), the router, and the whole lightning indexer. Every rank therefore
  selects exactly the same positions from bit-identical inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, ModelConfig

# (name suffix, sharded dim) of the tensor-parallel slices; anything else is replicated
_ATTENTION_SHARDS = ((".self_attn.q_b_proj.weight", 0), (".self_attn.kv_b_proj.weight", 0),
                     (".self_attn.o_proj.weight", 1))
_MLP_SHARDS = ((".gate_proj.weight", 0), (".up_proj.weight", 0), (".down_proj.weight", 1))
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight", ".embed_tokens.weight", ".shared_head.head.weight")


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's place in the world. Rank r is tensor rank r % tp of data-parallel group r // tp."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    def for_rank(self, rank: int) -> "ParallelLayout":
        return ParallelLayout(self.tensor_parallel_size, self.data_parallel_size, self.expert_parallel, rank)

    # -- checks --------------------------------------------------------------------------------
    def check_model(self, cfg: ModelConfig) -> None:
        """ConfigError unless every sharded dimension divides evenly (before any weight loads)."""
        tp, world = self.tensor_parallel_size, self.world_size
        if self.data_parallel_size > 1 and tp > 1:
            raise ConfigError("data_parallel_size > 1 runs with tensor_parallel_size 1 (data-parallel attention: "
                              "each rank holds whole attention and its own requests); combining both is not "
                              "supported yet")
        checks = [("num_attention_heads", cfg.num_attention_heads, tp, "tensor_parallel_size"),
                  ("vocab_size", cfg.vocab_size, tp, "tensor_parallel_size"),
                  ("intermediate_size", cfg.intermediate_size, tp, "tensor_parallel_size")]
        if cfg.n_routed_experts:
            checks.append(("moe_intermediate_size", cfg.moe_intermediate_size, tp, "tensor_parallel_size"))
            if self.expert_parallel:
                checks.append(("n_routed_experts", cfg.n_routed_experts, world,
                               "the world size (tensor_parallel_size x data_parallel_size) with expert parallelism"))
        for field, value, size, option in checks:
            if value % size:
                raise ConfigError(f"the model's {field} ({value}) is not divisible by {option} ({size})")

    # -- slices --------------------------------------------------------------------------------
    def local_experts(self, num_experts: int) -> range:
        """The routed experts this rank computes: all of them (sharded) without expert parallelism."""
        if not self.expert_parallel:
            return range(num_experts)
        per = num_experts // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    def holds(self, name: str, cfg: ModelConfig) -> bool:
        """Whether this rank loads the tensor at all (expert parallelism skips other ranks' experts)."""
        expert = _routed_expert(name)
        return expert is None or expert in self.local_experts(cfg.n_routed_experts)

    def shard(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, end) of this rank's slice of a tensor of `shape`, or None: it holds all of it."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return None
        dim = _sharded_dim(name, whole_experts=self.expert_parallel)
        if dim is None:
            return None
        size = shape[dim] // tp
        return dim, self.tp_rank * size, (self.tp_rank + 1) * size


def _routed_expert(name: str) -> int | None:
    parts = name.split(".")
    if "experts" in parts and parts[parts.index("experts") - 1] == "mlp":
        return int(parts[parts.index("experts") + 1])
    return None


def _sharded_dim(name: str, whole_experts: bool) -> int | None:
    if name in _VOCAB_TENSORS[:2] or name.endswith(_VOCAB_TENSORS[2:]):
        return 0
    for suffix, dim in _ATTENTION_SHARDS:
        if name.endswith(suffix):
            return dim
    if ".mlp." in name:
        if whole_experts and _routed_expert(name) is not None:
            return None
        for suffix, dim in _MLP_SHARDS:
            if name.endswith(suffix):
                return dim
    return None
