"""Scheduler and page allocator with fake requests: no torch, milliseconds."""
from __future__ import annotations

import subprocess
import sys

import pytest

from sparsekv.cache.pages import OutOfPages, PageAllocator
from sparsekv.cache.prefix import PrefixCache
from sparsekv.request import Request, RequestStatus, SamplingParams
from sparsekv.scheduler import Scheduler


def make(rid: str, n_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler) -> list:
    scheduled = sched.schedule()
    for ch in scheduled.chunks:
        if ch.samples_token:
            ch.request.output_token_ids.append(0)
    sched.update(scheduled, {}, [])
    return scheduled.chunks


def test_allocator_reserve_allocate_free():
    a = PageAllocator(10, page_size=4)
    assert a.reserve("x", 6) and not a.reserve("y", 5) and a.reserve("y", 4)
    pages = a.allocate("x", 3)
    assert a.num_free == 7 and a.num_available == 0
    with pytest.raises(OutOfPages):
        a.allocate("z", 1)
    with pytest.raises(RuntimeError, match=r"owned by \['x'\]"):
        a.free("y", pages)
    a.free("x", pages)
    a.check_integrity()
    assert a.num_available == 6


def test_chunked_prefill_mixes_with_decode_and_respects_budget():
    sched = Scheduler(PageAllocator(100, 4), max_num_seqs=4, max_num_batched_tokens=10, prefill_chunk_tokens=6)
    a = make("a", 3)
    sched.add(a)
    assert [(c.request.request_id, c.num_new_tokens) for c in run_step(sched)] == [("a", 3)]
    b = make("b", 20)
    sched.add(b)
    steps = [[(c.request.request_id, c.num_new_tokens) for c in run_step(sched)] for _ in range(4)]
    assert steps[0] == [("a", 1), ("b", 6)]          # decode first, then a prefill chunk
    assert steps[1] == [("a", 1), ("b", 6)]
    assert steps[3] == [("b", 2)] or steps[3][-1] == ("b", 2)
    assert b.num_computed_tokens == 20 and len(b.page_ids) == 5  # pages only for computed tokens


def test_admission_by_memory_and_max_num_seqs():
    alloc = PageAllocator(10, 4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=100, prefill_chunk_tokens=100)
    for rid in "abc":
        sched.add(make(rid, 12, max_tokens=4))   # 16 tokens -> 4 pages reserved each
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"] and len(sched.waiting) == 1
    sched.finish(sched.running[0], RequestStatus.FINISHED, "length")
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["b", "c"]
    big = make("d", 40, max_tokens=8)            # 12 pages: never fits while others run
    sched.add(big)
    run_step(sched)
    assert big in sched.waiting
    for r in list(sched.running) + [big]:
        sched.finish(r, RequestStatus.ABORTED, "abort")
    alloc.check_integrity()
    assert alloc.num_free == 10 and alloc.num_available == 10


def test_a_tenant_beyond_its_kv_share_waits_while_other_tenants_go_ahead():
    """tenant_pages 8 of 20: the heavy tenant's third 4-page request waits (its first two hold 8),
    the light tenant's request behind it is admitted, and the waiting one runs once a page-holder
    of its own tenant finishes. Without the share the memory rule alone admits heavy's first four
    and the light tenant waits behind them."""
    def heavy_then_light(tenant_pages):
        sched = Scheduler(PageAllocator(20, 4), max_num_seqs=8, max_num_batched_tokens=100, prefill_chunk_tokens=100,
                          tenant_pages=tenant_pages)
        for i in range(5):
            sched.add(Request(f"h{i}", list(range(12)), SamplingParams(max_tokens=4), tenant="heavy"))
        sched.add(Request("l", list(range(12)), SamplingParams(max_tokens=4), tenant="light"))
        run_step(sched)
        return sched
    sched = heavy_then_light(8)
    assert [r.request_id for r in sched.running] == ["h0", "h1", "l"]
    assert [r.request_id for r in sched.waiting] == ["h2", "h3", "h4"]  # still first in line, in order
    assert sched.tenant_stats() == {"heavy": {"running": 2, "waiting": 3, "kv_pages": 8},
                                    "light": {"running": 1, "waiting": 0, "kv_pages": 4}}
    sched.check_integrity()
    sched.finish(sched.running[0], RequestStatus.FINISHED, "length")
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["h1", "l", "h2"] and sched.pages_by_tenant["heavy"] == 8
    for req in list(sched.running) + list(sched.waiting):
        sched.finish(req, RequestStatus.ABORTED, "abort")
    assert sched.pages_by_tenant == {} and sched.tenant_stats() == {}
    sched.check_integrity()
    sched.allocator.check_integrity()
    unbounded = heavy_then_light(None)
    assert [r.request_id for r in unbounded.running] == ["h0", "h1", "h2", "h3", "h4"]
    assert [r.request_id for r in unbounded.waiting] == ["l"]


