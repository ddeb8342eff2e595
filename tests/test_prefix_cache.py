"""The prefix cache: outputs as without it (greedy tokens equal; logprobs bit for bit when the cached
pages were computed in the same row groups, else within the rounding bound of tests/tolerances.py, as
batching differs), with and without
tiering and with both selectors; isolated per tenant and cache_salt; evicted oldest first; every pool
back to its initial state."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, ConfigError, SamplingParams
from sparsekv.cache.pages import PageAllocator
from sparsekv.cache.prefix import PrefixCache
from sparsekv.request import Request
from sparsekv.tools.tiny import save_reference_checkpoint
from tolerances import assert_same_greedy, logprob_tolerance

PAGE = 16
BASE = [(7 * i) % 250 + 1 for i in range(70)]                 # 4 full pages and a partial one
PROMPTS = [BASE + [5, 6, 7], BASE[:40] + [9, 9], BASE + [1] * 30, BASE[:PAGE]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
SMALL = dict(kv_page_size=PAGE, prefill_chunk_tokens=24, max_num_batched_tokens=40, max_num_seqs=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prefix"))
    save_reference_checkpoint(path, family="glm_moe_dsa", seed=1, index_topk=8)  # past 8 tokens, sparse
    return path


def make(path, **options):
    torch.set_num_threads(1)
    return LLM(path, **{**SMALL, "enable_prefix_caching": False, **options})


def assert_close(want, got, bitwise: bool, tol: float | None = None):
    """bitwise: the cached pages were computed in the same row groups as without the cache, so every
    operation repeats on the same values in the same shapes. Otherwise rows were grouped differently
    and `tol` is the rounding bound (tests/tolerances.py)."""
    if not bitwise:
        assert_same_greedy(want, got, tol)
        return
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def assert_idle(llm):
    engine = llm.engine
    engine.check_integrity()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == stats["waiting"] == 0
    assert not engine.kv.prefix._chains and engine.kv.allocator.num_reserved_unallocated == 0


# -- bookkeeping ------------------------------------------------------------------------------------
def _request(rid, tokens, tenant="default", salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=4), tenant=tenant, cache_salt=salt)


def test_allocator_keeps_registered_pages_and_evicts_the_oldest_first():
    a = PageAllocator(4, PAGE)
    kept, evicted = {1: "t", 2: "t"}, []
    a.cached.tenant_of_named, a.cached.on_evict = kept.get, evicted.append
    pages = a.allocate("x", 4)
    a.free("x", [pages[2], pages[1], pages[0], pages[3]])   # 2 then 1 cached, 0 and 3 free
    assert a.num_free == 4 and len(a.cached) == 2 and list(a._free) == [0, 3]
    a.check_integrity()
    assert a.share_and_reserve("y", [1], 3) and a.num_owners(1) == 1 and a.num_available == 0
    assert not a.share_and_reserve("z", [2], 1)               # taking 2 leaves nothing for z's one page
    assert a.num_owners(2) == 0 and 2 in a.cached
    assert a.allocate("y", 3) == [0, 2, 3] and evicted == [2]  # free pages first, then the cached one (in order)
    a.check_integrity()
    a.free("y", [1, 0, 3, 2])
    assert len(a.cached) == 2 and a.num_free == 4              # 1 and 2 kept again (still registered)
    a.check_integrity()


def test_pages_freed_last_first_come_back_in_order_as_one_run(ckpt):
    """A request's pages are freed last first (its tail evicted before its head): the next request
    still gets them in ascending order, one run of slots that decode reads in place (in descending
    order every page was a run of its own, and a long context's decode step several times slower)."""
    a = PageAllocator(8, PAGE)
    pages = a.allocate("x", 8)
    a.free("x", pages[::-1])
    assert a.allocate("y", 8) == list(range(8))
    llm = make(ckpt, enable_prefix_caching=True, num_kv_pages=12, prefill_chunk_tokens=PAGE * 12,
               max_num_batched_tokens=PAGE * 12)
    engine = llm.engine
    for rid, prompt in (("first", BASE + [1] * 60), ("second", [3] * 120)):  # no page of the first's hits
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0))
        engine.step()
        held = engine.scheduler.running[0].page_ids
        assert held == sorted(held) and held == list(range(held[0], held[0] + len(held))), (rid, held)
        while engine.has_unfinished_requests():
            engine.step()


def test_eviction_takes_from_the_tenant_holding_the_most_cached_pages():
    """A tenant's new pages evict its own cached pages first, and never push another tenant's count
    below its own: the victim is the oldest page of the largest holder."""
    a = PageAllocator(10, PAGE)
    tenant_of, evicted = {}, []
    a.cached.tenant_of_named, a.cached.on_evict = tenant_of.get, evicted.append
    pages = a.allocate("r", 10)
    tenant_of.update({p: "noisy" for p in pages[:6]} | {p: "quiet" for p in pages[6:9]})
    a.free("r", pages)                                        # 6 noisy, 3 quiet cached, 1 free
    assert len(a.cached) == 9 and a.num_free == 10
    a.allocate("n", 5)                                        # the free page, then 4 evictions
    assert evicted == pages[:4]                               # noisy's oldest: 6 -> 2 while quiet keeps 3
    a.allocate("n", 2)
    assert evicted[4:] == [pages[6], pages[4]]                # quiet (3 against 2), then a tie: the first cached
    a.check_integrity()


