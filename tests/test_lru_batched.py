"""LRUTable: many working sets resolved in one batched pass, against the brute-force reference of
tests/test_lru.py, one reference per working set (no torch)."""
import random

import numpy as np
import pytest

from sparsekv.cache.lru import LRUTable, WorkingSetLRU
from test_lru import BruteForceLRU


@pytest.mark.parametrize("capacity,universe,rows,seed", [(1, 3, 3, 0), (4, 6, 5, 1), (8, 20, 8, 2),
                                                         (16, 64, 4, 3), (33, 1000, 6, 4), (64, 200, 16, 5)])
def test_batched_resolve_matches_brute_force(capacity, universe, rows, seed):
    """Each step accesses a random subset of the working sets (some with no position at all, sizes up
    to the capacity, mostly recent positions or not): per row, the same hits, misses, evictions, slots
    and LRU order as the reference, and every row stays consistent."""
    rng = random.Random(seed)
    table, refs = LRUTable(rows, capacity), [BruteForceLRU(capacity) for _ in range(rows)]
    for _ in range(200):
        chosen = rng.sample(range(rows), rng.randint(1, rows))
        accesses = []
        for _ in chosen:
            k = rng.randint(0, capacity) if rng.random() < 0.2 else rng.randint(1, capacity)
            accesses.append(np.array(sorted(rng.sample(range(universe), min(k, universe))), dtype=np.int64))
        results = table.resolve(chosen, accesses)
        for row, positions, res in zip(chosen, accesses, results):
            if not positions.size:
                assert res.hits == 0 and not res.misses and not res.evictions
                continue
            hits, misses, evictions, slots, order = refs[row].access(positions.tolist())
            assert (res.hits, res.misses, res.evictions, res.slots.tolist()) == (hits, misses, evictions, slots)
            assert table.lru(row).lru_order() == order
        for row in range(rows):
            table.lru(row).check_integrity()


def test_batched_resolve_equals_one_row_at_a_time():
    """The batched pass leaves exactly the state per-row resolves leave (stamps and clocks included)."""
    rng = random.Random(7)
    batched, alone = LRUTable(4, 8), [WorkingSetLRU(8) for _ in range(4)]
    for _ in range(100):
        accesses = [np.array(sorted(rng.sample(range(30), rng.randint(1, 8))), dtype=np.int64) for _ in range(4)]
        table_res = batched.resolve([0, 1, 2, 3], accesses)
        for row, (lru, positions, res) in enumerate(zip(alone, accesses, table_res)):
            want = lru.resolve(positions)
            assert res.slots.tolist() == want.slots.tolist() and res.evictions == want.evictions
            assert (batched.stamp[row] == lru._stamp).all() and batched.clock[row] == lru._clock


def test_batched_resolve_rejects_bad_accesses():
    table = LRUTable(2, 2)
    with pytest.raises(ValueError, match="twice"):
        table.resolve([0, 0], [np.array([1]), np.array([2])])
    with pytest.raises(ValueError, match="holds 2"):
        table.resolve([0], [np.array([1, 2, 3])])
    with pytest.raises(ValueError, match="ascending"):
        table.resolve([0, 1], [np.array([1, 2]), np.array([3, 3])])
    with pytest.raises(ValueError, match=">= 0"):
        table.resolve([1], [np.array([-1, 2])])


def test_each_rows_position_table_grows_when_an_access_reaches_its_end():
    """Each row's position table keeps its own size (1024 entries at first) and grows to cover an
    access's largest position: rows decoding one position apart reach position 1024, the first
    uncovered entry, at different steps, while their neighbours' tables are already grown or not yet;
    every step matches one brute-force reference per row."""
    rows, capacity = 3, 5
    table, refs = LRUTable(rows, capacity), [BruteForceLRU(capacity) for _ in range(rows)]
    for t in range(1018, 1030):
        accesses = [np.array([t + row - 4, t + row], dtype=np.int64) for row in range(rows)]
        for row, positions, res in zip(range(rows), accesses, table.resolve(list(range(rows)), accesses)):
            hits, misses, evictions, slots, order = refs[row].access(positions.tolist())
            assert (res.hits, res.misses, res.evictions, res.slots.tolist()) == (hits, misses, evictions, slots)
            assert table.lru(row).lru_order() == order
            table.lru(row).check_integrity()


def test_a_working_set_of_glm5s_top_k_evicts_oldest_first_like_the_reference():
    """At GLM-5's top-k (2048 slots) a step's victims are picked by a partition of the stamps, which
    keeps no order for rows this long (it happens to come out sorted for short rows, e.g. the 64 slots
    of the tests above): the victims must still be sorted oldest first, so that miss i (ascending
    position) gets the i-th oldest slot. Both resolvers, every step, against the reference."""
    capacity, rows = 2048, 2
    rng = random.Random(11)
    table, alone = LRUTable(rows, capacity), WorkingSetLRU(capacity)
    refs, ref_alone = [BruteForceLRU(capacity) for _ in range(rows)], BruteForceLRU(capacity)
    for step in range(10):
        accesses = [np.array(sorted(rng.sample(range(3 * capacity), rng.randint(200, 1200))), dtype=np.int64)
                    for _ in range(rows + 1)]
        results = table.resolve(list(range(rows)), accesses[:rows]) + [alone.resolve(accesses[rows])]
        for ref, positions, res in zip(refs + [ref_alone], accesses, results):
            hits, misses, evictions, slots, _ = ref.access(positions.tolist())
            assert (res.hits, res.misses, res.evictions, res.slots.tolist()) == (hits, misses, evictions, slots), step