def test_optimistic_admission_preempts_the_newest_and_resumes_it_with_its_tokens():
    """kv_admission="optimistic": two requests whose prompt + max_tokens (8 pages each) do not fit a
    10-page pool together are both admitted (4 pages each: the known tokens and one more); when their
    growth runs the pool dry the newer one is preempted (pages freed, tokens kept, back at the front of
    the queue) and resumes, recomputing its prompt and output, once the older one is done."""
    alloc = PageAllocator(10, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_tokens=100, optimistic=True)
    preempted = []
    sched.on_preempt = preempted.append
    a, b = make("a", 12, max_tokens=20), make("b", 12, max_tokens=20)
    for req in (a, b):
        sched.add(req)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"] and alloc.num_available == 2
    while not preempted:
        run_step(sched)
        sched.check_integrity()
        alloc.check_integrity()
    assert preempted == [b] and sched.num_preemptions == 1 and b.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b"] and b.page_ids == [] and b.num_computed_tokens == 0
    kept = list(b.output_token_ids)
    assert kept and b.status is RequestStatus.WAITING
    while a.num_output_tokens < 20:
        run_step(sched)
    sched.finish(a, RequestStatus.FINISHED, "length")
    chunks = run_step(sched)
    assert [(c.request.request_id, c.first_position, c.num_new_tokens) for c in chunks] == [("b", 0, 12 + len(kept))]
    assert b.output_token_ids[:len(kept)] == kept and b.num_computed_tokens == b.num_tokens - 1
    sched.check_integrity()
    alloc.check_integrity()
    reserve = Scheduler(PageAllocator(10, 4), max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_tokens=100)
    for req in (make("a", 12, max_tokens=20), make("b", 12, max_tokens=20)):
        reserve.add(req)
    run_step(reserve)
    assert [r.request_id for r in reserve.running] == ["a"]  # prompt + max_tokens: one at a time