def test_a_tenant_holds_at_most_its_quota_of_cached_pages():
    """`cached.max_per_tenant`: releasing a page beyond the quota evicts the tenant's oldest cached
    page at once (to the lower tiers), whatever room the pool has; other tenants are untouched."""
    a = PageAllocator(10, PAGE)
    tenant_of, evicted = {}, []
    a.cached.tenant_of_named, a.cached.on_evict, a.cached.max_per_tenant = tenant_of.get, evicted.append, 3
    pages = a.allocate("r", 8)
    tenant_of.update({p: "noisy" for p in pages[:6]} | {p: "quiet" for p in pages[6:]})
    a.free("r", pages)
    assert evicted == pages[:3] and a.cached.by_tenant() == {"noisy": 3, "quiet": 2}
    assert a.num_free == 10
    a.check_integrity()


def test_cached_pages_unused_since_a_cutoff_are_those_released_strictly_before_it():
    """The TTL's selection (every tier's `expire`): the cached pages released before the cutoff, every
    tenant's, a page released exactly at the cutoff kept; a hit (`touch`) makes a page its tenant's
    newest, last used at the hit's time."""
    from sparsekv.cache.cached_pages import TenantLRU
    lru = TenantLRU()
    for key, tenant, now in ((1, "a", 10.0), (2, "a", 20.0), (3, "b", 15.0), (4, "b", 30.0)):
        lru.add(key, tenant, now)
    assert lru.unused_since(20.0) == [1, 3]
    assert lru.unused_since(20.5) == [1, 2, 3] and lru.unused_since(10.0) == []
    lru.touch(1, 40.0)
    assert lru.keys("a") == [2, 1] and lru.last_used(1) == 40.0
    assert lru.unused_since(20.5) == [2, 3] and lru.oldest_first() == [3, 2, 4, 1]


def test_a_host_tier_of_exactly_one_page_is_enough_and_a_byte_less_is_refused(ckpt):
    """prefix_cache_host_bytes must hold one page of every slot-indexed tensor (latents and indexer keys:
    a page of the pool's bytes per token): exactly that is a one-page host tier, a byte less a
    ConfigError naming the option."""
    pool = make(ckpt).engine.kv.pool
    page_bytes = PAGE * (pool.latent_bytes_per_token() + pool.index_bytes_per_token())
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=page_bytes)
    assert llm.engine.kv.prefix.rows.page_bytes == page_bytes
    with pytest.raises(ConfigError, match=f"prefix_cache_host_bytes={page_bytes - 1} holds less than one"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=page_bytes - 1)


def test_the_tenant_quota_through_the_engine_keeps_outputs_and_feeds_the_host_tier(ckpt):
    """With a quota of 2 pages per tenant, a long prompt leaves 2 pages cached in the pool; its other
    pages go to the host tier, so a repeat still hits them all, with the same tokens."""
    want = make(ckpt, prefill_chunk_tokens=PAGE).generate([PROMPTS[0]], GREEDY)[0]  # pages computed alike
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_max_pages_per_tenant=2,
               prefix_cache_host_bytes=1 << 24, prefill_chunk_tokens=PAGE)
    llm.generate([BASE + [3]], GREEDY)
    stats = llm.stats()
    assert stats["prefix_cached_pages"] == 2 and stats["prefix_cache_by_tenant"]["default"]["cached_pages"] == 2
    assert stats["prefix_host_pages"] == 3                     # the other full pages: 5 - 2
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.num_cached_tokens == 64 and out.metrics["prefix_cached_tokens_host"] > 0
    assert_close([want], [out], bitwise=True)
    assert_idle(llm)
    with pytest.raises(ConfigError, match="prefix_cache_max_pages_per_tenant"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_max_pages_per_tenant=-1)
    with pytest.raises(ConfigError, match="prefix_cache_host_bytes=10 holds less than one 16-token page"):
        make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=10)  # a tier that could never hold a page


def test_lookup_follows_the_chain_per_tenant_and_salt_and_never_the_last_token():
    a = PageAllocator(16, PAGE)
    cache = PrefixCache(a)
    owner = _request("a", BASE)                               # 70 tokens: pages 0-3 full
    owner.page_ids = a.allocate("a", 5)
    owner.num_computed_tokens = 70
    cache.register(owner)
    assert len(cache._page_of) == 4
    assert cache.lookup(_request("b", BASE[:50] + [0] * 20)).pages == owner.page_ids[:3]
    assert cache.lookup(_request("c", BASE[:64])).pages == owner.page_ids[:3]   # the last token's page is computed
    assert cache.lookup(_request("d", BASE[:65])).pages == owner.page_ids[:4]
    assert cache.lookup(_request("e", [0] + BASE[1:])).pages == []                # the chain breaks at page 0
    assert cache.lookup(_request("f", BASE, tenant="other")).pages == []
    assert cache.lookup(_request("g", BASE, salt="s")).pages == []
    for rid in "abcdefg":
        cache.forget_request(rid)
    a.free("a", owner.page_ids)
    cache.check_integrity(set())
    assert len(a.cached) == 4


def test_a_request_computing_every_prompt_row_leaves_the_prefix_to_the_request_that_claimed_it():
    """A request with prompt_logprobs hits nothing and waits for nothing: admitted beside a request
    computing the same prefix, it does not take that request's claim, so once it leaves (aborted),
    a third request with the prefix still waits for the first's pages."""
    cache = PrefixCache(PageAllocator(16, PAGE))
    first = _request("a", BASE)
    cache.take(first, cache.match(first))                      # claims pages 0-3, computing them
    every_row = Request("b", BASE, SamplingParams(max_tokens=4, prompt_logprobs=1))
    hit = cache.match(every_row)
    assert hit is not None and not hit.pages and not hit.wait
    cache.take(every_row, hit)
    cache.forget_request("b")
    assert cache.match(_request("c", BASE)) is None            # still the first's pages to wait for
    for rid in "ac":
        cache.forget_request(rid)
    cache.check_integrity(set())


