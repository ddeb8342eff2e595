"""Imported pages landing in the pool (`PrefixCache(land_in_pool=True)`, the tiered decode side of
prefill/decode disaggregation): the rows are written once, into pool pages named and cached like pages
a request computed, and no host-tier copy is kept; the prompt's pages the cache already held join them
in the pool so that a lookup runs from page 0 through the pool; no room: the host tier, as untiered;
a refused import changes nothing. Small tensors, no model."""
from __future__ import annotations

import pytest
import torch

from sparsekv import SamplingParams
from sparsekv.cache.pages import PageAllocator
from sparsekv.cache.prefix import PrefixCache
from sparsekv.cache.prefix_host import PageRows, PrefixHostStore
from sparsekv.request import Request

PAGE = 4
PROMPT = list(range(1, 23))  # 5 full pages, then the page holding the last token


def _cache(num_pages: int = 8, host_pages: int = 16, ttl_s: float | None = None):
    """(cache, its pool tensor, allocator): one slot-indexed tensor of 2 values per token."""
    allocator = PageAllocator(num_pages, PAGE)
    pool = torch.zeros(num_pages * PAGE, 2)
    rows = PageRows([(pool, 1)], PAGE)
    host = PrefixHostStore(rows, host_pages * rows.page_bytes)
    return PrefixCache(allocator, tiers={"host": host}, rows=rows, land_in_pool=True, ttl_s=ttl_s), pool, allocator


def _exported(cache: PrefixCache, prompt=PROMPT, first: int = 0) -> list:
    """(name, rows) of the prompt's pages from `first` on, as another engine exports them: page i's
    rows all hold i + 1."""
    names = cache.prompt_names(prompt, "default", None)
    return [(name, [torch.full((PAGE, 2), float(i + 1))]) for i, name in enumerate(names)][first:]


def _hit(cache: PrefixCache, rid: str = "r"):
    return cache.lookup(Request(rid, PROMPT, SamplingParams(max_tokens=1)))


def _chains(cache: PrefixCache, prompt=PROMPT):
    return [cache.prompt_names(prompt, "default", None)]


def _check(cache: PrefixCache, allocator: PageAllocator) -> None:
    allocator.check_integrity()
    cache.check_integrity(set())


def test_imported_pages_land_once_in_the_pool():
    cache, pool, allocator = _cache()
    assert cache.import_pages(_exported(cache), "default", _chains(cache)) == 5
    hit = _hit(cache)
    assert len(hit.pages) == 5 and not hit.lower_names  # a pool hit: nothing copied back at admission
    assert cache.tiers["host"].num_pages == 0            # and no host-tier copy held beside the pool's
    assert len(allocator.cached) == 5 and allocator.num_free == allocator.num_pages
    for i, page in enumerate(hit.pages):
        assert torch.equal(pool[page * PAGE:(page + 1) * PAGE], torch.full((PAGE, 2), float(i + 1)))
    cache.forget_request("r")
    _check(cache, allocator)


def test_a_hit_on_landed_pages_names_them_for_every_rank():
    """Only this rank's pool was written: the hit lists them with the restored pages (mirrored to
    every tensor-parallel rank at the step), once."""
    cache, _, allocator = _cache()
    cache.import_pages(_exported(cache), "default", _chains(cache))
    for rid, mirrored in (("a", 5), ("b", 0)):
        req = Request(rid, PROMPT, SamplingParams(max_tokens=1))
        hit = cache.lookup(req)
        assert allocator.share_and_reserve(rid, hit.pages, 1)
        assert len(cache.take(req, hit).restored_page_ids) == mirrored
    for rid in ("a", "b"):
        cache.forget_request(rid)
        allocator.free(rid, hit.pages)
    _check(cache, allocator)