def test_bench_admission_compares_both_admissions_on_the_same_requests(tmp_path, capsys):
    """`sparsekv bench admission`: the optimistic engine runs more requests at once than the reserving
    one on a pool that fits two at full length, and every greedy output is identical."""
    import json

    from sparsekv.tools.bench import main
    out = tmp_path / "admission.json"
    assert main(["admission", "--requests", "5", "--prompt-tokens", "64", "--max-tokens", "192", "--fit", "2",
                 "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert result["identical"] and summary["optimistic"]["mean_running"] > summary["reserve"]["mean_running"]
    assert summary["reserve"]["preemptions"] == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out


def test_with_optimistic_admission_a_tenant_share_is_a_guarantee_not_a_cap():
    """Optimistic admission, tenant_pages 10 of 20: the heavy tenant alone takes the whole pool (no one
    else needs it); when the light tenant's request comes, the heavy tenant's newest request is
    preempted for it (queued right behind it) and it runs at once. Reserving admission would cap the
    heavy tenant at 10 pages whether or not anyone else waits."""
    alloc = PageAllocator(20, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=200, prefill_chunk_tokens=200, tenant_pages=10,
                      optimistic=True)
    heavy = [Request(f"h{i}", list(range(16)), SamplingParams(max_tokens=8), tenant="heavy") for i in range(4)]
    for req in heavy:
        sched.add(req)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["h0", "h1", "h2"]  # 5 pages each, 1 kept free: over its share
    assert sched.tenant_stats()["heavy"] == {"running": 3, "waiting": 1, "kv_pages": 15}
    light = Request("l", list(range(16)), SamplingParams(max_tokens=8), tenant="light")
    sched.add(light)
    run_step(sched)
    assert light in sched.running and heavy[2].num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["h3", "h2"]  # h3 was first in line; h2 behind the light one
    sched.check_integrity()
    alloc.check_integrity()
    assert sched.tenant_stats()["light"]["kv_pages"] == 5


def test_a_tenants_pages_shared_by_a_prefix_hit_count_once_toward_its_share():
    """Optimistic admission, tenant_pages 8 of 16, pages of 4 tokens. h1 hits the 3 pages h0 computed
    and adds 2: the heavy tenant holds 7 distinct pages (within its share), not 5 + 5. So h1 is
    admitted, the tenant's figure is 7, and when a third tenant finds no room nobody is preempted:
    every tenant is within its share (counted per request, heavy's 10 would make h1 the victim)."""
    alloc = PageAllocator(16, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=200, prefill_chunk_tokens=200,
                      prefix=PrefixCache(alloc), tenant_pages=8, optimistic=True)
    prompt = list(range(16))
    h0, h1 = (Request(f"h{i}", prompt, SamplingParams(max_tokens=8), tenant="heavy") for i in range(2))
    sched.add(h0)
    run_step(sched)
    sched.add(h1)
    sched.add(Request("m", list(range(100, 116)), SamplingParams(max_tokens=8), tenant="mid"))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["h0", "h1", "m"] and h1.num_cached_tokens == 12
    assert sched.tenant_stats()["heavy"]["kv_pages"] == len(set(h0.page_ids) | set(h1.page_ids)) + \
        alloc.reserved("h0") + alloc.reserved("h1") == 7
    sched.add(Request("l", list(range(200, 216)), SamplingParams(max_tokens=8), tenant="light"))
    run_step(sched)
    assert h1.num_preemptions == 0 and [r.request_id for r in sched.waiting] == ["l"]
    sched.check_integrity()
    alloc.check_integrity()


def test_the_admission_policy_loads_without_torch():
    """The scheduler and all it imports (requests, the page allocator, the prefix cache's bookkeeping,
    the tenants' ledger, the step's plain data) load in a process that never imports torch."""
    code = "import sys, sparsekv.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _chunks(chunks) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.first_position, c.num_new_tokens) for c in chunks]


def test_a_decode_goes_before_an_older_requests_prefill_chunk():
    """Budget 10, chunks of 8: p (40-token prompt) is admitted before d (2 tokens), so p is first in the
    running list, yet from the next step on d's decode is scheduled before p's prefill chunk, which takes
    what is left of the budget. With drafts (1 + 3 tokens) d still runs whole and p's chunk shrinks to 6,
    rather than p taking 8 and d's drafts being cut to fit."""
    sched = Scheduler(PageAllocator(100, 4), max_num_seqs=4, max_num_batched_tokens=10, prefill_chunk_tokens=8)
    p, d = make("p", 40, max_tokens=8), make("d", 2, max_tokens=8)
    sched.add(p)
    sched.add(d)
    assert _chunks(run_step(sched)) == [("p", 0, 8), ("d", 0, 2)]
    assert [r.request_id for r in sched.running] == ["p", "d"] and p.is_prefilling and not d.is_prefilling
    assert _chunks(run_step(sched)) == [("d", 2, 1), ("p", 8, 8)]
    d.draft_token_ids[:] = [5, 6, 7]
    chunks = run_step(sched)
    assert _chunks(chunks) == [("d", 3, 4), ("p", 16, 6)] and chunks[0].num_draft_tokens == 3


def test_optimistic_preemption_takes_the_newest_request_and_queues_it_first():
    """Optimistic admission, 9 pages of 4 tokens: a, b, c, d (7-token prompts, 2 pages each) are
    admitted, e waits. When they all cross into a third page the one free page goes to a; b finds none,
    and of the requests after it (c, d) the newest, d, is preempted (not c, the next in line), which is
    enough for b and c: nobody else is. d goes back to the front of the queue, ahead of e, which
    waited longer in the queue but was never admitted."""
    alloc = PageAllocator(9, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100, prefill_chunk_tokens=100, optimistic=True)
    preempted = []
    sched.on_preempt = preempted.append
    reqs = {rid: make(rid, 7, max_tokens=20) for rid in "abcde"}
    for req in reqs.values():
        sched.add(req)
    run_step(sched)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b", "c", "d"]
    assert [r.request_id for r in sched.waiting] == ["e"]
    assert not preempted and alloc.num_available == 1
    assert _chunks(run_step(sched)) == [("a", 8, 1), ("b", 8, 1), ("c", 8, 1)]
    assert preempted == [reqs["d"]] and sched.num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    assert [r.request_id for r in sched.waiting] == ["d", "e"]  # the preempted one first
    assert reqs["d"].status is RequestStatus.WAITING and reqs["d"].page_ids == [] and reqs["d"].num_computed_tokens == 0
    sched.check_integrity()
    alloc.check_integrity()


def test_optimistic_tenant_shares_at_their_exact_boundary():
    """Optimistic admission, tenant_pages 10, pages of 4 tokens, the heavy tenant's 16-token requests
    take 5 pages each (known tokens and one more), 1 page is kept free at admission.
    * 21 pages, heavy holds 20 (h0..h3): a light request of exactly 10 pages (39 tokens) is within its
      share (10 <= 10) and so preempts heavy's newest (h3, then h2) until it fits: it runs.
    * 20 pages, heavy holds 15 (h0..h2): the same light request preempts h2; heavy then holds exactly
      its share, which is not over it, so h1 is not preempted, and the light request waits (10 + 1 kept
      free > 10 available).
    * 21 pages, heavy holds 20: a 5-page light request preempts h3 alone: then 6 pages are available,
      exactly its 5 and the one kept free."""
    def heavy_then_light(num_pages: int, light_prompt: int):
        alloc = PageAllocator(num_pages, 4)
        sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=200, prefill_chunk_tokens=200,
                          tenant_pages=10, optimistic=True)
        heavy = [Request(f"h{i}", list(range(16)), SamplingParams(max_tokens=8), tenant="heavy") for i in range(4)]
        for req in heavy:
            sched.add(req)
        run_step(sched)
        light = Request("l", list(range(light_prompt)), SamplingParams(max_tokens=8), tenant="light")
        sched.add(light)
        run_step(sched)
        sched.check_integrity()
        alloc.check_integrity()
        return sched, [r.num_preemptions for r in heavy], light

    sched, preemptions, light = heavy_then_light(21, 39)
    assert light in sched.running and preemptions == [0, 0, 1, 1]
    assert sched.tenant_stats() == {"heavy": {"running": 2, "waiting": 2, "kv_pages": 10},
                                    "light": {"running": 1, "waiting": 0, "kv_pages": 10}}
    sched, preemptions, light = heavy_then_light(20, 39)
    assert preemptions == [0, 0, 1, 0] and [r.request_id for r in sched.running] == ["h0", "h1"]
    assert [r.request_id for r in sched.waiting] == ["h3", "l", "h2"]  # h2 right behind the light request
    assert sched.tenant_stats()["heavy"]["kv_pages"] == 10
    sched, preemptions, light = heavy_then_light(21, 16)
    assert light in sched.running and preemptions == [0, 0, 0, 1]


def test_a_preempted_request_reports_the_cached_tokens_of_its_first_admission():
    """num_cached_tokens is what the prefix cache served the prompt when the request was first admitted
    (docs/prefix_cache.md): b hits 12 of its 16 prompt tokens; preempted once its output has filled two
    more pages, it is recomputed from position 24 (its own pages, still cached), yet it still reports 12,
    neither 24 nor 0."""
    alloc = PageAllocator(12, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_tokens=100,
                      prefix=PrefixCache(alloc), optimistic=True)
    preempted = []
    sched.on_preempt = preempted.append
    warm = make("w", 16, max_tokens=1)
    sched.add(warm)
    run_step(sched)
    sched.finish(warm, RequestStatus.FINISHED, "length")
    a = Request("a", list(range(100, 112)), SamplingParams(max_tokens=20))
    b = Request("b", list(range(12)) + [50, 51, 52, 53], SamplingParams(max_tokens=20))  # its 4th page its own
    sched.add(a)
    sched.add(b)
    assert _chunks(run_step(sched)) == [("a", 0, 12), ("b", 12, 4)]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12
    while not preempted:
        run_step(sched)
    assert preempted == [b] and b.num_cached_tokens == 12
    sched.finish(a, RequestStatus.ABORTED, "abort")
    known = b.num_tokens
    assert known == 25 and _chunks(run_step(sched)) == [("b", 24, known - 24)]
    assert b.num_preemptions == 1 and b.num_cached_tokens == 12
    sched.check_integrity()
    alloc.check_integrity()


def test_max_num_seqs_alone_bounds_the_running_requests():
    """Memory and budget for all three: max_num_seqs 2 still admits two; the third waits for a slot."""
    sched = Scheduler(PageAllocator(100, 4), max_num_seqs=2, max_num_batched_tokens=100, prefill_chunk_tokens=100)
    for rid in "abc":
        sched.add(make(rid, 4))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"] and [r.request_id for r in sched.waiting] == ["c"]
    sched.finish(sched.running[0], RequestStatus.FINISHED, "length")
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["b", "c"]


def test_a_request_without_room_holds_back_the_requests_behind_it():
    """First come, first served: the 8-page request that does not fit beside the running one waits, and
    the 1-page request behind it, which would fit, waits behind it rather than overtaking it (which
    could starve the big one for ever)."""
    sched = Scheduler(PageAllocator(10, 4), max_num_seqs=8, max_num_batched_tokens=100, prefill_chunk_tokens=100)
    sched.add(make("a", 12, max_tokens=4))  # 4 pages
    run_step(sched)
    sched.add(make("big", 28, max_tokens=4))  # 8 pages
    sched.add(make("small", 2, max_tokens=2))  # 1 page
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["a"] and [r.request_id for r in sched.waiting] == ["big", "small"]
    sched.finish(sched.running[0], RequestStatus.FINISHED, "length")
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["big", "small"]


def test_optimistic_admission_keeps_no_page_free_when_nothing_runs():
    """The 1 % kept free is kept beside running requests: on an idle 10-page pool a request whose known
    tokens and one more need all 10 pages is admitted (else it could never run)."""
    alloc = PageAllocator(10, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_tokens=100, optimistic=True)
    whole = make("whole", 39, max_tokens=1)
    sched.add(whole)
    assert _chunks(run_step(sched)) == [("whole", 0, 39)] and alloc.num_available == 0
    sched.add(make("next", 3, max_tokens=1))
    run_step(sched)
    assert [r.request_id for r in sched.waiting] == ["next"]


def test_a_waiting_tenant_within_its_share_holds_back_only_other_tenants_and_only_until_admitted():
    """Optimistic admission, tenant_pages 10 of 40 pages: heavy runs 15 pages (over its share). Queued:
    light's 12-page request, light's 5-page one (the first request within its share: the one entitled),
    then heavy's h3. The big light request is not held back (its tenant is the entitled one's), and once
    the entitled request is admitted the others are served first come, first served again: h3, over its
    tenant's share, is admitted too, as there is room for all."""
    alloc = PageAllocator(40, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=400, prefill_chunk_tokens=400, tenant_pages=10,
                      optimistic=True)
    for i in range(3):
        sched.add(Request(f"h{i}", list(range(16)), SamplingParams(max_tokens=8), tenant="heavy"))
    run_step(sched)
    assert sched.tenant_stats()["heavy"]["kv_pages"] == 15
    sched.add(Request("l_big", list(range(47)), SamplingParams(max_tokens=8), tenant="light"))  # 12 pages
    sched.add(Request("l_small", list(range(16)), SamplingParams(max_tokens=8), tenant="light"))  # 5 pages
    sched.add(Request("h3", list(range(16)), SamplingParams(max_tokens=8), tenant="heavy"))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["h0", "h1", "h2", "l_big", "l_small", "h3"]
    assert not sched.waiting and sched.num_preemptions == 0
    sched.check_integrity()
    alloc.check_integrity()



def test_preemption_takes_the_newest_request_even_when_an_older_ones_prefill_runs_after_it():
    """Decodes go first in a step, so a newer decode is scheduled before an older request's prefill
    chunk. When the decode runs short of pages it is still the newest request that is preempted (the
    decode itself): the older prompt keeps its progress."""
    alloc = PageAllocator(23, 4)
    old, new = make("old", 80, max_tokens=8), make("new", 2, max_tokens=40)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=10, prefill_chunk_tokens=8, optimistic=True)
    preempted = []
    sched.on_preempt = preempted.append
    sched.add(old)
    run_step(sched)
    sched.add(new)
    while not preempted and old.is_prefilling:
        chunks = run_step(sched)
    assert preempted == [new] and old.num_preemptions == 0 and old in sched.running
    assert [c.request_id for c in chunks] == ["old"] and list(sched.waiting) == [new]
    alloc.check_integrity()