def test_a_page_is_named_once_its_rows_are_computed_and_the_token_its_name_covers_is_known():
    """`register` names a full page only once every row of it is computed (a decode step's sampled
    token fills its row at the next step) and, with lookahead 1 (speculative decoding), once the token
    after it is known too: a hit on it would read rows not yet written, or under another name."""
    a = PageAllocator(8, PAGE)
    for lookahead in (0, 1):
        cache = PrefixCache(a, lookahead=lookahead)
        req = _request("a", BASE[:2 * PAGE])
        req.page_ids, req.num_computed_tokens = a.allocate("a", 2), 2 * PAGE - 1  # the last row not written
        cache.register(req)
        assert len(cache._page_of) == 1
        req.num_computed_tokens = 2 * PAGE
        cache.register(req)
        assert len(cache._page_of) == 2 - lookahead              # page 1's name needs token 2 * PAGE
        req.output_token_ids.append(5)
        cache.register(req)
        assert len(cache._page_of) == 2
        cache.forget_request("a")
        a.free("a", req.page_ids)
        cache.reset()
        cache.check_integrity(set())


def test_the_names_a_prompt_exports_are_the_pages_a_lookup_can_hit():
    """`prompt_names` (what an export sends and an import expects) is every full page but the one
    holding the last token: a prompt filling its last page exactly leaves that page to compute, as a
    lookup does."""
    a = PageAllocator(16, PAGE)
    cache = PrefixCache(a)
    whole, longer = cache.prompt_names(BASE[:2 * PAGE], "default", None), cache.prompt_names(BASE[:2 * PAGE + 1], "default", None)
    assert len(whole) == 1 and len(longer) == 2 and longer[:1] == whole
    owner = _request("a", BASE[:2 * PAGE + 1])
    owner.page_ids, owner.num_computed_tokens = a.allocate("a", 3), 2 * PAGE + 1
    cache.register(owner)
    assert set(cache._page_of) == set(longer)                  # the names a request registers
    assert cache.lookup(_request("b", BASE[:2 * PAGE])).pages == owner.page_ids[:len(whole)]
    for rid in "ab":
        cache.forget_request(rid)
    a.free("a", owner.page_ids)
    cache.check_integrity(set())


# -- the engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [PAGE, 24], ids=["chunks-of-a-page", "chunks-across-pages"])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=8), dict(selector="quest")],
                         ids=["device", "tiered", "quest"])
def test_hits_compute_what_no_cache_computes(ckpt, options, chunk):
    """Prefill chunks of one page group rows as without the cache (bit for bit); chunks of 24 tokens
    group them differently (a hit starts its chunks at a page boundary), which moves logprobs ~1e-6."""
    reference = make(ckpt, prefill_chunk_tokens=chunk, **options)
    want = [reference.generate([p], GREEDY)[0] for p in PROMPTS]
    llm = make(ckpt, enable_prefix_caching=True, prefill_chunk_tokens=chunk, **options)
    llm.generate([BASE + [3]], GREEDY)
    got = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    assert_close(want, got, bitwise=chunk == PAGE, tol=logprob_tolerance(llm))
    # 4 pages, 2 pages (40 tokens), 4 pages, none (a one-page prompt's last token is on page 0)
    assert [o.num_cached_tokens for o in got] == [64, 32, 64, 0]
    stats = llm.stats()  # pool pages (with tiering: latents in the host store) count as device hits
    assert stats["prefix_cache_hits_device"] == 160 and stats["prefix_cache_hits_host"] == 0
    assert stats["prefix_cached_pages"] > 0
    assert stats["prompt_tokens"] == sum(len(p) for p in [BASE + [3]] + PROMPTS) - 160
    assert_idle(llm)


def test_a_batch_shares_pages_and_generated_tokens_are_cached_too(ckpt):
    reference = make(ckpt)
    llm = make(ckpt, enable_prefix_caching=True)
    first = llm.generate([BASE], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    continued = BASE + first.token_ids                          # 100 tokens: page 4 holds generated ones
    prompts = [continued + [4], continued + [8, 8], BASE[:60]]
    want = reference.generate(prompts, GREEDY)
    got = llm.generate(prompts, GREEDY)
    # page 4's entries were computed one decode row at a time
    assert_close(want, got, bitwise=False, tol=logprob_tolerance(llm))
    assert [o.num_cached_tokens for o in got] == [96, 96, 48]
    assert_idle(llm)


def _finish_one(engine, rid, tenant, salt):
    """Run one request of `tenant` and `salt` over BASE to its end; its final output."""
    engine.add_request(rid, BASE, GREEDY, tenant=tenant, cache_salt=salt)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs[0]


def test_a_step_lists_the_pages_a_prefix_tier_restore_wrote(ckpt):
    """`SchedulerOutput.restored_page_ids`, as the executor receives it: the pool pages whose rows a
    restore from a lower prefix-cache tier wrote while the step was scheduled (what an executor with a
    pool per rank must send to the other ranks first). A host-tier hit lists the request's first pages
    in the step that admits it and in no other; a miss and a pool hit list none."""
    seen = {}

    def watched(engine):
        seen[engine] = []
        engine.executor.add_observer(lambda step, out: seen[engine].append(
            (list(step.restored_page_ids), [list(ch.page_ids) for ch in step.chunks])))
        return engine

    def run(engine, rid):
        seen[engine].clear()
        return _finish_one(engine, rid, "default", None), list(seen[engine])
    host = watched(make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24,
                        prefix_cache_max_pages_per_tenant=0).engine)  # released pages go straight to the host tier
    pool = watched(make(ckpt, enable_prefix_caching=True).engine)
    for engine in (host, pool):
        out, steps = run(engine, "miss")
        assert out.num_cached_tokens == 0 and all(restored == [] for restored, _ in steps)
    out, steps = run(host, "host hit")
    assert out.metrics["prefix_cached_tokens_host"] == out.num_cached_tokens == 64
    (restored, pages), later = steps[0], steps[1:]
    assert restored == pages[0][:4] and all(r == [] for r, _ in later)
    out, steps = run(pool, "pool hit")
    assert out.metrics["prefix_cached_tokens_device"] == out.num_cached_tokens == 64
    assert all(restored == [] for restored, _ in steps)
    host.check_integrity()
    pool.check_integrity()


