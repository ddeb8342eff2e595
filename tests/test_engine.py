"""Engine behaviour: batching, FP8 loading, bad input, sampling, aborts, page-pool integrity."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekv import LLM, ConfigError, InvalidRequest, SamplingParams
from sparsekv.model.checkpoint import CheckpointError, dequantize_fp8
from sparsekv.tools.tiny import reference_model

from conftest import assert_matches_reference
from tolerances import assert_clear_lead, assert_logprobs_close, assert_same_greedy, logprob_tolerance

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def llm(glm_ckpt):
    # No prefix cache: these tests run the same prompts again and compare logprobs bit for bit or within
    # the rounding bound of regrouped rows (a hit regroups prefill rows: tests/test_prefix_cache.py).
    return LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40,
               enable_prefix_caching=False)


def _idle(llm):
    llm.engine.check_integrity()
    s = llm.stats()
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0


def test_batched_equals_one_at_a_time(llm, random_prompt):
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 19, 60)]
    batched = llm.generate(prompts, GREEDY)
    single = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert_same_greedy(single, batched, logprob_tolerance(llm))  # a batch groups rows differently
    _idle(llm)


def test_logprobs_hold_sampled_token_plus_top_alternatives(llm, random_prompt):
    out = llm.generate([random_prompt(9)], SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=3))[0]
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and 3 <= len(d) <= 4
        assert all(v <= 0 for v in d.values())
    _idle(llm)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_max_logprobs_are_refused(llm, random_prompt, name):
    """vLLM's max_logprobs, 20 by default: a request asking for more alternatives per token is refused
    before it is admitted, naming its parameter and the option that raises the bound."""
    with pytest.raises(InvalidRequest, match=r"21 alternatives per token asked, more than max_logprobs \(20; "
                                             r"--max-logprobs raises it\)") as e:
        llm.generate([random_prompt(9)], SamplingParams(max_tokens=2, **{name: 21}))
    assert e.value.param == name
    assert llm.generate([random_prompt(9)], SamplingParams(max_tokens=2, **{name: 20}))[0].finish_reason == "length"
    _idle(llm)


def test_max_logprobs_up_to_the_whole_vocabulary(glm_ckpt, random_prompt):
    """Raised past the vocabulary, max_logprobs lets a request have every token's logprob (a distribution:
    they sum to 1 within float32 rounding), and no more than the vocabulary has."""
    llm = LLM(glm_ckpt[0], max_model_len=64, kv_page_size=4, max_logprobs=10_000, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    assert vocab < 10_000
    out = llm.generate([random_prompt(9)], SamplingParams(max_tokens=2, temperature=0.0, logprobs=vocab))[0]
    for d in out.logprobs:
        assert sorted(d) == list(range(vocab))
        assert torch.tensor(list(d.values()), dtype=torch.float64).exp().sum().item() == \
            pytest.approx(1.0, abs=vocab * torch.finfo(torch.float32).eps)
    with pytest.raises(InvalidRequest, match=f"more than the vocabulary's {vocab} tokens"):
        llm.generate([random_prompt(9)], SamplingParams(max_tokens=2, logprobs=vocab + 1))
    with pytest.raises(ConfigError, match="max_logprobs must be an integer >= 0"):
        LLM(glm_ckpt[0], max_logprobs=-1)
    _idle(llm)


def test_logprobs_zero_gives_each_sampled_tokens_own_logprob(llm, random_prompt):
    """logprobs=0 (vLLM's): no alternatives, but each sampled token's own logprob, one entry per token
    (not None, as when logprobs are not asked for); alone and in a batch (plain rows decided together)."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=0)
    alone = llm.generate([random_prompt(9)], params)[0]
    with_one = llm.generate([random_prompt(9)], SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=1))[0]
    assert alone.token_ids == with_one.token_ids and alone.logprobs is not None and len(alone.logprobs) == 5
    for tok, d, d1 in zip(alone.token_ids, alone.logprobs, with_one.logprobs):
        assert list(d) == [tok] and d[tok] == d1[tok] <= 0  # the same row's log_softmax, computed alike
    batch = llm.generate([random_prompt(9), random_prompt(5, seed=1)], [params, SamplingParams(max_tokens=3)])
    assert [list(d) for d in batch[0].logprobs] == [[t] for t in batch[0].token_ids] and batch[1].logprobs is None
    _idle(llm)


def test_seed_reproducible_whatever_the_batch(llm, random_prompt):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate([random_prompt(11)], params)[0].token_ids
    crowd = llm.generate([random_prompt(30, seed=9), random_prompt(11), random_prompt(4, seed=8)],
                         [SamplingParams(max_tokens=7, temperature=1.0), params, SamplingParams(max_tokens=3)])
    assert crowd[1].token_ids == alone
    other_seed = llm.generate([random_prompt(11)], SamplingParams(max_tokens=10, temperature=0.9, seed=99))[0]
    assert other_seed.token_ids != alone
    _idle(llm)


