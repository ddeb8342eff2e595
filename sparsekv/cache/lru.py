"""Working-set bookkeeping for the tiered KV cache: which token position sits in which device slot.

Plain Python, no torch. One `WorkingSetLRU` per (request, index group): the layers of an IndexShare
group attend to the same positions every step, so their working sets stay in lockstep and one
resolver serves them all (tiered-kv-cache.md §1.5, "plan replay" for shared-index layers).

The policy, exactly (tests/test_lru.py checks it against a brute-force reference):

  * a step accesses a set A of distinct positions, |A| <= capacity;
  * hits are the positions of A already resident, misses the others;
  * misses take free slots first (lowest slot id first), then evict the least-recently-used
    resident positions that are not in A, oldest first; miss i (ascending position) gets the
    i-th slot so obtained;
  * afterwards every position of A is most recently used, in ascending position order.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice


@dataclass
class Resolution:
    """The result of one access: where each position lives now and what had to move."""

    slots: list[int]                                                    # slot of each accessed position, input order
    hits: int = 0
    misses: list[tuple[int, int]] = field(default_factory=list)        # (position, slot) to fill
    evictions: list[tuple[int, int]] = field(default_factory=list)     # (position, slot) dropped


class WorkingSetLRU:
    """A fixed number of device slots holding token positions, least-recently-used replacement."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"working-set capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # least recently used first
        self._free: deque[int] = deque(range(capacity))

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, position: int) -> bool:
        return position in self._slot_of

    def slot_of(self, position: int) -> int:
        return self._slot_of[position]

    def lru_order(self) -> list[int]:
        """Resident positions, least recently used first."""
        return list(self._slot_of)

    def resolve(self, positions: list[int]) -> Resolution:
        wanted = set(positions)
        if len(wanted) != len(positions):
            raise ValueError("positions accessed in one step must be distinct")
        if len(wanted) > self.capacity:
            raise ValueError(f"{len(wanted)} positions accessed at once, working set holds {self.capacity}")
        ordered = sorted(positions)
        missing = [p for p in ordered if p not in self._slot_of]
        res = Resolution([], len(positions) - len(missing))
        need = len(missing) - len(self._free)
        victims = list(islice((p for p in self._slot_of if p not in wanted), max(need, 0)))
        freed = [self._free.popleft() for _ in range(min(len(missing), len(self._free)))]
        for victim in victims:
            slot = self._slot_of.pop(victim)
            res.evictions.append((victim, slot))
            freed.append(slot)
        for p, slot in zip(missing, freed):
            self._slot_of[p] = slot
            res.misses.append((p, slot))
        for p in ordered:
            self._slot_of.move_to_end(p)
        res.slots = [self._slot_of[p] for p in positions]
        return res

    def check_integrity(self) -> None:
        used = list(self._slot_of.values())
        assert len(set(used)) == len(used), "a working-set slot holds two positions"
        assert not set(used) & set(self._free), "a working-set slot is both free and used"
        assert len(used) + len(self._free) == self.capacity, "free + used != capacity"
        assert all(0 <= s < self.capacity for s in used + list(self._free)), "slot id out of range"