def _allocator_with_a_cached_page() -> tuple[PageAllocator, list[int], int]:
    """6 pages: 2 owned by "x", 1 cached (named for tenant "t"), 3 free, and all 4 allocatable pages
    reserved by "w": consistent (reservations may reach the free pages, not pass them)."""
    a = PageAllocator(6, page_size=4)
    a.cached.tenant_of_named = lambda page: "t"
    owned = a.allocate("x", 2)
    (cached,) = a.allocate("y", 1)
    a.free("y", [cached])
    assert cached in a.cached and a.num_free == 4
    assert a.reserve("w", 4) and a.num_available == 0
    a.check_integrity()
    return a, owned, cached


@pytest.mark.parametrize("corrupt,message", [
    (lambda a, owned, cached: a._free.append(a._free[0]), "on the free list twice"),
    (lambda a, owned, cached: a._free.append(owned[0]), "both free and owned"),
    (lambda a, owned, cached: a._free.append(cached), "cached page is also free or owned"),
    (lambda a, owned, cached: a._free.popleft(), r"free \+ cached \+ used != total"),
    (lambda a, owned, cached: a._owners.__setitem__(owned[0], set()), "owned page with no owner"),
    (lambda a, owned, cached: a._reserved.__setitem__("x", -1), "negative reservation"),
    (lambda a, owned, cached: a._reserved.__setitem__("x", 1), "reservations exceed free pages"),
], ids=["free twice", "free and owned", "cached and free", "page lost", "ownerless", "negative reservation",
        "overreserved"])