@pytest.mark.parametrize("first, second", [(("alice", None), ("bob", None)), (("alice", "s1"), ("alice", "s2")),
                                           (("alice", "s1"), ("alice", None))])
def test_tenants_and_salts_never_share(ckpt, first, second):
    engine = make(ckpt, enable_prefix_caching=True).engine

    def run(rid, tenant, salt):
        return _finish_one(engine, rid, tenant, salt)
    run("a", *first)
    assert run("b", *second).num_cached_tokens == 0
    assert run("c", *first).num_cached_tokens == 64           # the owner's own tenant and salt still hit
    engine.check_integrity()


def test_eviction_under_memory_pressure_and_abort_keeps_computed_pages(ckpt):
    llm = make(ckpt, enable_prefix_caching=True, num_kv_pages=12, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("r0", BASE, GREEDY)
    engine.step()
    engine.step()                                             # 48 of 70 prompt tokens computed
    assert engine.abort("r0")
    assert len(engine.kv.allocator.cached) == 3                   # its 3 full, computed pages stay
    hit = llm.generate([BASE + [2]], GREEDY)[0]
    assert hit.num_cached_tokens == 48
    others = [[(11 * i + j) % 250 + 1 for i in range(150)] for j in range(3)]   # 10 pages each: evicts
    for out in llm.generate(others, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)):
        assert len(out.token_ids) == 20
    assert llm.generate([BASE + [2]], GREEDY)[0].num_cached_tokens == 0       # evicted
    assert_idle(llm)


def _drafting_run(model, base, prompts, lookahead=None, **options):
    """Greedy outputs of `prompts` after `base + [5]`, one at a time, and the MTP layer's logits of
    every drafting row."""
    from sparsekv.speculative import MTPDrafter
    llm = LLM(model, max_model_len=512, kv_page_size=PAGE, prefill_chunk_tokens=PAGE, max_num_batched_tokens=40,
              max_num_seqs=1, num_speculative_tokens=2, **options)
    if lookahead is not None:
        llm.engine.kv.prefix.lookahead = lookahead
    logits, real = [], MTPDrafter.forward

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out[0].shape[0]:
            logits.append(out[0].clone())
        return out
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    llm.generate([base + [5]], params)
    MTPDrafter.forward = spy
    try:
        outs = [llm.generate([p], params)[0] for p in prompts]
    finally:
        MTPDrafter.forward = real
    return outs, logits, llm


def test_speculative_decoding_hits_name_the_token_after_each_page():
    """The MTP layer's entry at a page's last position is made from the token after the page, so with
    drafting a page's name covers that token too: the drafts' MTP logits then equal those without
    the cache bit for bit. Named without it (lookahead 0), a prompt that diverges right at a page
    boundary reuses an entry made from another token, and the MTP logits move."""
    from sparsekv.paths import default_model_path
    model = default_model_path()
    tok = LLM(model, max_model_len=64).engine.tokenizer
    text = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 6
    base = tok.encode(text, add_special_tokens=False)[:8 * PAGE]     # ends at a page boundary
    prompts = [base + tok.encode(s, add_special_tokens=False) for s in ("x = 1\n", "def f(y):\n", "class A:\n")]
    want, want_logits, _ = _drafting_run(model, base, prompts, enable_prefix_caching=False)
    got, got_logits, llm = _drafting_run(model, base, prompts, enable_prefix_caching=True)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.metrics["spec_decode_num_accepted_tokens_per_pos"] == b.metrics["spec_decode_num_accepted_tokens_per_pos"]
    assert all(torch.equal(a, b) for a, b in zip(want_logits, got_logits, strict=True))
    assert [o.num_cached_tokens for o in got] == [7 * PAGE] * 3      # page 7's name includes token 128
    assert_idle(llm)
    unsafe, unsafe_logits, _ = _drafting_run(model, base, prompts, lookahead=0, enable_prefix_caching=True)
    assert [o.num_cached_tokens for o in unsafe] == [8 * PAGE] * 3
    assert max(float((a - b).abs().max()) for a, b in zip(want_logits, unsafe_logits, strict=True)) > 1e-3


