"""Speculative decoding with the MTP layer: greedy output identical to plain decoding, drafts equal to
the MTP layer run over the whole sequence at once, rejection sampling exact, clear errors."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, ConfigError, SamplingParams
from sparsekv.paths import default_model_path
from sparsekv.speculative import Draft, verify_draft

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
# small chunks and token budget: prefill in several chunks, and steps where a draft does not fit
OPTIONS = dict(max_model_len=512, prefill_chunk_tokens=8, max_num_batched_tokens=20, max_num_seqs=3)


@pytest.fixture(scope="module")
def model():
    return default_model_path()


def _idle(llm):
    llm.engine.check_integrity()
    s = llm.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0 and not llm.engine.speculator.drafts


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_plain_greedy(model, k):
    plain = LLM(model, **OPTIONS).generate(PROMPTS, GREEDY)
    llm = LLM(model, num_speculative_tokens=k, **OPTIONS)
    spec = llm.generate(PROMPTS, GREEDY)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < 1e-5
        assert b.metrics["spec_num_draft_tokens"] > 0
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    _idle(llm)


def test_penalised_greedy_with_drafts_equals_plain(model):
    """Each verified row is adjusted with the tokens accepted before it: with penalties, a logit bias
    and min_tokens, drafting still gives plain decoding's tokens and logprobs."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias={11: 2.0}, min_tokens=20)
    plain = LLM(model, **OPTIONS).generate(PROMPTS, params)
    unpenalised = LLM(model, **OPTIONS).generate(PROMPTS, GREEDY)
    llm = LLM(model, num_speculative_tokens=3, **OPTIONS)
    spec = llm.generate(PROMPTS, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < 1e-5
    assert [o.token_ids for o in plain] != [o.token_ids for o in unpenalised]
    assert 0 < llm.stats()["spec_num_accepted_tokens"]
    _idle(llm)


@pytest.mark.parametrize("repeat", [1, 20])  # 20: past index_topk (256), so the MTP indexer selects
def test_drafts_equal_the_mtp_layer_over_the_whole_sequence(model, repeat):
    """Each step's draft comes from the MTP cache built step by step; running the MTP layer over the
    finished sequence in one pass (its own fresh cache) must predict the same tokens."""
    from sparsekv.cache.pool import KVPool
    from sparsekv.context import ForwardContext, SeqSlice
    from sparsekv.speculative import MTPDrafter
    llm = LLM(model, num_speculative_tokens=2, **OPTIONS)
    drafts = []
    spec = llm.engine.speculator
    real = spec.draft

    def record(chunks, hidden, generators):
        real(chunks, hidden, generators)
        for ch in chunks:
            req = ch.request
            if req.draft_token_ids:  # the first draft: from the extend step's cache
                drafts.append((req.num_tokens, req.draft_token_ids[0]))  # (position drafted, token)
    spec.draft = record
    out = llm.generate([PROMPTS[1] * repeat], GREEDY)[0]
    assert (len(out.prompt_token_ids) > llm.engine.model.cfg.index_topk) == (repeat > 1)
    ids = out.prompt_token_ids + out.token_ids
    m, n = llm.engine.model, len(ids)
    cfg = m.cfg
    layers = list(range(cfg.num_hidden_layers + 1))
    cache = KVPool(cfg, -(-n // 64), 64, m.dtype, m.device, layers, cfg.full_layers + [cfg.num_hidden_layers])
    slots = torch.arange(n)

    def ctx_for(count, rows):
        seq = SeqSlice("x", 0, count, count, slots[:count], runs=((0, 0, count),))
        return ForwardContext(torch.tensor(ids[:count]), torch.arange(count), slots[:count], [seq], rows)
    with torch.inference_mode():
        hidden = m.hidden_states(ctx_for(n, torch.arange(n)), cache)
        ctx = ctx_for(n - 1, torch.arange(n - 1))
        logits, _ = MTPDrafter(m).forward(hidden[:n - 1], torch.tensor(ids[1:n]), ctx, cache)
    predicted = {p + 2: int(logits[p].argmax()) for p in range(n - 1)}  # row p predicts token p + 2
    assert len(drafts) > 10
    for position, token in drafts:
        assert predicted[position] == token, f"draft for position {position}"


def test_rejection_sampling_emits_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    target_logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    p = target_logits.softmax(-1)
    q = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    counts, trials = torch.zeros(5), 20000
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=g))
        token, accepted = verify_draft(target_logits, Draft(d, q), params, g)
        assert token == d or not accepted
        counts[token] += 1
    assert (counts / trials - p).abs().max() < 0.015


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([0.1, 3.0, 0.2])
    g = torch.Generator()
    assert verify_draft(logits, Draft(1, None), SamplingParams(temperature=0.0), g) == (1, True)
    assert verify_draft(logits, Draft(2, None), SamplingParams(temperature=0.0), g) == (1, False)


def test_seeded_sampling_with_drafts_is_reproducible_and_aborts_free_everything(model):
    llm = LLM(model, num_speculative_tokens=3, **OPTIONS)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    engine = llm.engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(6):
        engine.step()
    assert engine.abort("x")
    _idle(llm)


LONG = [PROMPTS[1] * 24, PROMPTS[2] * 12]  # 384 and 300 tokens: past index_topk (256), so full layers select


@pytest.mark.parametrize("selector, buffer", [("dsa", 256), ("dsa", 512), ("quest", 256)])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=5,
                                                           logprobs=2)], ids=["greedy", "sampled"])
