"""A page's rows in and out of the pool (`PageRows`), and what the prefix cache's host tier keeps of
rows handed to it (`PrefixHostStore.put`): the bytes written are the bytes saved, in runs of consecutive
pages or not, and a host tier copy holds its page's bytes and nothing more. Small tensors, no model."""
from __future__ import annotations

import pytest
import torch

from sparsekv.cache.prefix_host import PageRows, PrefixHostStore
from sparsekv.disagg.wire import pages_to_tensors, tensors_to_pages

PAGE = 4


def _rows(num_pages: int = 8) -> tuple[PageRows, list[torch.Tensor]]:
    """Two slot-indexed tensors: one row per token (3 values), and one row per page (as Quest's page
    bounds), both -1 before anything is written."""
    per_token = torch.full((num_pages * PAGE, 3), -1.0)
    per_page = torch.full((num_pages, 2), -1, dtype=torch.int32)
    return PageRows([(per_token, 1), (per_page, PAGE)], PAGE), [per_token, per_page]


def _saved(i: int) -> list[torch.Tensor]:
    return [torch.full((PAGE, 3), float(i)) + torch.arange(PAGE)[:, None], torch.full((1, 2), i, dtype=torch.int32)]


@pytest.mark.parametrize("pages, untouched", [([5, 6, 2, 3, 4, 0], (1, 7)), ([3, 2, 1], (0, 4)),
                                               ([1, 3, 6], (0, 2, 4, 5, 7))],
                         ids=["runs", "descending", "ascending-gaps"])
def test_copy_in_writes_each_page_where_it_belongs_and_nothing_else(pages, untouched):
    """Runs of consecutive pages (5-6, 2-4, 0) are copied together; pages listed in descending order
    (3, 2, 1), or ascending with gaps between them (1, 3, 6), are no run: each saved page goes to its
    own page, none shifted past it and no page between them written."""
    rows, tensors = _rows()
    saved = [_saved(i) for i in range(len(pages))]
    rows.copy_in(pages, saved)
    for page, page_rows in zip(pages, saved):
        assert all(torch.equal(got, want) for got, want in zip(rows.copy_out(page), page_rows))
    for page in untouched:
        assert (tensors[0][page * PAGE:(page + 1) * PAGE] == -1).all() and (tensors[1][page] == -1).all()


def test_the_host_tier_keeps_a_row_owning_its_memory_and_copies_a_view():
    rows, _ = _rows()
    host = PrefixHostStore(rows, 8 * rows.page_bytes)
    owned = _saved(1)
    batch = pages_to_tensors([(b"a", _saved(2)), (b"b", _saved(3))])
    view = tensors_to_pages([b"a", b"b"], batch)[1][1]  # page b's rows: views into the batch's tensors
    host.put(b"owned", owned, "default")
    host.put(b"view", view, "default")
    kept_owned, kept_view = host.take(b"owned"), host.take(b"view")
    assert all(k.data_ptr() == o.data_ptr() for k, o in zip(kept_owned, owned))  # no copy
    for kept, given in zip(kept_view, view):
        assert torch.equal(kept, given) and kept.data_ptr() != given.data_ptr()
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()  # not the whole batch


def test_received_pages_are_views_into_their_batch():
    pages = [(b"a", _saved(2)), (b"b", _saved(3))]
    batch = pages_to_tensors(pages)
    whole = {t.untyped_storage().nbytes() for t in batch}
    for (name, rows), (want_name, want) in zip(tensors_to_pages([b"a", b"b"], batch), pages):
        assert name == want_name and all(torch.equal(r, w) for r, w in zip(rows, want))
        assert {r.untyped_storage().nbytes() for r in rows} == whole


