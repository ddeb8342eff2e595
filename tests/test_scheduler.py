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
