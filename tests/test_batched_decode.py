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
    """(outputs, trace, llm). The trace: each full layer's selections, and each step's chunks as
    (request, token ids): with speculative decoding those hold the drafts being verified."""
    from sparsekv.runner import ModelRunner
    trace, real = record_selections(monkeypatch), ModelRunner.build_context

    def build_context(self, chunks):
        trace.append(("step", [(ch.request_id, list(ch.token_ids)) for ch in chunks]))
        return real(self, chunks)
    monkeypatch.setattr(ModelRunner, "build_context", build_context)
    llm = LLM(path, batch_dense_decodes=batched, **MIXED, **options)
    outs = llm.generate(prompts(), GREEDY)
    llm.engine.check_integrity()
    monkeypatch.undo()
    return outs, trace, llm


@pytest.mark.parametrize("selector", ["dsa", "quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_batched_selection_equals_per_request(family, selector, glm_ckpt, ds_ckpt, monkeypatch):
    """Every full layer selects exactly the positions it selects one request at a time, on requests
    from below top-k to 12x above it, in steps mixing prefill chunks and decodes; and the batched pass
    really ran (groups of several requests)."""
    from sparsekv.model.selectors import DSASelector, QuestSelector
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    want, want_trace, _ = generate(path, False, monkeypatch, selector=selector)
    cls = DSASelector if selector == "dsa" else QuestSelector
    groups, real = [], cls.select_group

    def spy(self, layer, seqs, *args):
        groups.append(len(seqs))
        return real(self, layer, seqs, *args)
    monkeypatch.setattr(cls, "select_group", spy)
    got, got_trace, llm = generate(path, True, monkeypatch, selector=selector)
    assert max(groups) >= 4  # the shortest finishes before the longest is prefilled
    assert len(got_trace) == len(want_trace)
    for (layer_a, a), (layer_b, b) in zip(want_trace, got_trace):
        assert layer_a == layer_b
        if layer_a == "step":  # the same chunks scheduled
            assert a == b
            continue
        assert a.keys() == b.keys()
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


# Batch 32 / batch 1, whole decode step, per (family, selector): the target everywhere. What
# still grows: the runner's one slot-table slice per request, and a group's selection pass costs more
# fixed ops than one request's (from batch 2 on, not per request; Quest's more than DSA's).
WHOLE_STEP_RATIO = {("glm", "dsa"): 1.25, ("ds", "dsa"): 1.25, ("glm", "quest"): 1.25, ("ds", "quest"): 1.25}


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True), dict(selector="quest")],
                         ids=["untiered", "tiered", "quest"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_decode_step_ops_do_not_grow_with_the_batch(family, options, glm_ckpt, ds_ckpt, monkeypatch):
    """Counted, not timed: the attention layers dispatch exactly as many ops for 32 decodes as for 2,
    and the whole step at batch 32 at most WHOLE_STEP_RATIO x batch 1's (one request at a time: ~9x);
    DSA and Quest."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    assert attention_ops(path, 2, monkeypatch, **options) == attention_ops(path, 32, monkeypatch, **options)
    one, many = decode_ops(path, 1, **options).total, decode_ops(path, 32, **options).total
    assert many <= WHOLE_STEP_RATIO[family, options.get("selector", "dsa")] * one, (one, many)
    assert decode_ops(path, 8, batched=False, **options).total > 2 * one  # the counter sees a per-request loop


# The bundled model's decode step (tools/bench_batch.py measures the same): at most this many ops at batch 1,
# and batch 32 at most BUNDLED_RATIO x that, untiered and tiered.
BUNDLED_STEP_OPS = 500
BUNDLED_RATIO = 1.25


def bundled_decode_ops(batch: int, **options) -> OpCounter:
    """One decode step of the bundled model with `batch` requests of 1,024 random tokens (past its top-k
    of 256: the sparse regime; `sparsekv bench batch --sparse-prompt-tokens 1024`), all decoding."""
    from sparsekv.paths import default_model_path
    llm = LLM(default_model_path(), max_num_seqs=batch, enable_prefix_caching=False, max_model_len=1040,
              max_num_batched_tokens=8192, num_kv_pages=batch * 17, **options)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, llm.engine.model_config.vocab_size, (1024,), generator=g).tolist() for _ in range(batch)]
    fill_decoding(llm.engine, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    llm.engine.step()  # the first decode step also promotes the prefill's last token
    return decode_step_ops(llm.engine)


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["untiered", "tiered"])
def test_bundled_model_decode_step_ops(options):
    """Counted, not timed: the bundled model's whole decode step (sparse regime) dispatches at most
    BUNDLED_STEP_OPS torch ops at batch 1 untiered, and at batch 32 at most BUNDLED_RATIO x its batch 1."""
    one, many = bundled_decode_ops(1, **options), bundled_decode_ops(32, **options)
    if not options:
        assert one.total <= BUNDLED_STEP_OPS, sorted(one.by_kind.items(), key=lambda kv: -kv[1])
    assert many.total <= BUNDLED_RATIO * one.total, (one.total, many.total)


def test_decode_step_ops_counts_every_step_it_runs():
    """`decode_step_ops(engine, steps)`: the ops of all `steps` steps together, each dispatch counted."""
    from types import SimpleNamespace
    x = torch.zeros(1)
    engine = SimpleNamespace(step=lambda: x + x * x)
    ops = decode_step_ops(engine, 3)
    assert ops.total == 3 * decode_step_ops(engine).total == 6 and ops.by_kind == {"add": 3, "mul": 3}


def test_a_draft_step_without_its_drafting_rows_selection_names_the_requests():
    """A draft step reuses each request's selection from its extend row (MTP index reuse): where one is
    missing the step fails naming those requests, before any attention, not with a bare KeyError."""
    from types import SimpleNamespace
    plan = SimpleNamespace(sparse=[SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")], sizes=[1, 1])
    ctx = SimpleNamespace(draft_step=True, decode_selection=None, selection={"a": torch.zeros(1, 4, dtype=torch.long)},
                          record_selection=None)
    layer = SimpleNamespace(selector=None, layer_idx=3)
    with pytest.raises(RuntimeError, match=r"draft step without the drafting row's selection for \['b'\]"):
        MLAttention._decode_selection(layer, plan, None, None, ctx, None)
    ctx.selection["b"] = torch.ones(1, 4, dtype=torch.long)
    assert torch.equal(MLAttention._decode_selection(layer, plan, None, None, ctx, None),
                       torch.tensor([[0] * 4, [1] * 4]))

def test_rms_norm_is_the_reference_bitwise():
    """fp32 RMSNorm in one call computes exactly the reference's ops (fp32 norm, weight multiply)."""
    from sparsekv.model.layers import rms_norm
    g = torch.Generator().manual_seed(0)
    for rows, dim in ((1, 256), (32, 64), (5, 6144)):
        x, w = torch.randn(rows, dim, generator=g) * 3, torch.rand(dim, generator=g) + 0.5
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(rms_norm(x, w, 1e-5), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_16_bits_is_the_reference_bitwise(dtype):
    """16-bit RMSNorm: fp32 norm, cast back to the input dtype, then the weight multiply in that dtype
    (transformers' DeepseekV3RMSNorm, the layers' reference), bit for bit: the weight is not applied in fp32."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from sparsekv.model.layers import rms_norm
    g = torch.Generator().manual_seed(0)
    for rows, dim in ((1, 256), (32, 64), (5, 6144)):
        x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
        ref = DeepseekV3RMSNorm(dim, eps=1e-6).to(dtype)
        with torch.no_grad():
            ref.weight.copy_(torch.rand(dim, generator=g) + 0.5)
            assert torch.equal(rms_norm(x, ref.weight.detach(), 1e-6), ref(x))

def test_stacked_experts_equal_one_expert_at_a_time():
    """The grouped routed sum equals the per-expert loop bit for bit (ascending expert id per token),
    for no rows, one row and many, with k = 3 of 8 experts; the experts' own weights are views of the stack."""
    from sparsekv.model.layers import DenseMLP, StackedExperts
    g = torch.Generator().manual_seed(1)
    experts = [DenseMLP(*(torch.randn(*shape, generator=g) for shape in ((16, 32), (16, 32), (32, 16))))
               for _ in range(8)]
    loose = [(e.gate_up.clone(), e.down.clone()) for e in experts]
    stacked = StackedExperts.of(experts)
    assert all(e.gate_up.data_ptr() == stacked.gate_up[i].data_ptr() for i, e in enumerate(experts))
    for rows in (0, 1, 2, 40):
        x, weights = torch.randn(rows, 32, generator=g), torch.rand(rows, 3, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(rows)]) if rows else \
            torch.zeros(0, 3, dtype=torch.long)
        want = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            gate, up = torch.nn.functional.linear(x[token], loose[e][0]).split(16, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, loose[e][1])
            want.index_add_(0, token, y * weights[token, slot, None])
        assert torch.equal(stacked(x, ids, weights), want), rows


def test_moe_without_stacked_experts_sums_this_ranks_experts_in_ascending_id():
    """The one-expert-at-a-time MoE (expert parallelism: another rank's experts are None, so no stack)
    skips the other rank's experts and adds each token's terms in ascending expert id, whatever order
    the router's top-k returns them in, as the reference's per-expert loop does: bit for bit, for one
    row (the decode path, one row's products) and many (one product per expert over its rows)."""
    from types import SimpleNamespace
    from sparsekv.model.layers import DenseMLP, MoE, route_experts
    g = torch.Generator().manual_seed(2)
    cfg = SimpleNamespace(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=2.5)
    experts = [DenseMLP(*(torch.randn(*shape, generator=g) for shape in ((16, 32), (16, 32), (32, 16))))
               for _ in range(8)]
    mine = [e if i % 2 == 0 else None for i, e in enumerate(experts)]  # rank 0 of 2, experts interleaved
    moe = MoE(cfg, torch.randn(8, 32, generator=g), torch.randn(8, generator=g) * 0.1, mine, shared=None)
    assert moe.stacked is None
    for rows in [1] * 20 + [2, 40]:
        x = torch.randn(rows, 32, generator=g)
        ids, weights = route_experts(cfg, x, moe.router, moe.bias)
        want = torch.zeros_like(x)
        for e in range(0, 8, 2):
            token, slot = torch.where(ids == e)
            want.index_add_(0, token, mine[e](x[token]) * weights[token, slot, None])
        assert torch.equal(moe.routed(x), want), rows

def with_mtp_layer(src: str, dst: str) -> str:
    """A copy of a tiny checkpoint with a NextN layer: a copy of layer 1 with layer 0's indexer."""
    import os
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    n = 1 + max(int(name.split(".")[2]) for name in tensors if name.startswith("model.layers."))
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1.") and ".indexer." not in name:
            tensors[name.replace("layers.1.", f"layers.{n}.")] = t.clone()
        if name.startswith("model.layers.0.self_attn.indexer."):
            tensors[name.replace("layers.0.", f"layers.{n}.")] = t.clone()
    g, p = torch.Generator().manual_seed(3), f"model.layers.{n}."
    tensors.update({p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
                    p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
                    p + "shared_head.norm.weight": torch.ones(hidden)})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("selector", ["dsa", "quest"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["untiered", "tiered"])
@pytest.mark.parametrize("family", ["glm", "ds"])
def test_batched_step_equals_per_request_with_chunks_and_drafts(family, options, selector, glm_ckpt, ds_ckpt,
                                                                tmp_path, monkeypatch):
    """Steps mixing prefill chunks, decodes and MTP verification rows (2 drafts), with draft steps:
    the same greedy tokens as one request at a time, logprobs within the bound of regrouped rows."""
    src = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    path = with_mtp_layer(src, str(tmp_path / family))
    options = dict(options, selector=selector, num_speculative_tokens=2)
    want, want_trace, _ = generate(path, False, monkeypatch, **options)
    got, got_trace, llm = generate(path, True, monkeypatch, **options)
    steps = [t for t in want_trace if t[0] == "step"]
    assert steps == [t for t in got_trace if t[0] == "step"]  # the same drafts verified at every step
    assert llm.engine.speculator.stats()["spec_decode_num_draft_tokens"] > 0
    assert_same_greedy(want, got, logprob_tolerance(llm))


def test_bench_batch_counts_ops_per_step(tmp_path):
    """`sparsekv bench batch` prints ops per step for both paths, and the decode graphs' pieces as a
    third (`--decode-graphs eager`); its sparse-regime runs (past top-k, untiered and tiered, each
    through the pieces too) count batch 1 and batch 4, with the same greedy tokens on every path, and
    only one request at a time grows with the batch; the pieces launch fewer kernels and graphs than
    the batched path dispatches ops."""
    import json
    from sparsekv.tools.bench import main
    out = tmp_path / "batch.json"
    assert main(["batch", "--batch", "2", "--prompt-tokens", "20", "--steps", "2", "--repeats", "1",
                 "--sparse-prompt-tokens", "300", "--sparse-batch", "4", "--sparse-steps", "1",
                 "--decode-graphs", "eager", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"one request at a time", "batched", "batched, decode graphs"}
    assert all(s["ops_per_step"] > 0 for s in result["summary"].values()) and result["identical_tokens"]
    sparse = result["sparse"]
    assert {f"{cache}/{path}" for cache in ("untiered", "tiered")
            for path in ("one request at a time", "batched", "batched, decode graphs")} == set(sparse["paths"])
    assert sparse["identical_tokens"] and sum(sparse["ops_by_kind_batch_1"].values()) == \
        sparse["paths"]["untiered/batched"]["ops_1"]
    for cache in ("untiered", "tiered"):
        batched, alone = sparse["paths"][f"{cache}/batched"], sparse["paths"][f"{cache}/one request at a time"]
        assert batched["ops_ratio"] < 1.25 < 1.5 < alone["ops_ratio"], (cache, batched, alone)
        graphs = sparse["paths"][f"{cache}/batched, decode graphs"]
        assert graphs["graph_launches_4"] < batched["ops_4"] / 2, (cache, graphs, batched)


def test_bench_batch_sparse_regime_with_drafts_and_quest(tmp_path):
    """`--sparse-drafts 3 --sparse-selector quest`: the sparse-regime runs draft (the bundled model's MTP
    layer) with Quest, over the tiered cache with working sets of 4 x top-k, so that the decode graphs'
    pieces run there too: the same greedy tokens on every path, a step's tokens counted as they came
    (at least one per request), and the pieces launching fewer kernels and graphs than the batched
    path dispatches ops."""
    import json
    from sparsekv.tools.bench import main
    out = tmp_path / "batch.json"
    assert main(["batch", "--batch", "2", "--prompt-tokens", "20", "--steps", "2", "--repeats", "1",
                 "--sparse-prompt-tokens", "300", "--sparse-batch", "4", "--sparse-steps", "2",
                 "--sparse-drafts", "3", "--sparse-selector", "quest", "--decode-graphs", "eager",
                 "--json", str(out)]) == 0
    sparse = json.loads(out.read_text())["sparse"]
    assert sparse["identical_tokens"]
    assert max(p["tokens_per_step_4"] for p in sparse["paths"].values()) > 4  # drafts accepted: it drafted
    for cache in ("untiered", "tiered"):
        batched, graphs = sparse["paths"][f"{cache}/batched"], sparse["paths"][f"{cache}/batched, decode graphs"]
        assert batched["tokens_per_step_1"] >= 1 and batched["tokens_per_step_4"] >= 4, batched
        assert graphs["graph_launches_4"] < batched["ops_4"], (cache, graphs, batched)


def test_groups_pad_each_history_at_most_twice_beyond_the_pad_free_length():
    """Decodes scored together come in runs of similar lengths: the longest at most twice the shortest
    unless all fit in GROUP_PAD_FREE_KEYS, so a group's count grows with the spread of lengths, not
    with the number of requests."""
    from types import SimpleNamespace
    from sparsekv.model.decode_plan import GROUP_PAD_FREE_KEYS, length_buckets
    lengths = [100, 3000, 4096, 5000, 9000, 10000, 18000, 50000, 60000, 70000]
    buckets = length_buckets([SimpleNamespace(context_len=n) for n in lengths])
    assert [[s.context_len for s in b] for b in buckets] == [[100, 3000, 4096], [5000, 9000, 10000], [18000],
                                                            [50000, 60000, 70000]]
    assert all(b[-1].context_len <= max(2 * b[0].context_len, GROUP_PAD_FREE_KEYS) for b in buckets)
    many = length_buckets([SimpleNamespace(context_len=1000 + i) for i in range(256)])
    assert len(many) == 1


def test_groups_stay_within_the_padded_budget():
    """`groups_within` closes a group exactly when the next decode would take its padded size, requests x
    longest history, past the budget: every group of several fits, and none could take the next."""
    from types import SimpleNamespace
    from sparsekv.model.decode_plan import groups_within
    budget, seqs = 60, [SimpleNamespace(context_len=n) for n in (10, 10, 12, 20, 25, 40, 100)]
    groups = groups_within(seqs, budget)
    assert [[s.context_len for s in g] for g in groups] == [[10, 10, 12], [20, 25], [40], [100]]
    assert all(len(g) == 1 or len(g) * g[-1].context_len <= budget for g in groups)
    assert all((len(g) + 1) * after[0].context_len > budget for g, after in zip(groups, groups[1:]))


def test_a_group_takes_a_decode_that_brings_it_exactly_to_the_budget():
    """`groups_within`'s bound is inclusive: a group whose padded size, requests x longest history,
    would equal the budget takes the next decode, and one that would pass it closes first."""
    from types import SimpleNamespace
    from sparsekv.model.decode_plan import groups_within
    seqs = [SimpleNamespace(context_len=n) for n in (20, 30, 30)]
    assert [[s.context_len for s in g] for g in groups_within(seqs, 60)] == [[20, 30], [30]]
    assert [[s.context_len for s in g] for g in groups_within(seqs, 59)] == [[20], [30], [30]]


def test_a_decode_past_the_budget_selects_alone_and_no_group_is_empty():
    """A decode whose history alone pads past the budget still gets a group (of one: it selects
    alone), first or not, and no group is ever empty: the groups partition the decodes, in order."""
    from types import SimpleNamespace
    from sparsekv.model.decode_plan import groups_within
    for lengths in ((100, 120), (10, 100), (70, 10)):
        seqs = [SimpleNamespace(context_len=n) for n in lengths]
        groups = groups_within(seqs, 60)
        assert all(groups) and [s for g in groups for s in g] == seqs, lengths
    assert [len(g) for g in groups_within([SimpleNamespace(context_len=n) for n in (100, 120)], 60)] == [1, 1]


def _decodes(contexts: list[int], attention: str = "sparse"):
    """A decode step's context: one single-row decode per history length."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    seqs = [SeqSlice(f"r{i}", i, i + 1, n, torch.arange(n)) for i, n in enumerate(contexts)]
    return SimpleNamespace(seqs=seqs, decode_rows=1, batch_dense_decodes=True, attention=attention,
                           input_ids=torch.zeros(len(contexts), dtype=torch.long))


@pytest.mark.parametrize("budget_keys, group_sizes", [(99, [1, 1, 1, 1]), (100, [2, 2])])
def test_the_plans_groups_score_within_the_devices_budget(monkeypatch, budget_keys, group_sizes):
    """`make_plan` sizes its scoring groups by the device's budget of padded elements, each history
    position costing decode rows x max(index heads, index head dim): four 50-key decodes under a budget
    of 99 keys select alone, under 100 keys in pairs. A group past the budget would pad more scores than
    the indexer's scratch is sized for."""
    from types import SimpleNamespace
    from sparsekv.model import decode_plan
    cfg = SimpleNamespace(index_topk=8, index_n_heads=4, index_head_dim=16)
    per_position = max(cfg.index_n_heads, cfg.index_head_dim)
    monkeypatch.setattr(decode_plan, "INDEX_DECODE_BATCH_ELEMENTS_CPU", budget_keys * per_position)
    plan = decode_plan.make_plan(_decodes([50] * 4), cfg)
    assert [len(group) for _, group in plan.groups] == group_sizes
    assert all(len(g) * g[-1].context_len * per_position <= budget_keys * per_position for _, g in plan.groups)


@pytest.mark.parametrize("budget_keys, group_sizes", [(299, [1, 1, 1, 1]), (300, [2, 2])])
def test_the_plans_groups_count_every_decode_row_against_the_budget(monkeypatch, budget_keys, group_sizes):
    """With drafts a decode scores 1 + drafts rows (`ctx.decode_rows`), each over its whole padded
    history: four 50-key decodes of 3 rows each pad 3 x 50 = 150 row-keys apiece, so a budget of 299
    row-keys lets each select alone and 300 pairs them (counting one row per decode would group all
    four: 4 x 50 = 200 <= 299)."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    from sparsekv.model import decode_plan
    cfg = SimpleNamespace(index_topk=8, index_n_heads=4, index_head_dim=16)
    per_position = max(cfg.index_n_heads, cfg.index_head_dim)
    monkeypatch.setattr(decode_plan, "INDEX_DECODE_BATCH_ELEMENTS_CPU", budget_keys * per_position)
    seqs = [SeqSlice(f"r{i}", 3 * i, 3 * i + 3, 50, torch.arange(50)) for i in range(4)]
    ctx = SimpleNamespace(seqs=seqs, decode_rows=3, batch_dense_decodes=True, attention="sparse",
                          input_ids=torch.zeros(12, dtype=torch.long))
    plan = decode_plan.make_plan(ctx, cfg)
    assert [len(group) for _, group in plan.groups] == group_sizes
    assert all(len(g) * 3 * g[-1].context_len <= budget_keys for _, g in plan.groups)


def test_with_dense_attention_every_decode_attends_alone_over_its_whole_history():
    """attention="dense" reads every position: no decode joins the sparse batch (which selects top-k
    keys) or the dense-regime batch, whatever its length, so a decode past top-k is never sparse."""
    from types import SimpleNamespace
    from sparsekv.model.decode_plan import make_plan
    ctx = _decodes([5, 8, 9, 40], attention="dense")
    plan = make_plan(ctx, SimpleNamespace(index_topk=8, index_n_heads=4, index_head_dim=16))
    assert plan.single == ctx.seqs and plan.dense == {} and plan.sparse == [] and plan.groups == []


def test_the_plan_groups_exactly_the_decodes_whose_every_row_sees_more_than_top_k():
    """`make_plan` at the top-k boundaries: a decode of context exactly k is in the dense regime; a
    sparse decode is in a group exactly when its first new row sees more than k keys (first new
    position >= k), else it selects alone. The groups cover a prefix of the sparse batch, in its
    order, each in ascending length (how `groups_within` and `length_buckets` expect them)."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    from sparsekv.model.decode_plan import make_plan
    k, starts = 8, iter(range(0, 100, 2))

    def seq(name, new, context):
        start = next(starts)
        return SeqSlice(name, start, start + new, context, torch.arange(context))
    dense = seq("dense", 1, k)            # context k: every key is read
    at_k = seq("at-k", 1, k + 1)           # first new position k: sees k + 1 keys
    draft_below = seq("draft-below", 2, k + 1)  # first new position k - 1: its first row sees k keys
    drafts = seq("drafts", 2, k + 2)       # first new position k
    long = seq("long", 1, 3 * k)
    seqs = [dense, long, draft_below, at_k, drafts]
    ctx = SimpleNamespace(seqs=seqs, decode_rows=2, batch_dense_decodes=True, attention="sparse",
                          input_ids=torch.zeros(100, dtype=torch.long))
    cfg = SimpleNamespace(index_topk=k, index_n_heads=4, index_head_dim=16)
    plan = make_plan(ctx, cfg)
    assert plan.single == [] and plan.dense == {k: [dense]}
    assert sorted(s.request_id for s in plan.sparse) == ["at-k", "draft-below", "drafts", "long"]
    grouped = [s for _, group in plan.groups for s in group]
    assert grouped == plan.sparse[:len(grouped)]
    assert {s.request_id for s in grouped} == {s.request_id for s in plan.sparse if s.first_new_position >= k} \
        == {"at-k", "drafts", "long"}
    assert all([s.context_len for s in g] == sorted(s.context_len for s in g) for _, g in plan.groups)
    assert plan.rows == [r for s in plan.sparse for r in range(s.token_start, s.token_end)]


def test_each_plan_group_has_the_scoring_layout_of_its_every_decode(monkeypatch):
    """Keys-major scoring is for one decode row over a long history (`keys_major`): with the threshold
    at 40 keys, plain decodes over 50 and 52 keys form a keys-major group, while decodes with drafts
    (3 rows) score query-major whatever their history, grouped with the short plain decode. Each
    group's layout is the one every member would take alone (`select_decode` asks `keys_major` with
    its own rows), and the keys-major batch scores one row per request."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    from sparsekv.model import indexer
    from sparsekv.model.decode_plan import make_plan
    monkeypatch.setattr(indexer, "DECODE_KEYS_MAJOR_MIN_KEYS_CPU", 40)
    shapes = {"plain-20": (1, 20), "plain-50": (1, 50), "plain-52": (1, 52), "drafts-20": (3, 20),
              "drafts-50": (3, 50), "drafts-55": (3, 55)}
    seqs, start = [], 0
    for name, (rows, context) in shapes.items():
        seqs.append(SeqSlice(name, start, start + rows, context, torch.arange(context)))
        start += rows
    ctx = SimpleNamespace(seqs=seqs, decode_rows=3, batch_dense_decodes=True, attention="sparse",
                          input_ids=torch.zeros(start, dtype=torch.long))
    plan = make_plan(ctx, SimpleNamespace(index_topk=8, index_n_heads=4, index_head_dim=16))
    cpu = torch.device("cpu")
    assert all(major == indexer.keys_major(cpu, s.num_new_tokens, s.context_len) for major, g in plan.groups for s in g)
    assert sorted((major, sorted(s.request_id for s in g)) for major, g in plan.groups) == \
        [(False, ["drafts-20", "drafts-50", "drafts-55", "plain-20"]), (True, ["plain-50", "plain-52"])]


def _seq(name: str, pages: list[int], length: int, page: int, device: str = "cpu"):
    """A SeqSlice of one decode row whose history of `length` tokens lies in `pages` (its runs as the
    runner makes them: consecutive pages merged)."""
    from sparsekv.context import SeqSlice
    slots = torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])[:length].to(device)
    runs = []
    for i, p in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == p * page:
            runs[-1][2] += page
        else:
            runs.append([i * page, p * page, page])
    runs[-1][2] -= len(pages) * page - length
    return SeqSlice(name, 0, 1, length, slots, runs=tuple(tuple(r) for r in runs))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)"))],
    ids=["cpu", "on_cuda"])
@pytest.mark.parametrize("layout", ["in-order", "interleaved", "shared-page", "sparse-span"])
def test_decode_selection_is_the_same_alone_and_batched_whatever_the_pages(layout, device):
    """Decode rows are scored page by page (`select_decode_pages`): on a CPU in place over the pool
    span when the pages are distinct and fill half of it, else (and on an accelerator) gathered.
    Every (request, page) pair scores its own page's keys either way, and a request selects the same
    positions, bit for bit, alone and in the batch."""
    from sparsekv.cache.pool import paged_keys
    from sparsekv.model.indexer import LightningIndexer
    page, dim, heads, k = 4, 16, 4, 8
    table = torch.randn(64 * page, dim, generator=torch.Generator().manual_seed(0)).to(device)
    pages = {"in-order": [[0, 1, 2], [3, 4, 5, 6], [7, 8]], "interleaved": [[0, 3, 6], [1, 4, 7, 9], [2, 5]],
             "shared-page": [[0, 1, 2], [0, 1, 3, 4], [5, 6]], "sparse-span": [[0, 20, 2], [40, 4, 5, 6], [60, 8]]}[layout]
    lengths = [11, 15, 8]
    seqs = [_seq(f"r{i}", p, n, page, device) for i, (p, n) in enumerate(zip(pages, lengths))]
    keys, at, counts = paged_keys(table, seqs, page)
    in_place = device == "cpu" and layout in ("in-order", "interleaved")  # distinct pages filling their span
    assert counts == [3, 4, 2] and (at is not None) == in_place
    assert (keys.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()) == in_place
    pairs = [p for ps in pages for p in ps]
    for i, p in enumerate(pairs):  # the pair's page, wherever it is among the keys
        assert torch.equal(keys[at[i] if at is not None else i], table[p * page:(p + 1) * page])
    indexer = LightningIndexer.__new__(LightningIndexer)  # select_decode_pages needs its head sizes only
    indexer.head_dim, indexer.n_heads = dim, heads
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(3, 1, heads, dim, generator=g).to(device), torch.randn(3, 1, heads, generator=g).to(device)
    positions = torch.tensor(lengths, device=device)[:, None] - 1
    together = indexer.select_decode_pages(q, w, keys, at, counts, lengths, positions, k)
    for i, seq in enumerate(seqs):
        alone = indexer.select_decode_pages(q[i:i + 1], w[i:i + 1], *paged_keys(table, [seq], page), [lengths[i]],
                                            positions[i:i + 1], k)
        assert torch.equal(alone, together[i:i + 1]), layout
        assert bool((alone < lengths[i]).all())


@pytest.mark.parametrize("pages, in_place", [([[0, 1], [5]], True), ([[0, 1], [5], [8]], False),
                                             ([[0], [3]], True), ([[0], [4]], False)],
                         ids=["3-of-6", "4-of-9", "2-of-4", "2-of-5"])
def test_decode_pages_are_read_in_place_exactly_when_they_fill_half_their_span(pages, in_place):
    """On a CPU `paged_keys` scores distinct pages in place over the pool span they cover when they
    fill at least half of it (a bound that includes exactly half), else gathers them: either way
    every (request, page) pair finds its own page's keys."""
    from sparsekv.cache.pool import paged_keys
    page, dim = 4, 8
    table = torch.randn(16 * page, dim, generator=torch.Generator().manual_seed(4))
    seqs = [_seq(f"r{i}", p, len(p) * page - 1, page) for i, p in enumerate(pages)]
    keys, at, counts = paged_keys(table, seqs, page)
    assert counts == [len(p) for p in pages] and (at is not None) == in_place
    assert (keys.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()) == in_place
    for i, p in enumerate(p for ps in pages for p in ps):
        assert torch.equal(keys[at[i] if in_place else i], table[p * page:(p + 1) * page])


@pytest.mark.parametrize("layout", ["in-order", "shared-page"])
def test_decode_pages_select_the_dense_top_k_when_histories_fill_whole_pages(layout):
    """`select_decode_pages`, batched and alone, against top-k of each request's dense scores (the
    other decode-selection tests compare its paths with each other), histories a whole number of
    pages long. Integer queries, keys and head weights with D = 16 (D^-1/2 = 1/4) make every score
    exact in fp32, so the sets must equal the reference's, ties included."""
    from sparsekv.cache.pool import paged_keys
    from sparsekv.kernels.attention import select_topk
    from sparsekv.model.indexer import LightningIndexer
    page, dim, heads, k = 4, 16, 4, 5
    g = torch.Generator().manual_seed(2)
    table = torch.randint(-3, 4, (64 * page, dim), generator=g).float()
    pages = {"in-order": [[0, 1], [2, 3, 4], [5, 6, 7, 8]], "shared-page": [[0, 1], [0, 3, 4], [5, 6, 7, 9]]}[layout]
    lengths = [8, 12, 16]
    seqs = [_seq(f"r{i}", p, n, page) for i, (p, n) in enumerate(zip(pages, lengths))]
    indexer = LightningIndexer.__new__(LightningIndexer)
    indexer.head_dim, indexer.n_heads = dim, heads
    q = torch.randint(-3, 4, (3, 1, heads, dim), generator=g).float()
    w = torch.randint(-2, 3, (3, 1, heads), generator=g).float()
    positions = torch.tensor(lengths)[:, None] - 1
    got = indexer.select_decode_pages(q, w, *paged_keys(table, seqs, page), lengths, positions, k)
    for i, seq in enumerate(seqs):
        keys = table[seq.slots]
        dense = ((torch.einsum("hd,td->ht", q[i, 0], keys).relu() * w[i, 0, :, None]).sum(0) * dim ** -0.5)
        want = select_topk(dense[None], k)
        alone = indexer.select_decode_pages(q[i:i + 1], w[i:i + 1], *paged_keys(table, [seq], page), [lengths[i]],
                                            positions[i:i + 1], k)
        assert torch.equal(got[i], want) and torch.equal(alone[0], want), (layout, i)


@pytest.mark.parametrize("major", [False, True], ids=["query-major", "keys-major"])
def test_decode_batch_selects_the_dense_top_k_over_padded_histories(major):
    """`select_decode_batch` (keys-major groups, gathered padded histories) against top-k of each
    request's dense scores: every history is padded to the longest by repeating its last key, so the
    padding ties with the newest key and only the mask past each row's position keeps it out; and
    the newest key (the row's own position) is visible, in the top-k here. Integer inputs with
    D = 16 make every score exact in fp32, so the sets must equal the reference's, ties included."""
    from sparsekv.kernels.attention import select_topk
    from sparsekv.model.indexer import LightningIndexer
    dim, heads, k, lengths = 16, 4, 5, [9, 12, 16]
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-3, 4, (3, 1, heads, dim), generator=g).float()
    w = torch.randint(1, 3, (3, 1, heads), generator=g).float()
    histories = [torch.randint(-3, 4, (n, dim), generator=g).float() for n in lengths]
    for i, h in enumerate(histories):
        h[-1] = 2 * q[i, 0].sum(0)  # the newest key aligned with the heads: a large score
    longest = max(lengths)
    keys = torch.stack([torch.cat([h, h[-1:].expand(longest - len(h), dim)]) for h in histories])
    indexer = LightningIndexer.__new__(LightningIndexer)  # select_decode_batch needs its head sizes only
    indexer.head_dim, indexer.n_heads = dim, heads
    positions = torch.tensor(lengths)[:, None] - 1
    got = indexer.select_decode_batch(q, w, keys, positions, k, major)
    for i, h in enumerate(histories):
        dense = (torch.einsum("hd,td->ht", q[i, 0], h).relu() * w[i, 0, :, None]).sum(0) * dim ** -0.5
        want = select_topk(dense[None], k)
        assert lengths[i] - 1 in want  # the row's own key is selected: a mask hiding it would show
        assert torch.equal(got[i], want), (major, i)


def test_a_decode_alone_takes_the_scoring_path_its_batch_would():
    """Batched, a decode joins a group (`select_group`, page by page) exactly when its row sees more
    than k keys, first new position >= k (decode_plan `_groups`); alone (`select_decode`) it must
    take the same path from the same position on, or a request's selection would depend on whether
    its step was batched (different products round differently)."""
    from types import SimpleNamespace
    from sparsekv.context import SeqSlice
    from sparsekv.model.selectors import DSASelector
    k, calls = 8, []

    class Indexer:
        def select(self, *args):
            calls.append("alone")
            return torch.zeros(1, k, dtype=torch.long)

        def select_decode_pages(self, *args):
            calls.append("group")
            return torch.zeros(1, 1, k, dtype=torch.long)
    cache = SimpleNamespace(index_key_segments=lambda layer, seq: [], index_key_pages=lambda layer, seqs: (None, None, [1]))
    selector = DSASelector(Indexer())
    state = (torch.zeros(1, 2, 4), torch.zeros(1, 2))
    for first in (k - 1, k, k + 1):
        seq = SeqSlice("r", 0, 1, first + 1, torch.arange(first + 1))
        selector.select_decode(0, seq, state, torch.zeros(1, 2, 4), torch.tensor([first]), k, cache)
    assert calls == ["alone", "group", "group"]