def test_allocator_check_integrity_catches_each_kind_of_corruption(corrupt, message):
    """Each assertion of PageAllocator.check_integrity fires on the corruption it names (the engine's
    and the scheduler tests' integrity checks rely on them: one that stopped checking would let a page
    be handed to two requests, or leak, silently)."""
    a, owned, cached = _allocator_with_a_cached_page()
    corrupt(a, owned, cached)
    with pytest.raises(AssertionError, match=message):
        a.check_integrity()


def _swap_two_tenants_keys(lru) -> None:
    """A second tenant's key, then each key recorded under the other's tenant (the counts still agree)."""
    lru.add(99, "u", 0.0)
    (k1, t1), (k2, t2) = lru._tenant.items()
    lru._tenant[k1], lru._tenant[k2] = t2, t1


@pytest.mark.parametrize("corrupt,message", [
    (lambda lru: lru._groups.setdefault("u", {}), "an empty tenant group"),
    (lambda lru: lru._groups.__setitem__("u", {next(iter(lru._tenant)): 0.0}), "a key is in two tenant groups"),
    (_swap_two_tenants_keys, "not in its tenant's group"),
], ids=["empty group", "two groups", "wrong group"])
def test_cached_pages_check_integrity_catches_each_kind_of_corruption(corrupt, message):
    """The allocator's integrity check covers its cached pages' tenant groups too (TenantLRU, the
    eviction order of every prefix-cache tier): each assertion fires on the corruption it names."""
    a, _, _ = _allocator_with_a_cached_page()
    corrupt(a.cached._lru)
    with pytest.raises(AssertionError, match=message):
        a.check_integrity()