def test_held_pages_in_the_host_tier_join_the_imported_ones():
    """The decode side held pages 0-1 in its host tier (so they were not sent): they land in the pool
    with pages 2-4, and the hit runs from page 0 through the pool."""
    cache, _, allocator = _cache()
    for name, rows in _exported(cache)[:2]:
        cache.tiers["host"].put(name, rows, "default")
    assert cache.held(PROMPT, "default", None) == 2
    cache.import_pages(_exported(cache, first=2), "default", _chains(cache))
    hit = _hit(cache)
    assert len(hit.pages) == 5 and not hit.lower_names
    cache.forget_request("r")
    _check(cache, allocator)


def test_held_pool_pages_are_not_evicted_by_the_landing():
    """Pages 0-1 are the oldest cached pool pages and every other page is cached too: the landing's
    allocations evict other pages, not these, and the landed tail is released before them (an eviction
    takes a chain's last pages first)."""
    cache, _, allocator = _cache(num_pages=7)
    cache.import_pages(_exported(cache)[:2], "default", [])
    other = [list(range(100, 123))]
    cache.import_pages(_exported(cache, other[0])[:5], "default", [cache.prompt_names(other[0], "default", None)])
    assert allocator.num_free == 7 and len(allocator.cached) == 7
    cache.import_pages(_exported(cache, first=2), "default", _chains(cache))
    hit = _hit(cache)
    assert len(hit.pages) == 5 and not hit.lower_names
    assert cache.tiers["host"].num_pages == 3  # the other prompt's evicted pages, saved there
    cache.forget_request("r")
    taken = allocator.allocate("x", 3)  # the other prompt's last two cached pages, then this chain's tail
    hit = _hit(cache)
    assert len(hit.pages) == 4 and len(hit.lower_names) == 1
    cache.forget_request("r")
    allocator.free("x", taken)
    _check(cache, allocator)


def test_without_room_in_the_pool_the_pages_go_to_the_host_tier():
    cache, _, allocator = _cache(num_pages=6)
    held = allocator.allocate("running", 4)
    cache.import_pages(_exported(cache), "default", _chains(cache))
    assert cache.tiers["host"].num_pages == 5 and len(allocator.cached) == 0
    hit = _hit(cache)
    assert not hit.pages and len(hit.lower_names) == 5
    cache.forget_request("r")
    allocator.free("running", held)
    _check(cache, allocator)


@pytest.mark.parametrize("bad", ["shape", "name", "dtype"])
def test_a_refused_import_keeps_nothing(bad):
    cache, pool, allocator = _cache()
    pages = _exported(cache)
    name, rows = pages[3]
    pages[3] = {"shape": (name, [rows[0][:, :1]]), "name": (name.hex(), rows),
                "dtype": (name, [rows[0].to(torch.float64)])}[bad]
    with pytest.raises(ValueError, match="page 3"):
        cache.import_pages(pages, "default", _chains(cache))
    assert cache.tiers["host"].num_pages == 0 and len(allocator.cached) == 0
    assert not _hit(cache).pages and not pool.any()
    cache.forget_request("r")
    _check(cache, allocator)


def test_a_copy_that_fails_frees_its_pages():
    cache, _, allocator = _cache()

    def broken(pages, saved):
        raise RuntimeError("copy failed")
    cache.rows.copy_in = broken
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.import_pages(_exported(cache), "default", _chains(cache))
    assert len(allocator.cached) == 0 and allocator.num_free == allocator.num_pages
    assert cache.tiers["host"].num_pages == 0
    _check(cache, allocator)