def test_max_tokens_and_stop_token_ids(llm, random_prompt):
    greedy = llm.generate([random_prompt(10)], GREEDY)[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([random_prompt(10)], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    assert out.stop_reason == stop_at and greedy.stop_reason is None  # vLLM's: which stop ended it
    _idle(llm)


def test_each_step_output_is_a_snapshot_of_that_step(llm, random_prompt):
    """An output `step` yields holds the tokens and logprobs out by that step: later steps do not
    grow it (its lists are copies, not the request's own, which a streaming caller keeps)."""
    engine = llm.engine
    engine.add_request("snap", random_prompt(7), SamplingParams(max_tokens=5, temperature=0.0, logprobs=1,
                                                                ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "snap"]
    final = outs[-1]
    assert final.finish_reason == "length" and [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5]
    for o in outs:
        n = len(o.token_ids)
        assert o.token_ids == final.token_ids[:n] and len(o.logprobs) == n and o.logprobs == final.logprobs[:n]
        assert o.new_token_ids == o.token_ids[-1:]
    _idle(llm)


def test_abort_mid_generation_frees_pages(llm, random_prompt):
    engine = llm.engine
    keep = engine.add_request("keep", random_prompt(20), GREEDY)
    engine.add_request("drop", random_prompt(50, seed=5), SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(4):
        engine.step()
    assert engine.abort("drop") and not engine.abort("drop")
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert keep.finish_reason == "length"
    _idle(llm)


def test_index_score_buffer_is_freed_when_the_engine_goes_idle(llm, random_prompt):
    """The prefill score buffer is reported while requests run and freed once none is left, by finish
    or by abort (it grows with the longest context prefilled, up to 512 MB on a CPU)."""
    engine = llm.engine
    for ending in ("finish", "abort"):
        engine.add_request(ending, random_prompt(40, seed=3), SamplingParams(max_tokens=4, temperature=0.0))
        engine.step()                                       # a 16-token prefill chunk, more keys than top-k
        held = llm.stats()["indexer_scratch_bytes"]
        assert held == engine.model.index_scratch.nbytes > 0
        if ending == "abort":
            assert engine.abort(ending)
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.stats()["indexer_scratch_bytes"] == engine.model.index_scratch.nbytes == 0
        _idle(llm)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature="hot"), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(n=0), "n"), (dict(n=129), "n"), (dict(n=1.0), "n"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop=5), "stop"),
])
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequest, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_bad_prompts_rejected_and_engine_unaffected(llm, random_prompt):
    engine = llm.engine
    with pytest.raises(InvalidRequest, match="longer than max_model_len 256"):
        engine.add_request(None, random_prompt(300), GREEDY)
    with pytest.raises(InvalidRequest, match=r"plus max_tokens \(100\) exceeds max_model_len 256"):
        engine.add_request(None, random_prompt(200), SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request(None, [1, 2, 999], GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request(None, [], GREEDY)
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        engine.add_request(None, "hello", GREEDY)
    with pytest.raises(InvalidRequest, match="integer token ids"):
        engine.add_request(None, [1, "2"], GREEDY)
    _idle(llm)
    assert len(llm.generate([random_prompt(6)], GREEDY)[0].token_ids) == 8


def test_prompt_length_limits_are_exact(llm, random_prompt):
    """A prompt plus max_tokens of exactly max_model_len fits; one token more is refused, naming
    max_tokens while the prompt alone fits (a prompt of max_model_len tokens still leaves no room
    for max_tokens), and the prompt once it alone is longer. Negative token ids are outside the
    vocabulary, and so is the vocabulary's size."""
    engine = llm.engine
    vocab = engine.outputs.vocab_size
    fits = engine.add_request("fits", random_prompt(256 - GREEDY.max_tokens), GREEDY)
    assert fits.num_prompt_tokens + GREEDY.max_tokens == 256 and engine.abort("fits")
    for n, param in ((257 - GREEDY.max_tokens, "max_tokens"), (256, "max_tokens"), (257, "prompt")):
        with pytest.raises(InvalidRequest) as e:
            engine.add_request(None, random_prompt(n), GREEDY)
        assert e.value.param == param, (n, str(e.value))
    for token in (-1, vocab):
        with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
            engine.add_request(None, [1, token, 2], GREEDY)
        assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="stop_token_ids") as e:
        engine.add_request(None, [1, 2], SamplingParams(max_tokens=2, stop_token_ids=[vocab]))
    _idle(llm)


def test_a_request_the_kv_pool_can_never_hold_is_refused_at_once(glm_ckpt, random_prompt):
    """Prompt + max_tokens past the whole pool (8 pages of 4 tokens): refused when added, naming
    max_tokens, instead of waiting forever for pages that can never be free; one that fills the pool
    exactly runs."""
    llm = LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, num_kv_pages=8, enable_prefix_caching=False)
    with pytest.raises(InvalidRequest, match=r"needs 9 KV pages .* the pool has 8") as e:
        llm.engine.add_request(None, random_prompt(20), SamplingParams(max_tokens=16))
    assert e.value.param == "max_tokens"
    out = llm.generate([random_prompt(20)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    _idle(llm)


def test_a_prompt_of_booleans_is_not_token_ids(llm):
    """JSON true and false are bools, which Python counts as ints: a prompt holding one is refused,
    not read as token ids 1 and 0."""
    for prompt in ([1, True, 2], [False]):
        with pytest.raises(InvalidRequest, match="integer token ids") as e:
            llm.engine.add_request(None, prompt, GREEDY)
        assert e.value.param == "prompt"
    _idle(llm)


def test_stop_strings_are_refused_without_a_tokenizer(llm):
    """This checkpoint has no tokenizer, so no text to find a stop string in: the request is refused
    (naming stop) rather than run to max_tokens as if it had no stop strings."""
    assert llm.engine.tokenizer is None
    with pytest.raises(InvalidRequest, match="tokenizer") as e:
        llm.engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2, stop=["x"]))
    assert e.value.param == "stop"
    _idle(llm)


def test_a_kv_pool_larger_than_the_devices_memory_is_a_config_error(glm_ckpt):
    """Sized from max_model_len past the machine's memory, the pool is refused before any allocation,
    naming what sized it (it failed deep in an allocation, or the process was killed for memory)."""
    from sparsekv.cache.memory import device_memory_bytes
    tokens = 2 * device_memory_bytes(torch.device("cpu"))  # at least a byte a token: past the memory
    with pytest.raises(ConfigError, match="the KV cache would take .* max_model_len"):
        LLM(glm_ckpt[0], max_model_len=tokens, max_num_seqs=1, hf_overrides={"max_position_embeddings": tokens})


def test_a_tiered_cache_larger_than_the_machine_is_a_config_error(glm_ckpt, tmp_path, monkeypatch):
    """The tiered cache's host store is checked against the RAM, or with host_store_path against the
    disk it is made on, before it is allocated (it failed in the allocator with a traceback)."""
    from sparsekv.cache.memory import device_memory_bytes
    tokens = 2 * device_memory_bytes(torch.device("cpu"))
    with pytest.raises(ConfigError, match="the tiered KV cache needs .* GiB of RAM .* sized by the default"):
        LLM(glm_ckpt[0], max_model_len=tokens, max_num_seqs=1, kv_tiering=True,
            hf_overrides={"max_position_embeddings": tokens})
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 10))
    with pytest.raises(ConfigError, match="GiB of free disk space at .* sized by host_kv_budget_bytes"):
        LLM(glm_ckpt[0], max_model_len=256, kv_tiering=True, host_kv_budget_bytes=1 << 20,
            host_store_path=str(tmp_path))


def test_the_tiered_fit_check_holds_at_exactly_the_memory_and_counts_a_file_store_on_its_disk(tmp_path, monkeypatch):
    """A tiered cache needing exactly the RAM there is fits (a byte more does not); a store in a file
    (not made yet: the free space of the directory it would be made in) counts against that disk, not
    the RAM, and the device part on a CPU counts against the RAM."""
    import shutil

    from sparsekv.cache import memory
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 1000)
    memory.check_tiered_fits(600, 400, cpu, None, "the test")
    with pytest.raises(ConfigError, match="GiB of RAM"):
        memory.check_tiered_fits(601, 400, cpu, None, "the test")
    with pytest.raises(ConfigError, match="GiB of RAM"):
        memory.check_tiered_fits(0, 1001, cpu, None, "the test")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=5000))
    store = str(tmp_path / "store.bin")  # a file to be made: its directory's free space
    memory.check_tiered_fits(5000, 1000, cpu, store, "the test")  # the host store is on the disk, not in RAM
    with pytest.raises(ConfigError, match="GiB of free disk space at .* sized by the test"):
        memory.check_tiered_fits(5001, 0, cpu, store, "the test")


def test_n_choices_per_prompt_as_vllm_returns_them(llm, random_prompt):
    """SamplingParams(n=3): one output per prompt whose `outputs` are its 3 choices, each the request
    the server would run for that choice (seed choice_seed(seed, i)); n=1 gives `outputs` = [itself]."""
    from sparsekv.sampling_params import choice_seed
    prompts = [random_prompt(5), random_prompt(7)]
    sampled = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11)
    outs = llm.generate(prompts, [sampled, GREEDY])
    assert len(outs) == 2 and len(outs[0].outputs) == 3 and outs[1].outputs == [outs[1]]
    for i, choice in enumerate(outs[0].outputs):
        alone = llm.generate([prompts[0]], SamplingParams(max_tokens=6, temperature=1.0, seed=choice_seed(11, i)))[0]
        assert choice.index == i and choice.token_ids == alone.token_ids and choice.prompt_token_ids == prompts[0]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert outs[1].token_ids == llm.generate([prompts[1]], GREEDY)[0].token_ids
    with pytest.raises(InvalidRequest, match="one choice"):
        llm.engine.add_request(None, prompts[0], sampled)
    for bad in (5, None):
        with pytest.raises(TypeError, match="prompts"):
            llm.generate(bad, GREEDY)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(prompts[0], {"max_tokens": 2})
    _idle(llm)