def test_tiering_with_drafts_is_exact(model, params, selector, buffer, monkeypatch):
    """The tiered cache with speculative decoding computes what the device-only cache computes, bit for
    bit, with either selector (the MTP layer keeps its own DSA indexer under Quest). A verification
    step (the newest token and its drafts) resolves the union of its rows' selections in the working
    set, or streams from the host store when the union exceeds N (at N = top-k both happen); the MTP
    layer resolves in its own working set too."""
    from sparsekv.cache.tiers import TieredKVPool
    paths, plan = set(), TieredKVPool._plan

    def spy(self, leader, seq, positions, src, dst):
        rows = plan(self, leader, seq, positions, src, dst)
        paths.add(("mtp" if leader in self.mtp_layers else seq.num_new_tokens > 1, rows is not None))
        return rows
    monkeypatch.setattr(TieredKVPool, "_plan", spy)
    _check_tiered_drafting(model, params, selector, buffer, "cpu")
    assert (True, True) in paths and ("mtp", True) in paths
    if selector == "dsa":
        assert ((True, False) in paths) == (buffer == 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
def test_tiering_with_drafts_is_exact_on_cuda(model):
    _check_tiered_drafting(model, GREEDY, "dsa", 256, "cuda")


def test_tiering_with_drafts_is_exact_under_emulated_cuda_ordering(model, emulated_cuda):
    """The CUDA test above on this CPU: backups and shared layers' fetches land as late as CUDA allows
    (conftest.emulated_cuda), through verification chunks and the MTP layer's own pass."""
    _check_tiered_drafting(model, GREEDY, "dsa", 256, "cpu")
    assert emulated_cuda["backups"] > 0 and emulated_cuda["fetches"] > 0


def _check_tiered_drafting(model, params, selector, buffer, device):
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, selector=selector, device=device)
    ref = LLM(model, num_speculative_tokens=2, **options).generate(prompts, params)
    llm = LLM(model, num_speculative_tokens=2, kv_tiering=True, device_buffer_tokens=buffer, **options)
    outs = llm.generate(prompts, params)
    for a, b in zip(ref, outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens"):  # the same drafts, too
            assert a.metrics[key] == b.metrics[key]
        assert b.metrics["spec_num_draft_tokens"] > 0 and b.metrics["d2h_bytes"] > 0
    stats, cache = llm.stats(), llm.engine.kv.pool
    assert min(len(outs[0].prompt_token_ids), len(outs[2].prompt_token_ids)) > llm.engine.model.cfg.index_topk
    assert stats["tier_misses"] > 0 and stats["h2d_bytes"] > 0 and cache.mtp_layers
    if params is GREEDY:  # and both equal plain decoding
        plain = LLM(model, **options).generate(prompts, params)
        assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    _idle(llm)
    cache.check_integrity(set())


@pytest.mark.parametrize("k", [1, 3])
def test_quest_with_drafts_equals_plain_quest(model, k):
    """Quest's page bounds are min/max accumulators: a rejected draft's latent must not stay in them.
    Past top-k (so Quest selects), drafting gives plain decoding's tokens, and keeps nothing after."""
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, selector="quest")
    plain = LLM(model, **options).generate(prompts, GREEDY)
    llm = LLM(model, num_speculative_tokens=k, **options)
    spec = llm.generate(prompts, GREEDY)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < 1e-5
    assert llm.stats()["spec_num_draft_tokens"] > llm.stats()["spec_num_accepted_tokens"] > 0
    _idle(llm)


def test_tiering_with_drafts_counts_the_mtp_layer(model):
    """Host, indexer and working-set bytes include the MTP layer's; a working set holds one more
    new-token row per draft."""
    plain = LLM(model, kv_tiering=True, max_model_len=512).engine.kv.pool
    spec = LLM(model, kv_tiering=True, num_speculative_tokens=1, max_model_len=512).engine.kv.pool
    cfg = spec.cfg
    row = cfg.latent_dim * spec.dtype.itemsize
    assert spec.latent_bytes_per_token() == plain.latent_bytes_per_token() + row
    assert spec.index_bytes_per_token() == plain.index_bytes_per_token() + cfg.index_head_dim * spec.dtype.itemsize
    assert plain.working_set_bytes() == (plain.device_buffer_tokens + 1) * row * cfg.num_hidden_layers
    assert spec.working_set_bytes() == (spec.device_buffer_tokens + 2) * row * (cfg.num_hidden_layers + 1)