def test_a_copy_that_fails_lets_go_of_the_held_pool_pages_too():
    """The prompt's first pages already in the pool (held while the rest are allocated) and the copy of
    the imported rows failing: the held pages are released with the new ones, still cached and named,
    so a hit finds them and every page of the pool can be taken again."""
    cache, _, allocator = _cache()
    cache.import_pages(_exported(cache)[:2], "default", [])
    held = [cache._page_of[name] for name, _ in _exported(cache)[:2]]

    def broken(pages, saved):
        raise RuntimeError("copy failed")
    cache.rows.copy_in = broken
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.import_pages(_exported(cache, first=2), "default", _chains(cache))
    assert [allocator.num_owners(page) for page in held] == [0, 0]
    hit = _hit(cache)
    assert hit.pages == held and len(allocator.cached) == 2
    cache.forget_request("r")
    _check(cache, allocator)
    taken = allocator.allocate("x", allocator.num_pages)  # none is left owned by the failed import
    allocator.free("x", taken)


@pytest.mark.parametrize("room", ["pool", "host"])
def test_forgetting_an_import_drops_its_pages_in_every_tier_but_those_a_request_holds(room):
    """An import undone (a data-parallel rank's, when another rank refused the same pages): the pages
    landed in the pool, or in the host tier when the pool had no room, are forgotten; a pool page a
    request holds stays named, and its host copy goes."""
    cache, _, allocator = _cache(num_pages=8 if room == "pool" else 6)
    held = allocator.allocate("running", 4) if room == "host" else []
    other = list(range(100, 123))
    cache.import_pages(_exported(cache, other)[:2], "default", [])  # another prompt's pages stay
    pages = _exported(cache)
    cache.import_pages(pages, "default", _chains(cache))
    assert cache.held(PROMPT, "default", None) == 5
    names = [name for name, _ in pages]
    assert cache.forget(names) == 5
    assert cache.held(PROMPT, "default", None) == 0 and cache.held(other, "default", None) == 2
    assert cache.forget(names) == 0
    _check(cache, allocator)
    allocator.free("running", held)
    cache.import_pages(pages, "default", _chains(cache))
    req = Request("r", PROMPT, SamplingParams(max_tokens=1))
    hit = cache.lookup(req)
    assert allocator.share_and_reserve("r", hit.pages, 1) and len(hit.pages) == 5
    cache.take(req, hit)
    assert cache.forget(names) == 0  # the request holds every page: all stay
    assert cache.held(PROMPT, "default", None) == 5
    cache.forget_request("r")
    allocator.free("r", hit.pages)
    _check(cache, allocator)


def _admit(cache: PrefixCache, allocator: PageAllocator, rid: str, first_token: bool = True, **params):
    """Admit a request for PROMPT; `first_token`: with its first token sampled elsewhere (a tail's user)."""
    req = Request(rid, PROMPT, SamplingParams(max_tokens=2, **params), output_token_ids=[7] if first_token else [])
    hit = cache.lookup(req)
    assert allocator.share_and_reserve(rid, hit.pages, allocator.pages_for(len(PROMPT) + 2) - len(hit.pages))
    return cache.take(req, hit)