def test_tenant_pages_check_integrity_catches_a_wrong_ledger_and_a_tenant_over_its_cap():
    """TenantPages.check_integrity (the scheduler's): the ledger must equal the running requests'
    footprints (prompt + max_tokens in pages: 12 + 4 tokens = 4 pages each), and with a cap no tenant
    may reserve more than it: exactly the cap is fine, one page over is not."""
    from sparsekv.cache.tenant_pages import TenantPages
    ledger = TenantPages(PageAllocator(20, page_size=4))
    running = [make("a", 12), make("b", 12)]
    for r in running:
        ledger.admit(r)
    assert ledger.reserved == {"default": 8}
    ledger.check_integrity(running, cap=8)
    ledger.check_integrity(running, cap=None)
    with pytest.raises(AssertionError, match="more than its share"):
        ledger.check_integrity(running, cap=7)
    ledger.release(running[1])
    assert ledger.reserved == {"default": 4}
    with pytest.raises(AssertionError, match="disagree"):
        ledger.check_integrity(running, cap=None)
    ledger.check_integrity(running[:1], cap=4)
    ledger.release(running[0])
    assert ledger.reserved == {}  # no tenant left with a zero entry
    ledger.check_integrity([], cap=4)


def test_tenant_pages_keep_a_tenants_last_page_after_a_release():
    """A release leaving the tenant one page reserved (a one-page request still running) keeps that
    page in the ledger: only a tenant left with none loses its entry."""
    from sparsekv.cache.tenant_pages import TenantPages
    ledger = TenantPages(PageAllocator(20, page_size=4))
    small, large = make("s", 2, max_tokens=2), make("l", 4, max_tokens=4)  # 1 page and 2 pages
    for r in (small, large):
        ledger.admit(r)
    assert ledger.reserved == {"default": 3}
    ledger.release(large)
    assert ledger.reserved == {"default": 1}
    ledger.check_integrity([small], cap=1)
    ledger.release(small)
    assert ledger.reserved == {}


