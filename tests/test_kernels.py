"""The deterministic top-k: exact sets, ties at the boundary resolved to the most recent positions."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparsekv.kernels.attention import causal_mask_scores, fill_blocks, select_topk, top_values


def brute_force(row: list[float], k: int) -> list[int]:
    """Sort by (score desc, position desc), keep k, return ascending positions."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], -i))
    return sorted(order[:k])


def test_select_topk_matches_brute_force_with_and_without_ties():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        T, k = int(torch.randint(2, 40, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        k = min(k, T)
        # few distinct values -> many exact ties, often across the boundary
        scores = torch.randint(0, 4 if trial % 2 else 1000, (3, T), generator=g).float()
        got = select_topk(scores, k)
        for r in range(3):
            assert got[r].tolist() == brute_force(scores[r].tolist(), k), (scores[r], k)


def test_masked_positions_never_beat_visible_ones():
    scores = torch.zeros(2, 10)                      # all visible scores tie at 0
    masked = causal_mask_scores(scores, torch.tensor([5, 9]))
    assert select_topk(masked, 4).tolist() == [[2, 3, 4, 5], [6, 7, 8, 9]]


def test_decode_rows_skip_the_causal_mask():
    scores = torch.randn(1, 6)
    assert causal_mask_scores(scores, torch.tensor([5])) is scores


def test_two_stage_top_values_equal_a_plain_topk_on_long_rows():
    """Rows long enough for the block path: random, rising (recency), few distinct values, masked tails."""
    g = torch.Generator().manual_seed(1)
    T, m = 5000, 17
    rows = [torch.randn(T, generator=g),
            torch.arange(T, dtype=torch.float32) + torch.randn(T, generator=g),
            torch.randint(0, 3, (T,), generator=g).float(),
            torch.randn(T, generator=g).clamp(min=0)]
    scores = torch.stack(rows)
    scores[3, 4000:] = float("-inf")
    values, idx = top_values(scores, m)
    assert torch.equal(values, scores.topk(m).values)
    assert torch.equal(scores.gather(1, idx), values)  # positions hold those values


def test_select_topk_on_long_rows_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    T, k = 3000, 16
    scores = torch.stack([torch.randn(T, generator=g),
                          torch.randint(0, 5, (T,), generator=g).float(),      # ties across the boundary
                          -torch.randn(T, generator=g).abs().clamp(max=0.5)])  # ReLU-zero-like ties at the top
    scores[2, ::7] = 0.0
    got = select_topk(causal_mask_scores(scores, torch.tensor([T - 1, T - 1, 2500])), k)
    for r in range(3):
        row = scores[r].tolist()
        assert got[r].tolist() == brute_force(row, k)


def test_fill_blocks_writes_each_block_in_place():
    calls = []

    def compute(start, end):
        calls.append((start, end))
        return torch.arange(start, end, dtype=torch.float64)[:, None].expand(end - start, 3) * 2
    out = fill_blocks(10, 4, compute)
    assert calls == [(0, 4), (4, 8), (8, 10)] and out.dtype == torch.float64
    assert torch.equal(out, torch.arange(10, dtype=torch.float64)[:, None].expand(10, 3) * 2)



def test_fill_blocks_copies_a_single_broadcast_block():
    """One block whose result is a broadcast view (stride 0, as an expanded row): the caller gets its
    own contiguous rows, not the view, so writing one row changes no other."""
    out = fill_blocks(3, 4, lambda start, end: torch.ones(1, 2).expand(end - start, 2))
    assert out.is_contiguous()
    out[0] = 7.0
    assert torch.equal(out[1:], torch.ones(2, 2))


_DENSE_PEAK = """
import resource, torch
from sparsekv.kernels.attention import fill_blocks, latent_attention, query_block_size
torch.set_num_threads(1)
t = 12288
q, keys, pos = torch.randn(t, 4, 96), torch.randn(t, 96), torch.arange(t)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fill_blocks(t, query_block_size(4 * t, t), lambda s, e: latent_attention(q[s:e], keys, pos[None, :] <= pos[s:e, None], 0.1, 64))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_blockwise_dense_attention_memory_stays_bounded():
    """Dense attention over 12K positions, 3 query rows per 1M-element block: the peak grows by a few
    blocks' worth, not by the sum of every block's transients (2+ GB when block results were
    collected in a list and concatenated). Measured in a fresh process, so other tests' peaks do
    not count."""
    grown_mb = int(subprocess.run([sys.executable, "-c", _DENSE_PEAK], capture_output=True, text=True,
                                  check=True).stdout.split()[-1])
    assert grown_mb < 400


def test_lightning_indexer_select_in_blocks_and_tiles_matches_one_dense_pass(monkeypatch):
    """`LightningIndexer.select` scores queries in blocks against key tiles into one reused buffer, over
    key segments of both kinds (a run of positions, scattered positions). With small integer inputs every
    score is exact in fp32, so its sets must equal top-k of the whole [S, T] score matrix computed at
    once, ties (many, with integers) included."""
    from sparsekv.model import indexer as attn
    from sparsekv.tools.tiny import TINY_GLM
    from sparsekv.config import ModelConfig
    cfg = ModelConfig.from_dict({**TINY_GLM, "model_type": "glm_moe_dsa"})
    indexer = attn.LightningIndexer(cfg, None)
    # blocks of 8 queries, tiles of 16 keys (8 x 8 heads x 16 = 1024 elements)
    monkeypatch.setattr(attn, "INDEX_QUERY_BLOCK_CPU_MAX", 8)
    monkeypatch.setattr(attn, "INDEX_TILE_ELEMENTS_CPU", 1024)
    g = torch.Generator().manual_seed(0)
    T, S, H, D, k = 300, 45, cfg.index_n_heads, cfg.index_head_dim, 12
    q = torch.randint(-3, 4, (S, H, D), generator=g).float()
    weights = torch.randint(-2, 3, (S, H), generator=g).float()
    keys = torch.randint(-3, 4, (T, D), generator=g).float()
    positions = torch.sort(torch.randperm(T - k, generator=g)[:S]).values + k   # every row sees > k keys
    scattered = torch.arange(100, 180).flip(0)            # positions 100..179 stored out of order
    segments = [(0, keys[:100]), (scattered, keys[scattered]), (180, keys[180:])]
    got = indexer.select(q, weights, segments, positions, k)
    dense = torch.einsum("shd,td->sht", q, keys).relu() * D ** -0.5
    dense = (dense * weights[:, :, None]).sum(1)
    dense[torch.arange(T)[None, :] > positions[:, None]] = float("-inf")
    assert torch.equal(got, select_topk(dense, k))


@pytest.mark.parametrize("keys_major_from", [0, 1 << 30], ids=["keys-major", "query-major"])
def test_decode_rows_score_like_one_dense_pass_in_either_layout(monkeypatch, keys_major_from):
    """A decode row (one query) is scored keys-major over long histories, query-major over short ones
    (`keys_major`). Forced either way, over key segments of both kinds and tiles of 16 keys, with
    integer inputs (exact fp32 scores): each row's set equals top-k of the dense scores, ties included."""
    from sparsekv.model import indexer as attn
    from sparsekv.tools.tiny import TINY_GLM
    from sparsekv.config import ModelConfig
    cfg = ModelConfig.from_dict({**TINY_GLM, "model_type": "glm_moe_dsa"})
    indexer = attn.LightningIndexer(cfg, None)
    monkeypatch.setattr(attn, "DECODE_KEYS_MAJOR_MIN_KEYS_CPU", keys_major_from)
    monkeypatch.setattr(attn, "INDEX_TILE_ELEMENTS_CPU", 16 * cfg.index_n_heads)
    g = torch.Generator().manual_seed(1)
    T, H, D, k = 300, cfg.index_n_heads, cfg.index_head_dim, 12
    keys = torch.randint(-3, 4, (T, D), generator=g).float()
    scattered = torch.arange(100, 180).flip(0)
    segments = [(0, keys[:100]), (scattered, keys[scattered]), (180, keys[180:])]
    for p in (20, 150, 299):
        q = torch.randint(-3, 4, (1, H, D), generator=g).float()
        weights = torch.randint(-2, 3, (1, H), generator=g).float()
        got = indexer.select(q, weights, segments, torch.tensor([p]), k)
        dense = ((torch.einsum("hd,td->ht", q[0], keys[:p + 1]).relu() * D ** -0.5) * weights[0, :, None]).sum(0)
        assert torch.equal(got, select_topk(dense[None], k)), p
    cpu = torch.device("cpu")
    assert attn.keys_major(cpu, 1, T) == (keys_major_from == 0) and not attn.keys_major(cpu, 2, T)


def test_index_score_scratch_is_reused_across_calls_and_shared_by_indexers(monkeypatch):
    """A model's indexers share one `ScoreScratch`: later `select` calls (the next prefill chunk, the next
    full layer) write into the same storage instead of a fresh allocation, it grows only when a call needs
    more, and a shared buffer changes no selection. The loaded model wires one scratch into every indexer,
    the MTP layer's included."""
    from sparsekv.model import indexer as attn
    from sparsekv.tools.tiny import TINY_GLM
    from sparsekv.config import ModelConfig
    cfg = ModelConfig.from_dict({**TINY_GLM, "model_type": "glm_moe_dsa"})
    scratch = attn.ScoreScratch()
    first, second, alone = (attn.LightningIndexer(cfg, None, s) for s in (scratch, scratch, None))
    monkeypatch.setattr(attn, "INDEX_QUERY_BLOCK_CPU_MAX", 8)
    g = torch.Generator().manual_seed(1)
    H, D, k = cfg.index_n_heads, cfg.index_head_dim, 12

    def call(indexer, T, S):
        q, w = torch.randn(S, H, D, generator=g), torch.randn(S, H, generator=g)
        keys, positions = torch.randn(T, D, generator=g), torch.arange(T - S, T)
        return indexer.select(q, w, [(0, keys)], positions, k), (q, w, keys, positions)

    got, inputs = call(first, 200, 20)
    storage, size = scratch._buffers["scores"].data_ptr(), scratch.nbytes
    assert size == 8 * 200 * 4                       # one block of 8 rows x 200 keys
    got2, inputs2 = call(second, 150, 20)            # smaller: same storage
    assert scratch._buffers["scores"].data_ptr() == storage and scratch.nbytes == size
    q, w, keys, positions = inputs2
    assert torch.equal(got2, alone.select(q, w, [(0, keys)], positions, k))
    call(first, 300, 20)                             # larger: grows by doubling
    assert scratch.nbytes == 2 * size
    scratch.release()
    assert scratch.nbytes == 0

    from sparsekv.model.checkpoint import load_model
    from sparsekv.paths import DEFAULT_MODEL_DIR
    model = load_model(DEFAULT_MODEL_DIR, torch.float32, torch.device("cpu"))   # FSFSS + an MTP layer
    indexers = [layer.attn.indexer for layer in model.layers + [model.mtp.layer] if layer.attn.indexer]
    assert len(indexers) >= 2 and all(ix.scratch is model.index_scratch for ix in indexers)


def test_index_score_scratch_serves_a_call_of_exactly_its_size_from_the_same_storage():
    """`ScoreScratch.take` grows only when a call needs more than it holds: a call for exactly the
    buffer's size (the same chunk shape again, the next full layer) gets the same storage, no new
    allocation; one element more grows it by doubling. Each purpose and dtype keeps its own buffer."""
    from sparsekv.model.indexer import ScoreScratch
    cpu, scratch = torch.device("cpu"), ScoreScratch()
    first = scratch.take(1000, cpu)
    storage = first.data_ptr()
    again = scratch.take(1000, cpu)
    assert again.data_ptr() == storage and again.numel() == 1000 and scratch.nbytes == 1000 * 4
    assert scratch.take(999, cpu).data_ptr() == storage and scratch.nbytes == 1000 * 4
    keys = scratch.take(1000, cpu, torch.bfloat16, "keys")
    assert scratch.take(1000, cpu, torch.bfloat16, "keys").data_ptr() == keys.data_ptr()
    assert scratch.nbytes == 1000 * 4 + 1000 * 2
    assert scratch.take(1001, cpu).numel() == 1001 and scratch.nbytes == 2000 * 4 + 1000 * 2


def test_decode_rows_score_keys_major_from_the_threshold_on():
    """`keys_major` is documented as "from this many keys on": a decode row over exactly
    DECODE_KEYS_MAJOR_MIN_KEYS_CPU keys (or a policy's `keys_major_min_keys`) is keys-major, one key
    fewer is not; verification chunks (more than one row) never are."""
    from sparsekv.model import indexer as attn
    cpu = torch.device("cpu")
    least = attn.DECODE_KEYS_MAJOR_MIN_KEYS_CPU
    assert attn.keys_major(cpu, 1, least) and not attn.keys_major(cpu, 1, least - 1)
    assert not attn.keys_major(cpu, 3, 4 * least)
    policy = attn.BlockPolicy(keys_major_min_keys=100)
    assert attn.keys_major(cpu, 1, 100, policy) and not attn.keys_major(cpu, 1, 99, policy)


def test_index_scores_and_head_weights_follow_the_papers_formula():
    """I[t,s] = sum_h w_h(x_t) H^-1/2 ReLU(<q_{t,h}, k_s>) D^-1/2. The head weights `keys_and_queries`
    returns carry H^-1/2 (the same op on the same values: bit for bit), and `scores` folds D^-1/2 in;
    a positive scale never changes a selection, so only the scores show it. Integer queries and keys
    make every dot product exact; the rest is a handful of float32 roundings against float64."""
    from sparsekv.config import ModelConfig
    from sparsekv.model import indexer as attn
    from sparsekv.tools.tiny import TINY_GLM
    from tolerances import gamma
    cfg = ModelConfig.from_dict({**TINY_GLM, "model_type": "glm_moe_dsa"})
    H, D, hidden = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    g = torch.Generator().manual_seed(4)
    w = attn.IndexerWeights(wq_b=torch.randn(H * D, cfg.q_lora_rank, generator=g), wk=torch.randn(D, hidden, generator=g),
                            k_norm_weight=torch.ones(D), k_norm_bias=torch.zeros(D),
                            weights_proj=torch.randn(H, hidden, generator=g))
    indexer = attn.LightningIndexer(cfg, w)
    x, q_resid = torch.randn(5, hidden, generator=g), torch.randn(5, cfg.q_lora_rank, generator=g)
    cos, sin = torch.ones(5, cfg.qk_rope_head_dim // 2), torch.zeros(5, cfg.qk_rope_head_dim // 2)
    _, (_, weights) = indexer.keys_and_queries(x, q_resid, cos, sin)
    assert torch.equal(weights, torch.nn.functional.linear(x, w.weights_proj) * H ** -0.5)

    T = 40
    q = torch.randint(-3, 4, (3, H, D), generator=g).float()
    keys = torch.randint(-3, 4, (T, D), generator=g).float()
    head_w = torch.randn(3, H, generator=g)
    got = indexer.scores(q, head_w, [(0, keys)], T).double()
    relu = torch.einsum("shd,td->sht", q.double(), keys.double()).relu()
    want = (head_w.double()[:, :, None] * relu).sum(1) * D ** -0.5
    # float32: the folded scale (1 rounding), each product (1) and the H-term sum: gamma_(H+2) of the magnitudes
    slack = gamma(H + 2) * (head_w.double().abs()[:, :, None] * relu).sum(1) * D ** -0.5
    assert ((got - want).abs() <= slack).all()