def test_server_reports_cached_tokens_per_tenant_and_hits_by_tier(tmp_path):
    import openai

    from test_server_util import ThreadServer, scrape, scrape_labelled, scrape_samples, tiny_checkpoint
    model = tiny_checkpoint(tmp_path)
    prompt = "the rain in spain falls mainly on the plain " * 8
    with ThreadServer(model, api_keys=["sk-a:alice", "sk-b:bob"], enable_prefix_caching=True, metrics_api_keys=["sk-m"],
                      prefix_cache_max_pages_per_tenant=1, prefix_cache_host_bytes=1 << 26) as srv:
        def cached(key, **extra):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens
        assert cached("sk-a") == 0
        assert cached("sk-a") > 0                           # the same tenant's second request hits
        assert cached("sk-b") == 0                          # another tenant never does
        assert cached("sk-a", cache_salt="x") == 0          # nor another salt
        m = scrape(srv.url)
        assert m["sparsekv:prefix_cache_hits_total"] > 0
        by_tenant = scrape_labelled(srv.url, "tenant", "sk-m")  # the operator's view: who is served and holds what
        hits = by_tenant["sparsekv:prefix_cache_tenant_hits_total"]
        assert hits["alice"] > 0 and hits["bob"] == 0
        queries = by_tenant["sparsekv:prefix_cache_tenant_queries_total"]
        assert queries["alice"] == 3 * queries["bob"] > 0
        samples = scrape_samples(srv.url, "sk-m")
        pages = {(s.labels["tenant"], s.labels["tier"]): s.value for s in samples
                 if s.name == "sparsekv:prefix_cache_tenant_cached_pages"}
        first_tokens = {s.labels["tenant"]: s.value for s in samples  # latency by tenant, one per request
                        if s.name == "sparsekv:tenant_time_to_first_token_seconds_count"}
        assert first_tokens == {"alice": 3, "bob": 1}
        assert pages[("alice", "device")] == pages[("bob", "device")] == 1  # the quota; the rest went to host
        assert pages[("alice", "host")] > 0 and pages[("bob", "host")] > 0
        srv.engine.check_integrity()


@pytest.mark.parametrize("tiering", [[], ["--kv-tiering"]], ids=["device", "tiered"])
def test_bench_prefix_computes_only_the_suffix_and_matches_no_cache(tmp_path, capsys, tiering):
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "prefix.json"
    assert main(["prefix", "--requests", "3", "--prefix-tokens", "256", "--suffix-tokens", "16", "--chunk", "128",
                 "--json", str(out)] + tiering) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert result["kv_tiering"] == bool(tiering) and set(summary) == {"no cache", "prefix cache"}
    assert all(s["identical"] == 3 for s in summary.values())
    assert summary["no cache"]["computed_tokens"] == 272
    assert summary["prefix cache"]["computed_tokens"] == 16       # 256 tokens = 4 cached pages
    assert summary["prefix cache"]["hit_rate"] == pytest.approx(2 * 256 / (3 * 272))
    assert "greedy identical" in capsys.readouterr().out