def test_generate_with_one_bad_prompt_adds_none_of_them(llm, random_prompt):
    """The prompts before a refused one are taken back: nothing of the call stays queued or runs."""
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate([random_prompt(6), random_prompt(7), [1, 2, 999]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    _idle(llm)


def _copy_with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_config_errors(glm_ckpt, tmp_path):
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        LLM(_copy_with_config(glm_ckpt[0], str(tmp_path / "a"), model_type="llama"))
    with pytest.raises(ConfigError, match="layer 0 is 'shared'"):
        LLM(_copy_with_config(glm_ckpt[0], str(tmp_path / "b"), indexer_types=["shared", "full", "full", "full"]))
    with pytest.raises(ConfigError, match="kv_page_size must be >= 1"):
        LLM(glm_ckpt[0], kv_page_size=0)
    with pytest.raises(ConfigError, match="attention 'flash'"):
        LLM(glm_ckpt[0], attention="flash")
    short = _copy_with_config(glm_ckpt[0], str(tmp_path / "c"), max_position_embeddings=128)
    with pytest.raises(ConfigError, match=r"max_model_len \(129\) is beyond the model's max_position_embeddings \(128\)"):
        LLM(short, max_model_len=129)  # untrained positions only when asked for, as vLLM
    assert LLM(short, max_model_len=128).engine.max_model_len == 128
    assert LLM(short, max_model_len=256, hf_overrides={"max_position_embeddings": 256}).engine.max_model_len == 256


@pytest.mark.parametrize("option, match", [
    (dict(kv_tiering="false"), "kv_tiering must be bool, got 'false'"),  # a truthy string: tiering would turn on
    (dict(max_num_seqs="4"), "max_num_seqs must be int"), (dict(kv_page_size=64.5), "kv_page_size must be int"),
    (dict(tenant_kv_share="0.5"), "tenant_kv_share must be float or None"), (dict(seed=None), "seed must be int"),
    (dict(prefix_cache_disk_old_key_files="path"), "must be list"), (dict(quest_page_tokens=8), "only applies with")])
def test_an_option_of_the_wrong_kind_is_a_config_error(glm_ckpt, option, match):
    with pytest.raises(ConfigError, match=match):
        LLM(glm_ckpt[0], **option)


def test_checkpoint_errors_name_the_tensor(glm_ckpt, tmp_path):
    src = glm_ckpt[0]
    # An indexer on a layer the config calls shared -> unexpected tensors, with a hint.
    d = _copy_with_config(src, str(tmp_path / "u"), indexer_types=["full", "shared", "shared", "shared"])
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.3\.self_attn\.indexer"):
        LLM(d)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.o_proj.weight"},
              os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.o_proj\.weight"):
        LLM(d)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(3,\), config implies \(64,\)"):
        LLM(d)


def _with_tensors(src: str, dst: str, change) -> str:
    """A copy of the checkpoint whose tensors `change(tensors)` edited (in place)."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


O_PROJ = "model.layers.1.self_attn.o_proj.weight"


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update({O_PROJ: t[O_PROJ].to(torch.int32)}), "is I32: a weight must be a float"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"] > 0}), "is BOOL: a weight must be a float"),
    (lambda t: t.update({O_PROJ: t[O_PROJ].to(torch.float8_e5m2)}), "is F8_E5M2"),
    (lambda t: t.update({O_PROJ + "_scale_inv": torch.ones(1, 1)}), "given, but .*o_proj.weight is F32"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn),
                         "model.norm.weight_scale_inv": torch.ones(1)}), "a 2-D FP8 tensor"),
    (lambda t: t.update({O_PROJ: t[O_PROJ].to(torch.float8_e4m3fn), O_PROJ + "_scale_inv": torch.ones(2, 1)}),
     r"o_proj.weight_scale_inv has shape \(2, 1\)"),
])
def test_a_weight_stored_as_another_kind_of_number_is_refused(glm_ckpt, tmp_path, change, match):
    """An int, a bool, e5m2 or a scale that does not belong would load as some other number."""
    with pytest.raises(CheckpointError, match=match):
        LLM(_with_tensors(glm_ckpt[0], str(tmp_path / "c"), change))


def test_a_damaged_checkpoint_is_a_checkpoint_error(glm_ckpt, tmp_path):
    src = glm_ckpt[0]
    cut = str(tmp_path / "cut")
    shutil.copytree(src, cut)
    data = open(os.path.join(src, "model.safetensors"), "rb").read()
    with open(os.path.join(cut, "model.safetensors"), "wb") as f:
        f.write(data[:len(data) // 2])  # a copy cut short
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        LLM(cut)
    indexed = str(tmp_path / "indexed")
    shutil.copytree(src, indexed)
    names = list(load_file(os.path.join(src, "model.safetensors")))
    index = os.path.join(indexed, "model.safetensors.index.json")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if n != O_PROJ}, os.path.join(indexed, "model.safetensors"))
    for body, match in [({"weight_map": {n: "model.safetensors" for n in names}}, f"does not hold {O_PROJ}"),
                        ({"metadata": {}}, "weight_map must map"), ({"weight_map": list(names)}, "weight_map must map"),
                        ([1, 2], "not a JSON object")]:
        json.dump(body, open(index, "w"))
        with pytest.raises(CheckpointError, match=match):
            LLM(indexed)
    listed = _copy_with_config(src, str(tmp_path / "listed"))
    json.dump([1], open(os.path.join(listed, "config.json"), "w"))
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        LLM(listed)


def test_an_indexshare_override_applies_to_deepseek_too(ds_ckpt, tmp_path):
    llm = LLM(ds_ckpt[0], max_model_len=64, hf_overrides={"index_topk_pattern": "FSSF"})
    assert llm.engine.model_config.indexer_types == ("full", "shared", "shared", "full")
    # the same schedule written into config.json: the checkpoint's extra indexers are refused, and an
    # override of anything but the schedule (here the positions) does not skip them
    shared = _copy_with_config(ds_ckpt[0], str(tmp_path / "shared"), indexer_types=["full", "shared", "shared", "full"])
    for overrides in (None, {"max_position_embeddings": 1 << 21}):
        with pytest.raises(CheckpointError, match="unexpected tensor"):
            LLM(shared, max_model_len=64, hf_overrides=overrides)


def test_loading_holds_one_copy_of_each_layer_at_a_time(glm_ckpt, monkeypatch):
    """The model's fused and stacked weights are copies (q_a with kv_a; gate with up; the routed
    experts stacked): each layer's checkpoint tensors go once it is built, so loading never holds the
    whole model twice."""
    import weakref
    from sparsekv.model import checkpoint, model as model_module
    copied = ("self_attn.q_a_proj.weight", "mlp.gate_proj.weight", "mlp.experts.0.up_proj.weight")
    refs, alive_while_building = [], []
    real_load, real_build = checkpoint.load_tensors, model_module.build_layer

    def load(*args, **kwargs):
        tensors = real_load(*args, **kwargs)
        refs.extend((name, weakref.ref(t)) for name, t in tensors.items() if name.endswith(copied))
        return tensors

    def build(cfg, i, *args, **kwargs):
        alive_while_building.append({n.split(".")[2] for n, r in refs if r() is not None})
        return real_build(cfg, i, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "load_tensors", load)
    monkeypatch.setattr(model_module, "build_layer", build)
    LLM(glm_ckpt[0], max_model_len=64)
    assert alive_while_building[0] == {"0", "1", "2", "3"}
    assert alive_while_building[3] == {"3"}  # layers 0-2 built: their copied tensors gone


def test_dequantize_fp8_blocks():
    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5
    each = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]  # every element's scale
    w8 = (w / each).to(torch.float8_e4m3fn)
    deq = dequantize_fp8(w8, scale, "x")
    assert deq[130, 260] == w8[130, 260].float() * scale[1, 2]
    assert deq[5, 5] == w8[5, 5].float() * scale[0, 0]
    from tolerances import e4m3_error
    # within half an e4m3 step of w, plus float32's roundings
    assert ((deq - w).abs() <= e4m3_error(w, each)).all()


QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk",
             "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    amax = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().clamp(min=1e-4)
    scale = amax / 448.0
    full = scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_fp8_checkpoint_matches_dequantised_reference(tmp_path, random_prompt):
    ref = reference_model("glm_moe_dsa", seed=11, hidden_size=192)
    state, fp8 = ref.state_dict(), {}
    ref.save_pretrained(str(tmp_path))
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    for name, w in saved.items():
        if name.endswith(".weight") and any(f"{q}.weight" in name for q in QUANTIZED):
            w8, scale = _quantize(w)
            fp8[name], fp8[name + "_scale_inv"] = w8, scale
            saved[name] = dequantize_fp8(w8, scale, name)
        else:
            fp8[name] = w
    save_file(fp8, os.path.join(tmp_path, "model.safetensors"))
    # The reference gets the dequantised weights: the engine must reproduce it exactly.
    for name, w in saved.items():
        if name in state and ".experts." not in name:
            state[name].copy_(w)
    ref.load_state_dict(state)
    _load_experts(ref, saved)
    prompt = random_prompt(30, seed=12)
    out = LLM(str(tmp_path), max_model_len=128, kv_page_size=8).generate([prompt], GREEDY)[0]
    assert_matches_reference(ref, prompt, out)


def _load_experts(ref, saved):
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                p = f"model.layers.{i}.mlp.experts.{e}"
                experts.gate_up_proj[e].copy_(torch.cat([saved[f"{p}.gate_proj.weight"], saved[f"{p}.up_proj.weight"]]))
                experts.down_proj[e].copy_(saved[f"{p}.down_proj.weight"])


def test_final_output_carries_its_request_figures(llm, random_prompt):
    out = llm.generate([random_prompt(30)], GREEDY)[0]
    m = out.metrics
    assert m["num_prompt_tokens"] == 30 and m["num_output_tokens"] == 8
    # 37 computed tokens in 4-token pages: 10 pages held just before release
    assert m["device_latent_bytes"] == 10 * 4 * llm.engine.kv.pool.latent_bytes_per_token() > 0
    assert m["device_kv_bytes"] == m["device_latent_bytes"] + m["device_indexer_bytes"]
    _idle(llm)


def test_use_tqdm_bar_counts_prompt_tokens_and_finished_requests(llm, random_prompt, monkeypatch):
    """`generate(..., use_tqdm=True)` shows one bar over the prompts' tokens (advanced chunk by chunk as
    prefill computes them), with finished requests and generated tokens alongside; output unchanged."""
    import tqdm
    bars, seen = [], []

    class Recording(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

        def update(self, n=1):
            seen.append(self.n + n)
            return super().update(n)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    prompts = [random_prompt(n, seed=n) for n in (37, 50)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert len(bars) == 1 and seen[-1] == bars[0].total == 87
    assert bars[0].postfix == "finished=2/2, generated=16"
    assert len(set(seen)) >= 3      # 87 prompt tokens in chunks of at most 40 tokens a step
    _idle(llm)


def test_sharded_checkpoint_with_index(tmp_path, random_prompt):
    ref = reference_model("glm_moe_dsa", seed=21)
    ref.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = random_prompt(20, seed=22)
    out = LLM(str(tmp_path), max_model_len=64, kv_page_size=4).generate([prompt], GREEDY)[0]
    assert_matches_reference(ref, prompt, out)


def _add_mtp_layer(path: str, drop: str | None = None) -> None:
    """Append a NextN layer (a copy of layer 1 with an indexer, plus the MTP glue) as layer 4."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", "layers.4.")] = t.clone()
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.0.self_attn.indexer."):
            tensors[name.replace("layers.0.", "layers.4.")] = t.clone()
    tensors.update({"model.layers.4.enorm.weight": torch.ones(hidden), "model.layers.4.hnorm.weight": torch.ones(hidden),
                    "model.layers.4.eh_proj.weight": torch.randn(hidden, 2 * hidden),
                    "model.layers.4.shared_head.norm.weight": torch.ones(hidden)})
    tensors.pop(drop, None)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_mtp_layer_is_loaded_and_never_breaks_loading(glm_ckpt, tmp_path, random_prompt):
    d = str(tmp_path / "mtp")
    shutil.copytree(glm_ckpt[0], d)
    _add_mtp_layer(d)
    llm = LLM(d, max_model_len=64, kv_page_size=4)
    mtp = llm.engine.model.mtp
    assert mtp is not None and mtp.layer.attn.indexer is not None and mtp.eh_proj.shape == (64, 128)
    prompt = random_prompt(20, seed=23)
    assert_matches_reference(glm_ckpt[1], prompt, llm.generate([prompt], GREEDY)[0])  # main model unchanged
    d2 = str(tmp_path / "partial")
    shutil.copytree(glm_ckpt[0], d2)
    _add_mtp_layer(d2, drop="model.layers.4.eh_proj.weight")
    with pytest.raises(CheckpointError, match=r"MTP layer 4 is incomplete; missing model\.layers\.4\.eh_proj\.weight"):
        LLM(d2)


