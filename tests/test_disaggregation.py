"""Prefill/decode disaggregation's core, in one process: a prefill engine computes a prompt, its named
KV pages (latents, indexer keys, the MTP layer's entries, the selector's per-page state) are exported
as plain rows, and a decode engine imports them into its prefix cache's host tier; the request then
runs there as a host-tier hit, computing only what was not sent (the last, partial page and on).
Greedy tokens and logprobs must be those of one colocated engine."""
import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.paths import default_model_path
from tolerances import assert_same_greedy, logprob_tolerance

PAGE = 4
BASE = dict(kv_page_size=PAGE, max_model_len=128, num_threads=1)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
DECODE = dict(prefix_cache_host_bytes=1 << 24)


def _prompt(vocab: int, n: int = 41, seed: int = 3) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _disaggregated(path: str, prompt: list[int], prefill_options: dict, decode_options: dict):
    prefill = LLM(path, **BASE, **prefill_options)
    # with drafting a page is named once the MTP layer's entries for it exist: the MTP pass after the
    # first token writes them, and a request that ends at its first token skips that pass
    tokens = 3 if prefill_options.get("num_speculative_tokens") else 1
    prefill.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE, **decode_options)
    assert decode.engine.kv.import_prefix(pages) == len(pages)
    return pages, decode.generate([prompt], GREEDY)[0], decode


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "decode-tiered", "fp8"])
def test_a_prompt_prefilled_elsewhere_decodes_as_one_engine_would(family, options, glm_ckpt, ds_ckpt):
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    prefill_options = {k: v for k, v in options.items() if k == "kv_cache_dtype"}
    pages, got, decode = _disaggregated(path, prompt, prefill_options, options)
    assert len(pages) == (len(prompt) - 1) // PAGE  # every full page but the one holding the last token
    assert got.metrics["prefix_cached_tokens_host"] == got.num_cached_tokens == len(pages) * PAGE
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()


def test_with_mtp_drafting_on_both_sides():
    """The pages carry the MTP layer's entries: drafting on the decode side reads them."""
    path, prompt = default_model_path(), _prompt(4096, 50)
    colocated = LLM(path, **BASE, num_speculative_tokens=2)
    want = colocated.generate([prompt], GREEDY)[0]
    pages, got, decode = _disaggregated(path, prompt, dict(num_speculative_tokens=2), dict(num_speculative_tokens=2))
    assert got.num_cached_tokens == len(pages) * PAGE > 0
    assert got.metrics["spec_decode_num_drafts"] > 0
    assert_same_greedy([want], [got], logprob_tolerance(colocated, extra_layers=1))


def test_pages_the_decode_side_holds_are_not_sent_again(glm_ckpt):
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    decode = LLM(path, **BASE, **DECODE)
    decode.generate([prompt[:21]], SamplingParams(max_tokens=1))  # the first 5 pages are in its pool
    held = decode.engine.kv.held_prefix(prompt)
    assert held == 5
    pages = prefill.engine.kv.export_prefix(prompt, skip=held)
    assert len(pages) == (len(prompt) - 1) // PAGE - held
    assert decode.engine.kv.import_prefix(pages) == len(pages)
    out = decode.generate([prompt], GREEDY)[0]
    assert out.metrics["prefix_cached_tokens_device"] == held * PAGE
    assert out.metrics["prefix_cached_tokens_host"] == len(pages) * PAGE


def test_rows_that_do_not_fit_the_decode_cache_are_refused_whole(glm_ckpt):
    """A corrupted layer (a row of the wrong shape) or another tenant's name: nothing is imported."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    name, rows = pages[3]
    bad = pages[:3] + [(name, [rows[0][:, :-1]] + rows[1:])] + pages[4:]
    decode = LLM(path, **BASE, **DECODE)
    with pytest.raises(ValueError, match="page 3"):
        decode.engine.kv.import_prefix(bad)
    assert decode.stats()["prefix_host_pages"] == 0
    decode.engine.check_integrity()
    out = decode.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0
