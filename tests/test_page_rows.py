"""A page's rows in and out of the pool (`PageRows`), and what the prefix cache's host tier keeps of
rows handed to it (`PrefixHostStore.put`): the bytes written are the bytes saved, in runs of consecutive
pages or not, and a host tier copy holds its page's bytes and nothing more. Small tensors, no model."""
from __future__ import annotations

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


def test_copy_in_writes_each_page_in_runs_of_consecutive_pages_and_nothing_else():
    rows, tensors = _rows()
    pages = [5, 6, 2, 3, 4, 0]  # runs: 5-6, 2-4, 0; pages 1 and 7 are not written
    saved = [_saved(i) for i in range(len(pages))]
    rows.copy_in(pages, saved)
    for page, page_rows in zip(pages, saved):
        assert all(torch.equal(got, want) for got, want in zip(rows.copy_out(page), page_rows))
    for page in (1, 7):
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