def test_reading_history_in_runs_of_pages_is_exact(llm, random_prompt, monkeypatch):
    """Concurrent requests interleave their page allocations, so a request's history is several runs
    of consecutive slots. Reading long runs as views (no gather) must give what one gather gives."""
    import sparsekv.cache.pool as pool
    prompts = [random_prompt(n, seed=n) for n in (45, 70, 33)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    monkeypatch.setattr(pool, "MIN_VIEW_RUN", 1 << 30)     # every run gathered
    gathered = llm.generate(prompts, params)
    monkeypatch.setattr(pool, "MIN_VIEW_RUN", 8)           # runs of >= 2 pages read as views
    seen = []
    real = pool.history_segments
    monkeypatch.setattr(pool, "history_segments", lambda t, s: seen.append(len(s.runs)) or real(t, s))
    views = llm.generate(prompts, params)
    assert max(seen) > 1, "the scenario must produce histories of several runs"
    for a, b in zip(gathered, views):
        # bit for bit: the pieces only group the indexer's scores differently, which could change a
        # selection only at a near-tie; attention then reads the same rows in the same shapes
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    _idle(llm)


def test_a_tenant_kv_share_admits_other_tenants_past_a_flood_and_keeps_outputs(glm_ckpt, llm, random_prompt):
    """tenant_kv_share=0.5 on a 40-page pool: the heavy tenant's four 12-page requests run one at a
    time (two would hold 24 of its 20), the light tenant's request behind them is admitted in the first
    step (unbounded, three heavy ones would take 36 pages and it would wait), every output equals
    the unbounded engine's, per-tenant figures are reported, a request of exactly the share is served,
    and a request bigger than the share is refused with a clear error (nothing else is affected)."""
    prompts = [random_prompt(40, seed=s) for s in range(5)]
    want = llm.generate(prompts, GREEDY)
    shared = LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40,
                 enable_prefix_caching=False, num_kv_pages=40, tenant_kv_share=0.5)
    engine = shared.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY, tenant="light" if i == 4 else "heavy")  # 48 tokens: 12 pages
    engine.step()
    by_tenant = shared.stats()["kv_by_tenant"]
    assert by_tenant == {"heavy": {"running": 1, "waiting": 3, "kv_pages": 12},
                         "light": {"running": 1, "waiting": 0, "kv_pages": 12}}
    engine.step()
    assert shared.stats()["kv_by_tenant"]["heavy"] == {"running": 1, "waiting": 3, "kv_pages": 12}  # 24 > 20
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    for i, w in enumerate(want):
        assert outs[f"r{i}"].token_ids == w.token_ids
    at_share = shared.generate([random_prompt(72)], GREEDY)[0]  # 80 tokens: 20 pages, exactly the share
    assert at_share.finish_reason == "length" and len(at_share.token_ids) == GREEDY.max_tokens
    with pytest.raises(InvalidRequest, match=r"needs 21 KV pages .* a tenant may hold 20 of the 40 \(tenant_kv_share 0.5\)"):
        shared.generate([random_prompt(76)], GREEDY)
    assert shared.stats()["kv_by_tenant"] == {}
    _idle(shared)
    with pytest.raises(ConfigError, match="tenant_kv_share"):
        LLM(glm_ckpt[0], tenant_kv_share=0)