def test_an_imported_tail_fills_the_last_tokens_page_for_the_first_request_admitted():
    """A prompt's tail (here the 2 rows of page 5 through the last token) is written into a page of the
    first admitted request's reservation, after the hit's pages, listed with the restored pages (every
    rank copies it); the next request for the prompt computes the page."""
    cache, pool, allocator = _cache()
    tail = [torch.full((2, 2), 9.0)]
    cache.keep_tails(cache.padded_tails([(cache.tail_name(PROMPT, "default", None), tail, len(PROMPT))]))
    cache.import_pages(_exported(cache), "default", _chains(cache))
    taken = _admit(cache, allocator, "a")
    assert (taken.num_pages, taken.num_tail_tokens, len(taken.page_ids)) == (5, 2, 6)
    page = taken.page_ids[5]
    assert page in taken.restored_page_ids and torch.equal(pool[page * PAGE:page * PAGE + 2], torch.full((2, 2), 9.0))
    again = _admit(cache, allocator, "b")
    assert again.num_tail_tokens == 0 and len(again.page_ids) == 5
    for rid, pages in (("a", taken.page_ids), ("b", again.page_ids)):
        cache.forget_request(rid)
        allocator.free(rid, pages)
    _check(cache, allocator)
    # a prompt of two choices: each takes the rows into a page of its own, a third computes the page
    cache.keep_tails(cache.padded_tails([(cache.tail_name(PROMPT, "default", None), tail, len(PROMPT))]), uses=2)
    taken = [_admit(cache, allocator, rid) for rid in ("c", "d", "e")]
    assert [t.num_tail_tokens for t in taken] == [2, 2, 0] and taken[0].page_ids[5] != taken[1].page_ids[5]
    assert all(torch.equal(pool[t.page_ids[5] * PAGE:t.page_ids[5] * PAGE + 2], tail[0]) for t in taken[:2])
    for rid, t in zip(("c", "d", "e"), taken):
        cache.forget_request(rid)
        allocator.free(rid, t.page_ids)
    _check(cache, allocator)
    with pytest.raises(ValueError, match="at least one use"):
        cache.keep_tails([], uses=0)
    for rows, length in ((3, len(PROMPT)), (PAGE, len(PROMPT)), (2, 4 * PAGE)):  # not the prompt's last page
        with pytest.raises(ValueError, match="tail 0"):
            cache.padded_tails([(b"x", [torch.zeros(rows, 2)], length)])
    for rows in (PAGE, PAGE - 1):  # a whole last page; a short tail, through the token before the last
        assert [count for _, _, count in cache.padded_tails([(b"x", [torch.zeros(rows, 2)], 4 * PAGE)])] == [rows]


def test_resetting_one_tenant_drops_its_tails_only():
    """A tenant's reset_prefix_cache drops its own imported tails; another tenant's waiting for their
    requests stay (every tenant's went, and their requests each computed a page again)."""
    cache, _, _ = _cache()
    tail = [torch.full((2, 2), 9.0)]
    for tenant in ("alice", "bob"):
        cache.keep_tails(cache.padded_tails([(cache.tail_name(PROMPT, tenant, None), tail, len(PROMPT))]), tenant=tenant)
    cache.reset("alice")
    assert [kept[3] for kept in cache._tails.values()] == ["bob"]
    cache.reset()
    assert not cache._tails


def test_an_imported_tail_unused_for_the_ttl_is_forgotten():
    """With a TTL (`prefix_cache_ttl_s`), `expire` forgets a tail no request has used for that long, as
    it forgets pages: a tail holds rows of a tenant's prompt, which the retention bound says are gone
    within the TTL of their last use, and one whose request was aborted before admission is never
    taken. A tail kept again (another transfer of its prompt) or taken by a request is used then."""
    now = [0.0]
    cache, _, allocator = _cache(ttl_s=10)
    cache.set_clock(lambda: now[0])
    tail = [torch.full((2, 2), 9.0)]
    unused, kept_again, taken = (cache.tail_name(PROMPT, tenant, None) for tenant in ("a", "b", "default"))
    cache.keep_tails(cache.padded_tails([(key, tail, len(PROMPT)) for key in (unused, kept_again)]))
    cache.keep_tails(cache.padded_tails([(taken, tail, len(PROMPT))]), uses=2)
    cache.import_pages(_exported(cache), "default", _chains(cache))
    now[0] = 8.0
    cache.keep_tails(cache.padded_tails([(kept_again, tail, len(PROMPT))]))
    assert _admit(cache, allocator, "r").num_tail_tokens == 2
    now[0] = 11.0
    cache.expire()
    assert set(cache._tails) == {kept_again, taken}
    now[0] = 19.0
    cache.expire()
    assert not cache._tails

