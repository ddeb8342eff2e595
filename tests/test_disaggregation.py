"""Prefill/decode disaggregation's core, in one process: a prefill engine computes a prompt, its named
KV pages (latents, indexer keys, the MTP layer's entries, the selector's per-page state) are exported
as plain rows, and a decode engine imports them: into its prefix cache's host tier, or with
kv_tiering into its pool (latents in the host store it decodes from, held once). The request then runs
as a prefix hit, computing only what was not sent (the last, partial page and on), whose rows' selections
warm its device working set. Greedy tokens and logprobs must be those of one colocated engine."""
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
    assert decode.engine.kv.import_prefix(pages, prompts=[prompt]) == len(pages)
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
    landing = "device" if options.get("kv_tiering") else "host"  # tiered: the pool, whose latents are host rows
    assert got.metrics[f"prefix_cached_tokens_{landing}"] == got.num_cached_tokens == len(pages) * PAGE
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()


@pytest.mark.parametrize("family", ["glm", "ds"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "decode-tiered", "fp8"])
@pytest.mark.parametrize("length", [41, 44])  # the last token alone in its page (no tail); 3 rows before it
def test_with_the_last_pages_rows_before_the_last_token_the_decode_side_computes_that_token_alone(
        family, options, length, glm_ckpt, ds_ckpt):
    """The prefill engine's layer taps hand out the rows of the last token's page before that token
    (a tail); imported with the pages, the decode engine's hit takes them too and computes the last
    token alone, and decodes as one engine would."""
    path = (glm_ckpt if family == "glm" else ds_ckpt)[0]
    prompt = _prompt(256, length)
    colocated = LLM(path, **BASE, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    prefill = LLM(path, **BASE, **{k: v for k, v in options.items() if k == "kv_cache_dtype"})
    got_rows = []
    prefill.engine.tap_layers("p", len(prompt), 0, got_rows.append)
    prefill.engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    num_kinds = len(prefill.engine.kv.page_tensors())
    by_kind = {k: r[0] for d in got_rows if d.tail for k, r in zip(d.kinds, d.ready())}
    tail = (len(prompt) - 1) % PAGE
    assert sorted(by_kind) == (list(range(num_kinds)) if tail else [])
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE, **options)
    tails = [[by_kind[k] for k in range(num_kinds)] if tail else None]
    assert decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=tails) == len(pages)
    got = decode.generate([prompt], GREEDY)[0]
    assert got.num_cached_tokens == len(prompt) - 1  # the last token alone was computed
    assert_same_greedy([want], [got], logprob_tolerance(colocated))
    decode.engine.check_integrity()
    again = decode.generate([prompt], GREEDY)[0]  # a tail serves one request: the next computes the page
    assert again.num_cached_tokens == len(pages) * PAGE and again.token_ids == got.token_ids


def test_a_tail_that_does_not_fit_refuses_the_import_whole(glm_ckpt):
    path = glm_ckpt[0]
    prompt = _prompt(256, 44)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    decode = LLM(path, **BASE, **DECODE)
    tensors = [t for t, _ in decode.engine.kv.page_tensors()]
    for bad in ([t[:3, :1] for t in tensors], [t[:PAGE] for t in tensors], [t[:3] for t in tensors[:1]]):
        # a row's width, a whole page, a kind missing
        with pytest.raises(ValueError, match="tail 0"):
            decode.engine.kv.import_prefix(pages, prompts=[prompt], tails=[bad])
        assert decode.engine.kv.held_prefix(prompt) == 0
    decode.engine.check_integrity()