def test_a_tenant_share_is_the_floor_of_the_share_as_written(glm_ckpt):
    """docs/server.md: a tenant may hold floor(F x the pool's pages). 0.29 of 100 pages is 29 pages
    (0.29 * 100 is 28.999... in floating point: truncated, a request of exactly the share was refused
    as needing more than 28); the prefix cache's per-tenant share rounds the same way."""
    common = dict(max_model_len=256, kv_page_size=4, num_kv_pages=100)
    kv = LLM(glm_ckpt[0], enable_prefix_caching=False, tenant_kv_share=0.29, **common).engine.kv
    assert kv.tenant_pages == 29
    kv.check_fits(112, 4)  # 116 tokens: 29 pages
    with pytest.raises(InvalidRequest, match="needs 30 KV pages .* a tenant may hold 29 of the 100"):
        kv.check_fits(113, 4)
    cached = LLM(glm_ckpt[0], enable_prefix_caching=True, prefix_cache_tenant_share=0.29, **common).engine.kv
    assert cached.allocator.cached.max_per_tenant == 29


def _run_counting_peak(llm, prompts, params) -> tuple[list, int]:
    """Every request through the engine's step loop: outputs in order, and the most running at once."""
    engine, outs, peak = llm.engine, {}, 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        peak = max(peak, llm.stats()["running"])
        engine.check_integrity()
    return [outs[f"r{i}"] for i in range(len(prompts))], peak


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16),
                                     dict(kv_tiering=True, device_buffer_tokens=16, emulated_cuda=True),
                                     dict(bundled=True),
                                     dict(mtp_layer=True, selector="quest", quest_page_tokens=2, num_speculative_tokens=2,
                                          prompt_seed=70),
                                     dict(mtp_layer=True, num_speculative_tokens=2, kv_tiering=True, device_buffer_tokens=24,
                                          prompt_seed=70),
                                     dict(mtp_layer=True, selector="quest", quest_page_tokens=2, num_speculative_tokens=2,
                                          kv_tiering=True, device_buffer_tokens=24, prompt_seed=130)],
                         ids=["device", "tiered", "tiered, emulated CUDA ordering", "bundled model, MTP drafts",
                              "Quest, MTP drafts", "tiered, MTP drafts", "tiered, Quest, MTP drafts"])
def test_optimistic_admission_preempts_and_recomputes_exactly(glm_ckpt, random_prompt, options, request, tmp_path):
    """kv_admission="optimistic" on a pool that holds one of six requests at its full length (prompt +
    max_tokens): more run at once, the newest are preempted as pages run out and recomputed later
    (their pages hit in the prefix cache's host tier), and every output equals the reserving engine's:
    greedy and seeded sampled tokens identical (with MTP drafts too: they outlive the preemption),
    logprobs within the rounding bound (tests/tolerances.py), prompt logprobs recorded once. Counted in stats and in each output's metrics.
    Past the tiny model's top-k, a recomputation ends in the drafts it kept, and a rejected one's position
    is written again: Quest's page bounds must be rewound as after a decode's drafts, and a tiered working
    set primed by that chunk must hold final positions only."""
    from sparsekv.paths import default_model_path
    from test_batched_decode import with_mtp_layer
    options = dict(options)
    bundled, mtp_layer = options.pop("bundled", False), options.pop("mtp_layer", False)
    prompt_seed = options.pop("prompt_seed", 50)  # (prompts without a near-tie in their greedy tokens)
    landed = request.getfixturevalue("emulated_cuda") if options.pop("emulated_cuda", False) else None
    path = default_model_path() if bundled else glm_ckpt[0]
    if mtp_layer:
        path = with_mtp_layer(path, str(tmp_path / "mtp"))
    vocab = 4096 if bundled else 256
    if bundled:
        options["num_speculative_tokens"] = 1
    prompts = [random_prompt(40 + 3 * i, seed=prompt_seed + i, vocab=vocab) for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)] * 2
    common = dict(max_model_len=256, kv_page_size=4, prefill_chunk_tokens=16, max_num_batched_tokens=40,
                  max_num_seqs=6, num_kv_pages=32, **options)
    reserving = LLM(path, enable_prefix_caching=False, **common)
    want, reserve_peak = _run_counting_peak(reserving, prompts, params)
    llm = LLM(path, kv_admission="optimistic", prefix_cache_host_bytes=1 << 24, **common)
    got, peak = _run_counting_peak(llm, prompts, params)
    stats = llm.stats()
    assert reserve_peak == 1 and peak > 1
    assert landed is None or (landed["backups"] > 0 and landed["fetches"] > 0)
    assert stats["preemptions"] >= 3 and sum(o.metrics["num_preemptions"] for o in got) == stats["preemptions"]
    assert any(o.metrics["num_preemptions"] and o.prompt_logprobs for o in got)  # one with prompt logprobs too
    # recomputation starts from the pages the prefix cache kept: a preempted request's freed pages are
    # the first an allocation evicts, so they come back from the host tier
    assert stats["prefix_cache_preempted_hits_host"] > 0 and stats["prefix_cache_preempted_queries"] > 0
    tol = logprob_tolerance(llm)  # batches, hits and recomputation group rows differently
    for w, g, sp in zip(want, got, params):
        assert w.token_ids == g.token_ids  # a preempted request keeps its drafts: the same draws
        if w.logprobs is not None:
            if sp.greedy:
                assert_clear_lead(w, tol)
            assert_logprobs_close(w.logprobs, g.logprobs, tol)
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
            assert_logprobs_close(w.prompt_logprobs[1:], g.prompt_logprobs[1:], tol)
    _idle(llm)
    with pytest.raises(ConfigError, match="kv_admission"):
        LLM(path, kv_admission="lazy")


def test_default_cache_holds_max_num_seqs_requests_of_max_model_len_each():
    """Whole pages per request: 2 requests of 80 positions at 64 per page need 2 pages each (4), not
    the 3 pages that 160 tokens round up to."""
    llm = LLM(max_model_len=80, max_num_seqs=2, kv_page_size=64)
    assert llm.engine.kv.allocator.num_pages == 4
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("a", list(range(1, 65)), params)
    llm.engine.add_request("b", list(range(2, 66)), params)
    llm.engine.step()
    assert len(llm.engine.scheduler.running) == 2