def test_bench_prefix_rotation_is_served_by_the_host_and_disk_tiers(tmp_path):
    """Two prefixes in turn through a pool that holds one: each request's prefix was evicted by the
    previous one. The pool keeps the head page (a request's pages are released last page first, so
    its tail is evicted first); the host tier, or the disk tier, serves the rest. --restart: a fresh
    engine on a disk tier an earlier engine filled serves even its first requests from disk."""
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "prefix.json"
    assert main(["prefix", "--requests", "4", "--prefix-tokens", "256", "--suffix-tokens", "16", "--chunk", "128",
                 "--rotate", "2", "--restart", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert all(s["identical"] == 4 for s in summary.values())
    assert summary["prefix cache"]["computed_tokens"] == 272 - 64
    assert summary["prefix cache + host tier"]["computed_tokens"] == 16
    assert summary["prefix cache + host tier"]["hit_tokens_host"] == 2 * 192
    assert summary["prefix cache + disk tier"]["computed_tokens"] == 16
    assert summary["prefix cache + disk tier"]["hit_tokens_disk"] == 2 * 192
    restarted = summary["disk tier, after a restart"]  # its first sightings are read from disk
    assert restarted["computed_tokens"] == 16 and restarted["hit_tokens_disk"] >= 2 * 256


# -- the host tier ------------------------------------------------------------------------------------
OTHERS = [[(11 * i + j) % 250 + 1 for i in range(150)] for j in range(2)]   # 10 pages each: evict BASE's


def _evict_then_hit(llm, prompts):
    """Run BASE, evict its pages with other prompts, then `prompts` (which start with BASE)."""
    llm.generate([BASE + [3]], GREEDY)
    for prompt in OTHERS:
        llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    return [llm.generate([p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=8, host_kv_budget_bytes=12 * PAGE * 640),
                                     dict(selector="quest")], ids=["device", "tiered", "quest"])
def test_evicted_pages_come_back_from_the_host_tier_exactly(ckpt, options, emulated_cuda):
    """Evicted pages are copied to host memory and back on a hit: the same bytes, so outputs equal no
    cache bit for bit (prefill chunks of one page). Under CUDA's emulated copy ordering, so a host
    copy read before the tier link's pending backups land would show."""
    small = dict(num_kv_pages=12, max_num_seqs=1, prefill_chunk_tokens=PAGE, **options)
    if options.get("kv_tiering"):
        small.pop("num_kv_pages")  # the tiered pool sizes its pages from the host budget (12 pages here)
    reference = make(ckpt, **small)
    want = [reference.generate([p], GREEDY)[0] for p in PROMPTS[:3]]
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, **small)
    assert llm.engine.kv.allocator.num_pages == 12
    got = _evict_then_hit(llm, PROMPTS[:3])
    assert_close(want, got, bitwise=True)
    assert [o.num_cached_tokens for o in got] == [64, 32, 64]
    for out in got:  # each output splits its cached tokens by tier
        assert out.metrics["prefix_cached_tokens_device"] + out.metrics["prefix_cached_tokens_host"] == out.num_cached_tokens
    stats = llm.stats()
    assert stats["prefix_cache_hits_host"] == sum(o.metrics["prefix_cached_tokens_host"] for o in got) >= 64
    assert stats["prefix_host_pages"] > 0
    assert_idle(llm)


def test_the_tiered_pool_lands_its_backups_before_a_prefix_tier_copies_rows(ckpt, emulated_cuda, monkeypatch):
    """With kv_tiering a page's latents are host-store rows, and under CUDA's ordering (emulated) a
    step's backups land in the store only at the link's next flush. The prefix cache must flush
    (`before_copy`) before it copies a page out to the host tier (an eviction) and before it copies
    a host copy back into a pool page (a restore): else it saves rows not yet written, or a pending
    backup of the page's previous owner lands over the restored rows. The order of flushes and
    copies is recorded: every copy sees no backup pending, and both kinds of copy happen right
    after a flush that had backups to land (so the flush was needed, not just harmless)."""
    from sparsekv.cache.host_store import HostLink
    from sparsekv.cache.prefix_host import PageRows
    log, links = [], []
    real_flush, real_out, real_in = HostLink.flush, PageRows.copy_out, PageRows.copy_in

    def flush(self):
        log.append(("flush", len(self._pending)))
        real_flush(self)

    def copy_out(self, page):
        log.append(("copy_out", len(links[0]._pending)))
        return real_out(self, page)

    def copy_in(self, pages, saved):
        log.append(("copy_in", len(links[0]._pending)))
        return real_in(self, pages, saved)
    monkeypatch.setattr(HostLink, "flush", flush)
    monkeypatch.setattr(PageRows, "copy_out", copy_out)
    monkeypatch.setattr(PageRows, "copy_in", copy_in)
    engine = make(ckpt, kv_tiering=True, device_buffer_tokens=8, host_kv_budget_bytes=40 * PAGE * 640, max_num_seqs=2,
                  prefill_chunk_tokens=PAGE, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24,
                  prefix_cache_max_pages_per_tenant=0).engine  # released pages go straight to the host tier
    links.append(engine.kv.pool.link)
    engine.add_request("first", BASE + [3], GREEDY)
    while engine.has_unfinished_requests():  # its pages are evicted as its last step ends
        engine.step()
    other = engine.add_request("other", OTHERS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while len(other.output_token_ids) < 3:  # decoding: a decode step leaves its backups pending
        engine.step()
    engine.add_request("hit", PROMPTS[0], GREEDY)  # restored from the host tier while "other"'s are pending
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["hit"].metrics["prefix_cached_tokens_host"] == outs["hit"].num_cached_tokens == 64
    copies = [(i, kind, pending) for i, (kind, pending) in enumerate(log) if kind != "flush"]
    assert {kind for _, kind, _ in copies} == {"copy_out", "copy_in"}
    assert [c for c in copies if c[2]] == []  # (log index, kind, backups pending): a copy before its flush
    for kind in ("copy_out", "copy_in"):  # a flush with backups to land came right before a copy of each kind
        assert any(log[i - 1][0] == "flush" and log[i - 1][1] > 0 for i, k, _ in copies if k == kind), kind
    engine.check_integrity()


def test_the_host_tier_keeps_its_budget_and_a_broken_chain_stops_hits(ckpt):
    page_bytes = make(ckpt, num_kv_pages=12, enable_prefix_caching=True,
                      prefix_cache_host_bytes=1 << 24).engine.kv.prefix.tiers["host"].page_bytes
    llm = make(ckpt, enable_prefix_caching=True, num_kv_pages=12, max_num_seqs=1, prefix_cache_host_bytes=3 * page_bytes)
    out = _evict_then_hit(llm, [BASE + [9]])[0]
    host = llm.engine.kv.prefix.tiers["host"]
    assert host.num_pages <= 3 and host.dropped > 0
    assert out.num_cached_tokens == 0          # BASE's page 0 copy was pushed out: the chain starts nowhere
    assert_idle(llm)
    with pytest.raises(ConfigError, match="prefix_cache_host_bytes"):
        make(ckpt, enable_prefix_caching=False, prefix_cache_host_bytes=1 << 20)


@pytest.mark.parametrize("first, second", [(("alice", None), ("bob", None)), (("alice", "s1"), ("alice", "s2")),
                                           (("alice", "s1"), ("alice", None))])
def test_the_host_tier_never_serves_another_tenants_or_salts_page(ckpt, first, second):
    """With a quota of 0 cached pool pages per tenant, every released page goes straight to the host
    tier, so lookups can only find the owner's pages there: a request of another tenant or salt gets
    no host hit, while the owner's next request is served from those copies."""
    engine = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24,
                  prefix_cache_max_pages_per_tenant=0).engine

    def run(rid, tenant, salt):
        return _finish_one(engine, rid, tenant, salt)
    run("a", *first)
    stats = engine.stats()
    assert stats["prefix_cached_pages"] == 0 and stats["prefix_host_pages"] == 5  # the owner's pages: host only
    other = run("b", *second)
    assert other.num_cached_tokens == 0 and engine.stats()["prefix_cache_hits_host"] == 0
    own = run("c", *first)
    assert own.metrics["prefix_cached_tokens_host"] == own.num_cached_tokens == 64
    engine.check_integrity()


def test_lookup_stops_at_a_pool_page_after_host_copies():
    """Pages evicted out of chain order: page 0 in the host store, page 1 still in the pool. The hit is
    page 0 from the host only; page 1 is computed (restoring a second copy of a named page would name
    two pages alike)."""
    from sparsekv.cache.prefix import PrefixHit

    class Host:
        def __init__(self):
            self.names = set()

        def has(self, name):
            return name in self.names

        def save(self, name, page, tenant):
            self.names.add(name)

    a = PageAllocator(8, PAGE)
    cache = PrefixCache(a, tiers={"host": Host()})
    owner = _request("a", BASE)
    owner.page_ids, owner.num_computed_tokens = a.allocate("a", 5), 70
    cache.register(owner)
    cache.forget_request("a")
    a.free("a", owner.page_ids)
    second = cache._name_of[owner.page_ids[1]]
    cache.tiers["host"].names.add(second)                              # page 1 also has a host copy (saved, restored)
    cache._forget_page(owner.page_ids[0])                     # as an eviction of page 0 would
    a.cached.drop([owner.page_ids[0]])
    hit = cache.lookup(_request("b", BASE))
    assert hit == PrefixHit([], [cache._chains["b"][0]]) and cache._chains["b"][1] == second


def test_a_lower_tier_copy_that_does_not_come_back_leaves_it_and_every_later_page_to_compute(monkeypatch):
    """A restore stops at the first copy that does not come back (a disk file that fails to read, a copy
    pushed out meanwhile): the pages before it hold their rows, and that page and every later one are
    computed, even where a later copy is still there (the request computes from its first uncached
    position on)."""
    from sparsekv.cache.prefix_host import PageRows, PrefixHostStore
    a = PageAllocator(8, PAGE)
    pool = torch.zeros(8 * PAGE, 2)
    rows = PageRows([(pool, 1)], PAGE)
    cache = PrefixCache(a, tiers={"host": PrefixHostStore(rows, 8 * rows.page_bytes)}, rows=rows)
    prompt = BASE[:3 * PAGE + 1]                                       # 3 cacheable pages
    names = cache.prompt_names(prompt, "default", None)
    assert cache.import_pages([(n, [torch.full((PAGE, 2), i + 1.0)]) for i, n in enumerate(names)], "default", [names]) == 3
    host = cache.tiers["host"]
    take = host.take
    monkeypatch.setattr(host, "take", lambda name: None if name == names[1] else take(name))
    req = _request("r", prompt)
    hit = cache.lookup(req)
    assert hit.lower_names == names
    assert a.share_and_reserve("r", hit.pages, a.pages_for(len(prompt) + 4))
    taken = cache.take(req, hit)
    assert (taken.num_pages, taken.tiers, taken.restored_page_ids) == (1, ["host"], taken.page_ids[:1])
    first = taken.page_ids[0]
    assert torch.equal(pool[first * PAGE:(first + 1) * PAGE], torch.full((PAGE, 2), 1.0))
    assert cache._page_of == {names[0]: first}                         # no page named for rows it does not hold
    assert cache.hit_tokens == {"device": 0, "host": PAGE, "disk": 0}  # counted as served: the page that came back
    assert cache.by_tenant == {"default": {"queries": len(prompt), "hits": PAGE}}
    assert cache.stats()["prefix_cache_hit_rate"] == PAGE / len(prompt)  # lower-tier hits are hits too
    cache.forget_request("r")
    a.free("r", taken.page_ids)
    cache.check_integrity(set())


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=8),
                                     dict(kv_tiering=True, device_buffer_tokens=8, tenant_kv_share=0.5,
                                          prefix_cache_tenant_share=0.5, prefix_cache_max_pages_per_tenant=2,
                                          disk=True),
                                     dict(kv_tiering=True, device_buffer_tokens=8, kv_admission="optimistic",
                                          num_kv_pages=10, tenant_kv_share=0.5)],
                         ids=["device", "tiered", "tiered, tenant shares, disk tier",
                              "tiered, optimistic admission, guaranteed shares"])
