"""The engine API an RL trainer uses (docs/rl.md): weight updates in process and from disk, no stale
prefix-cache page in any tier after one, drain and abort policies, pause/continue, routed experts.

After an update the model holds the very values a fresh load of the new weights makes and runs the same
operations on them, but in the memory the old weights had: CPU matrix kernels pick their code path by
the operands' alignment, so the rounding may differ, and logprobs are compared within the bound of
tests/tolerances.py (greedy tokens equal, where the inputs leave a clear lead)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import STARTUP_S
from sparsekv import LLM, SamplingParams
from sparsekv.model.checkpoint import LOAD_FAULT_ENV
from sparsekv.paths import default_model_path
from sparsekv.tools.tiny import save_reference_checkpoint
from sparsekv.weights import WeightLoadError, WeightUpdateConflict, WeightUpdateError
from tolerances import assert_same_greedy, logprob_tolerance

PAGE = 4
OPTIONS = dict(max_model_len=256, kv_page_size=PAGE, prefill_chunk_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPT = [(7 * i) % 250 + 1 for i in range(37)]
OTHER = [(11 * i) % 250 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of one architecture (A, B: other random weights) and B's reference model."""
    root = tmp_path_factory.mktemp("rl")
    a, b = str(root / "a"), str(root / "b")
    save_reference_checkpoint(a, "glm_moe_dsa", seed=0, index_topk=8)
    ref_b = save_reference_checkpoint(b, "glm_moe_dsa", seed=1, index_topk=8)
    return a, b, ref_b


def _same(x, y, model=None):
    """Equal tokens; logprobs bit for bit (the same weights in the same memory), or with `model` (an
    updated LLM or DSAModel) within its rounding bound, greedy tokens where the lead is clear."""
    if model is None:
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
        return
    assert_same_greedy([y], [x], logprob_tolerance(model))


def _tensors(path):
    return load_file(f"{path}/model.safetensors")


def test_update_from_disk_serves_what_a_fresh_engine_of_b_serves(ckpts):
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    before = llm.generate([PROMPT], GREEDY)[0]
    assert before.metrics["weights_version"] == 0
    assert llm.update_weights_from_disk(b) == 1
    after = llm.generate([PROMPT, OTHER], GREEDY)
    fresh = LLM(b, **OPTIONS).generate([PROMPT, OTHER], GREEDY)
    for x, y in zip(after, fresh):
        _same(x, y, llm)
    assert after[0].token_ids != before.token_ids
    assert after[0].metrics["weights_version"] == 1 and llm.stats()["weights_version"] == 1
    llm.engine.check_integrity()


def test_update_from_tensors_with_fp8_scales_and_a_partial_update(ckpts, tmp_path):
    a, b, _ = ckpts
    tensors = _tensors(b)
    name = "model.layers.1.self_attn.q_b_proj.weight"  # stored as FP8 with 128x128 block scales in C
    w = tensors[name].float()
    scale = torch.full((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), w.abs().max().item() / 448.0)
    w8 = (w / scale[0, 0]).to(torch.float8_e4m3fn)
    c = tmp_path / "c"
    c.mkdir()
    for f in ("config.json",):
        (c / f).write_bytes(open(f"{b}/{f}", "rb").read())
    save_file({**{k: v for k, v in tensors.items() if k != name}, name: w8, name + "_scale_inv": scale},
              str(c / "model.safetensors"))
    fresh = LLM(str(c), **OPTIONS).generate([PROMPT], GREEDY)[0]
    llm = LLM(a, **OPTIONS)
    update = [(k, v) for k, v in tensors.items() if k != name] + [(name, w8), (name + "_scale_inv", scale)]
    assert llm.update_weights(update) == 1
    _same(llm.generate([PROMPT], GREEDY)[0], fresh, llm)
    # partial: only the FP8 tensor, back to B's own values; the rest keep what the last update gave
    llm.update_weights([(name, tensors[name])])
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)
    assert llm.weights_version == 2


