"""The rows a data-parallel rank keeps for a prefill worker (parallel/dp_held.py): how rank 0 names them
(`Held`, `Stacked`: the slices the prefill worker takes give the shapes torch gives), and the rank's
store (`HeldRows`): rows leave once, go with their owner, and the integrity check finds rows of an
owner that ended. The calls between the ranks run in tests/test_disagg_parallel.py."""
from __future__ import annotations

import pickle

import pytest
import torch

from sparsekv.parallel.dp_held import Held, HeldRows, RankSide, Stacked, is_held, ranks_of, stack


def _rows(seed: int, shape=(3, 4, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_slices_of_held_rows_have_the_shapes_and_values_torch_gives():
    held = HeldRows(rank=1)
    t = _rows(0)
    name = held.keep(("tap", 0), [t])[0]
    keys = [(slice(1, None),), (slice(None), slice(None, 3)), (slice(5, None),), (slice(0, 2), slice(2, 2))]
    for key in keys:
        assert name[key].shape == tuple(t[key].shape), key
    cut = name[1:][:, :3]  # a delivery cut at a held page, then a short tail
    assert cut.shape == (2, 3, 5) and cut.numel() == 30 and cut.element_size() == 4
    assert torch.equal(held.take([cut])[0], t[1:][:, :3])
    with pytest.raises(TypeError, match="no step"):
        name[::2]
    with pytest.raises(TypeError, match="no step"):
        name[0]


def test_rows_leave_once_and_a_batch_takes_each_entry_it_names():
    held = HeldRows(rank=2)
    a, b = _rows(1), _rows(2)
    rows_a = held.keep(("room", "r"), [a, torch.arange(4)])
    rows_b = held.keep(("room", "r"), [b])
    assert len(held) == 2 and held.nbytes() == a.numel() * 4 + 4 * 8 + b.numel() * 4
    stacked = stack([rows_a[0], rows_b[0]])
    assert isinstance(stacked, Stacked) and stacked.shape == (2, 3, 4, 5) and stacked.rank == 2
    got = held.take([stacked, rows_a[1]])
    assert torch.equal(got[0], torch.stack([a, b])) and torch.equal(got[1], torch.arange(4))
    assert got[0].is_contiguous() and len(held) == 0  # both entries left with the batch
    with pytest.raises(KeyError, match=r"rows \[0\] are no longer held on data-parallel rank 2"):
        held.take([rows_a[0]])


def test_an_owner_takes_its_rows_with_it_and_dropped_rows_go():
    held = HeldRows(rank=1)
    tap = held.keep(("tap", 3), [_rows(3)])[0]
    held.keep(("tap", 3), [_rows(4)])
    room = held.keep(("room", "r"), [_rows(5)])[0]
    assert held.release(("tap", 3)) == 2 and held.owners() == {("room", "r")}
    held.drop([room.handle, tap.handle, 99])  # gone or never kept: nothing to do
    assert len(held) == 0 and held.nbytes() == 0


def test_the_integrity_check_finds_rows_of_a_tap_or_room_that_ended():
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    side.live_taps.add(("tap", 0))
    side.rooms["r"] = None
    side.held.keep(("tap", 0), [_rows(6)])
    side.held.keep(("room", "r"), [_rows(7)])
    side.held.check_integrity(side.live_owners())
    assert side.figures() == {"held_rows_bytes": 2 * 60 * 4, "held_rooms": 1}
    side.live_taps.discard(("tap", 0))  # untapped, its rows not released
    with pytest.raises(AssertionError, match="rows of ended taps or rooms"):
        side.held.check_integrity(side.live_owners())
    side.held.release(("tap", 0))
    del side.rooms["r"]
    with pytest.raises(AssertionError, match="room"):
        side.held.check_integrity(side.live_owners())


def test_rank_0_tells_held_rows_from_its_own_and_pickles_their_names():
    t = torch.zeros(2, 3)
    a = Held(1, 0, 0, (2, 3), torch.float32)
    b = Held(2, 5, 1, (2, 3), torch.bfloat16)[1:]
    assert is_held(a) and is_held(Stacked((a,))) and not is_held(t)
    assert ranks_of([t, a, b, Stacked((a, a))]) == {1, 2} and ranks_of([t]) == set()
    assert torch.equal(stack([t, t]), torch.stack([t, t]))
    assert pickle.loads(pickle.dumps(b)) == b and b.shape == (1, 3) and b.element_size() == 2