def test_a_host_tier_of_exactly_n_pages_holds_n_and_pushes_out_the_oldest_past_them():
    """The budget is a bound, not a strict one: a budget of one page's bytes holds a page, of N pages'
    N; the (N + 1)-th pushes out the oldest alone."""
    rows, _ = _rows()
    spilled = []
    one = PrefixHostStore(rows, rows.page_bytes, spill=lambda name, r, tenant: spilled.append(name))
    one.save(b"a", 0, "default")
    assert one.has(b"a") and spilled == []
    three = PrefixHostStore(rows, 3 * rows.page_bytes, spill=lambda name, r, tenant: spilled.append(name))
    for i, name in enumerate((b"x", b"y", b"z")):
        three.save(name, i, "default")
    assert three.num_pages == 3 and spilled == []
    three.save(b"w", 3, "default")
    assert spilled == [b"x"] and three.num_pages == 3 and three.bytes_used == three.capacity_bytes
    three.check_integrity()


def test_a_tensor_whose_rows_do_not_tile_a_page_is_refused():
    """A tensor of 3 tokens per row cannot hold pages of 4 tokens in whole rows: refused when the rows are
    described, not misplaced at the first copy."""
    with pytest.raises(ValueError, match="does not tile pages of 4"):
        PageRows([(torch.zeros(8, 2), 3)], PAGE)


def test_the_host_tier_copies_a_view_at_the_start_of_a_larger_tensor():
    """The first page of a received batch is a view at offset 0 of the batch's tensors: the host tier
    copies it (keeping it would hold the whole batch for one page)."""
    rows, _ = _rows()
    host = PrefixHostStore(rows, 8 * rows.page_bytes)
    batch = pages_to_tensors([(b"a", _saved(2)), (b"b", _saved(3))])
    first = tensors_to_pages([b"a", b"b"], batch)[0][1]
    assert all(r.storage_offset() == 0 for r in first)
    host.put(b"first", first, "default")
    for kept, given in zip(host.take(b"first"), first):
        assert torch.equal(kept, given) and kept.data_ptr() != given.data_ptr()
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


def _host_of_two_pages():
    """(rows, a host tier of two pages' budget holding pages a and b saved in that order on a counting
    clock, the names it spills)."""
    rows, _ = _rows()
    spilled = []
    host = PrefixHostStore(rows, 2 * rows.page_bytes, spill=lambda name, r, tenant: spilled.append(name))
    host.clock = iter(range(100)).__next__
    host.save(b"a", 0, "default")
    host.save(b"b", 1, "default")
    return rows, host, spilled


def test_a_page_saved_again_is_used_again_and_outlives_older_copies():
    """A page the host tier holds, saved or put again, is not copied twice: it becomes the most recently
    used, so the next page over the budget pushes out the copy saved after it, not it."""
    rows, host, spilled = _host_of_two_pages()
    host.save(b"a", 2, "default")
    host.put(b"b", _saved(9), "default")
    host.save(b"a", 3, "default")
    assert host.saved == 2 and [name for name, _, _ in host.items()] == [b"b", b"a"]
    host.save(b"c", 4, "default")
    assert spilled == [b"b"] and host.has(b"a") and host.has(b"c")
    assert torch.equal(host.take(b"c")[0], rows.copy_out(4)[0])
    assert host.stats() == {"prefix_host_pages": 2, "prefix_host_bytes": 2 * rows.page_bytes,
                            "prefix_host_budget_bytes": 2 * rows.page_bytes, "prefix_host_saves": 3,
                            "prefix_host_loads": 1, "prefix_host_evictions": 1}


def test_a_host_hit_keeps_its_copy_over_older_ones():
    """A copy read back (`take`, a host-tier hit) is used now: the next page over the budget pushes out
    the copy saved after it and not hit, not the one hit."""
    rows, host, spilled = _host_of_two_pages()
    assert torch.equal(host.take(b"a")[0], rows.copy_out(0)[0])
    host.save(b"c", 2, "default")
    assert spilled == [b"b"] and [name for name, _, _ in host.items()] == [b"a", b"c"]
    host.check_integrity()