def test_the_same_prompts_tail_from_two_transfers_serves_both_requests():
    """Two requests of one prompt transferred at once: the second import's tail adds its use to the
    first's (it replaced it, and one of the two requests recomputed the last page)."""
    cache, pool, allocator = _cache()
    key, tail = cache.tail_name(PROMPT, "default", None), [torch.full((2, 2), 9.0)]
    for _ in range(2):
        cache.keep_tails(cache.padded_tails([(key, tail, len(PROMPT))]))
        cache.import_pages(_exported(cache), "default", _chains(cache))
    taken = [_admit(cache, allocator, rid) for rid in ("a", "b", "c")]
    assert [t.num_tail_tokens for t in taken] == [2, 2, 0] and key not in cache._tails


def test_a_short_tail_serves_a_request_without_a_first_token():
    """A short tail (the last page's rows before the last token) is taken by a request that samples its
    first token here: it computes the last token alone. A request given its first token leaves it."""
    cache, pool, allocator = _cache()
    key = cache.tail_name(PROMPT, "default", None)
    cache.keep_tails(cache.padded_tails([(key, [torch.full((1, 2), 5.0)], len(PROMPT))]))
    cache.import_pages(_exported(cache), "default", _chains(cache))
    assert _admit(cache, allocator, "a", first_token=True).num_tail_tokens == 0 and key in cache._tails
    taken = _admit(cache, allocator, "b", first_token=False)
    assert (taken.num_pages, taken.num_tail_tokens) == (5, 1) and key not in cache._tails
    assert torch.equal(pool[taken.page_ids[5] * PAGE:taken.page_ids[5] * PAGE + 1], torch.full((1, 2), 5.0))


def test_a_request_that_cannot_use_its_tail_takes_it_and_the_tails_kept_are_bounded():
    from sparsekv.cache.prefix_transfer import MAX_TAILS
    cache, _, allocator = _cache()
    key = cache.tail_name(PROMPT, "default", None)
    cache.keep_tails(cache.padded_tails([(key, [torch.ones(2, 2)], len(PROMPT))]))
    cache.import_pages(_exported(cache), "default", _chains(cache))
    # a request that samples its first token computes the last page: it leaves the tail to one that does not
    assert _admit(cache, allocator, "z", first_token=False).num_tail_tokens == 0 and key in cache._tails
    assert _admit(cache, allocator, "a", prompt_logprobs=1).num_tail_tokens == 0  # every prompt row is computed
    assert _admit(cache, allocator, "b").num_tail_tokens == 0  # taken by the first
    cache.keep_tails(cache.padded_tails([(bytes([i]) * 32, [torch.ones(2, 2)], len(PROMPT))
                                         for i in range(MAX_TAILS + 1)]))
    assert len(cache._tails) == MAX_TAILS and bytes([0]) * 32 not in cache._tails
    cache.reset()
    assert not cache._tails


def test_a_tail_kept_again_is_the_newest_when_the_oldest_go():
    """A tail kept a second time (another transfer of its prompt) moves to the newest: past MAX_TAILS the
    tails kept before it go first, not the one still awaited."""
    from sparsekv.cache.prefix_transfer import MAX_TAILS
    cache, _, _ = _cache()
    tails = [(bytes([i]) * 32, [torch.ones(2, 2)], len(PROMPT)) for i in range(MAX_TAILS + 1)]
    cache.keep_tails(cache.padded_tails(tails[:MAX_TAILS]))
    cache.keep_tails(cache.padded_tails(tails[:1]))  # the first again: two uses, the newest
    cache.keep_tails(cache.padded_tails(tails[MAX_TAILS:]))
    assert len(cache._tails) == MAX_TAILS and bytes([1]) * 32 not in cache._tails
    assert cache._tails[bytes([0]) * 32][1] == 2


