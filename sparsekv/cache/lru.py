"""Bookkeeping of the tiered KV cache, plain Python, no torch: which token position sits in which
device slot (`WorkingSetLRU`), hit/miss/byte counters, and the sizes the budgets allow.

One `WorkingSetLRU` per (request, index group): the layers of an IndexShare
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

from ..config import ConfigError, EngineConfig, ModelConfig


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


def latent_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return cfg.latent_dim * itemsize * cfg.num_hidden_layers


def index_bytes_per_layer(cfg: ModelConfig, itemsize: int, fp8: bool = False) -> int:
    """One token's indexer key in one layer (fp8: e4m3 bytes plus an fp32 scale)."""
    return cfg.index_head_dim + 4 if fp8 else cfg.index_head_dim * itemsize


def index_bytes_per_token(cfg: ModelConfig, itemsize: int, fp8: bool = False) -> int:
    return index_bytes_per_layer(cfg, itemsize, fp8) * len(cfg.full_layers)


@dataclass(frozen=True)
class TierSizes:
    """What the budgets allow. Logical pages bound the host rows and the device indexer keys."""

    num_pages: int
    num_buffers: int
    buffer_tokens: int
    limit: str  # the binding budget, for admission errors


def plan_tier_sizes(config: EngineConfig, cfg: ModelConfig, latent_per_token: int, selector_per_token: int,
                    default_pages: int) -> TierSizes:
    page, n = config.kv_page_size, config.device_buffer_tokens or 2 * cfg.index_topk
    buffers = config.max_num_seqs
    limits = []
    if config.num_kv_pages:
        limits.append((config.num_kv_pages, f"num_kv_pages={config.num_kv_pages}"))
    if config.host_kv_budget_bytes:
        limits.append((config.host_kv_budget_bytes // (page * latent_per_token),
                       f"host_kv_budget_bytes={config.host_kv_budget_bytes}"))
    rows = n + 1 + config.num_speculative_tokens  # LRU slots + the step's new tokens
    if config.device_kv_budget_bytes:
        left = config.device_kv_budget_bytes - buffers * rows * latent_per_token
        if left < page * max(selector_per_token, 1):
            raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} cannot hold {buffers} working "
                              f"sets of {rows} tokens ({rows * latent_per_token} B each, max_num_seqs={buffers}) "
                              f"plus one page of indexer keys; raise it or lower max_num_seqs / device_buffer_tokens")
        limits.append((left // (page * max(selector_per_token, 1)),
                       f"device_kv_budget_bytes={config.device_kv_budget_bytes} (indexer keys after working sets)"))
    pages, limit = min(limits) if limits else (default_pages, "the default cache size")
    if pages < 1:
        raise ConfigError(f"{limit} holds less than one {page}-token page of host KV "
                          f"({page * latent_per_token} B); raise it")
    return TierSizes(pages, buffers, n, limit)


@dataclass
class TierCounters:
    """Hits and misses count one lookup per (position, layer); bytes are what crosses the host link."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def add(self, hits: int = 0, misses: int = 0, h2d: int = 0, d2h: int = 0) -> None:
        self.hits += hits
        self.misses += misses
        self.h2d_bytes += h2d
        self.d2h_bytes += d2h

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {"tier_hits": self.hits, "tier_misses": self.misses,
                "tier_miss_rate": self.misses / lookups if lookups else 0.0,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes}


def untiered_pages(config: EngineConfig, cfg: ModelConfig, itemsize: int) -> int:
    """Pages of a fully device-resident cache that fit in `device_kv_budget_bytes`."""
    per_token = latent_bytes_per_token(cfg, itemsize) + index_bytes_per_token(cfg, itemsize)
    if config.num_speculative_tokens:  # the MTP layer's own latent and indexer keys
        per_token += (cfg.latent_dim + cfg.index_head_dim) * itemsize
    per_page = config.kv_page_size * per_token
    if config.device_kv_budget_bytes < per_page:
        raise ConfigError(f"device_kv_budget_bytes={config.device_kv_budget_bytes} holds less than one "
                          f"{config.kv_page_size}-token page ({per_page} B)")
    return config.device_kv_budget_bytes // per_page
