"""The working-set LRU against a brute-force reference (no torch)."""
import random

import pytest

from sparsekv.cache.lru import WorkingSetLRU


class BruteForceLRU:
    """The documented policy, written the slow and obvious way: timestamps, scans, no ordered dict."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.slot = [None] * capacity          # slot -> position
        self.last_used = {}                    # position -> (step, position) recency key
        self.step = 0

    def access(self, positions):
        self.step += 1
        wanted = set(positions)
        resident = {p: s for s, p in enumerate(self.slot) if p is not None}
        hits = sum(p in resident for p in positions)
        misses, evictions = [], []
        for p in sorted(positions):
            if p in resident:
                continue
            free = [s for s, q in enumerate(self.slot) if q is None]
            if free:
                s = min(free)
            else:
                candidates = [q for q in resident if q not in wanted]
                victim = min(candidates, key=lambda q: self.last_used[q])
                s = resident.pop(victim)
                evictions.append((victim, s))
                del self.last_used[victim]
            self.slot[s] = p
            resident[p] = s
            misses.append((p, s))
        for p in positions:
            self.last_used[p] = (self.step, p)   # ascending position order within a step
        order = sorted(resident, key=lambda q: self.last_used[q])
        return hits, misses, evictions, [resident[p] for p in positions], order


@pytest.mark.parametrize("capacity,universe,seed", [(1, 3, 0), (4, 6, 1), (8, 20, 2), (16, 64, 3), (8, 9, 4),
                                                    (64, 200, 5), (33, 1000, 6)])
def test_lru_matches_brute_force(capacity, universe, seed):
    rng = random.Random(seed)
    lru, ref = WorkingSetLRU(capacity), BruteForceLRU(capacity)
    for _ in range(300):
        k = rng.randint(1, capacity)
        positions = rng.sample(range(universe), min(k, universe))
        if rng.random() < 0.5:  # locality, as in decoding: mostly recent positions
            positions = sorted(positions)
        res = lru.resolve(positions)
        hits, misses, evictions, slots, order = ref.access(positions)
        assert (res.hits, res.misses, res.evictions, res.slots.tolist()) == (hits, misses, evictions, slots)
        assert lru.lru_order() == order
        lru.check_integrity()


def test_lru_fills_free_slots_before_evicting():
    lru = WorkingSetLRU(4)
    assert lru.resolve([10, 11]).misses == [(10, 0), (11, 1)]
    res = lru.resolve([11, 12, 13])
    assert res.hits == 1 and res.misses == [(12, 2), (13, 3)] and not res.evictions
    res = lru.resolve([14])  # 10 is least recently used
    assert res.evictions == [(10, 0)] and res.misses == [(14, 0)]


def test_lru_never_evicts_a_position_of_the_same_step():
    lru = WorkingSetLRU(3)
    lru.resolve([1, 2, 3])
    res = lru.resolve([1, 2, 9])  # 1 and 2 are old, yet accessed now: 3 goes
    assert res.evictions == [(3, 2)] and res.hits == 2


def test_lru_rejects_bad_accesses():
    lru = WorkingSetLRU(2)
    with pytest.raises(ValueError, match="distinct"):
        lru.resolve([1, 1])
    with pytest.raises(ValueError, match="holds 2"):
        lru.resolve([1, 2, 3])
    with pytest.raises(ValueError):
        WorkingSetLRU(0)


def test_lru_takes_arrays_in_any_order_and_rejects_negative_positions():
    import numpy as np
    lru = WorkingSetLRU(4)
    res = lru.resolve(np.array([30, 10, 20]))
    assert res.slots.tolist() == [2, 0, 1] and res.misses == [(10, 0), (20, 1), (30, 2)]
    assert lru.resolve([20, 40]).slots.tolist() == [1, 3] and lru.lru_order() == [10, 30, 20, 40]
    with pytest.raises(ValueError, match=">= 0"):
        lru.resolve([-1])
    lru.check_integrity()


def _exhaustive_optimum(steps, capacity):
    """The fewest counted misses over every possible eviction choice (tiny cases only); an uncounted
    step's positions may be evicted at once (a free insertion the policy skips)."""
    from itertools import combinations
    states = {frozenset(): 0}
    for positions, counted in steps:
        step, nxt = set(positions), {}
        for resident, misses in states.items():
            misses += len(step - resident) if counted else 0
            full = resident | step
            excess = len(full) - capacity
            candidates = full - step if counted else full   # a free insertion may be skipped
            for victims in combinations(sorted(candidates), max(excess, 0)):
                state = frozenset(full - set(victims))
                nxt[state] = min(nxt.get(state, misses), misses)
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("capacity,universe,seed", [(1, 3, 0), (2, 5, 1), (3, 6, 2), (3, 7, 3), (4, 7, 4)])
def test_replay_optimum_is_the_exhaustive_minimum_and_bounds_lru(capacity, universe, seed):
    from sparsekv.cache.lru import replay
    rng = random.Random(seed)
    for _ in range(40):
        steps = []
        for _ in range(9):  # counted steps, and free insertions: a decode's promoted token, or several
            steps.append((rng.sample(range(universe), rng.randint(1, capacity)), rng.random() < 0.8))
            if rng.random() < 0.4:
                steps.append(([rng.randrange(universe)], False))
        counts = replay(steps, capacity)
        assert counts.optimal_misses == _exhaustive_optimum(steps, capacity)
        lru, lru_misses = WorkingSetLRU(capacity), 0
        for positions, counted in steps:
            missed = lru.resolve(positions).miss_positions.size
            lru_misses += missed if counted else 0
        assert counts.lru_misses == lru_misses
        assert counts.compulsory_misses <= counts.optimal_misses <= counts.lru_misses
        assert counts.lookups == sum(len(p) for p, counted in steps if counted)