def test_random_traffic_with_aborts_keeps_every_pool_consistent(ckpt, options, tmp_path):
    """Requests from three tenants over a few shared prefixes, a small pool with the host tier (and a
    disk tier, and tenant shares of the KV cache and of every prefix tier), random aborts while
    prefilling and decoding: integrity after every step, every page back at the end, and each
    finished request's tokens equal to running it alone without the cache."""
    import random
    rng = random.Random(0)
    heads = [[(5 * i + j) % 250 + 1 for i in range(40)] for j in range(3)]
    options = dict(options)
    cache_options = {k: options.pop(k) for k in list(options) if k.startswith("prefix_cache")}
    host_bytes = 1 << 22
    if options.pop("disk", False):  # a host tier of 6 pages: the rest goes on to disk
        cache_options.update(prefix_cache_disk_path=str(tmp_path), prefix_cache_disk_bytes=1 << 22)
        host_bytes = 6 * make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 22).engine.kv.prefix.tiers["host"].page_bytes
    engine = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=host_bytes,
                  max_num_seqs=3, **{"num_kv_pages": 24, **options}, **cache_options).engine
    reference = make(ckpt, **options)
    prompts, finished, step = {}, {}, 0
    for i in range(18):
        prompt = rng.choice(heads)[:rng.randrange(17, 41)] + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 9))]
        rid = f"r{i}"
        prompts[rid] = prompt
        engine.add_request(rid, prompt, GREEDY, tenant=rng.choice(["a", "b", "c"]))
        for _ in range(rng.randrange(1, 4)):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
            engine.check_integrity()
            step += 1
        if rng.random() < 0.3:
            victim = rng.choice([r.request_id for r in engine.scheduler.running + list(engine.scheduler.waiting)] or [rid])
            engine.abort(victim)
            engine.check_integrity()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_pages and engine.kv.allocator.num_reserved_unallocated == 0
    assert len(finished) >= 8 and sum(o.num_cached_tokens for o in finished.values()) > 0
    stats = engine.stats()
    assert stats["prefix_cache_hits_device"] > 0 and stats["prefix_cache_hits_host"] > 0  # both tiers served
    if "prefix_cache_disk_path" in cache_options:
        assert stats["prefix_cache_hits_disk"] > 0  # all three tiers served
    assert (stats["preemptions"] > 0) == (options.get("kv_admission") == "optimistic")
    tol = logprob_tolerance(reference)  # batches, hits and recomputation group rows differently
    for rid, out in finished.items():
        assert_same_greedy(reference.generate([prompts[rid]], GREEDY), [out], tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
def test_prefix_cache_with_tiering_and_host_tier_is_exact_on_cuda(ckpt):
    options = dict(device="cuda", kv_tiering=True, device_buffer_tokens=8, num_kv_pages=12, max_num_seqs=1,
                   prefill_chunk_tokens=PAGE)
    want = [make(ckpt, **options).generate([p], GREEDY)[0] for p in PROMPTS[:3]]
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, **options)
    got = _evict_then_hit(llm, PROMPTS[:3])
    assert [a.token_ids for a in want] == [b.token_ids for b in got]
    assert_close(want, got, bitwise=False, tol=logprob_tolerance(llm))
    assert llm.stats()["prefix_cache_hits_host"] > 0
    assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py --tiers runs it)")
