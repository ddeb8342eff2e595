"""Which rank holds which slice (parallel/layout.py), the vocabulary-parallel embedding's row ranges
(parallel/comm.py) and how a launcher's environment is read (parallel/launch.py): arithmetic on names,
shapes and configs, no process group."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sparsekv.config import ConfigError, ModelConfig
from sparsekv.parallel.layout import ParallelLayout


def test_rank_r_is_tensor_rank_r_mod_tp_of_data_parallel_group_r_div_tp():
    layout = ParallelLayout(2, 3)
    assert layout.world_size == 6
    assert [(layout.for_rank(r).tp_rank, layout.for_rank(r).dp_rank) for r in range(6)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # a slice is the tensor rank's: ranks 1 and 3 hold the same half
    for rank in (1, 3):
        assert layout.for_rank(rank).shard("model.layers.0.self_attn.q_b_proj.weight", (8, 4)) == (0, 4, 8)


SHARDS = {  # name -> sharded dim under tensor parallelism (None: replicated), with and without expert parallelism
    "model.embed_tokens.weight": (0, 0), "lm_head.weight": (0, 0),
    "model.layers.2.embed_tokens.weight": (0, 0), "model.layers.2.shared_head.head.weight": (0, 0),  # an MTP layer's own
    "model.layers.0.self_attn.q_b_proj.weight": (0, 0), "model.layers.0.self_attn.kv_b_proj.weight": (0, 0),
    "model.layers.0.self_attn.o_proj.weight": (1, 1),
    "model.layers.0.self_attn.q_a_proj.weight": (None, None), "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (None, None),
    "model.layers.0.self_attn.indexer.wq_b.weight": (None, None), "model.layers.0.input_layernorm.weight": (None, None),
    "model.layers.0.mlp.gate_proj.weight": (0, 0), "model.layers.0.mlp.up_proj.weight": (0, 0),
    "model.layers.0.mlp.down_proj.weight": (1, 1),  # a dense MLP
    "model.layers.1.mlp.shared_experts.gate_proj.weight": (0, 0), "model.layers.1.mlp.shared_experts.down_proj.weight": (1, 1),
    "model.layers.1.mlp.experts.3.gate_proj.weight": (0, None), "model.layers.1.mlp.experts.3.up_proj.weight": (0, None),
    "model.layers.1.mlp.experts.3.down_proj.weight": (1, None),  # routed: whole under expert parallelism
    "model.layers.1.mlp.gate.weight": (None, None), "model.norm.weight": (None, None),
}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_each_tensor_is_sharded_on_its_documented_dimension(expert_parallel):
    shape = (8, 6)
    for rank in (0, 1):
        layout = ParallelLayout(2, 1, expert_parallel, rank)
        for name, dims in SHARDS.items():
            dim = dims[expert_parallel]
            want = None if dim is None else (dim, rank * shape[dim] // 2, (rank + 1) * shape[dim] // 2)
            assert layout.shard(name, shape) == want, (name, rank)
    assert ParallelLayout(1, 1).shard("lm_head.weight", shape) is None  # one tensor rank holds everything


def test_routed_experts_are_spread_over_the_whole_world_only_under_expert_parallelism(glm_ckpt):
    cfg = replace(ModelConfig.from_json(glm_ckpt[0]), n_routed_experts=8)
    assert [list(ParallelLayout(1, 4, True, r).local_experts(8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(ParallelLayout(2, 1, False, 1).local_experts(8)) == list(range(8))
    mine = ParallelLayout(1, 2, True, 1)
    assert mine.holds("model.layers.1.mlp.experts.5.up_proj.weight", cfg)
    assert not mine.holds("model.layers.1.mlp.experts.2.up_proj.weight", cfg)
    assert mine.holds("model.layers.1.mlp.shared_experts.up_proj.weight", cfg) and mine.holds("lm_head.weight", cfg)


@pytest.mark.parametrize("field, layout, message", [
    ("vocab_size", ParallelLayout(2), "vocab_size (255) is not divisible by tensor_parallel_size (2)"),
    ("intermediate_size", ParallelLayout(2), "intermediate_size (63) is not divisible by tensor_parallel_size (2)"),
    ("moe_intermediate_size", ParallelLayout(2), "moe_intermediate_size (63) is not divisible by tensor_parallel_size (2)"),
    ("n_routed_experts", ParallelLayout(1, 2, True), "n_routed_experts (63) is not divisible by the world size"),
], ids=["vocab", "intermediate", "moe-intermediate", "experts-over-data-parallel-ranks"])
def test_every_sharded_dimension_must_divide(glm_ckpt, field, layout, message):
    cfg = ModelConfig.from_json(glm_ckpt[0])
    layout.check_model(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout.check_model(replace(cfg, **{field: 63 if field != "vocab_size" else 255}))
    # without tensor parallelism nothing of the layers is split: only the experts over the world count
    if field != "n_routed_experts":
        ParallelLayout(1, 2, False).check_model(replace(cfg, **{field: 63 if field != "vocab_size" else 255}))


def test_vocab_parallel_embedding_sums_to_the_whole_tables_rows_at_every_boundary():
    """Each rank looks up the ids in its own rows and gives zeros for the others': the ranks' parts (the
    all-reduce's terms) add up to the whole table's rows exactly, the first and last id of every rank's
    range included (rank 0's last row is id 3, rank 1's first is id 4)."""
    from sparsekv.parallel.comm import TensorParallel

    class Unreduced(TensorParallel):
        def all_reduce(self, x):
            return x
    table = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 3, 4, 7, 4, 3])
    parts = [Unreduced(None, 2, rank).embed(ids, table[rank * 4:(rank + 1) * 4]) for rank in (0, 1)]
    assert torch.equal(parts[0] + parts[1], F.embedding(ids, table))
    assert torch.equal(parts[0][2:4], torch.zeros(2, 3)) and torch.equal(parts[1][:2], torch.zeros(2, 3))