def test_a_tiered_decode_side_holds_the_imported_rows_once(glm_ckpt):
    """The rows land in pool pages (their latents in the host store the request decodes from), not in
    the prefix cache's host tier as well; they are the bytes sent, and stay so after the request."""
    path, prompt = glm_ckpt[0], _prompt(256)
    tiered = dict(kv_tiering=True, device_buffer_tokens=16)
    pages, out, decode = _disaggregated(path, prompt, {}, tiered)
    stats = decode.stats()
    assert stats["prefix_host_pages"] == stats["prefix_host_bytes"] == 0
    assert stats["prefix_cached_pages"] >= len(pages) and stats["prefix_cache_hits_host"] == 0
    assert out.metrics["prefix_cached_tokens_device"] == len(pages) * PAGE
    held = decode.engine.kv.export_prefix(prompt)[:len(pages)]  # read back from the pool
    assert [name for name, _ in held] == [name for name, _ in pages]
    assert all(torch.equal(a, b) for (_, x), (_, y) in zip(held, pages) for a, b in zip(x, y, strict=True))
    decode.engine.check_integrity()


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True)], ids=["plain", "decode-tiered"])
def test_with_mtp_drafting_on_both_sides(options):
    """The pages carry the MTP layer's entries: drafting on the decode side reads them (tiered: from the
    pool pages they landed in)."""
    path, prompt = default_model_path(), _prompt(4096, 50)
    colocated = LLM(path, **BASE, num_speculative_tokens=2, **options)
    want = colocated.generate([prompt], GREEDY)[0]
    pages, got, decode = _disaggregated(path, prompt, dict(num_speculative_tokens=2),
                                        dict(num_speculative_tokens=2, **options))
    assert got.num_cached_tokens == len(pages) * PAGE > 0
    assert got.metrics["spec_decode_num_drafts"] > 0
    assert decode.stats()["prefix_host_pages"] == (0 if options else len(pages))
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


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16)], ids=["plain", "tiered"])
def test_rows_that_do_not_fit_the_decode_cache_are_refused_whole(options, glm_ckpt):
    """A corrupted layer (a row of the wrong shape): nothing is imported, in any tier."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    name, rows = pages[3]
    bad = pages[:3] + [(name, [rows[0][:, :-1]] + rows[1:])] + pages[4:]
    decode = LLM(path, **BASE, **DECODE, **options)
    with pytest.raises(ValueError, match="page 3"):
        decode.engine.kv.import_prefix(bad, prompts=[prompt])
    stats = decode.stats()
    assert stats["prefix_host_pages"] == stats["prefix_cached_pages"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    decode.engine.check_integrity()
    out = decode.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0


def test_more_pages_than_the_host_tier_holds_are_refused_whole(glm_ckpt):
    """An import the host tier cannot hold whole would push its first pages out with its last (the
    hit would be empty, the transfer wasted): refused, naming the option to raise; nothing kept."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    pages = prefill.engine.kv.export_prefix(prompt)
    page_bytes = sum(r.numel() * r.element_size() for r in pages[0][1])
    decode = LLM(path, **BASE, prefix_cache_host_bytes=(len(pages) - 1) * page_bytes)
    with pytest.raises(ValueError, match="prefix-cache-host-bytes"):
        decode.engine.kv.import_prefix(pages, prompts=[prompt])
    assert decode.stats()["prefix_host_pages"] == 0
    assert decode.engine.kv.import_prefix(pages[:-1], prompts=[prompt]) == len(pages) - 1  # what fits is kept
    decode.engine.check_integrity()


def test_the_decode_side_starts_decoding_warm(monkeypatch):
    """A tiered decode side computes only the page holding the last token; placing every position its
    rows selected in the working set (rows read for that chunk anyway) makes its first decode step miss
    far fewer entries than from the last row's selections alone, and than from an empty working set.
    The bundled model, past top-k (256): the sparse regime. Placement never changes outputs."""
    from sparsekv.cache.tiers import TieredKVPool
    from sparsekv.tools.bench_kv_dtype import default_text
    path = default_model_path()
    prefill = LLM(path, max_model_len=1024)
    prompt = prefill.engine.tokenizer.encode(default_text())[:600]  # a last chunk of 600 - 9 * 64 = 24 rows
    prefill.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    pages = prefill.engine.kv.export_prefix(prompt)

    def first_decode_misses():
        decode = LLM(path, max_model_len=1024, kv_tiering=True, prefix_cache_host_bytes=1 << 28)
        engine = decode.engine
        engine.kv.import_prefix(pages, prompts=[prompt])
        req = engine.add_request(None, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while req.is_prefilling or not req.output_token_ids:
            engine.step()
        assert req.num_cached_tokens == len(pages) * 64
        before = engine.stats()["tier_misses"]
        engine.step()
        misses = engine.stats()["tier_misses"] - before
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
        return misses, list(req.output_token_ids)
    warm, tokens = first_decode_misses()
    monkeypatch.setattr(TieredKVPool, "_prime_block", lambda self, layer, seq, positions, distinct, inverse, stored:
                        self._prime(layer, seq, positions[-1], stored.index_select(0, inverse[-positions.shape[1]:])))
    last_row, last_row_tokens = first_decode_misses()
    monkeypatch.setattr(TieredKVPool, "_prime", lambda *args: None)
    cold, cold_tokens = first_decode_misses()
    assert cold > 250 * 4  # nearly every one of the 256 selected positions, in each layer
    assert warm < last_row / 4 and last_row < cold
    assert tokens == last_row_tokens == cold_tokens


def test_landed_pages_serve_only_their_tenant_and_salt(glm_ckpt):
    """Pages that landed in a tiered decode side's pool keep their names: another tenant, or the same
    tenant with another cache_salt, computes the prompt; the tenant and salt they were sent for hit them."""
    path, prompt = glm_ckpt[0], _prompt(256)
    prefill = LLM(path, **BASE)
    prefill.engine.add_request(None, prompt, SamplingParams(max_tokens=1), tenant="a", cache_salt="s")
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    pages = prefill.engine.kv.export_prefix(prompt, "a", "s")
    decode = LLM(path, **BASE, **DECODE, kv_tiering=True, device_buffer_tokens=16)
    decode.engine.kv.import_prefix(pages, "a", [prompt], "s")
    assert decode.stats()["prefix_cached_pages"] == len(pages) > 0
    cached = {}
    for tenant, salt in (("b", "s"), ("a", None), ("a", "s")):
        req = decode.engine.add_request(None, prompt, SamplingParams(max_tokens=2), tenant=tenant, cache_salt=salt)
        while decode.engine.has_unfinished_requests():
            decode.engine.step()
        cached[tenant, salt] = req.num_cached_tokens
    assert cached == {("b", "s"): 0, ("a", None): 0, ("a", "s"): len(pages) * PAGE}
    decode.engine.check_integrity()
