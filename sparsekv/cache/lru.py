"""Bookkeeping of the tiered KV cache, Python and numpy, no torch: which token position sits in which
device slot (`WorkingSetLRU`), hit/miss/byte counters, and a replay of a selection trace against LRU
and Belady's optimum. The sizes the budgets allow are in sizing.py.

One `WorkingSetLRU` per (request, index group): the layers of an IndexShare group attend to the
same positions every step, so their working sets stay in lockstep and one resolver serves them all
(the group's later layers replay the leader's plan: the same hits, misses and slots). The LRUs of a
group are rows of one `LRUTable`, so a step resolves every request's access in one batched pass.

The policy, exactly (tests/test_lru.py checks it against a brute-force reference):

  * a step accesses a set A of distinct positions, |A| <= capacity;
  * hits are the positions of A already resident, misses the others;
  * misses take free slots first (lowest slot id first), then evict the least-recently-used
    resident positions that are not in A, oldest first; miss i (ascending position) gets the
    i-th slot so obtained;
  * afterwards every position of A is most recently used, in ascending position order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np



_NEVER = np.iinfo(np.int64).max
_NONE = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))


@dataclass
class Resolution:
    """The result of one access: where each position lives now and what had to move (numpy arrays)."""

    slots: np.ndarray                       # slot of each accessed position, input order
    hits: int
    miss_positions: np.ndarray              # ascending; miss_slots[i] is where miss_positions[i] goes
    miss_slots: np.ndarray
    evicted_positions: np.ndarray           # dropped to make room, least recently used first
    evicted_slots: np.ndarray

    @property
    def misses(self) -> list[tuple[int, int]]:
        return list(zip(self.miss_positions.tolist(), self.miss_slots.tolist()))

    @property
    def evictions(self) -> list[tuple[int, int]]:
        return list(zip(self.evicted_positions.tolist(), self.evicted_slots.tolist()))


class WorkingSetLRU:
    """A fixed number of device slots holding token positions, least-recently-used replacement.

    Vectorised: each slot has a position (-1 when free) and a recency stamp, and a dense table maps
    positions to slots (8 bytes per position of context, growing with the request: 8 MB per group at
    1M, under 1% of that request's host latent). Free slots carry negative stamps ascending with
    their id, so "the oldest stamps not accessed now" is exactly the policy's order: free slots lowest
    id first, then residents least recently used first. One access costs a handful of numpy calls,
    whatever k (top-k is 2048 on GLM-5)."""

    def __init__(self, capacity: int, table: LRUTable | None = None, row: int = 0):
        if capacity < 1:
            raise ValueError(f"working-set capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # its state is row `row` of `table` (one of many working sets resolved together), or its own
        self.table, self.row = (LRUTable(1, capacity) if table is None else table), row

    @property
    def _position(self) -> np.ndarray:  # slot -> position, -1 free
        return self.table.position[self.row]

    @property
    def _stamp(self) -> np.ndarray:     # recency; free slots < 0
        return self.table.stamp[self.row]

    @property
    def _slot_of(self) -> np.ndarray:   # position -> slot, -1 not resident
        return self.table.slot_of[self.row]

    @_slot_of.setter
    def _slot_of(self, table: np.ndarray) -> None:
        self.table.slot_of[self.row] = table

    @property
    def _clock(self) -> int:
        return int(self.table.clock[self.row])

    @_clock.setter
    def _clock(self, value: int) -> None:
        self.table.clock[self.row] = value

    def __len__(self) -> int:
        return int((self._position >= 0).sum())

    def lru_order(self) -> list[int]:
        """Resident positions, least recently used first."""
        order = np.argsort(self._stamp, kind="stable")
        return [p for p in self._position[order].tolist() if p >= 0]

    def _cover(self, end: int) -> None:
        """Grow the position table to cover positions < end."""
        if end > self._slot_of.size:
            grown = np.full(max(end, 2 * self._slot_of.size), -1, dtype=np.int64)
            grown[:self._slot_of.size] = self._slot_of
            self._slot_of = grown

    def resolve(self, positions) -> Resolution:
        if not (isinstance(positions, np.ndarray) and positions.dtype == np.int64 and positions.ndim == 1):
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = positions.size
        if n > self.capacity:
            raise ValueError(f"{n} positions accessed at once, working set holds {self.capacity}")
        if n <= 1:  # every plain decode step promotes its newest token: keep it cheap
            return self._resolve_one(int(positions[0])) if n else Resolution(positions, 0, *_NONE, *_NONE)
        order = None
        if not (positions[1:] > positions[:-1]).all():  # top-k selections come sorted: no reordering
            order = np.argsort(positions, kind="stable")
            positions = positions[order]
            if (positions[1:] == positions[:-1]).any():
                raise ValueError("positions accessed in one step must be distinct")
        if positions[0] < 0:
            raise ValueError("positions must be >= 0")
        self._cover(int(positions[-1]) + 1)
        slots = self._slot_of[positions]
        missing = slots < 0
        miss_positions = positions[missing]
        victims = self._oldest_unused(slots, missing, miss_positions.size)
        evicted_positions = self._position[victims]
        was_resident = evicted_positions >= 0
        evicted = evicted_positions[was_resident], victims[was_resident]
        self._slot_of[evicted[0]] = -1
        self._slot_of[miss_positions] = victims
        self._position[victims] = miss_positions
        slots[missing] = victims
        self._stamp[slots] = np.arange(self._clock, self._clock + n)  # ascending position order
        self._clock += n
        if order is not None:
            slots[order] = slots.copy()  # back to input order
        return Resolution(slots, n - miss_positions.size, miss_positions, victims, *evicted)

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        """Where each position lives now (-1: not resident); no access, nothing moves."""
        self._cover(int(positions.max()) + 1 if positions.size else 0)
        return self._slot_of[positions]

    def _resolve_one(self, position: int) -> Resolution:
        """resolve([position]), the same policy without the array machinery."""
        if position < 0:
            raise ValueError("positions must be >= 0")
        self._cover(position + 1)
        slot, hit, evicted = int(self._slot_of[position]), True, _NONE
        if slot < 0:
            slot, hit = int(self._stamp.argmin()), False  # the oldest stamp: lowest free slot, else LRU
            old = int(self._position[slot])
            if old >= 0:
                self._slot_of[old] = -1
                evicted = np.array([old]), np.array([slot])
            self._slot_of[position], self._position[slot] = slot, position
        self._stamp[slot] = self._clock
        self._clock += 1
        moved = _NONE if hit else (np.array([position]), np.array([slot]))
        return Resolution(np.array([slot]), int(hit), *moved, *evicted)

    def _oldest_unused(self, slots: np.ndarray, missing: np.ndarray, count: int) -> np.ndarray:
        """`count` slots with the oldest stamps, not among this access's resident `slots`, oldest first."""
        if count == 0:
            return _NONE[0]
        stamps = self._stamp
        if count < missing.size:  # some accessed positions are resident: their slots are not candidates
            stamps = stamps.copy()
            stamps[slots[~missing]] = _NEVER
        if count == 1:
            return stamps.argmin(keepdims=True)
        picked = np.argpartition(stamps, count - 1)[:count] if count < self.capacity else np.arange(self.capacity)
        return picked[np.argsort(stamps[picked], kind="stable")]

    def check_integrity(self) -> None:
        used = self._position[self._position >= 0]
        assert np.unique(used).size == used.size, "a working-set slot holds two positions"
        assert self._position.shape == self._stamp.shape == (self.capacity,), "working set resized"
        assert np.unique(self._stamp).size == self.capacity, "two slots share a recency stamp"
        assert (self._stamp[self._position < 0] < 0).all(), "a free slot looks recently used"
        resident = np.flatnonzero(self._position >= 0)
        assert (self._slot_of[self._position[resident]] == resident).all(), "position table disagrees with slots"
        assert (self._slot_of >= 0).sum() == resident.size, "position table holds an evicted position"


class LRUTable:
    """The state of many working sets' LRUs, one row each ([rows, capacity] slot positions and
    recency stamps, a clock per row), so that one step's accesses to all of them resolve in one
    batched pass (`resolve`), exactly as each row's `WorkingSetLRU.resolve` would, in a fixed number of
    array operations plus three small lookups per row (each row's position table keeps its own size)."""

    def __init__(self, rows: int, capacity: int):
        self.capacity = capacity
        self.position = np.full((rows, capacity), -1, dtype=np.int64)
        self.stamp = np.empty((rows, capacity), dtype=np.int64)
        self.clock = np.zeros(rows, dtype=np.int64)
        self.slot_of: list[np.ndarray] = [_EMPTY_TABLE] * rows
        for row in range(rows):
            self.reset(row)

    def reset(self, row: int) -> None:
        """Row `row` empty, as a new WorkingSetLRU."""
        self.position[row] = -1
        self.stamp[row] = np.arange(self.capacity, dtype=np.int64) - self.capacity
        self.clock[row] = 0
        self.slot_of[row] = np.full(1024, -1, dtype=np.int64)

    def lru(self, row: int) -> WorkingSetLRU:
        return WorkingSetLRU(self.capacity, self, row)

    def resolve(self, rows: list[int], positions: list[np.ndarray]) -> list[Resolution]:
        """`WorkingSetLRU.resolve(positions[i])` of each row rows[i] (distinct rows; each access distinct
        positions, ascending), all at once: the same Resolutions and the same state afterwards."""
        if len(set(rows)) != len(rows):
            raise ValueError("a working set accessed twice in one batch")
        sizes = np.array([p.size for p in positions], dtype=np.int64)
        if not rows or not sizes.any():
            return [self.lru(r).resolve(p) for r, p in zip(rows, positions)]
        r, n = np.asarray(rows, dtype=np.int64), int(sizes.max())
        valid = np.arange(n)[None, :] < sizes[:, None]
        padded = np.full(valid.shape, _NEVER, dtype=np.int64)
        padded[valid] = np.concatenate(positions)
        self._check(padded, sizes, valid)
        slots = np.full((len(rows), n), -1, dtype=np.int64)
        for i, (row, pos) in enumerate(zip(rows, positions)):
            if pos.size:
                self._cover(row, int(pos[-1]) + 1)
                slots[i, :pos.size] = self.slot_of[row][pos]
        missing = valid & (slots < 0)
        stamps = self.stamp[r]                                    # a copy: hit slots are not candidates
        hit_i, hit_j = np.nonzero(valid & ~missing)
        stamps[hit_i, slots[hit_i, hit_j]] = _NEVER
        oldest = _oldest(stamps, int(missing.sum(axis=1).max()))  # free slots first, then least recent
        miss_i, miss_j = np.nonzero(missing)                      # each row's misses, ascending position
        victims = oldest[miss_i, (np.cumsum(missing, axis=1) - 1)[miss_i, miss_j]]
        miss_positions = padded[miss_i, miss_j]
        evicted = self.position[r[miss_i], victims]
        self.position[r[miss_i], victims] = miss_positions
        slots[miss_i, miss_j] = victims
        ends = np.cumsum(missing.sum(axis=1))
        for i, row in enumerate(rows):
            part = slice(ends[i - 1] if i else 0, ends[i])
            was = evicted[part] >= 0
            self.slot_of[row][evicted[part][was]] = -1
            self.slot_of[row][miss_positions[part]] = victims[part]
        at_i, at_j = np.nonzero(valid)
        self.stamp[r[at_i], slots[at_i, at_j]] = self.clock[r][at_i] + at_j   # ascending position order
        self.clock[r] += sizes
        out = []
        for i in range(len(rows)):
            part = slice(ends[i - 1] if i else 0, ends[i])
            was = evicted[part] >= 0
            out.append(Resolution(slots[i, :sizes[i]].copy(), int(sizes[i] - (part.stop - part.start)),
                                  miss_positions[part], victims[part], evicted[part][was], victims[part][was]))
        return out

    def _check(self, padded: np.ndarray, sizes: np.ndarray, valid: np.ndarray) -> None:
        if int(sizes.max()) > self.capacity:
            raise ValueError(f"{int(sizes.max())} positions accessed at once, working set holds {self.capacity}")
        if padded.min() < 0:
            raise ValueError("positions must be >= 0")
        if not (padded[:, 1:] > padded[:, :-1])[valid[:, 1:]].all():
            raise ValueError("positions of a batched access must be distinct and ascending")

    def _cover(self, row: int, end: int) -> None:
        table = self.slot_of[row]
        if end > table.size:
            grown = np.full(max(end, 2 * table.size), -1, dtype=np.int64)
            grown[:table.size] = table
            self.slot_of[row] = grown


_EMPTY_TABLE = np.empty(0, dtype=np.int64)


def _oldest(stamps: np.ndarray, count: int) -> np.ndarray:
    """Each row's `count` slots of oldest stamp, oldest first ([rows, count]): a partition, then a sort
    of only those (a step's misses are few; the stamps of a row are distinct below _NEVER)."""
    if count <= 1:
        return stamps.argmin(axis=1)[:, None] if count else np.empty((stamps.shape[0], 0), dtype=np.int64)
    if count >= stamps.shape[1]:
        return np.argsort(stamps, axis=1, kind="stable")
    part = np.argpartition(stamps, count - 1, axis=1)[:, :count]
    return np.take_along_axis(part, np.argsort(np.take_along_axis(stamps, part, 1), axis=1, kind="stable"), 1)


@dataclass
class TierCounters:
    """Hits and misses count one lookup per (position, layer); bytes are what crosses the host link."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    warmed: int = 0  # entries (one per position and layer) placed before a first decode, not looked up

    def add(self, hits: int = 0, misses: int = 0, h2d: int = 0, d2h: int = 0, warmed: int = 0) -> None:
        self.hits += hits
        self.misses += misses
        self.h2d_bytes += h2d
        self.d2h_bytes += d2h
        self.warmed += warmed

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {"tier_hits": self.hits, "tier_misses": self.misses,
                "tier_miss_rate": self.misses / lookups if lookups else 0.0,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "tier_warmed": self.warmed}


@dataclass
class ReplayCounts:
    """Lookups and misses of one access trace (counted steps only), under LRU and under the offline
    optimum, and the misses no policy avoids (a position's first access)."""

    lookups: int = 0
    lru_misses: int = 0
    optimal_misses: int = 0
    compulsory_misses: int = 0

    def rates(self) -> dict:
        n = max(self.lookups, 1)
        return {"lookups": self.lookups, "lru_miss_rate": self.lru_misses / n,
                "optimal_miss_rate": self.optimal_misses / n, "compulsory_miss_rate": self.compulsory_misses / n}


def replay(steps: list[tuple[list[int], bool]], capacity: int) -> ReplayCounts:
    """Replay a working set's access trace: `steps` are (distinct positions, counted). Uncounted steps
    are insertions that cost no host transfer (a decode's promoted new token) but still occupy slots.

    LRU is `WorkingSetLRU` itself. The optimum (Belady's furthest-next-use, adapted) evicts first the
    residents whose next access is free or never comes, then those whose next counted access is
    furthest away, never one the counted step itself accesses, and may skip a free insertion;
    tests/test_lru.py checks it against an exhaustive search. No replacement policy misses less on
    the same trace, so it tells whether a smarter policy could reach a miss-rate goal at this buffer
    size or whether the selection itself moves too much."""
    lru, counts, seen = WorkingSetLRU(capacity), ReplayCounts(), set()
    for positions, counted in steps:
        res = lru.resolve(positions)
        if counted:
            counts.lookups += len(positions)
            counts.lru_misses += res.miss_positions.size
            counts.compulsory_misses += sum(p not in seen for p in positions)
        seen.update(positions)
    counts.optimal_misses = _optimal_misses(steps, capacity)
    return counts


def _optimal_misses(steps: list[tuple[list[int], bool]], capacity: int) -> int:
    uses: dict[int, list[tuple[int, bool]]] = {}
    for t, (positions, counted) in enumerate(steps):
        for p in positions:
            uses.setdefault(p, []).append((t, counted))
    for times in uses.values():
        times.reverse()  # times[-1] is the next access
    never = len(steps)

    def cost_key(p: int) -> int:
        """Evicting p costs a miss at its next access if that access is counted; an uncounted one
        brings p back for free, so p is as cheap to drop as a position never used again."""
        if not uses[p] or not uses[p][-1][1]:
            return never
        return uses[p][-1][0]

    resident, misses = set(), 0
    for positions, counted in steps:
        step = set(positions)
        if len(step) > capacity:
            raise ValueError(f"{len(step)} positions accessed at once, working set holds {capacity}")
        misses += len(step - resident) if counted else 0
        resident |= step
        for p in step:
            uses[p].pop()
        excess = len(resident) - capacity
        if excess > 0:
            candidates = resident - step if counted else resident  # a free insertion may be skipped
            victims = sorted(candidates, key=cost_key, reverse=True)
            resident.difference_update(victims[:excess])
    return misses