def test_replay_counts_a_cyclic_trace():
    from sparsekv.cache.lru import replay
    # positions 0..3 in a cycle through 3 slots: LRU misses every access, the optimum one in three
    steps = [([t % 4], True) for t in range(12)]
    counts = replay(steps, 3)
    assert (counts.lookups, counts.lru_misses, counts.compulsory_misses) == (12, 12, 4)
    assert counts.optimal_misses == 6   # 4 first accesses, then one miss per 3 accesses
    assert counts.rates()["lru_miss_rate"] == 1.0


def test_lru_rejects_a_negative_position_among_several_and_changes_nothing():
    """The several-position path checks for negatives too (not only the one-position fast path): a
    negative position would index the position table from its end and corrupt another position's slot."""
    import numpy as np
    lru = WorkingSetLRU(4)
    lru.resolve([5, 6])
    for bad in ([-1, 2], np.array([7, -3, 1])):
        with pytest.raises(ValueError, match=">= 0"):
            lru.resolve(bad)
        assert lru.lru_order() == [5, 6] and len(lru) == 2
        lru.check_integrity()


def test_slots_of_answers_positions_past_the_position_table_without_moving_anything():
    """slots_of grows the position table to cover the largest position asked (it starts at 1024
    entries): a position at or past the table's end is simply not resident, and nothing is accessed."""
    import numpy as np
    lru = WorkingSetLRU(4)
    lru.resolve([3, 7])
    assert lru.slots_of(np.array([7, 3, 1024, 5000, 9])).tolist() == [1, 0, -1, -1, -1]
    assert lru.slots_of(np.array([], dtype=np.int64)).tolist() == []
    assert lru.lru_order() == [3, 7] and len(lru) == 2
    lru.check_integrity()


def _populated_lru():
    """Capacity 4, three positions resident (slots 0..2), slot 3 free."""
    lru = WorkingSetLRU(4)
    lru.resolve([10, 20])
    lru.resolve([30])
    lru.check_integrity()
    return lru


@pytest.mark.parametrize("corrupt,message", [
    (lambda lru: lru._position.__setitem__(1, 10), "holds two positions"),
    (lambda lru: lru._stamp.__setitem__(1, lru._stamp[0]), "share a recency stamp"),
    (lambda lru: lru._stamp.__setitem__(3, 1000), "free slot looks recently used"),
    (lambda lru: lru._slot_of.__setitem__([10, 20], [1, 0]), "disagrees with slots"),
    (lambda lru: lru._slot_of.__setitem__(99, 3), "holds an evicted position"),
], ids=["two slots one position", "shared stamp", "free slot stamped", "swapped table", "stale table entry"])
def test_lru_check_integrity_catches_each_kind_of_corruption(corrupt, message):
    """check_integrity is what the engine's integrity checks rely on for the working sets: each of
    its assertions must fire on the corruption it names (an assertion that stopped checking would let
    a wrong slot be read silently)."""
    lru = _populated_lru()
    corrupt(lru)
    with pytest.raises(AssertionError, match=message):
        lru.check_integrity()


@pytest.mark.parametrize("several", [False, True], ids=["one position", "several positions"])
def test_a_decode_reaching_the_end_of_the_position_table_matches_brute_force(several):
    """The position table starts at 1024 entries and grows to cover each access: a request decoding
    through positions 1016..1031 accesses position 1024, the table's first uncovered entry, as the
    largest of its step, through the one-position path (a promoted token) or the several-position one
    (a selection): the same hits, misses, evictions and slots as the reference at every step."""
    lru, ref = WorkingSetLRU(6), BruteForceLRU(6)
    for t in range(1016, 1032):
        positions = [t - 7, t - 3, t] if several else [t]
        res = lru.resolve(positions)
        hits, misses, evictions, slots, order = ref.access(positions)
        assert (res.hits, res.misses, res.evictions, res.slots.tolist()) == (hits, misses, evictions, slots), t
        assert lru.lru_order() == order
        lru.check_integrity()
