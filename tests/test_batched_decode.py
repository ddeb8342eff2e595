"""A decode step as one batch (model/decode_plan.py): the same selections, tokens and logprobs as one
request at a time (`batch_dense_decodes=False`), and a number of dispatched torch ops that does not
grow with the number of requests (tools/op_count.py)."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.model.attention import MLAttention
from sparsekv.tools.op_count import OpCounter, decode_step_ops, fill_decoding
from tolerances import assert_same_greedy, logprob_tolerance

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
# Top-k is 8: 3 and 6 start below it (dense regime, then crossing it while decoding), the others above;
# 97 is 20x 5. Chunks of 8 under a budget of 24 tokens make steps that mix prefill chunks and decodes.
LENGTHS = (3, 6, 11, 40, 97)
MIXED = dict(kv_page_size=16, max_num_seqs=5, prefill_chunk_tokens=8, max_num_batched_tokens=24,
             enable_prefix_caching=False, max_model_len=256)


def prompts(lengths=LENGTHS) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 1 for i in range(n)] for j, n in enumerate(lengths)]


def record_selections(monkeypatch) -> list:
    """Every full layer's selections of every request it selected for, in call order."""
    trace, real = [], MLAttention._attention

    def spy(self, q, index_q, ctx, cache):
        out = real(self, q, index_q, ctx, cache)
        if self.selector is not None and not ctx.draft_step:
            trace.append((self.layer_idx, {rid: s.clone() for rid, s in ctx.selection.items()}))
        return out
    monkeypatch.setattr(MLAttention, "_attention", spy)
    return trace


def generate(path, batched: bool, monkeypatch, **options):
    trace = record_selections(monkeypatch)
    llm = LLM(path, batch_dense_decodes=batched, **MIXED, **options)
    outs = llm.generate(prompts(), GREEDY)
    llm.engine.check_integrity()
    monkeypatch.undo()
    return outs, trace, llm


@pytest.mark.parametrize("family", ["glm", "ds"])
def test_batched_selection_equals_per_request(family, glm_ckpt, ds_ckpt, monkeypatch):
    """DSA: every full layer selects exactly the positions it selects one request at a time, on
    requests from below top-k to 12x above it, in steps mixing prefill chunks and decodes; and the
    batched pass really ran (groups of several requests)."""
    from sparsekv.model.indexer import LightningIndexer
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    want, want_trace, _ = generate(path, False, monkeypatch)
    groups, real = [], LightningIndexer.select_decode_batch

    def spy(self, q, *args, **kwargs):
        groups.append(q.shape[0])
        return real(self, q, *args, **kwargs)
    monkeypatch.setattr(LightningIndexer, "select_decode_batch", spy)
    got, got_trace, llm = generate(path, True, monkeypatch)
    assert max(groups) >= 4  # the shortest finishes before the longest is prefilled
    assert len(got_trace) == len(want_trace)
    for (layer_a, a), (layer_b, b) in zip(want_trace, got_trace):
        assert layer_a == layer_b and a.keys() == b.keys()
        for rid in a:
            assert torch.equal(a[rid], b[rid]), (layer_a, rid)
    assert_same_greedy(want, got, logprob_tolerance(llm))


def decoding(path, batch: int, batched: bool = True, **options) -> LLM:
    """An LLM whose `batch` requests (contexts 24 to 24 + 3 (batch - 1) tokens, all past top-k: the
    sparse regime) have made one decode step; the next step is a decode step like it."""
    llm = LLM(path, batch_dense_decodes=batched, max_num_seqs=batch, kv_page_size=16, enable_prefix_caching=False,
              max_model_len=128, max_num_batched_tokens=4096, **options)
    fill_decoding(llm.engine, prompts([24 + 3 * i for i in range(batch)]),
                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.engine.step()  # the first decode step also promotes the prefill's last token
    return llm


def decode_ops(path, batch: int, batched: bool = True, **options) -> OpCounter:
    return decode_step_ops(decoding(path, batch, batched, **options).engine)


def attention_ops(path, batch: int, monkeypatch, **options) -> int:
    """A decode step (`decoding`), counting only the ops of the attention layers (selection, gather, attention and
    the cache reads and writes they make) and of the cache's step set-up (tier promotions)."""
    from sparsekv.cache.tiers import TieredKVPool
    counts = []

    def counted(real):
        def run(*args, **kwargs):
            with OpCounter() as ops:
                out = real(*args, **kwargs)
            counts.append(ops.total)
            return out
        return run
    llm = decoding(path, batch, **options)
    monkeypatch.setattr(MLAttention, "forward", counted(MLAttention.forward))
    monkeypatch.setattr(TieredKVPool, "begin_step", counted(TieredKVPool.begin_step))
    llm.engine.step()
    monkeypatch.undo()
    return sum(counts)


# Batch 32 / batch 1, whole decode step. What still grows: the runner's three ops per request (its
# position range and two slot slices) and the MoE layers' per-expert loop until every expert is
# touched; the DeepSeek model has twice the experts.
WHOLE_STEP_RATIO = {"glm": 1.25, "ds": 1.35}


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["untiered", "tiered"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_decode_step_ops_do_not_grow_with_the_batch(family, options, glm_ckpt, ds_ckpt, monkeypatch):
    """Counted, not timed: the attention layers dispatch exactly as many ops for 32 decodes as for 2,
    and the whole step at batch 32 at most WHOLE_STEP_RATIO x batch 1's (one request at a time: ~9x)."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    assert attention_ops(path, 2, monkeypatch, **options) == attention_ops(path, 32, monkeypatch, **options)
    one, many = decode_ops(path, 1, **options).total, decode_ops(path, 32, **options).total
    assert many <= WHOLE_STEP_RATIO[family] * one, (one, many)
    assert decode_ops(path, 8, batched=False, **options).total > 2 * one  # the counter sees a per-request loop