@pytest.mark.parametrize("bad, match", [
    (lambda t: [("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(3, 3))], "wrong shape"),
    (lambda t: [("model.layers.9.mlp.gate.weight", torch.zeros(3, 3))], "unknown tensor"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"].to(torch.float8_e4m3fn))], "no model.norm.weight_scale_inv"),
    (lambda t: [("model.norm.weight_scale_inv", torch.ones(1, 1))], "not F8_E4M3"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"].to(torch.int32))], "is torch.int32: a weight must be"),
    (lambda t: [("model.layers.0.self_attn.o_proj.weight",
                 t["model.layers.0.self_attn.o_proj.weight"].to(torch.float8_e5m2))], "float8_e5m2: a weight must be"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"].to(torch.float8_e4m3fn)),
                ("model.norm.weight_scale_inv", torch.ones(1))], "a 2-D FP8 tensor"),
    (lambda t: [("model.norm.weight", t["model.norm.weight"])] * 2, "given twice"),
])
def test_a_bad_update_is_refused_whole_and_a_keeps_serving(ckpts, bad, match):
    """The rest of the update is B's whole, good: nothing of it loads."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    tensors = _tensors(b)
    wrong = bad(tensors)
    update = [(k, v) for k, v in tensors.items() if k not in {n for n, _ in wrong}] + wrong
    with pytest.raises(WeightUpdateError, match=match):
        llm.update_weights(update)
    with pytest.raises(WeightUpdateError, match="no tensors"):
        llm.update_weights([])
    with pytest.raises(WeightUpdateError, match="without their weight"):
        llm.update_weights([("model.norm.weight_scale_inv", torch.ones(1, 1))])
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    assert llm.weights_version == 0


def test_a_checkpoint_of_another_architecture_is_refused(ckpts, tmp_path):
    a, _, _ = ckpts
    other = str(tmp_path / "other")
    save_reference_checkpoint(other, "glm_moe_dsa", seed=2, index_topk=4)  # the same tensors, another top-k
    llm = LLM(a, **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    with pytest.raises(WeightUpdateError, match="index_topk"):
        llm.update_weights_from_disk(other)
    with pytest.raises(WeightUpdateError):
        llm.update_weights_from_disk(str(tmp_path / "missing"))
    _same(llm.generate([PROMPT], GREEDY)[0], want)


def test_a_checkpoint_without_the_running_models_mtp_layer_is_refused(ckpts, tmp_path):
    """The drafter's MTP layer is part of the loaded model: a checkpoint of the same config without it
    (whose headers a load alone would accept, the layer being optional) is refused by its tensor names,
    before anything changes."""
    from test_sizing import _with_mtp_layer
    a, b, _ = ckpts
    llm = LLM(_with_mtp_layer(a, str(tmp_path / "a_mtp")), **OPTIONS, num_speculative_tokens=1)
    want = llm.generate([PROMPT], GREEDY)[0]
    with pytest.raises(WeightUpdateError, match=r"its tensors differ from the loaded model's: missing model\.layers\.\d+\."):
        llm.update_weights_from_disk(b)
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    assert llm.weights_version == 0


@pytest.mark.parametrize("damage", ["shape", "fp8-scale"])
def test_a_checkpoint_whose_stored_tensors_disagree_is_refused_by_its_headers(ckpts, tmp_path, damage):
    """Its config and tensor names right, but a tensor stored wrong (another shape; FP8 with a scale that
    is not its 128x128 blocks'): refused from the safetensors headers, a WeightUpdateError before any
    part loads, not a load failing part-way."""
    import shutil
    a, b, _ = ckpts
    bad = shutil.copytree(b, tmp_path / "bad")
    tensors = _tensors(b)
    name = "model.layers.2.self_attn.o_proj.weight"
    if damage == "shape":
        tensors[name] = tensors[name][:, 1:].contiguous()
    else:
        tensors[name], tensors[name + "_scale_inv"] = tensors[name].to(torch.float8_e4m3fn), torch.ones(2, 2)
    save_file(tensors, str(bad / "model.safetensors"))
    llm = LLM(a, **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    with pytest.raises(WeightUpdateError, match=name):
        llm.update_weights_from_disk(str(bad))
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    assert llm.weights_version == 0


def _tier_options(tier: str, tmp_path, page_bytes: int | None = None) -> dict:
    options = dict(OPTIONS, enable_prefix_caching=True, max_num_seqs=1)
    if tier in ("host", "disk"):
        options.update(num_kv_pages=12, prefix_cache_host_bytes=1 << 24)
    if tier == "disk":
        options.update(prefix_cache_host_bytes=page_bytes, prefix_cache_disk_path=str(tmp_path / "disk"),
                       prefix_cache_disk_bytes=1 << 24)
    return options


def _cache_prompt(llm, tier: str) -> None:
    """PROMPT's pages cached, then (host, disk) pushed out of the pool by another prompt."""
    llm.generate([PROMPT], GREEDY)
    if tier != "device":
        llm.generate([OTHER], GREEDY)
    if tier == "disk":
        llm.engine.kv.prefix.tiers["disk"].flush()


@pytest.mark.parametrize("how", ["disk", "tensors"])
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_prompt_cached_under_a_is_recomputed_under_b_in_every_tier(ckpts, tmp_path, tier, how):
    a, b, _ = ckpts
    page_bytes = LLM(a, **dict(OPTIONS, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 20)) \
        .engine.kv.prefix.tiers["host"].page_bytes
    control = LLM(a, **_tier_options(tier, tmp_path / "control", page_bytes))
    _cache_prompt(control, tier)
    hit = control.generate([PROMPT], GREEDY)[0]
    assert hit.metrics[f"prefix_cached_tokens_{tier}"] > 0  # without an update the tier serves the prompt
    control.close()
    llm = LLM(a, **_tier_options(tier, tmp_path / "updated", page_bytes))
    _cache_prompt(llm, tier)
    written = llm.stats().get("prefix_disk_writes", 0)
    if how == "disk":
        llm.update_weights_from_disk(b)
    else:
        llm.update_weights(_tensors(b).items())
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 0
    if tier == "disk" and how == "disk":  # the disk tier reopened for B: its counts go on from A's
        assert llm.stats()["prefix_disk_writes"] >= written > 0
    fresh = LLM(b, **_tier_options(tier, tmp_path / "fresh", page_bytes)).generate([PROMPT], GREEDY)[0]
    _same(out, fresh, llm)
    llm.engine.check_integrity()
    llm.close()


def test_reloading_the_same_checkpoint_reopens_the_disk_tier_with_its_pages(ckpts, tmp_path):
    """An update from the checkpoint already loaded names the disk tier's own directory again: the old
    tier must be closed first (one engine locks a directory), so the tier reopens and serves every
    page of the prompt written there before the update (the same weights' KV)."""
    a, _, _ = ckpts
    page_bytes = LLM(a, **dict(OPTIONS, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 20)) \
        .engine.kv.prefix.tiers["host"].page_bytes
    llm = LLM(a, **_tier_options("disk", tmp_path, page_bytes))
    llm.generate([PROMPT], GREEDY)
    llm.generate([OTHER, [(11 * i + 1) % 250 + 3 for i in range(37)]], GREEDY)  # PROMPT's pages pushed to disk
    prefix = llm.engine.kv.prefix
    prefix.tiers["disk"].flush()
    names = prefix.prompt_names(PROMPT, "default", None)
    assert all(prefix.tiers["disk"].has(name) for name in names)
    llm.update_weights_from_disk(a)
    assert "disk" in prefix.tiers
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics["prefix_cached_tokens_disk"] == out.num_cached_tokens == len(names) * PAGE
    llm.engine.check_integrity()
    llm.close()

def _run_until_done(engine, outs: dict) -> None:
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o


def test_drain_finishes_started_requests_under_a_and_holds_new_ones_for_b(ckpts):
    a, b, _ = ckpts
    only_a = LLM(a, **OPTIONS).generate([PROMPT], GREEDY)[0]
    only_b = LLM(b, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    for _ in range(4):  # prefill and a few decodes under A
        engine.step()
    assert engine.update_weights_from_disk(b, policy="drain") == []
    assert engine.weight_update_pending and engine.weights_version == 0
    engine.add_request("r2", OTHER, GREEDY)
    engine.check_integrity()  # r2 held out of the scheduler, its sampling state kept
    with pytest.raises(WeightUpdateConflict, match="pausing would hold it"):  # r1 would never finish
        engine.pause_generation()
    stats = engine.stats()  # held, it waits: what /metrics and the router's load figure read
    assert (stats["running"], stats["waiting"]) == (1, 1)
    assert stats["kv_by_tenant"]["default"]["waiting"] == 1
    with pytest.raises(Exception, match="already in use"):
        engine.add_request("r2", OTHER, GREEDY)
    outs = {}
    _run_until_done(engine, outs)
    _same(outs["r1"], only_a)  # all under A, in A's memory: bit for bit
    _same(outs["r2"], only_b, engine.model)
    assert outs["r1"].metrics["weights_version"] == 0 and outs["r2"].metrics["weights_version"] == 1
    engine.check_integrity()


def test_a_drain_loads_once_its_last_started_request_is_aborted(ckpts):
    """The only started request is aborted (its client went away) while a drain waits: the next step
    loads the update, and the held request runs under B."""
    a, b, _ = ckpts
    only_b = LLM(b, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    for _ in range(3):
        engine.step()
    engine.update_weights_from_disk(b, policy="drain")
    engine.add_request("r2", OTHER, GREEDY)
    engine.abort("r1")
    assert engine.has_unfinished_requests()
    engine.step()
    assert engine.weights_version == 1 and not engine.weight_update_pending
    outs = {}
    _run_until_done(engine, outs)
    _same(outs["r2"], only_b, engine.model)
    assert outs["r2"].metrics["weights_version"] == 1
    engine.check_integrity()


def test_drain_finishes_a_preempted_request_under_a(ckpts):
    """A request preempted before the update waits with tokens A computed: it is drained, not held."""
    a, b, _ = ckpts
    ref = LLM(a, **OPTIONS)
    only_a = ref.generate([PROMPT], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    req = engine.add_request("r1", PROMPT, GREEDY)
    for _ in range(5):
        engine.step()
    engine.scheduler.preempt(req)
    assert req in engine.scheduler.waiting and req.num_output_tokens > 0
    engine.update_weights_from_disk(b, policy="drain")
    assert engine.weight_update_pending
    outs = {}
    _run_until_done(engine, outs)
    assert outs["r1"].metrics["weights_version"] == 0 and engine.weights_version == 1
    assert outs["r1"].metrics["num_preemptions"] == 1
    _same(outs["r1"], only_a, ref)  # recomputed in other row groups: within the bound
    engine.check_integrity()


def test_abort_ends_started_requests_and_runs_the_queued_ones_under_b(ckpts):
    a, b, _ = ckpts
    only_b = LLM(b, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.step()
    engine.add_request("r2", OTHER, GREEDY)  # queued behind, not started: it runs under B
    engine.pause_generation()
    with pytest.raises(WeightUpdateConflict, match="paused"):
        engine.update_weights_from_disk(b, policy="drain")
    aborted = engine.update_weights_from_disk(b, policy="abort")
    engine.continue_generation()
    assert [o.request_id for o in aborted] == ["r1"] and aborted[0].finish_reason == "abort"
    assert aborted[0].metrics["weights_version"] == 0 and engine.weights_version == 1
    outs = {}
    _run_until_done(engine, outs)
    assert set(outs) == {"r2"}
    _same(outs["r2"], only_b, engine.model)
    engine.check_integrity()


def test_a_load_that_fails_after_abort_still_returns_the_aborted_outputs_and_a_serves(ckpts, monkeypatch):
    """The "abort" policy ends the started requests before loading; if the load itself then fails (an
    I/O or memory error past the checks), their final outputs come with the WeightLoadError, nothing
    is left running, and A keeps serving."""
    a, b, _ = ckpts
    engine = LLM(a, **OPTIONS).engine
    want = LLM(a, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()

    def fail(update):
        raise OSError("disk gone")
    monkeypatch.setattr(engine.executor, "update_weights", fail)
    with pytest.raises(WeightLoadError, match="disk gone") as failed:
        engine.update_weights_from_disk(b, policy="abort")
    assert [(o.request_id, o.finish_reason) for o in failed.value.aborted] == [("r1", "abort")]
    assert engine.weights_version == 0 and not engine.has_unfinished_requests()
    engine.add_request("r2", OTHER, GREEDY)
    outs = {}
    _run_until_done(engine, outs)
    assert outs["r2"].token_ids == want.token_ids
    engine.check_integrity()


def test_pause_keeps_requests_and_kv_and_continue_gives_the_uninterrupted_outputs(ckpts):
    a, _, _ = ckpts
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, logprobs=1)
    want = LLM(a, **OPTIONS).generate([PROMPT, OTHER], params)
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("p", PROMPT, params)
    engine.add_request("o", OTHER, params)
    engine.step()
    engine.step()
    engine.pause_generation()
    free = engine.stats()["kv_pages_free"]
    for _ in range(3):
        assert engine.step() == []
    assert engine.stats()["kv_pages_free"] == free and engine.stats()["running"] == 2
    engine.continue_generation()
    outs = {}
    _run_until_done(engine, outs)
    _same(outs["p"], want[0])
    _same(outs["o"], want[1])


def test_seeded_tokens_do_not_depend_on_the_batch_after_an_update(ckpts):
    a, b, _ = ckpts
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    llm = LLM(a, **OPTIONS)
    llm.generate([PROMPT], params)
    llm.update_weights_from_disk(b)
    alone = llm.generate([PROMPT], params)[0]
    batched = llm.generate([OTHER, PROMPT, OTHER[:20]], params)[1]
    assert alone.token_ids == batched.token_ids
    assert alone.token_ids == LLM(b, **OPTIONS).generate([PROMPT], params)[0].token_ids


def _reference_routing(ref, token_ids: list[int]) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert ids per position, from transformers' router on its own forward."""
    found = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: found.append(out[2].sort(-1).values))
             for layer in ref.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            ref(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    return found


def test_routed_experts_are_the_ones_the_reference_router_picks(ckpts):
    a, b, ref_b = ckpts
    params = SamplingParams(max_tokens=8, temperature=0.0, return_routed_experts=True)
    llm = LLM(a, **OPTIONS)
    llm.update_weights_from_disk(b)  # under B: its reference model recomputes the routing
    outs = llm.generate([PROMPT, OTHER[:23]], params)
    for prompt, out in zip([PROMPT, OTHER[:23]], outs):
        routing = _reference_routing(ref_b, prompt + out.token_ids)
        assert len(out.routed_experts) == len(out.token_ids) and len(out.routed_experts[0]) == len(routing)
        for i in range(len(out.token_ids)):  # token i was sampled at position len(prompt) - 1 + i
            want = [layer[len(prompt) - 1 + i].tolist() for layer in routing]
            assert out.routed_experts[i] == want, f"token {i}"
    assert llm.generate([PROMPT], GREEDY)[0].routed_experts is None


def test_routed_experts_of_verified_drafts_equal_plain_decoding():
    """MTP verification rows (the bundled model has an MTP layer): the experts of each accepted token's
    row are those plain decoding routes the same token with."""
    params = SamplingParams(max_tokens=16, temperature=0.0, return_routed_experts=True)
    options = dict(max_model_len=512, prefill_chunk_tokens=8, max_num_seqs=2)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n"]
    plain = LLM(default_model_path(), **options).generate(prompts, params)
    llm = LLM(default_model_path(), num_speculative_tokens=2, **options)
    spec = llm.generate(prompts, params)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    for x, y in zip(plain, spec):
        assert x.token_ids == y.token_ids
        assert x.routed_experts == y.routed_experts


@pytest.mark.parametrize("options", [{}, dict(enable_expert_parallel=True),
                                     dict(enable_expert_parallel=True, weight_update_host_copy=False)],
                         ids=["tp2", "tp2-ep", "tp2-ep-no-host-copy"])
def test_tensor_parallel_ranks_each_load_their_slices(ckpts, options):
    """Under tensor (and expert) parallelism the update goes through the executor: every rank loads its
    own slices, from disk or from the tensors rank 0 was given; outputs are then one process's under B.
    Without the host copy, a partial update leaving out a tensor the last update replaced is refused on
    rank 0 before any rank loads, though another rank holds it (rank 1's experts)."""
    a, b, _ = ckpts
    single = LLM(b, **OPTIONS)
    want = single.generate([PROMPT, OTHER], GREEDY)
    tol = logprob_tolerance(single)
    llm = LLM(a, tensor_parallel_size=2, dist_startup_timeout_s=STARTUP_S, **OPTIONS, **options)
    try:
        llm.generate([PROMPT], GREEDY)
        llm.update_weights_from_disk(b)
        assert_same_greedy(want, llm.generate([PROMPT, OTHER], GREEDY), tol)
        with pytest.raises(WeightUpdateError, match="wrong shape"):
            llm.update_weights([("model.norm.weight", torch.zeros(3))])
        llm.update_weights_from_disk(a)
        llm.update_weights(_tensors(b).items())
        assert_same_greedy(want, llm.generate([PROMPT, OTHER], GREEDY), tol)
        assert llm.weights_version == 3
        if options.get("weight_update_host_copy") is False:
            name = "model.layers.1.mlp.experts.3.up_proj.weight"  # rank 1's: its layer's others are left out
            with pytest.raises(WeightUpdateError, match="keeps no host copy"):
                llm.update_weights([(name, _tensors(a)[name])])
            assert llm.weights_version == 3
            assert_same_greedy(want, llm.generate([PROMPT, OTHER], GREEDY), tol)
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_a_tensor_parallel_worker_failing_to_load_an_update_fails_it_on_rank_0(ckpts, tmp_path, monkeypatch):
    """Under expert parallelism rank 1 alone reads experts 2 and 3: reading one fails there (an injected
    fault), while rank 0 loads its slices. Rank 0 learns it from the ranks' agreement: the update itself
    fails, naming it, and since the ranks' weights now differ every later call raises RankFailure."""
    import shutil

    from sparsekv.model.checkpoint import LOAD_FAULT_ENV
    from sparsekv.parallel.launch import RankFailure
    a, b, _ = ckpts
    monkeypatch.setenv(LOAD_FAULT_ENV, "rank1:model.layers.1.mlp.experts.2.gate_proj.weight")
    shutil.copytree(b, tmp_path / "rank1")
    llm = LLM(a, tensor_parallel_size=2, enable_expert_parallel=True, num_threads=1, dist_startup_timeout_s=STARTUP_S,
              **OPTIONS)
    try:
        assert llm.generate([PROMPT], GREEDY)[0].token_ids
        with pytest.raises(RankFailure, match="weights now differ: a worker rank failed to load it"):
            llm.update_weights_from_disk(str(tmp_path / "rank1"))
        with pytest.raises(RankFailure):
            llm.generate([PROMPT], GREEDY)
    finally:
        llm.close()


def test_tensor_parallel_ranks_that_all_fail_and_put_their_weights_back_keep_serving(ckpts, tmp_path, monkeypatch):
    """Both ranks fail part-way through an update (a tensor every rank reads, in layer 1: the ends and
    layer 0 were copied in by then) and put what they had loaded back: they agree that the old weights
    keep serving everywhere (WeightLoadError), and the engine answers as before."""
    import shutil
    a, b, _ = ckpts
    monkeypatch.setenv(LOAD_FAULT_ENV, "both:model.layers.1.input_layernorm.weight")  # before the ranks start
    shutil.copytree(b, tmp_path / "both")
    llm = LLM(a, tensor_parallel_size=2, num_threads=1, dist_startup_timeout_s=STARTUP_S, **OPTIONS)
    try:
        want = llm.generate([PROMPT, OTHER], GREEDY)
        with pytest.raises(WeightLoadError, match="no rank loaded the weight update"):
            llm.update_weights_from_disk(str(tmp_path / "both"))
        again = llm.generate([PROMPT, OTHER], GREEDY)
        assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in want]
        assert llm.weights_version == 0
        llm.update_weights_from_disk(b)  # the engine still loads the next update
        assert llm.weights_version == 1
    finally:
        llm.close()


def test_tensor_parallel_ranks_that_cannot_put_their_weights_back_stop_the_engine(ckpts, tmp_path, monkeypatch):
    """Both ranks fail part-way (in layer 1, after layer 0 was copied in) and cannot put layer 0 back,
    the checkpoint they loaded having changed on disk since: though every rank failed, their weights
    are a mix, not the old ones kept, so the update raises RankFailure and the engine steps no more."""
    import os
    import shutil

    from sparsekv.parallel.launch import RankFailure
    a, b, _ = ckpts
    loaded = shutil.copytree(a, tmp_path / "loaded")
    monkeypatch.setenv(LOAD_FAULT_ENV, "both:model.layers.1.input_layernorm.weight")  # before the ranks start
    shutil.copytree(b, tmp_path / "both")
    llm = LLM(str(loaded), tensor_parallel_size=2, num_threads=1, dist_startup_timeout_s=STARTUP_S, **OPTIONS)
    try:
        llm.generate([PROMPT], GREEDY)
        os.utime(loaded / "model.safetensors", ns=(1, 1))
        with pytest.raises(RankFailure, match="weights now differ: rank 0 failed to load it: WeightRestoreError"):
            llm.update_weights_from_disk(str(tmp_path / "both"))
        with pytest.raises(RankFailure):
            llm.generate([PROMPT], GREEDY)
    finally:
        llm.close()


class _Part:
    """A stand-in for one of the model's objects (copy_weights walks sparsekv.model's classes)."""

    __module__ = "sparsekv.model.fake"

    def __init__(self, **fields):
        vars(self).update(fields)


def test_copy_weights_allows_a_missing_part_only_when_it_holds_views():
    from sparsekv.weights import copy_weights
    base = torch.zeros(2, 4)
    old = _Part(experts=[_Part(w=base[0]), _Part(w=base[1])], stacked=_Part(w=base, t=base.t()))
    new = _Part(experts=[_Part(w=torch.ones(4)), _Part(w=torch.full((4,), 2.0))], stacked=None)
    assert copy_weights(old, new) == 2
    assert old.stacked.t.tolist() == [[1.0, 2.0]] * 4  # updated through the views
    by_name = _Part(table={"w": torch.zeros(2)})  # tensors kept in a dict are weights too
    assert copy_weights(by_name, _Part(table={"w": torch.ones(2)})) == 1 and by_name.table["w"].tolist() == [1.0, 1.0]
    own = _Part(experts=[_Part(w=torch.zeros(4))], stacked=_Part(w=torch.zeros(3)))
    with pytest.raises(WeightUpdateError, match="stale"):
        copy_weights(own, _Part(experts=[_Part(w=torch.ones(4))], stacked=None))
    assert own.experts[0].w.tolist() == [0.0] * 4  # refused before anything was copied


def test_copy_weights_refuses_a_tensor_of_another_dtype_or_shape_before_copying_any():
    """A fresh model's tensor is copied only into one of its very shape and dtype (copy_ would cast or
    broadcast it silently); a mismatch anywhere raises before the first copy."""
    from sparsekv.weights import copy_weights
    for other in (torch.ones(3, dtype=torch.float64), torch.ones(1)):
        running = _Part(a=torch.zeros(4), b=torch.zeros(3))
        with pytest.raises(WeightUpdateError, match=r"model\.b: the updated model's tensor does not match"):
            copy_weights(running, _Part(a=torch.ones(4), b=other))
        assert running.a.tolist() == [0.0] * 4 and running.b.tolist() == [0.0] * 3


def test_update_outcomes_keep_the_last_results_by_ticket():
    """Each settled update's (version, error) by its ticket, the last KEEP of them: the oldest go first,
    and one still waiting to load has none."""
    from sparsekv.weights import UpdateOutcomes
    outcomes = UpdateOutcomes()
    error = WeightLoadError("disk gone")
    for version in range(1, UpdateOutcomes.KEEP + 3):
        ticket = outcomes.accept()
        assert outcomes.outcome(ticket) is None
        outcomes.settle(None, error) if version == 3 else outcomes.settle(version, None)
    assert outcomes.outcome(1) is outcomes.outcome(2) is None
    assert outcomes.outcome(3) == (None, error) and outcomes.outcome(UpdateOutcomes.KEEP + 2) == (UpdateOutcomes.KEEP + 2, None)
    assert sum(outcomes.outcome(t) is not None for t in range(1, UpdateOutcomes.KEEP + 3)) == UpdateOutcomes.KEEP


def test_a_partial_update_after_an_update_from_disk_builds_on_that_checkpoint(ckpts, tmp_path):
    """An update from disk replaces what earlier in-process updates gave: a partial update after it takes
    the tensors it leaves out from that checkpoint, neither from the one loaded first nor from tensors
    given before it."""
    import shutil
    a, b, _ = ckpts
    tensors_a, tensors_b = _tensors(a), _tensors(b)
    name = "model.layers.0.self_attn.o_proj.weight"
    mixed = shutil.copytree(b, tmp_path / "mixed")
    save_file({**tensors_b, name: tensors_a[name]}, str(mixed / "model.safetensors"))  # B with A's o_proj
    llm = LLM(a, **OPTIONS)
    llm.update_weights([("model.norm.weight", tensors_a["model.norm.weight"] * 2)])  # a norm of neither
    llm.update_weights_from_disk(b)
    llm.update_weights([(name, tensors_a[name])])
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(str(mixed), **OPTIONS).generate([PROMPT], GREEDY)[0], llm)
    assert llm.weights_version == 3


def test_a_partial_update_is_refused_once_the_loaded_checkpoint_changed_on_disk(ckpts, tmp_path):
    """The tensors a partial update leaves out are read back from the loaded checkpoint: if a trainer
    wrote other weights there since, they would be the wrong ones, so the update is refused. The
    running weights stay A's meanwhile (they are no view of the file's pages)."""
    import shutil
    a, b, _ = ckpts
    path = shutil.copytree(a, tmp_path / "ckpt")
    llm = LLM(str(path), **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    shutil.copyfile(f"{b}/model.safetensors", path / "model.safetensors")  # B written over A
    norm = ("model.norm.weight", _tensors(b)["model.norm.weight"])
    with pytest.raises(WeightUpdateError, match="changed on disk"):
        llm.update_weights([norm])
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    llm.update_weights(_tensors(b).items())  # every tensor: nothing to read back
    llm.update_weights_from_disk(str(path))  # the directory as it is now
    llm.update_weights([norm])
    assert llm.weights_version == 3


def _projections(model) -> dict[str, torch.Tensor]:
    """The model's projection weights that `gemm_layout` lays out on a CPU, by name."""
    out = {"lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        attn, ffn = layer.attn, layer.ffn
        out.update({f"{i}.w_a": attn.w_a, f"{i}.q_b": attn.w.q_b, f"{i}.o": attn.w.o})
        if attn.indexer is not None:
            w = attn.indexer.w
            out.update({f"{i}.wq_b": w.wq_b, f"{i}.wk": w.wk, f"{i}.weights_proj": w.weights_proj})
        mlp = getattr(ffn, "shared", ffn)
        out.update({f"{i}.gate_up": mlp.gate_up, f"{i}.down": mlp.down})
    return out


def test_projections_are_column_major_on_a_cpu_and_a_weight_update_keeps_them_so(ckpts):
    """On a CPU every projection is stored column-major (`model.layers.gemm_layout`: its transpose
    contiguous, the shape and values the checkpoint's), the routed experts stay the row-major views of
    their stack (the grouped GEMM's bits are the per-expert F.linear's); an update from disk writes the
    new values through that layout: the same bits as a fresh engine of B, still column-major."""
    a, b, _ = ckpts
    llm, fresh = LLM(a, **OPTIONS), LLM(b, **OPTIONS)
    model = llm.engine.model
    laid_out = _projections(model)
    assert len(laid_out) > 10 and all(w.t().is_contiguous() and not w.is_contiguous() for w in laid_out.values())
    moe = next(layer.ffn for layer in model.layers if hasattr(layer.ffn, "stacked"))
    assert moe.stacked is not None and all(e.gate_up.is_contiguous() and e.down.is_contiguous() for e in moe.experts)
    assert llm.update_weights_from_disk(b) == 1
    new = _projections(fresh.engine.model)
    for name, w in _projections(model).items():
        assert w.data_ptr() == laid_out[name].data_ptr() and w.t().is_contiguous(), name
        assert torch.equal(w, new[name]), name


def test_a_transformers_state_dict_updates_the_engine_as_docs_rl_shows(ckpts, tmp_path):
    """`llm.update_weights(model.state_dict().items())` with a transformers model: its routed experts
    fused (`experts.gate_up_proj`, `experts.down_proj`) and, tied, `lm_head.weight` the embedding."""
    a, b, ref_b = ckpts
    names = ref_b.state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)  # what makes this test one
    llm = LLM(a, **OPTIONS)
    assert llm.update_weights(ref_b.state_dict().items()) == 1
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)
    tied_dir = str(tmp_path / "tied")
    tied = save_reference_checkpoint(tied_dir, "glm_moe_dsa", seed=3, index_topk=8, tie_word_embeddings=True)
    assert "lm_head.weight" in tied.state_dict()
    engine = LLM(tied_dir, **OPTIONS)
    assert engine.update_weights(tied.state_dict().items()) == 1
    other = {k: v.clone() for k, v in tied.state_dict().items()}
    other["lm_head.weight"] += 1.0  # no longer the embedding: not what this model can hold
    with pytest.raises(WeightUpdateError, match="ties it to model.embed_tokens.weight"):
        engine.update_weights(other.items())


def test_an_fp8_checkpoint_updates_a_bf16_loaded_engine_and_back(ckpts, tmp_path):
    """FP8 weights are dequantised at load: the same architecture, whatever `quantization_config` says."""
    import json
    import shutil
    a, b, _ = ckpts
    fp8 = str(tmp_path / "b-fp8")
    shutil.copytree(b, fp8)
    tensors = _tensors(b)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    scale = torch.full((1, 1), 0.01)
    tensors[name + "_scale_inv"], tensors[name] = scale, (tensors[name] / 0.01).to(torch.float8_e4m3fn)
    save_file(tensors, f"{fp8}/model.safetensors")
    with open(f"{fp8}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(f"{fp8}/config.json", "w") as f:
        json.dump(config, f)
    llm = LLM(a, **OPTIONS)
    assert llm.update_weights_from_disk(fp8) == 1
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(fp8, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)
    assert llm.update_weights_from_disk(a) == 2


def test_a_failed_update_keeps_no_copy_of_the_weights(ckpts, monkeypatch):
    """The error kept for the one who asked holds no traceback: its frames held the failed load's
    tensors (a near-full copy of the weights per failed update) and the files' mappings."""
    import gc
    import weakref
    from sparsekv.model import checkpoint
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    loaded, order = [], []
    real_stored, real_names, real_load = checkpoint.as_stored, checkpoint.check_names, checkpoint._load_one

    def stored(name, t, dtype, device):
        out = real_stored(name, t, dtype, device)
        loaded.append(weakref.ref(out))
        return out

    def names(*args, **kwargs):
        want = real_names(*args, **kwargs)
        order[:] = list(want)
        return want

    def load_one(files, name, *args):
        if name == order[-1]:  # the last tensor: every other one is loaded by then
            raise checkpoint.CheckpointError(f"{name}: bad bytes")
        return real_load(files, name, *args)
    monkeypatch.setattr(checkpoint, "as_stored", stored)
    monkeypatch.setattr(checkpoint, "check_names", names)
    monkeypatch.setattr(checkpoint, "_load_one", load_one)
    with pytest.raises(WeightLoadError, match="bad bytes"):
        llm.update_weights_from_disk(b)
    # every tensor but the failing one read, and those of the parts copied before it read again to put them back
    assert len(loaded) >= len(order) - 1
    gc.collect()
    assert sum(ref() is not None for ref in loaded) == 0, "a failed update's tensors are still referenced"
    assert llm.weights_version == 0


def _record_parts(monkeypatch) -> list:
    """Record each part an update copies in: (its name, weak references to the fresh part's tensors)."""
    import weakref

    from sparsekv import weights
    real, copied = weights.copy_weights, []

    def record(running, fresh, where):
        found: list = []
        weights._pair(fresh, fresh, where, found, set(), [])
        copied.append((where, [weakref.ref(t) for t, _ in found]))
        return real(running, fresh, where)
    monkeypatch.setattr(weights, "copy_weights", record)
    return copied


def test_an_update_holds_one_part_of_new_weights_at_a_time(ckpts, monkeypatch):
    """An update builds and copies in one part after another (each decoder layer, the MTP layer, the
    ends), each dropped before the next is built: never a second model beside the running one. The
    result is a fresh engine of B's."""
    import gc
    a, b, _ = ckpts
    want = LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0]
    llm = LLM(a, **OPTIONS)
    cfg, model = llm.engine.model_config, llm.engine.executor.model
    copied = _record_parts(monkeypatch)
    seen_alive = []
    real_read = type(llm.engine.executor.weights)._read

    def read(self, *args, **kwargs):  # before each part is read: every part built so far is gone
        gc.collect()
        seen_alive.append(sum(ref() is not None for _, refs in copied for ref in refs))
        return real_read(self, *args, **kwargs)
    monkeypatch.setattr(type(llm.engine.executor.weights), "_read", read)
    llm.update_weights_from_disk(b)
    parts = cfg.num_hidden_layers + 1 + (model.mtp is not None)
    assert len(copied) == parts and len({where for where, _ in copied}) == parts
    assert len(seen_alive) == parts and seen_alive == [0] * parts
    _same(llm.generate([PROMPT], GREEDY)[0], want, llm)


def test_an_in_process_update_rebuilds_only_the_parts_it_touches(ckpts, monkeypatch):
    """A partial update rebuilds the parts holding its tensors (the final norm: the ends; one expert:
    its layer), and leaves every other part's tensors where they are, untouched."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    model = llm.engine.executor.model
    layer0 = model.layers[0].input_norm.clone()
    copied = _record_parts(monkeypatch)
    tensors = _tensors(b)
    expert = "model.layers.1.mlp.experts.2.gate_proj.weight"
    llm.update_weights([("model.norm.weight", tensors["model.norm.weight"]), (expert, tensors[expert])])
    assert sorted(where for where, _ in copied) == ["model part 1", "model part ends"]
    assert torch.equal(model.norm, tensors["model.norm.weight"].to(model.norm.dtype))
    assert torch.equal(model.layers[0].input_norm, layer0)
    want = LLM(a, **OPTIONS)
    want.update_weights([(n, tensors[n]) for n in ("model.norm.weight", expert)])
    llm.engine.check_integrity()
    _same(llm.generate([PROMPT], GREEDY)[0], want.generate([PROMPT], GREEDY)[0])


def test_an_update_that_cannot_put_the_old_weights_back_stops_the_engine(ckpts, tmp_path, monkeypatch):
    """A load failing part-way puts the parts it copied back from the checkpoint the engine loaded; when
    that checkpoint changed on disk since (a trainer writing over it), they cannot be: the model holds
    parts of two versions, so the update raises WeightRestoreError (a RankFailure) and the engine
    steps no more, rather than serve a mix."""
    import os
    import shutil

    from sparsekv.model.checkpoint import LOAD_FAULT_ENV
    from sparsekv.parallel.launch import RankFailure
    from sparsekv.weights import WeightRestoreError
    a, b, _ = ckpts
    loaded = shutil.copytree(a, tmp_path / "loaded")
    llm = LLM(str(loaded), **OPTIONS)
    llm.generate([PROMPT], GREEDY)
    monkeypatch.setenv(LOAD_FAULT_ENV, f"{os.path.basename(b)}:model.layers.1.mlp.experts.2.gate_proj.weight")
    os.utime(loaded / "model.safetensors", ns=(1, 1))
    with pytest.raises(WeightRestoreError, match="changed on disk since"):
        llm.update_weights_from_disk(b)
    with pytest.raises(RankFailure, match="parts of both"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(RankFailure):
        llm.engine.check_ranks()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py runs it)")
def test_weight_updates_load_part_by_part_into_a_model_on_cuda(ckpts, monkeypatch):
    """On a device the parts are built on the host and copied into the device's tensors: an update from
    disk answers as an engine of B on the device, and a load failing part-way puts A back there."""
    a, b, _ = ckpts
    want_b = LLM(b, device="cuda", **OPTIONS).generate([PROMPT], GREEDY)[0]
    llm = LLM(a, device="cuda", **OPTIONS)
    _a_load_failing_part_way_keeps_serving(llm, b, monkeypatch)
    llm.update_weights_from_disk(b)
    _same(llm.generate([PROMPT], GREEDY)[0], want_b, llm)
    assert all(t.is_cuda for t in (llm.engine.executor.model.embed, llm.engine.executor.model.layers[0].input_norm))


def test_tensors_an_update_gave_are_never_read_back_from_the_loaded_checkpoint(ckpts, tmp_path):
    """An in-process update giving every tensor reads nothing from the checkpoint the engine loaded, nor
    does a partial one after it (the earlier update gave the rest): with that checkpoint's weights gone
    from disk, both load, and the model serves B's."""
    import shutil
    a, b, _ = ckpts
    path = shutil.copytree(a, tmp_path / "ckpt")
    llm = LLM(str(path), **OPTIONS)
    (path / "model.safetensors").unlink()
    tensors = _tensors(b)
    assert llm.update_weights(tensors.items()) == 1
    assert llm.update_weights([("model.norm.weight", tensors["model.norm.weight"])]) == 2
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)


def test_a_failed_update_puts_back_the_given_tensors_though_the_loaded_checkpoint_changed(ckpts, tmp_path,
                                                                                           monkeypatch):
    """Parts whose every tensor an in-process update gave are put back from those tensors: a load failing
    part-way (layer 1, after the ends and layer 0) once the loaded checkpoint changed on disk still
    leaves the weights before it serving, bit for bit, and the engine steps on."""
    import os
    import shutil

    from sparsekv.model.checkpoint import LOAD_FAULT_ENV
    a, b, _ = ckpts
    path = shutil.copytree(a, tmp_path / "ckpt")
    llm = LLM(str(path), **OPTIONS)
    llm.update_weights(_tensors(b).items())
    want = llm.generate([PROMPT], GREEDY)[0]
    os.utime(path / "model.safetensors", ns=(1, 1))
    monkeypatch.setenv(LOAD_FAULT_ENV, f"{os.path.basename(a)}:model.layers.1.mlp.experts.2.gate_proj.weight")
    with pytest.raises(WeightLoadError, match="injected fault"):
        llm.update_weights_from_disk(a)
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    assert llm.weights_version == 1


def _mtp_tensors_equal(model, other) -> int:
    """How many tensors the MTP layers of two models hold, asserting each pair equal bit for bit."""
    from sparsekv.weights import _pair
    pairs: list = []
    _pair(model.mtp, other.mtp, "mtp", pairs, set(), [])
    for x, y in pairs:
        assert torch.equal(x, y)
    return len(pairs)


def test_an_update_loads_the_drafters_mtp_layer_from_disk_and_in_process(ckpts, tmp_path):
    """The MTP layer (the drafter's) is a part of its own: an update from disk leaves it B's, as a fresh
    engine of B holds it, and an in-process update of one of its tensors rebuilds it alone."""
    from test_sizing import _with_mtp_layer
    a, b, _ = ckpts
    b_mtp = _with_mtp_layer(b, str(tmp_path / "b_mtp"))
    llm = LLM(_with_mtp_layer(a, str(tmp_path / "a_mtp")), **OPTIONS, num_speculative_tokens=1)
    model, fresh = llm.engine.executor.model, LLM(b_mtp, **OPTIONS, num_speculative_tokens=1).engine.executor.model
    assert llm.update_weights_from_disk(b_mtp) == 1
    assert _mtp_tensors_equal(model, fresh) > 10
    name = f"model.layers.{model.cfg.num_hidden_layers}.enorm.weight"
    enorm = torch.full_like(_tensors(b_mtp)[name], 0.5)
    assert llm.update_weights([(name, enorm)]) == 2
    assert torch.equal(model.mtp.enorm, enorm.to(model.mtp.enorm.dtype))
    fresh.mtp.enorm.copy_(enorm)
    assert _mtp_tensors_equal(model, fresh) > 10
    assert llm.generate([PROMPT], GREEDY)[0].token_ids


def test_a_checkpoint_changed_while_an_update_reads_it_counts_as_changed_since(ckpts, tmp_path, monkeypatch):
    """The checkpoint an update from disk loads is stamped before it is read: a trainer writing into that
    directory while the update reads it leaves files other than the ones read, so a partial update
    after it, which would read the tensors it leaves out from there, is refused."""
    import os
    import shutil
    a, b, _ = ckpts
    path = shutil.copytree(b, tmp_path / "b")
    llm = LLM(a, **OPTIONS)
    source = type(llm.engine.executor.weights)
    real_read = source._read

    def read(self, *args, **kwargs):  # the file rewritten while the update reads it
        os.utime(path / "model.safetensors", ns=(1, 1))
        return real_read(self, *args, **kwargs)
    monkeypatch.setattr(source, "_read", read)
    assert llm.update_weights_from_disk(str(path)) == 1
    monkeypatch.undo()
    with pytest.raises(WeightUpdateError, match="changed on disk"):
        llm.update_weights([("model.norm.weight", _tensors(a)["model.norm.weight"])])
    assert llm.weights_version == 1


def test_each_rank_builds_its_parts_from_its_own_tensors_alone(ckpts):
    """Under expert parallelism a rank holds some experts only: the names it builds each part from (what
    it reads, takes from its overlay, or needs unchanged on disk to put a part back) are its own."""
    from sparsekv.parallel.layout import ParallelLayout
    from sparsekv.weights import WeightSource, model_weight_shapes
    a, _, _ = ckpts
    model = LLM(a, **OPTIONS).engine.executor.model
    for rank in (0, 1):
        layout = ParallelLayout(2, 1, True, rank)
        names = {n for _, part in WeightSource(a, None, model.dtype, layout)._parts(model, None) for n in part}
        others = {n for n in model_weight_shapes(model) if not layout.holds(n, model.cfg)}
        assert names and others and not names & others
        assert names | others == set(model_weight_shapes(model))


def test_a_bf16_engine_keeps_the_router_bias_and_indexer_head_weights_fp32_through_updates(ckpts):
    """Computed in bfloat16, the router's correction bias and the indexer's head weights stay fp32 (as the
    reference computes them): loaded, updated from disk and updated in process, they hold the
    checkpoint's fp32 values exactly (these values have no bfloat16 form)."""
    from sparsekv.model.layers import MoE
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS, dtype="bfloat16")
    model = llm.engine.executor.model

    def assert_fp32(tensors) -> None:
        kinds = set()
        for i, layer in enumerate(model.layers):
            if isinstance(layer.ffn, MoE):
                assert torch.equal(layer.ffn.bias, tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
                kinds.add("bias")
            if layer.attn.indexer is not None:
                want = tensors[f"model.layers.{i}.self_attn.indexer.weights_proj.weight"]
                assert torch.equal(layer.attn.indexer.w.weights_proj, want)
                kinds.add("weights_proj")
        assert kinds == {"bias", "weights_proj"}
    assert_fp32(_tensors(a))
    llm.update_weights_from_disk(b)
    assert_fp32(_tensors(b))
    llm.update_weights(_tensors(a).items())
    assert_fp32(_tensors(a))


def test_an_update_keeps_the_given_tensors_as_they_were_given(ckpts):
    """The tensors an in-process update gave are kept (what later partial updates and a failed update's
    restore build from) as they were when given: a trainer stepping its parameters in place afterwards
    changes nothing that a partial update of another tensor of their part rebuilds."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    params = {k: v.clone() for k, v in _tensors(b).items()}
    llm.update_weights(params.items())
    for t in params.values():
        t.add_(1.0)  # the trainer's next step, in place
    norm = "model.norm.weight"
    llm.update_weights([(norm, _tensors(b)[norm])])  # rebuilds the ends: B's embedding and head as given
    _same(llm.generate([PROMPT], GREEDY)[0], LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)


def test_a_rank_keeps_its_slice_of_a_given_tensor_not_the_whole(ckpts):
    """Under tensor parallelism a rank keeps its slice of each given tensor in memory of its own, also
    where the slice is a run of whole rows (a view of the given tensor as it is cut)."""
    from sparsekv.parallel.layout import ParallelLayout
    from sparsekv.weights import WeightSource
    a, _, _ = ckpts
    model = LLM(a, **OPTIONS).engine.executor.model
    layout, kinds = ParallelLayout(2, 1, False, 1), set()
    source = WeightSource(a, None, model.dtype, layout)
    for name, t in _tensors(a).items():
        shard = layout.shard(name, tuple(t.shape))
        if shard is None or not layout.holds(name, model.cfg):
            continue
        kept = source._slice(name, t, model.cfg)
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size(), name
        assert torch.equal(kept, t.narrow(shard[0], shard[1], shard[2] - shard[1]).to(kept.dtype)), name
        kinds.add(shard[0])
    assert kinds == {0, 1}


@pytest.mark.parametrize("options", [{}, dict(tensor_parallel_size=2, dist_startup_timeout_s=STARTUP_S)],
                         ids=["one-rank", "tp2"])
def test_a_drain_partial_update_fails_to_load_once_the_checkpoint_it_reads_back_changed(ckpts, tmp_path, options):
    """A partial update is checked when given, but a drain loads it later: if the loaded checkpoint
    changed on disk meanwhile (B written over A), the tensors it leaves out would be read back as B's,
    so it fails to load instead, refused before any rank starts, and A keeps serving whole."""
    import shutil
    a, b, _ = ckpts
    path = shutil.copytree(a, tmp_path / "ckpt")
    want = LLM(a, **OPTIONS).generate([OTHER], GREEDY)[0]
    llm = LLM(str(path), **OPTIONS, **options)
    engine = llm.engine
    try:
        engine.add_request("r1", PROMPT, GREEDY)
        engine.step()
        assert engine.update_weights([("model.norm.weight", _tensors(a)["model.norm.weight"])], policy="drain") == []
        shutil.copyfile(f"{b}/model.safetensors", path / "model.safetensors")
        engine.add_request("r2", OTHER, GREEDY)  # held for the update
        outs = {}
        _run_bounded(engine, outs)
        version, error = engine.weight_updates.outcome(1)
        assert version is None and "changed on disk" in str(error) and engine.weights_version == 0
        assert outs["r2"].token_ids == want.token_ids
        engine.check_integrity()
    finally:
        llm.close()


def test_a_partial_update_is_refused_once_the_loaded_checkpoint_is_gone(ckpts, tmp_path):
    """A loaded checkpoint whose directory was removed has changed on disk too: refused as such."""
    import shutil
    a, _, _ = ckpts
    path = shutil.copytree(a, tmp_path / "ckpt")
    llm = LLM(str(path), **OPTIONS)
    shutil.rmtree(path)
    with pytest.raises(WeightUpdateError, match="changed on disk"):
        llm.update_weights([("model.norm.weight", _tensors(a)["model.norm.weight"])])
    assert llm.weights_version == 0 and llm.generate([PROMPT], GREEDY)[0].token_ids


def test_an_update_from_disk_lists_the_checkpoint_once_not_per_part(ckpts, monkeypatch):
    """The checkpoint's files are listed (every shard's header scanned, without an index) once for the
    whole update, not again for each part it reads."""
    from sparsekv.model import checkpoint
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    real, listed = checkpoint.list_tensor_files, []
    monkeypatch.setattr(checkpoint, "list_tensor_files", lambda path: listed.append(path) or real(path))
    assert llm.update_weights_from_disk(b) == 1
    assert listed == [b]


def test_tensors_received_from_a_trainer_are_kept_as_they_are_and_given_ones_are_copied(ckpts):
    """The overlay (what later partial updates build from) keeps a tensor the engine received over a
    trainer's group as it is: nobody else holds it, and a copy would double the host memory of every
    update. A tensor given in process is copied (the caller may step it in place)."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    received = {n: t.clone() for n, t in _tensors(b).items()}
    llm.engine.update_weights_from_group("g", 1, received.items())
    overlay = llm.engine.executor.weights.overlay
    same = [n for n in overlay if overlay[n].dtype == received[n].dtype]
    assert same and all(overlay[n].data_ptr() == received[n].data_ptr() for n in same)
    llm.update_weights(received.items())
    overlay = llm.engine.executor.weights.overlay
    assert not any(overlay[n].untyped_storage().data_ptr() == received[n].untyped_storage().data_ptr() for n in same)


def test_a_checkpoint_written_while_the_engine_loads_it_counts_as_changed_since(ckpts, tmp_path, monkeypatch):
    """The loaded checkpoint's stamp is taken before its weights are read: a trainer writing over it
    during the load makes a later partial update (which would read the rest back from it) refused."""
    import os
    import shutil

    from sparsekv.model import checkpoint
    a, b, _ = ckpts
    loaded = shutil.copytree(a, tmp_path / "loaded")
    real = checkpoint.load_tensors

    def read_then_written_over(path, *args, **kwargs):
        out = real(path, *args, **kwargs)
        os.utime(os.path.join(path, "model.safetensors"), ns=(1, 1))
        return out
    monkeypatch.setattr(checkpoint, "load_tensors", read_then_written_over)
    llm = LLM(str(loaded), **OPTIONS)
    monkeypatch.undo()
    with pytest.raises(WeightUpdateError, match="changed on disk since"):
        llm.update_weights([("model.norm.weight", _tensors(b)["model.norm.weight"])])


def test_a_drain_update_loads_the_tensors_as_they_were_given(ckpts):
    """A drain update waits for the started request; the caller stepping its tensors in place meanwhile
    (a trainer's optimizer) changes nothing of what then loads: B's norm, not the zeros written since."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    engine = llm.engine
    engine.add_request("r", PROMPT, GREEDY)
    engine.step()  # started: the update waits for it
    norm = _tensors(b)["model.norm.weight"].clone()
    want = norm.clone()
    assert engine.update_weights([("model.norm.weight", norm)], policy="drain") == []
    assert engine.weight_update_pending
    norm.zero_()
    outs = {}
    _run_bounded(engine, outs)
    assert engine.weights_version == 1
    assert torch.equal(engine.executor.model.norm, want.to(engine.executor.model.norm.dtype))


def _run_bounded(engine, outs: dict, steps: int = 200) -> None:
    """`_run_until_done`, but failing (not hanging) if requests never finish."""
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            return
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    pytest.fail(f"requests still unfinished after {steps} steps: {engine.stats()}")


def test_a_second_update_while_a_drain_waits_is_refused(ckpts):
    a, b, _ = ckpts
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.update_weights_from_disk(b, policy="drain")
    assert engine.weight_update_pending
    for policy in ("drain", "abort"):
        with pytest.raises(WeightUpdateConflict, match="another weight update"):
            engine.update_weights_from_disk(a, policy=policy)
    outs = {}
    _run_bounded(engine, outs)
    assert engine.weights_version == 1 and outs["r1"].metrics["weights_version"] == 0


def test_a_drain_left_with_no_request_still_counts_as_unfinished_work_until_it_loads(ckpts):
    """The only started request is aborted while a drain waits and nothing else is queued: the engine
    still has work (`has_unfinished_requests`), so a loop that steps while there is work runs the step
    that loads the update, and the caller waiting for its outcome gets it."""
    a, b, _ = ckpts
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.update_weights_from_disk(b, policy="drain")
    assert engine.abort("r1") and engine.weight_update_pending
    assert engine.has_unfinished_requests()
    _run_bounded(engine, {})
    assert engine.weights_version == 1 and not engine.weight_update_pending
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_a_request_queued_but_not_started_when_a_drain_begins_runs_under_b(ckpts):
    """Added before the update and never scheduled: held with the ones added after, it runs under B."""
    a, b, _ = ckpts
    only_b = LLM(b, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.add_request("r2", OTHER, GREEDY)  # queued, not yet scheduled
    engine.update_weights_from_disk(b, policy="drain")
    outs = {}
    _run_bounded(engine, outs)
    assert outs["r1"].metrics["weights_version"] == 0 and outs["r2"].metrics["weights_version"] == 1
    _same(outs["r2"], only_b, engine.model)
    engine.check_integrity()


def test_a_drain_load_that_fails_releases_the_held_requests_and_the_next_update_succeeds(ckpts, monkeypatch):
    """The load fails after the drain: the held request still runs, under A, and a later good update
    loads and reports success (no stale error from the failed one)."""
    a, b, _ = ckpts
    want = LLM(a, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()

    def fail(update):
        raise OSError("disk gone")
    monkeypatch.setattr(engine.executor, "update_weights", fail)
    assert engine.update_weights_from_disk(b, policy="drain") == []
    engine.add_request("r2", OTHER, GREEDY)  # held for the update
    outs = {}
    _run_bounded(engine, outs)
    assert engine.weights_version == 0 and not engine.weight_update_pending
    assert outs["r2"].token_ids == want.token_ids and outs["r2"].metrics["weights_version"] == 0
    monkeypatch.undo()
    assert engine.update_weights_from_disk(b, policy="drain") == []
    assert engine.weights_version == 1
    engine.check_integrity()


def _a_load_failing_part_way_keeps_serving(llm, path: str, monkeypatch) -> None:
    """An update from `path` failing at its third part: WeightLoadError, and the weights before it
    serve on, bit for bit."""
    want = llm.generate([PROMPT], GREEDY)[0]
    _fail_the_third_copy(monkeypatch)
    with pytest.raises(WeightLoadError, match="out of memory"):
        llm.update_weights_from_disk(path)
    monkeypatch.undo()
    _same(llm.generate([PROMPT], GREEDY)[0], want)


def _fail_the_third_copy(monkeypatch) -> list:
    """Make an update fail at its third part (two copied in by then): the parts copy_weights was called
    for, in order (the ones after the third are the restore's)."""
    from sparsekv import weights
    real, calls = weights.copy_weights, []

    def fail(*args):
        calls.append(args[2])
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(*args)
    monkeypatch.setattr(weights, "copy_weights", fail)
    return calls


@pytest.mark.parametrize("how", ["disk", "tensors"])
def test_a_load_that_fails_while_copying_leaves_no_trace_for_the_next_partial_update(ckpts, monkeypatch, how):
    """A load that fails part-way (its third part, two copied already) changes nothing: the parts it
    copied are put back from A, and a later partial update (A's own norm) fills the rest from A's
    checkpoint, not from the failed update's tensors or directory."""
    a, b, _ = ckpts
    llm = LLM(a, **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    calls = _fail_the_third_copy(monkeypatch)
    with pytest.raises(WeightLoadError, match="out of memory"):
        if how == "disk":
            llm.update_weights_from_disk(b)
        else:
            llm.update_weights([(k, v) for k, v in _tensors(b).items() if k != "model.norm.weight"])
    monkeypatch.undo()
    assert calls[3:] == calls[:2]  # the two parts copied were put back
    assert llm.weights_version == 0
    _same(llm.generate([PROMPT], GREEDY)[0], want)
    assert llm.update_weights([("model.norm.weight", _tensors(a)["model.norm.weight"])]) == 1
    _same(llm.generate([PROMPT], GREEDY)[0], want, llm)


def test_flush_cache_forgets_the_cached_prompt(ckpts):
    a, _, _ = ckpts
    llm = LLM(a, **dict(OPTIONS, enable_prefix_caching=True))
    llm.generate([PROMPT], GREEDY)
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens > 0
    assert llm.flush_cache() > 0
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens == 0
    assert llm.weights_version == 0


def test_a_first_token_given_while_a_drain_waits_is_sampled_again_under_b(ckpts):
    """A first token sampled under A (weights_version 0) and given while a drain update to B waits: the
    request is held and runs under B, so the token is dropped and B samples its own (no request mixes
    weights), though weights_version still reads 0 when it is added."""
    from sparsekv.outputs import FirstToken
    a, b, _ = ckpts
    only_b = LLM(b, **OPTIONS).generate([OTHER], GREEDY)[0]
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.update_weights_from_disk(b, policy="drain")
    assert engine.weight_update_pending and engine.weights_version == 0
    under_a = (only_b.token_ids[0] + 1) % engine.model_config.vocab_size  # any token but B's own
    engine.add_request("r2", OTHER, GREEDY, first_token=FirstToken(under_a, {under_a: -0.5}, weights_version=0))
    outs = {}
    _run_bounded(engine, outs)
    assert outs["r2"].metrics["weights_version"] == 1
    _same(outs["r2"], only_b, engine.model)
    engine.check_integrity()


def test_generate_while_paused_is_refused_and_adds_nothing(ckpts, monkeypatch):
    """A paused engine's step returns nothing until continue_generation: LLM.generate would step it
    forever, so it is refused before adding any request; after continue it generates as before."""
    a, _, _ = ckpts
    llm = LLM(a, **OPTIONS)
    want = llm.generate([PROMPT], GREEDY)[0]
    llm.engine.pause_generation()
    real_step, steps = llm.engine.step, []

    def bounded_step():
        steps.append(1)
        assert len(steps) < 50, "generate stepped a paused engine"
        return real_step()
    monkeypatch.setattr(llm.engine, "step", bounded_step)
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([PROMPT], GREEDY)
    assert steps == [] and not llm.engine.has_unfinished_requests()
    llm.engine.continue_generation()
    _same(llm.generate([PROMPT], GREEDY)[0], want)


def test_a_request_held_for_a_drain_counts_as_waiting_and_aborts_leaving_nothing(ckpts):
    """Held out of the scheduler while a drain waits, a request is still waiting (for every tenant and
    its own: the server's queue figures) and its abort leaves no state behind; the update then loads."""
    a, b, _ = ckpts
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()
    engine.update_weights_from_disk(b, policy="drain")
    engine.add_request("r2", OTHER, GREEDY, tenant="t2")
    assert engine.num_waiting_requests() == 1 and engine.num_waiting_requests("t2") == 1
    assert engine.num_waiting_requests("default") == 0
    assert engine.abort("r2") and not engine.abort("r2")
    assert engine.num_waiting_requests() == 0
    engine.check_integrity()  # no sampling state of r2 left in the output processor
    outs = {}
    _run_bounded(engine, outs)
    assert set(outs) == {"r1"} and engine.weights_version == 1
    engine.check_integrity()


def test_an_abort_update_frees_the_index_score_buffer_of_the_requests_it_ends(ckpts):
    """The "abort" policy leaves the engine idle: the indexer's prefill score buffer (sized by the longest
    prefill so far) is freed then, as when requests finish or are aborted one by one."""
    a, b, _ = ckpts
    engine = LLM(a, **OPTIONS).engine
    engine.add_request("r1", PROMPT, GREEDY)
    engine.step()  # a 16-token prefill chunk, more keys than top-k
    assert engine.stats()["indexer_scratch_bytes"] > 0
    aborted = engine.update_weights_from_disk(b, policy="abort")
    assert [o.request_id for o in aborted] == ["r1"] and engine.weights_version == 1
    assert not engine.has_unfinished_requests() and engine.stats()["indexer_scratch_bytes"] == 0
    engine.check_integrity()


def test_without_a_host_copy_updates_keep_nothing_and_a_partial_one_must_give_what_they_replaced(ckpts):
    """`weight_update_host_copy=False`: an update giving every tensor loads as with the copy and keeps
    none of them (only their names); a partial update leaving out a tensor they replaced, in a part it
    touches, is refused whole (a host copy would have supplied it); one giving those parts whole loads;
    an update from disk makes the checkpoint the source of every tensor again."""
    from sparsekv.weights import WeightUpdateError
    a, b, _ = ckpts
    llm = LLM(a, weight_update_host_copy=False, **OPTIONS)
    tensors, source = _tensors(b), llm.engine.executor.weights
    given = {n: t.clone() for n, t in tensors.items()}
    assert llm.update_weights(given.items()) == 1
    on_b = llm.generate([PROMPT], GREEDY)[0]
    _same(on_b, LLM(b, **OPTIONS).generate([PROMPT], GREEDY)[0], llm)
    assert source.overlay == {} and source.replaced == set(tensors)
    assert all(torch.equal(given[n], tensors[n]) for n in tensors)  # read as views, left as they were
    for t in given.values():  # a trainer stepping its parameters in place: the model keeps its copy
        t.zero_()
    _same(llm.generate([PROMPT], GREEDY)[0], on_b)
    with pytest.raises(WeightUpdateError, match="keeps no host copy") as refused:
        llm.update_weights([("model.norm.weight", _tensors(a)["model.norm.weight"])])
    assert "model.embed_tokens.weight" in str(refused.value)  # the ends' other tensors
    assert llm.weights_version == 1
    _same(llm.generate([PROMPT], GREEDY)[0], on_b)
    ends = [n for n in tensors if not n.startswith("model.layers.")]
    assert llm.update_weights([(n, _tensors(a)[n]) for n in ends]) == 2
    layer = next(n for n in tensors if n.startswith("model.layers.0."))  # replaced by the first update still
    with pytest.raises(WeightUpdateError, match="keeps no host copy"):
        llm.update_weights([(layer, _tensors(a)[layer])])
    want = LLM(a, **OPTIONS)
    want.update_weights(tensors.items())
    want.update_weights([(n, _tensors(a)[n]) for n in ends])
    _same(llm.generate([PROMPT], GREEDY)[0], want.generate([PROMPT], GREEDY)[0])
    llm.update_weights_from_disk(a)
    assert source.replaced == set() and llm.update_weights([("model.norm.weight", tensors["model.norm.weight"])]) == 4


def test_without_a_host_copy_a_failed_load_puts_back_the_parts_no_update_replaced(ckpts, monkeypatch):
    """Without the host copy, a load failing part-way puts back the parts it copied from the checkpoint
    when no in-process update replaced any of their tensors, though one replaced a part it had not
    reached (the last layer, given whole): the old weights keep serving, that layer included."""
    a, b, _ = ckpts
    llm = LLM(a, weight_update_host_copy=False, **OPTIONS)
    last = f"model.layers.{llm.engine.executor.model.cfg.num_hidden_layers - 1}."
    assert llm.update_weights([(n, t) for n, t in _tensors(b).items() if n.startswith(last)]) == 1
    want = llm.generate([PROMPT], GREEDY)[0]
    calls = _fail_the_third_copy(monkeypatch)  # the ends, layer 0, then layer 1 fails
    with pytest.raises(WeightLoadError, match="out of memory"):
        llm.update_weights_from_disk(b)
    monkeypatch.undo()
    assert calls[3:] == calls[:2] and llm.weights_version == 1
    _same(llm.generate([PROMPT], GREEDY)[0], want)


def test_without_a_host_copy_an_update_reads_the_given_tensors_as_views(ckpts):
    """Without the host copy nothing of an update outlives it, so a given tensor, or a rank's slice of it
    that is a run of whole rows, is read as a view of the caller's tensor, not copied; with the copy it
    is copied."""
    from sparsekv.parallel.layout import ParallelLayout
    from sparsekv.weights import WeightSource
    a, _, _ = ckpts
    model = LLM(a, **OPTIONS).engine.executor.model
    tensors = {n: t for n, t in _tensors(a).items() if t.dtype == model.dtype}
    assert tensors
    kinds = set()  # whole tensors and row slices
    for layout in (None, ParallelLayout(2, 1, False, 1)):
        views = WeightSource(a, None, model.dtype, layout, keep_host_copy=False)
        copies = WeightSource(a, None, model.dtype, layout)
        for name, t in tensors.items():
            shard = layout.shard(name, tuple(t.shape)) if layout is not None else None
            if layout is not None and (not layout.holds(name, model.cfg) or shard is None or shard[0] != 0):
                continue
            kinds.add(shard is None)
            storage = t.untyped_storage().data_ptr()
            assert views._slice(name, t, model.cfg).untyped_storage().data_ptr() == storage, name
            assert copies._slice(name, t, model.cfg).untyped_storage().data_ptr() != storage, name
    assert kinds == {True, False}


def test_without_a_host_copy_a_load_failing_over_replaced_weights_stops_the_engine(ckpts, monkeypatch):
    """Without the host copy, parts an in-process update replaced cannot be put back when a later load
    fails part-way: WeightRestoreError, and the engine steps no more. Parts still the checkpoint's are
    put back from it as with the copy: the old weights keep serving."""
    from sparsekv.parallel.launch import RankFailure
    from sparsekv.weights import WeightRestoreError
    a, b, _ = ckpts
    _a_load_failing_part_way_keeps_serving(LLM(a, weight_update_host_copy=False, **OPTIONS), b, monkeypatch)
    lost = LLM(a, weight_update_host_copy=False, **OPTIONS)
    lost.update_weights(_tensors(b).items())
    _fail_the_third_copy(monkeypatch)
    with pytest.raises(WeightRestoreError, match="keeps no host copy"):
        lost.update_weights_from_disk(a)
    monkeypatch.undo()
    with pytest.raises(RankFailure):
        lost.generate([PROMPT], GREEDY)