def test_an_import_of_exactly_the_host_tiers_room_is_kept_and_a_tenant_quota_bounds_it():
    """Without landing, imported pages go to the host tier: as many as it holds are kept (a page more is
    refused, all or none), and a tenant quota below the budget is the bound."""
    allocator = PageAllocator(8, PAGE)
    rows = PageRows([(torch.zeros(8 * PAGE, 2), 1)], PAGE)
    host = PrefixHostStore(rows, 5 * rows.page_bytes)
    cache = PrefixCache(allocator, tiers={"host": host}, rows=rows)
    assert cache.import_pages(_exported(cache), "default") == 5 and host.num_pages == 5
    assert len(_hit(cache).lower_names) == 5
    cache.forget_request("r")
    small = PrefixHostStore(rows, 4 * rows.page_bytes)
    with pytest.raises(ValueError, match="holds 4"):
        PrefixCache(allocator, tiers={"host": small}, rows=rows).import_pages(_exported(cache), "default")
    assert small.num_pages == 0
    quota = PrefixHostStore(rows, 16 * rows.page_bytes, max_pages_per_tenant=4)
    with pytest.raises(ValueError, match="holds 4 for this tenant"):
        PrefixCache(allocator, tiers={"host": quota}, rows=rows).import_pages(_exported(cache), "default")
    assert quota.num_pages == 0


def test_an_export_skips_the_pages_the_other_side_holds_and_stops_at_the_first_not_held():
    """`held` counts a prompt's first pages held in any tier; `export(skip=n)` gives the pages after the
    first n (those the other side holds), each with its rows, up to the first page not held."""
    cache, _, allocator = _cache()
    pages = _exported(cache)
    cache.import_pages(pages[:2] + pages[3:], "default", _chains(cache))  # page 2 missing: a gap
    assert cache.held(PROMPT, "default", None) == 2
    assert [n for n, _ in cache.export(PROMPT, "default", None, skip=1)] == [pages[1][0]]
    cache.import_pages(pages[2:3], "default", _chains(cache))
    out = cache.export(PROMPT, "default", None, skip=2)
    assert [n for n, _ in out] == [n for n, _ in pages[2:]]
    assert all(torch.equal(got[0], want[0]) for (_, got), (_, want) in zip(out, pages[2:]))
    _check(cache, allocator)


def test_a_tail_of_no_rows_is_refused():
    """A prompt whose last page holds its last token alone has a short tail of 0 rows: nothing to
    keep, refused as no rows at all are."""
    cache, _, _ = _cache()
    for rows in ([torch.zeros(0, 2)], []):
        with pytest.raises(ValueError, match="tail 0"):
            cache.padded_tails([(b"x", rows, 4 * PAGE + 1)])
    assert [count for _, _, count in cache.padded_tails([(b"x", [torch.zeros(1, 2)], 4 * PAGE + 1)])] == [1]


def test_a_tail_of_another_length_replaces_the_kept_one():
    """The same prompt's tail kept again with another row count (a short tail after a whole one) is not
    the same rows: it replaces the kept tail, uses and all, instead of adding a use to it."""
    cache, _, _ = _cache()
    key = cache.tail_name(PROMPT, "default", None)
    cache.keep_tails(cache.padded_tails([(key, [torch.full((2, 2), 9.0)], len(PROMPT))]))
    cache.keep_tails(cache.padded_tails([(key, [torch.full((1, 2), 5.0)], len(PROMPT))]))
    rows, uses, count, tenant, _ = cache._tails[key]
    assert (uses, count, tenant) == (1, 1, "default") and torch.equal(rows[0][:1], torch.full((1, 2), 5.0))


def test_held_host_pages_after_the_imported_ones_land_with_them():
    """The decode side held pages 3-4 in its host tier and was sent pages 0-2: the chain runs through
    the imported pages to the held ones, and all five land in the pool (the hit never leaves it)."""
    cache, _, allocator = _cache()
    pages = _exported(cache)
    for name, rows in pages[3:]:
        cache.tiers["host"].put(name, rows, "default")
    cache.import_pages(pages[:3], "default", _chains(cache))
    hit = _hit(cache)
    assert len(hit.pages) == 5 and not hit.lower_names
    cache.forget_request("r")
    _check(cache, allocator)