def test_configuration_errors(model, glm_ckpt):
    with pytest.raises(ConfigError, match="needs a checkpoint with an MTP layer"):
        LLM(glm_ckpt[0], num_speculative_tokens=1)
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer in"):
        LLM(model, num_speculative_tokens=9)


@pytest.mark.parametrize("tiering", [[], ["--kv-tiering"]], ids=["device", "tiered"])
def test_bench_spec_reports_identical_greedy_outputs(tmp_path, capsys, tiering):
    import json
    from sparsekv.tools.bench_spec import main
    out = tmp_path / "spec.json"
    assert main(["--prompts", "2", "--prompt-tokens", "64", "--max-tokens", "8", "--json", str(out)] + tiering) == 0
    result = json.loads(out.read_text())
    assert result["kv_tiering"] == bool(tiering)
    assert ("h2d_mb_per_token" in result["summary"]["MTP draft"]) == bool(tiering)
    assert result["identical"] == result["prompts"] == 2
    assert 0.0 <= result["summary"]["MTP draft"]["acceptance"] <= 1.0
    assert result["summary"]["MTP draft"]["steps_per_token"] <= 1.0
    assert "greedy outputs identical to plain decoding: 2 of 2" in capsys.readouterr().out


def test_acceptance_counters_reach_prometheus_as_vllm_names():
    from sparsekv.server.metrics import ServerMetrics
    stats = {"spec_num_draft_tokens": 10, "spec_num_accepted_tokens": 6, "spec_acceptance_rate": 0.6}
    text = ServerMetrics("m", lambda: stats, lambda: True).render().decode()
    assert 'sparsekv:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'sparsekv:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert "# TYPE sparsekv:spec_acceptance_rate gauge" in text


def test_server_streams_drafted_tokens_and_exports_acceptance(model):
    """Several tokens per engine step reach a streaming client in order, equal to plain greedy."""
    import json

    import httpx
    from test_server_util import ThreadServer, scrape
    body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = LLM(model, max_model_len=256).generate([PROMPTS[2]], SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True))[0]
    with ThreadServer(model, num_speculative_tokens=2) as srv:
        text = ""
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        m = scrape(srv.url)
    assert text == plain.text
    assert m["sparsekv:spec_decode_num_draft_tokens_total"] >= m["sparsekv:spec_decode_num_accepted_tokens_total"] > 0
    srv.engine.check_integrity()


def test_device_budget_counts_the_mtp_layer(model):
    budget = 4 << 20
    plain = LLM(model, device_kv_budget_bytes=budget, max_model_len=256).engine
    spec = LLM(model, device_kv_budget_bytes=budget, max_model_len=256, num_speculative_tokens=1).engine
    for engine in (plain, spec):
        per_token = engine.kv.pool.latent_bytes_per_token() + engine.kv.pool.index_bytes_per_token()
        assert engine.kv.allocator.num_pages * engine.kv.page_size * per_token <= budget
    assert spec.kv.allocator.num_pages < plain.kv.allocator.num_pages


@pytest.mark.parametrize("tiering", [False, True])
def test_batched_selection_of_drafting_decodes_equals_per_request(model, tiering, monkeypatch):
    """Verification rows (the newest token and its drafts) join the accelerator's batched decode
    selection; forced on here, drafting gives the same tokens, logprobs and drafts bit for bit."""
    from sparsekv.model.indexer import LightningIndexer
    from sparsekv.model.selectors import DSASelector
    prompts = [LONG[0], PROMPTS[0], LONG[1]]
    options = dict(OPTIONS, prefill_chunk_tokens=64, max_num_batched_tokens=72, num_speculative_tokens=2,
                   kv_tiering=tiering)
    ref = LLM(model, **options).generate(prompts, GREEDY)
    shapes, real = [], LightningIndexer.select_decode_batch

    def spy(self, q, weights, keys, positions, k, major=False):
        shapes.append(tuple(q.shape[:2]))
        return real(self, q, weights, keys, positions, k, major)
    monkeypatch.setattr(LightningIndexer, "select_decode_batch", spy)
    monkeypatch.setattr(DSASelector, "batch_decode", True)
    outs = LLM(model, **options).generate(prompts, GREEDY)
    for a, b in zip(ref, outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.metrics["spec_num_accepted_tokens"] == b.metrics["spec_num_accepted_tokens"]
    assert any(rows == 3 for _, rows in shapes), "no batch held a verification chunk"