def test_a_seeded_requests_drafts_that_exactly_fill_the_chunk_run_whole_this_step():
    """A seeded, sampled request's 1 + 3 rows exactly fill a 4-token budget: they fit, so they run
    this step whole (the rule that defers its drafts is for rows that do not fit, not for rows that
    just fit), and the step samples from its last row."""
    sched = Scheduler(PageAllocator(100, 4), max_num_seqs=4, max_num_batched_tokens=4, prefill_chunk_tokens=4)
    s = Request("s", [1, 2], SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    sched.add(s)
    assert _chunks(run_step(sched)) == [("s", 0, 2)]
    s.draft_token_ids[:] = [5, 6, 7]
    chunks = sched.schedule().chunks
    assert _chunks(chunks) == [("s", 2, 4)] and chunks[0].num_draft_tokens == 3 and chunks[0].samples_token


def test_drafts_left_out_of_a_chunk_that_reaches_the_last_token_are_dropped():
    """Budget 1: a decode with 3 drafts runs its newest token alone, a plain decode, and its drafts are
    dropped (they were proposed to follow that token: no later step may verify them)."""
    sched = Scheduler(PageAllocator(100, 4), max_num_seqs=4, max_num_batched_tokens=1, prefill_chunk_tokens=1)
    d = make("d", 1, max_tokens=8)
    sched.add(d)
    assert _chunks(run_step(sched)) == [("d", 0, 1)]
    d.draft_token_ids[:] = [5, 6, 7]
    chunks = sched.schedule().chunks
    assert _chunks(chunks) == [("d", 1, 1)] and chunks[0].num_draft_tokens == 0 and chunks[0].samples_token
    assert d.draft_token_ids == []


def test_a_finished_prompts_tail_page_is_evicted_before_its_head():
    """A request's pages are freed last page first, so the prefix cache evicts a finished prompt's tail
    before its head: after one cached page is taken for another request, the prompt's first two pages
    still hit (a lookup walks a prompt from its first page, so an evicted head would lose them all)."""
    alloc = PageAllocator(5, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_tokens=100,
                      prefix=PrefixCache(alloc))
    warm = make("w", 13, max_tokens=1)  # 3 full pages named, and a partial one
    sched.add(warm)
    run_step(sched)
    sched.finish(warm, RequestStatus.FINISHED, "length")
    assert len(alloc.cached) == 3
    other = Request("x", list(range(100, 112)), SamplingParams(max_tokens=1))  # 3 pages: 2 free, 1 evicted
    sched.add(other)
    run_step(sched)
    assert len(alloc.cached) == 2
    sched.finish(other, RequestStatus.FINISHED, "length")
    again = make("b", 13, max_tokens=1)
    sched.add(again)
    run_step(sched)
    assert again.num_cached_tokens == 8
    sched.finish(again, RequestStatus.FINISHED, "length")
    alloc.check_integrity()


def test_allocated_pages_come_in_ascending_order_whatever_order_they_were_freed_in():
    """A request's pages are freed last first; the next allocation still hands out ascending page ids
    (consecutive pages are one run of slots, which decode reads in place)."""
    a = PageAllocator(6, page_size=4)
    pages = a.allocate("x", 3)
    assert pages == [0, 1, 2]
    a.free("x", pages[::-1])
    assert a.allocate("y", 4) == [2, 3, 4, 5]
    a.check_integrity()