def test_optimistic_admission_with_tiering_is_exact_on_cuda(ckpt):
    """Preemption on the device: requests on a 12-page pool (one preemption on a CPU), admitted optimistically
    on the tiered cache with a host tier, preempted and recomputed; tokens equal to one at a time."""
    options = dict(device="cuda", kv_tiering=True, device_buffer_tokens=8, max_num_seqs=4, num_kv_pages=12)
    want = [make(ckpt, **options).generate([p], GREEDY)[0] for p in PROMPTS]
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, kv_admission="optimistic", **options)
    got = llm.generate(PROMPTS, GREEDY)
    assert [a.token_ids for a in want] == [b.token_ids for b in got]
    assert_close(want, got, bitwise=False, tol=logprob_tolerance(llm))
    assert llm.stats()["preemptions"] > 0
    assert_idle(llm)


def test_a_request_waits_for_a_running_request_computing_its_prefix(ckpt):
    """Two requests with one long prefix arrive together: the second waits while the first computes the
    shared pages, then hits them (instead of computing them twice); an unrelated request behind it goes
    ahead; aborting the first lets the second in at once."""
    engine = make(ckpt, enable_prefix_caching=True, prefill_chunk_tokens=PAGE, max_num_batched_tokens=40).engine
    other = [(3 * i) % 200 + 7 for i in range(30)]
    for rid, prompt in (("first", BASE + [1]), ("second", BASE + [2]), ("other", other)):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"first", "other"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["second"]
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert outs["second"].num_cached_tokens == 64 and outs["first"].num_cached_tokens == 0
    reference = make(ckpt, prefill_chunk_tokens=PAGE, max_num_batched_tokens=40)
    assert outs["second"].token_ids == reference.generate([BASE + [2]], GREEDY)[0].token_ids

    engine.add_request("a", [9] + BASE, GREEDY)
    engine.add_request("b", [9] + BASE + [5], GREEDY)
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]
    engine.abort("a")
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["b"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert not engine.kv.prefix._inflight


def test_a_preempted_request_is_looked_up_once_as_its_prompt(ckpt):
    """Queries and hits count each prompt once: the lookup of a preempted request coming back (which
    finds its own pages, output tokens included) is no new query; it is counted apart, as in vLLM."""
    prompts = [[(31 * i + 7 * j) % 200 + 20 for j in range(30 + 5 * i)] for i in range(3)]  # no shared page
    llm = make(ckpt, enable_prefix_caching=True, kv_admission="optimistic", num_kv_pages=6)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    assert stats["preemptions"] > 0  # what makes this test one
    assert stats["prefix_cache_queries"] == sum(map(len, prompts))
    assert stats["prefix_cache_hits_device"] == 0 and stats["prefix_cache_by_tenant"]["default"]["hits"] == 0
    assert stats["prefix_cache_preempted_queries"] > 0  # counted apart: its own pages, output tokens included
    assert_idle(llm)


def test_a_preempted_request_reports_the_host_tier_tokens_of_its_first_admission(ckpt):
    """prefix_cached_tokens_host is what the host tier served the prompt when the request was first
    admitted, as num_cached_tokens is: b hits BASE's 4 pages in the host tier, is preempted (optimistic
    admission, a 10-page pool it shares with a) and recomputed from what the cache kept of its own
    pages, yet its metrics still say 64 host tokens, the device's share 0."""
    llm = make(ckpt, enable_prefix_caching=True, prefix_cache_host_bytes=1 << 24, kv_admission="optimistic",
               prefix_cache_max_pages_per_tenant=0, num_kv_pages=10)  # released pages go straight to the host tier
    llm.generate([BASE + [3]], GREEDY)
    engine, outs = llm.engine, {}
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [(5 * i) % 200 + 3 for i in range(30)], SamplingParams(max_tokens=80, temperature=0.0,
                                                                                     ignore_eos=True))
    engine.step()
    engine.add_request("b", BASE + [5, 6, 7], long)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    b = outs["b"]
    assert b.metrics["num_preemptions"] >= 1  # what makes this test one
    assert b.num_cached_tokens == b.metrics["prefix_cached_tokens_host"] == 64
    assert b.metrics["prefix_cached_tokens_device"] == 0
    assert_idle(llm)