def test_an_engine_without_a_thread_option_sets_the_rules_count(glm_ckpt):
    """LLM(path) applies threads.py's count (a small model: 1), whatever torch had; 0 leaves torch's."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLM(glm_ckpt[0], max_model_len=64)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        LLM(glm_ckpt[0], max_model_len=64, num_threads=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_vllm_prompt_dicts_and_off_values_are_taken_as_vllm_takes_them(llm):
    """{"prompt": text} and {"prompt_token_ids": ids} (vLLM's TextPrompt, TokensPrompt) alone or in a
    list; a single dict walked its keys, generating from the text "prompt"; top_k=-1 is off and
    seed=-1 random, as in vLLM."""
    ids = [5, 6, 7, 8]
    want = llm.generate([ids], GREEDY)[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].token_ids == want
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": ids}, ids], GREEDY)] == [want, want]
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        llm.generate({"prompt_ids": ids}, GREEDY)
    params = SamplingParams(max_tokens=8, top_k=-1, seed=-1)
    assert params.top_k == 0 and params.seed is None
    draws = {tuple(llm.generate([ids], params)[0].token_ids) for _ in range(4)}
    assert len(draws) > 1  # not one fixed seed
    _idle(llm)


def test_generate_from_two_threads_runs_one_call_at_a_time(llm):
    """Two threads stepping one engine at once advanced its counts twice and left both spinning."""
    import threading
    results: dict[int, list[int]] = {}
    want = llm.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, llm.generate([[5, 6, 7, 8]] * 2, GREEDY)),
                                daemon=True) for i in range(2)]  # daemon: a livelock fails the test, not the run
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert all(o.token_ids == want for outs in results.values() for o in outs) and len(results) == 2
    _idle(llm)


def test_chat_renders_the_chat_template_and_generates_as_from_its_ids(llm):
    """vLLM's LLM.chat: one conversation or several, the tokenizer's template (the bundled model ships
    one), then generate: the same tokens as generating from the rendered ids. Without a tokenizer it is
    a clear error."""
    from sparsekv.paths import default_model_path
    chat_llm = LLM(default_model_path(), max_model_len=256, num_threads=1)
    conversation = [{"role": "user", "content": "Write a function that adds two numbers."}]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokenizer = chat_llm.tokenizer
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = chat_llm.generate([ids], params)[0]
    got = chat_llm.chat(conversation, params)
    both = chat_llm.chat([conversation, [{"role": "user", "content": "hello"}]], params)
    assert got[0].prompt_token_ids == ids and got[0].token_ids == want.token_ids
    assert len(both) == 2 and both[0].token_ids == want.token_ids
    prefilled = conversation + [{"role": "assistant", "content": "def add(a, b):"}]
    continued = chat_llm.chat(prefilled, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert tokenizer.decode(continued.prompt_token_ids).endswith("def add(a, b):")  # vLLM's assistant prefill
    with pytest.raises(InvalidRequest, match="continue_final_message"):
        chat_llm.chat(prefilled, params, continue_final_message=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a function "},
                                          {"type": "text", "text": "that adds two numbers."}]}]
    assert chat_llm.chat(parts, params)[0].prompt_token_ids == ids  # OpenAI's text parts, joined as the server does
    for bad, match in [("hello", "conversation"), ([{"content": "hi"}], "role"), ([["hi"]], "role"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text content parts")]:
        with pytest.raises(InvalidRequest, match=match):
            chat_llm.chat(bad, params)
    with pytest.raises(InvalidRequest, match="tokenize"):
        chat_llm.chat(conversation, params, chat_template_kwargs={"tokenize": True})
    chat_llm.close()
    with pytest.raises(InvalidRequest, match="tokenizer"):
        llm.chat(conversation, params)  # the tiny test checkpoint has no tokenizer


def _token_bytes(cfg) -> tuple[int, int]:
    """A token's float32 cache bytes from the model's dimensions, not from cache/sizing.py: (latent,
    latent + indexer keys). Each layer keeps a latent row (kv_lora_rank + qk_rope_head_dim), each full
    layer an indexer key (index_head_dim)."""
    latent = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
    return latent, latent + 4 * cfg.index_head_dim * len(cfg.full_layers)


def _ten_page_pool(glm_ckpt, **options) -> LLM:
    """The tiny GLM in float32 on a pool of 10 pages of 4 tokens, no prefix cache."""
    return LLM(glm_ckpt[0], max_model_len=256, kv_page_size=4, num_kv_pages=10, prefill_chunk_tokens=16,
               max_num_batched_tokens=40, enable_prefix_caching=False, **options)


def test_check_fits_admits_exactly_the_pool_and_a_tenant_share_rounded_down(glm_ckpt):
    """CacheManager.check_fits at its boundaries: prompt + max_tokens of exactly the 10-page pool fits,
    one token more is refused; tenant_kv_share 0.55 of 10 pages is 5 whole pages (rounded down: a sixth
    would pass the share), so 20 tokens fit and 21 are refused; with optimistic admission the share is
    a guarantee, not a cap, and only the pool bounds a request."""
    kv = _ten_page_pool(glm_ckpt).engine.kv
    kv.check_fits(36, 4)
    with pytest.raises(InvalidRequest, match="needs 11 KV pages for 37 \\+ 4 tokens .* the pool has 10"):
        kv.check_fits(37, 4)
    shared = _ten_page_pool(glm_ckpt, tenant_kv_share=0.55).engine.kv
    assert shared.tenant_pages == 5
    shared.check_fits(16, 4)
    with pytest.raises(InvalidRequest, match=r"needs 6 KV pages .* a tenant may hold 5 of the 10"):
        shared.check_fits(17, 4)
    optimistic = _ten_page_pool(glm_ckpt, tenant_kv_share=0.55, kv_admission="optimistic").engine.kv
    optimistic.check_fits(36, 4)
    with pytest.raises(InvalidRequest, match="the pool has 10"):
        optimistic.check_fits(37, 4)


def test_a_pool_of_exactly_the_devices_memory_is_built_and_a_byte_more_is_refused(glm_ckpt, monkeypatch):
    """The pool's memory check counts every byte of it (10 pages x 4 tokens x a token's bytes): a device
    with exactly that much builds it, one byte less is a ConfigError."""
    import sparsekv.cache.manager as manager
    from sparsekv.config import ModelConfig
    pool_bytes = 10 * 4 * _token_bytes(ModelConfig.from_json(glm_ckpt[0]))[1]
    monkeypatch.setattr(manager, "device_memory_bytes", lambda device: pool_bytes)
    assert _ten_page_pool(glm_ckpt).engine.kv.allocator.num_pages == 10
    monkeypatch.setattr(manager, "device_memory_bytes", lambda device: pool_bytes - 1)
    with pytest.raises(ConfigError, match=r"the KV cache would take .* \(10 pages of 4 tokens"):
        _ten_page_pool(glm_ckpt)


def test_kv_capacity_and_byte_figures_count_tokens_not_pages(glm_ckpt, random_prompt):
    """capacity_tokens (the server's context limit) is pages x page size; the device byte figures of the
    cache and of a request are their pages' tokens x a token's bytes (each figure would be 4 times too
    small if it counted pages as tokens)."""
    llm = _ten_page_pool(glm_ckpt)
    engine, kv = llm.engine, llm.engine.kv
    latent_bytes, token_bytes = _token_bytes(engine.model_config)
    assert kv.capacity_tokens == engine.kv_capacity_tokens == 40
    engine.add_request("a", random_prompt(10), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    (req,) = engine.scheduler.running
    used = kv.allocator.num_pages - kv.allocator.num_free
    assert used == len(req.page_ids) >= 3
    stats = kv.stats()
    assert stats["device_kv_bytes"] == used * 4 * token_bytes and stats["device_latent_bytes"] == used * 4 * latent_bytes
    assert kv.request_metrics(req)["device_kv_bytes"] == len(req.page_ids) * 4 * token_bytes
    engine.abort("a")
    _idle(llm)


@pytest.mark.parametrize("corruption,message", [
    ("page twice", "holds a page twice"),
    ("unheld page", "allocator and requests disagree"),
    ("extra owner", "page owners and requests disagree"),
    ("unnamed shared page", "a shared page has no name"),
    ("free page twice", "on the free list twice"),
])
def test_cache_check_integrity_catches_each_kind_of_corruption(glm_ckpt, random_prompt, corruption, message):
    """CacheManager.check_integrity (the engine's) compares the running requests' page tables with the
    allocator: each of its assertions fires on the disagreement it names (one that stopped checking
    would let two requests write one page, or a page leak, unnoticed), and it runs the allocator's own."""
    llm = _ten_page_pool(glm_ckpt)
    engine, kv = llm.engine, llm.engine.kv
    for rid, seed in (("a", 1), ("b", 2)):
        engine.add_request(rid, random_prompt(6, seed=seed), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    a, b = engine.scheduler.running
    kv.check_integrity([a, b], set())
    if corruption == "page twice":
        a.page_ids.append(a.page_ids[0])
    elif corruption == "unheld page":
        kv.allocator.allocate("ghost", 1)
    elif corruption == "free page twice":
        kv.allocator._free.append(kv.allocator._free[0])
    elif corruption == "extra owner":
        kv.allocator._owners[a.page_ids[0]].add("ghost")
    else:  # b shares a's first page, as a prefix hit would, but no prefix cache names it
        kv.allocator._owners[a.page_ids[0]].add(b.request_id)
        b.page_ids.insert(0, a.page_ids[0])
    with pytest.raises(AssertionError, match=message):
        kv.check_integrity([a, b], set())


def test_a_sampling_params_list_of_another_length_than_the_prompts_is_refused(llm, random_prompt):
    """A list of params pairs with the prompts one to one (vLLM's): one short would silently drop a
    prompt's output, so it is refused before any request is added."""
    prompts = [random_prompt(5), random_prompt(6), random_prompt(7)]
    for params in ([GREEDY], [GREEDY] * 4):
        with pytest.raises(ValueError, match=f"3 prompts but {len(params)} sampling params"):
            llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    _idle(llm)


def test_a_generate_that_fails_mid_step_aborts_its_requests(llm, random_prompt, monkeypatch):
    """An error (or Ctrl-C) out of a step ends the call's requests: none stays queued or holds pages,
    and the engine serves the next call as before."""
    want = llm.generate([random_prompt(9)], GREEDY)[0].token_ids
    real_step, steps = llm.engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([random_prompt(9), random_prompt(30, seed=4)], GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    _idle(llm)
    assert llm.generate([random_prompt(9)], GREEDY)[0].token_ids == want


def test_the_tokenizers_eos_ends_generation_when_the_config_names_none(glm_ckpt):
    """A checkpoint whose config.json has no eos_token_id, served with a tokenizer that names one:
    that EOS ends the output (finish_reason "stop", no stop_reason), as in vLLM."""
    from sparsekv.paths import default_model_path
    llm = LLM(glm_ckpt[0], tokenizer=default_model_path(), max_model_len=64, kv_page_size=4,
              enable_prefix_caching=False)
    eos = llm.tokenizer.eos_token_id
    assert llm.engine.model_config.eos_token_ids == () and eos is not None
    assert llm.engine.eos_token_ids == {eos}
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={eos: 100.0}))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    _idle(llm)


class _Clock:
    """time.monotonic for sparsekv.engine, advanced by hand."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_requests_first_scheduled_time_is_its_first_steps_not_its_latest(llm, random_prompt, monkeypatch):
    """`first_scheduled_time` (what the server's queue-time figures read) is set by the step that
    first schedules a request and kept through its later chunks and decodes."""
    clock = _Clock()
    monkeypatch.setattr("sparsekv.engine.time", clock)
    req = llm.engine.add_request("sched", random_prompt(40, seed=2), GREEDY)
    assert req.first_scheduled_time is None
    llm.engine.step()
    first = req.first_scheduled_time
    assert first == clock.now
    while llm.engine.has_unfinished_requests():
        clock.now += 1.0
        llm.engine.step()
    assert req.finish_reason == "length" and req.first_scheduled_time == first
    _idle(llm)


def test_check_ranks_asks_every_rank_once_per_probe_interval(llm, monkeypatch):
    """An idle server calls check_ranks in a tight loop: the rank round trip (rank_stats) runs once
    every RANK_PROBE_S, not on every call; the liveness check runs on every call."""
    from sparsekv.engine import RANK_PROBE_S
    clock, alive, probes = _Clock(), [], []

    class Ranks:
        def check_alive(self):
            alive.append(clock.now)
    monkeypatch.setattr("sparsekv.engine.time", clock)
    monkeypatch.setattr(llm.engine.executor, "ranks", Ranks(), raising=False)
    monkeypatch.setattr(llm.engine.executor, "rank_stats", lambda: probes.append(clock.now) or [])
    monkeypatch.setattr(llm.engine, "_ranks_probed", clock.now)
    for _ in range(3):
        llm.engine.check_ranks()
    assert len(alive) == 3 and probes == []
    clock.now += RANK_PROBE_S
    for _ in range(3):
        llm.engine.check_ranks()
    assert len(alive) == 6 and probes == [clock.now]
    clock.now += RANK_PROBE_S / 2
    llm.engine.check_ranks()
    assert probes == [clock.now - RANK_PROBE_S / 2]
    clock.now += RANK_PROBE_S / 2
    llm.engine.check_ranks()
    assert len(probes) == 2


def test_a_dict_prompt_with_other_keys_is_refused(llm):
    """Only vLLM's TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}: a dict with
    other keys too (multi-modal data, both kinds) would have them silently ignored, so it is refused."""
    for bad in ({"prompt": "hi", "multi_modal_data": {}}, {"prompt_token_ids": [5, 6], "prompt": "hi"},
                {"prompt_token_ids": [5, 6], "mm_processor_kwargs": {}}):
        with pytest.raises(InvalidRequest, match="a dict prompt is"):
            llm.generate(bad, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    _idle(llm)


def test_the_tqdm_bar_never_passes_its_total_when_prompt_tokens_are_computed_again(monkeypatch):
    """Prompt tokens recomputed after a preemption count again in the engine's counters: the bar is
    clamped to the prompts' total (GenerateProgress's docstring)."""
    import types

    import tqdm
    from sparsekv.llm import GenerateProgress
    monkeypatch.setattr(tqdm, "tqdm", lambda *args, **kwargs: _Bar(**kwargs))
    engine = types.SimpleNamespace(counters={"prompt_tokens": 100, "generation_tokens": 0, "steps": 0})
    requests = [types.SimpleNamespace(num_prompt_tokens=n) for n in (30, 20)]
    progress = GenerateProgress(engine, requests)
    engine.counters["prompt_tokens"] += 40
    progress.update(0)
    assert progress.bar.n == 40
    engine.counters["prompt_tokens"] += 30  # 20 of them recomputed after a preemption
    progress.update(1)
    assert progress.bar.n == progress.bar.total == 50
    progress.close(2)
    assert progress.bar.n == 50


class _Bar:
    """tqdm's counting, with nothing drawn."""

    def __init__(self, total, **kwargs):
        self.total, self.n, self.postfix = total, 0, None

    def set_postfix(self, refresh=True, **kwargs):
        self.postfix = kwargs

    def update(self, n=1):
        self.n += n

    def close(self):
        pass


def test_a_requests_slot_table_is_runs_of_consecutive_pages_and_follows_its_pages():
    """The runner's slot table (runner.py): every slot of a request's pages, with runs of consecutive
    slots merged (long runs are read as views of the pool, context.SeqSlice.runs) and clipped to the
    context; extended page by page, and built again when the request holds fewer pages than it knew."""
    import types

    from sparsekv.runner import ModelRunner
    runner = ModelRunner(types.SimpleNamespace(device=torch.device("cpu")), None, 4, "sparse")
    slots, runs = runner.slot_table("r", [3, 4, 5, 9])
    assert slots.tolist() == [*range(12, 24), *range(36, 40)] and runs == [[0, 12, 12], [12, 36, 4]]
    whole = runner.seq_slice("r", [3, 4, 5, 9], 0, 1, 12)  # the first three pages exactly
    assert whole.runs == ((0, 12, 12),) and whole.contiguous_start == 12 and whole.slots.tolist() == [*range(12, 24)]
    split = runner.seq_slice("r", [3, 4, 5, 9], 0, 2, 14)
    assert split.runs == ((0, 12, 12), (12, 36, 2)) and split.contiguous_start is None
    assert split.first_new_position == 12
    slots, runs = runner.slot_table("r", [3, 4, 5, 9, 10])
    assert slots.tolist()[-4:] == [*range(40, 44)] and runs == [[0, 12, 12], [12, 36, 8]]
    slots, runs = runner.slot_table("r", [7])  # fewer pages than known: not the old table
    assert slots.tolist() == [*range(28, 32)] and runs == [[0, 28, 4]]
    slots, runs = runner.slot_table("r", [7, 2])
    assert slots.tolist() == [*range(28, 32), *range(8, 12)] and runs == [[0, 28, 4], [4, 8, 4]]


def test_chat_given_a_list_of_strings_says_what_a_conversation_is(llm):
    """A list of plain strings (prompts, as generate takes them) is neither a conversation nor a list
    of them: the error says what chat takes, not that the letter 'h' is no message."""
    for bad in (["hello", "hi"], [[{"role": "user", "content": "hi"}], "hello"]):
        with pytest.raises(InvalidRequest, match="a conversation .* or a list of conversations"):
            llm.chat(bad, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_the_token_counters_count_each_prompt_token_once_and_each_generated_token(llm, random_prompt):
    """stats()' prompt_tokens and generation_tokens (the server's Prometheus counters): a prompt's
    tokens once, whether prefilled in one chunk or several, none of its decode rows; each output token."""
    before = llm.stats()
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 60)]
    outs = llm.generate(prompts, GREEDY)
    after = llm.stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == 5 + 37 + 60
    assert after["generation_tokens"] - before["generation_tokens"] == sum(len(o.token_ids) for o in outs)
    _idle(llm)


def test_an_index_naming_shard_files_that_are_not_there_lists_them(glm_ckpt, tmp_path):
    """A sharded checkpoint copied without some of its shards: the error lists the missing files (what
    to copy again), before any tensor is read."""
    src = glm_ckpt[0]
    d = str(tmp_path / "partial")
    shutil.copytree(src, d)
    names = list(load_file(os.path.join(src, "model.safetensors")))
    gone = ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    weight_map = {n: "model.safetensors" for n in names}
    weight_map.update({O_PROJ: gone[0], "model.norm.weight": gone[1]})
    json.dump({"weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match=rf"shard file\(s\) missing: {gone[0]}, {gone[1]}"):
        LLM(d)


def test_a_tied_checkpoint_that_also_stores_its_lm_head_loads(glm_ckpt, tmp_path, random_prompt):
    """tie_word_embeddings with lm_head.weight stored too (exporters that write shared tensors twice)
    is a valid checkpoint: it loads and serves what the same checkpoint without the copy serves."""
    def tied(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    both = _with_tensors(glm_ckpt[0], str(tmp_path / "both"), tied)
    only_embed = _with_tensors(glm_ckpt[0], str(tmp_path / "embed"), lambda t: t.pop("lm_head.weight"))
    for d in (both, only_embed):
        cfg = json.load(open(os.path.join(d, "config.json")))
        json.dump({**cfg, "tie_word_embeddings": True}, open(os.path.join(d, "config.json"), "w"))
    prompt = random_prompt(12, seed=5)
    llms = [LLM(d, max_model_len=64, kv_page_size=4) for d in (both, only_embed)]
    outs = [llm.generate([prompt], GREEDY)[0] for llm in llms]
    assert_same_greedy([outs[1]], [outs[0]], logprob_tolerance(llms[1]))  # equal weights, other memory


def test_a_checkpoint_missing_many_tensors_names_some_and_counts_the_rest(glm_ckpt, tmp_path):
    """Six names, then how many more: a checkpoint missing a whole layer gives a readable message."""
    d = _with_tensors(glm_ckpt[0], str(tmp_path / "no-layer-1"),
                      lambda t: [t.pop(n) for n in [n for n in t if n.startswith("model.layers.1.")]])
    missing = len([n for n in load_file(os.path.join(glm_ckpt[0], "model.safetensors")) if n.startswith("model.layers.1.")])
    assert missing > 6
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) (model\.layers\.1\.[^,]+, ){{5}}model\.layers\.1\.\S+ "
                                              rf"\(\+{missing - 6} more\)$"):
        LLM(d)


def test_an_indexshare_override_still_refuses_a_tensor_no_layer_has(glm_ckpt, tmp_path):
    """With indexers overridden to shared, the checkpoint's indexer tensors of those layers are skipped,
    and only those: any other unexpected tensor is still an error."""
    pattern = {"index_topk_pattern": "FSSS"}
    assert LLM(glm_ckpt[0], max_model_len=64, hf_overrides=pattern).engine.model_config.indexer_types[1:] == ("shared",) * 3
    d = _with_tensors(glm_ckpt[0], str(tmp_path / "extra"),
                      lambda t: t.update({"model.layers.2.self_attn.extra.weight": torch.ones(4)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.2\.self_attn\.extra\.weight"):
        LLM(d, max_model_len=64, hf_overrides=pattern)


def test_a_request_id_used_again_after_its_request_ended_computes_from_its_own_pages(llm, random_prompt):
    """Clients reuse request ids: a finished (or aborted) request's per-request state in the runner and
    selectors goes with it, so a later request of that id reads only its own pages."""
    long_prompt = random_prompt(60, seed=6)
    want = llm.generate([long_prompt], GREEDY)[0]
    engine = llm.engine
    for ending in ("finish", "abort"):
        engine.add_request("dup", random_prompt(9, seed=7), GREEDY)
        engine.step()
        if ending == "abort":
            assert engine.abort("dup")
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.add_request("filler", random_prompt(20, seed=8), GREEDY)  # takes the pages "dup" held
        engine.step()
        engine.add_request("dup", long_prompt, GREEDY)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        assert_same_greedy([want], [outs["dup"]], logprob_tolerance(llm))  # a batch groups rows differently
        _idle(llm)


def test_the_engines_check_integrity_catches_selector_state_of_a_request_not_running(glm_ckpt, random_prompt):
    """LLMEngine.check_integrity asks each token selector too (the executor's part): Quest's page history
    kept for a request that is not running is reported, not passed over."""
    llm = LLM(glm_ckpt[0], max_model_len=64, kv_page_size=4, selector="quest", quest_page_tokens=2,
              enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", random_prompt(6), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    engine.check_integrity()
    (quest,) = engine.model.selectors()
    quest._last["ghost"] = next(iter(quest._last.values()), {})
    with pytest.raises(AssertionError, match=r"page history for finished requests \['ghost'\]"):
        engine.check_integrity()


def test_a_cuda_pool_may_take_what_torchs_caching_allocator_holds_unused(monkeypatch):
    """`mem_get_info`'s free memory leaves out the blocks torch's caching allocator keeps reserved after
    an earlier engine in the process freed its pool (pytest and gpu_check build several): those are
    available to the next pool too. No GPU needed: torch.cuda's figures are given."""
    from sparsekv.cache import memory
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * gib)
    assert memory.device_memory_bytes(torch.device("cuda")) == 35 * gib
    memory.check_tiered_fits(0, 35 * gib, torch.device("cuda"), None, "the test")
    with pytest.raises(ConfigError, match="cuda memory"):
        memory.check_tiered_fits(0, 35 * gib + 1, torch.device("cuda"), None, "the test")
