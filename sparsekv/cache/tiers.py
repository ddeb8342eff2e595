"""Tiered KV cache: a bounded device working set per request, the full latent history in a host store.

`TieredKVPool` has `KVPool`'s interface, so the model is unchanged. One page table (the engine's
`PageAllocator`) addresses *logical* slots, which hold a position's indexer keys on the device and
its latent in the host store::

    device                                              host (TieredHostStore, layer-first)
      index keys  [logical slots]   all history (DSA)      latent [logical slots]   all history
      working sets, per layer  [max_num_seqs x (N + R)]    (written at every step: backup, D2H)
        buffer b: rows b(N+R) .. b(N+R)+N-1    LRU slots
                  rows b(N+R)+N .. +R-1        the step's new tokens (R = 1 + speculative drafts)

A step, as the engine drives it:
  1. `begin_step(chunks)`: a chunk of at most R new tokens (a decode: the newest token and its
     drafts) uses its request's working set. Last step's new tokens that are now final (before this
     chunk's first position) are promoted into the LRU slots (a device copy); rejected drafts' rows
     are dropped, never read again.
  2. `write_latent`: every new latent goes to the host store; a decode's also to its new rows.
  3. A full layer's `gather_latent` (sparse regime) or `latent_for` (dense regime, T <= top-k <= N)
     resolves the positions through the group's LRU (every decode of the step in one batched pass,
     `LRUTable`): hits stay, misses are copied host -> device into
     the least-recently-used slots, for the full layer *and* its IndexShare shared layers at once
     (shared layers' copies on a CUDA side stream, waited on by the shared layer). Attention then
     reads the working set rows in the order it asked for: same values, same order, so it is exact.
     A decode with drafts resolves the union of its rows' selections; if that exceeds N, that
     request streams this step's rows from the host store instead (exact either way).
  4. Longer chunks (prefill) stream the rows they read from the host store, one query block at a
     time (the same transient a dense pool's gather makes); they do not touch the working set.

The MTP layer (speculative decoding) has its own working set and LRU in each request's buffer, and
its own pass: after the target's forward, `begin_mtp_pass(seqs)` notes the rows the MTP layer
writes (the step's newly final positions), promotes the last pass's rows into its LRU, and its
reads (the drafting row, then the chained draft steps reusing that selection) resolve like a
decode's. Positions a rejected draft wrote are rewritten next step; they never reach the LRU slots,
which only ever hold positions before the request's newest final token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..context import SeqSlice, padded_rows
from .host_store import HostLink, TieredHostStore, make_host_store
from .index_keys import IndexKeyCache
from .latent_format import PlainLatent, latent_format
from .lru import LRUTable, TierCounters, WorkingSetLRU
from .memory import check_tiered_fits
from .sizing import (TierSizes, format_of, index_bytes_per_token, indexer_bytes_per_token_layer,
                     latent_bytes_per_token, plan_tier_sizes, quest_bytes_per_token)
from .pages import PageAllocator
from .pool import distinct_positions, gather_picked


@dataclass
class _WorkingSet:
    """A decoding request's device buffer: one LRU per index group, shared by the group's layers."""

    buffer: int
    lrus: dict[int, WorkingSetLRU]  # per group leader (the MTP layer is its own group)
    # first position and count held in the new-token rows: the last decode's, the last MTP pass's
    new: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _StepState:
    ws_rows: torch.Tensor | None = None       # flat-batch rows of this step's decode tokens
    new_rows: torch.Tensor | None = None      # their new-token rows in the working sets
    decoding: dict = field(default_factory=dict)  # request -> its page ids (logical slots, on the CPU)
    plans: dict = field(default_factory=dict)  # (requests, group leader) -> _Plan
    priming: set = field(default_factory=set)  # requests prefilling their prompt's last chunk


@dataclass
class _Plan:
    """Where a group's decode rows read: working-set rows of the resolved requests (concatenated, in
    request order), and the requests whose selections did not fit in N, which stream from the host."""

    rows: torch.Tensor | None
    streamed: frozenset[int]  # indices into the step's requests


class TieredKVPool:
    """KVPool's interface over device working sets + a host store. See the module docstring."""

    def __init__(self, cfg: ModelConfig, sizes: TierSizes, page_size: int, dtype: torch.dtype, device,
                 host: TieredHostStore, fp8_index_keys: bool = False, keep_index_keys: bool = True,
                 mtp_layers: tuple[int, ...] = (), new_rows: int = 1, fmt=None, padding_page: bool = False):
        self.cfg, self.page_size, self.dtype, self.device = cfg, page_size, dtype, torch.device(device)
        self.fmt = fmt = fmt or PlainLatent(cfg, dtype)  # latent rows as stored (latent_format.py)
        self.num_slots = sizes.num_pages * page_size
        self.device_buffer_tokens, self.sizes, self.host = sizes.device_buffer_tokens, sizes, host
        self.mtp_layers = list(mtp_layers)
        self.layers = list(range(cfg.num_hidden_layers)) + self.mtp_layers
        self.leader = {**_group_leaders(cfg), **{l: l for l in self.mtp_layers}}
        self.groups = {g: [l for l in self.layers if self.leader[l] == g] for g in cfg.full_layers + self.mtp_layers}
        self.passes = {"target": [g for g in self.groups if g not in self.mtp_layers], "mtp": self.mtp_layers}
        self.new_rows = new_rows  # 1 + speculative drafts: the most new tokens a decode writes
        rows = sizes.num_buffers * (self.device_buffer_tokens + new_rows)
        # padding_page (decode graphs): a page of indexer keys past the allocator's and a zeroed working-set
        # row past every buffer's, which no request holds: a bucket's padding rows write (and read) there
        self.padding_slot = self.num_slots if padding_page else None
        self.padding_row = rows if padding_page else None
        self.ws = {l: torch.empty(rows + padding_page, fmt.row_width, dtype=fmt.row_dtype, device=self.device)
                   for l in self.layers}
        for table in self.ws.values():
            table[rows:].zero_()
        self.buffers = PageAllocator(sizes.num_buffers, self.device_buffer_tokens + new_rows)  # one "page" = one working set
        # every working set's LRU state, per group, one row per buffer: a step resolves them together
        self.lru_tables = {g: LRUTable(sizes.num_buffers, self.device_buffer_tokens) for g in self.groups}
        self.index = IndexKeyCache((cfg.full_layers if keep_index_keys else []) + self.mtp_layers,
                                   self.num_slots + (page_size if padding_page else 0), cfg.index_head_dim, dtype,
                                   self.device, fp8_index_keys)
        self.selector_bytes_per_token = self.index.bytes_per_token()  # Quest adds its page bounds (engine)
        self._resident: dict[str, _WorkingSet] = {}
        self._resolved: dict = {}  # request -> (`_older`, its Resolution): `_resolve` hands them to `_plan`
        self._counters: dict[str, TierCounters] = {}
        self.totals = TierCounters()
        self._step = _StepState()      # the target's forward
        self._mtp_step = _StepState()  # the MTP layer's pass after it
        self.link = HostLink(host, self.device)

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor indexed by logical slot (host latents, device indexer keys); working sets are
        per request, not per slot. Flush the link before reading or writing a page's rows in them."""
        return self.host.slot_tensors() + self.index.slot_tensors()

    def layer_slot_tensors(self, layer: int) -> list[torch.Tensor]:
        """The slot-indexed tensors layer `layer`'s forward writes (its host latents, its indexer keys)."""
        return self.host.layer_slot_tensors(layer) + self.index.layer_slot_tensors(layer)

    # -- sizes ---------------------------------------------------------------------------------
    def latent_bytes_per_token(self) -> int:
        return self.host.bytes_per_token

    def index_bytes_per_token(self) -> int:
        return self.index.bytes_per_token()

    def working_set_bytes(self) -> int:
        """Device latent bytes of one decoding request: N LRU rows + the new-token rows, every layer
        (the MTP layer's included)."""
        return (self.device_buffer_tokens + self.new_rows) * self.host.row_bytes * len(self.layers)

    @property
    def num_working_sets(self) -> int:
        return len(self._resident)

    # -- the step protocol ---------------------------------------------------------------------
    def begin_step(self, chunks) -> None:
        """Before the forward: note which rows are decodes, promote last step's final new tokens."""
        self.link.flush()  # last step's backups: every host row is current before anything reads it
        rows = [(ch.request_id, ch.page_ids, ch.first_position, ch.num_new_tokens) for ch in chunks]
        self._step = self._begin("target", rows, len(self.layers) - len(self.mtp_layers))
        for ch in chunks:  # a prompt's last chunk: its last row's selections prime the working set (`_prime`)
            if ch.samples_token and ch.num_new_tokens > self.new_rows:
                self._working_set(ch.request_id)
                self._step.priming.add(ch.request_id)
            elif ch.warm and ch.request_id in self._step.decoding:
                self._warm(ch)

    def begin_mtp_pass(self, seqs: list[SeqSlice], page_ids: dict[str, list[int]]) -> None:
        """Before the MTP layer's pass over `seqs` (speculative.py): the same for its working set."""
        rows = [(s.request_id, page_ids[s.request_id], s.first_new_position, s.num_new_tokens) for s in seqs]
        self._mtp_step = self._begin("mtp", rows, len(self.mtp_layers))

    def _begin(self, name: str, chunks: list[tuple[str, list[int], int, int]], layers: int) -> _StepState:
        step, ws_rows, new_rows, row, final = _StepState(), [], [], 0, []
        for rid, pages, first, n in chunks:
            self._count(rid, d2h=n * self.host.row_bytes * layers)
            if n <= self.new_rows:
                ws = self._working_set(rid)
                self._promote(ws, name, first, final)
                ws.new[name] = (first, n)
                step.decoding[rid] = pages
                ws_rows.extend(range(row, row + n))
                start = self._base(ws) + self.device_buffer_tokens
                new_rows.extend(range(start, start + n))
            elif rid in self._resident:
                self._resident[rid].new.pop(name, None)
            row += n
        self._move(name, final)
        if ws_rows:
            step.ws_rows, step.new_rows = self.link.index(ws_rows), self.link.index(new_rows)
        return step

    def release(self, request_id: str, keep_counters: bool = False) -> dict:
        """Free the request's working set (its host rows go with its pages). Returns its counters, which
        are forgotten unless `keep_counters` (a preempted request, to be resumed)."""
        ws = self._resident.pop(request_id, None)
        if ws is not None:
            self.buffers.free(request_id, [ws.buffer])
        self._step.decoding.pop(request_id, None)
        self._mtp_step.decoding.pop(request_id, None)
        counters = self._counters.get(request_id, TierCounters()) if keep_counters else \
            self._counters.pop(request_id, TierCounters())
        return counters.as_dict()

    def request_counters(self, request_id: str) -> dict:
        return self._counters.get(request_id, TierCounters()).as_dict()

    def has_working_set(self, request_id: str) -> bool:
        return request_id in self._resident

    # -- writes --------------------------------------------------------------------------------
    def write_latent(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        rows = self.fmt.encode(values)
        self.link.backup(layer, slots, rows)  # every token's latent reaches the host
        step = self._step_of(layer)
        if step.ws_rows is not None:
            self.ws[layer].index_copy_(0, step.new_rows, rows[step.ws_rows])

    def write_index_keys(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.index.write(layer, slots, values)

    # -- reads ---------------------------------------------------------------------------------
    def index_key_segments(self, layer: int, seq: SeqSlice) -> list[tuple[int | torch.Tensor, torch.Tensor]]:
        return self.index.segments(layer, seq)

    def index_keys_batch(self, layer: int, seqs: list[SeqSlice], scratch=None) -> torch.Tensor:
        return self.index.padded(layer, seqs, scratch)

    def index_key_pages(self, layer: int, seqs: list[SeqSlice]):
        return self.index.pages(layer, seqs, self.page_size)

    def _step_of(self, layer: int) -> _StepState:
        return self._mtp_step if layer in self.mtp_layers else self._step

    def _uses_working_set(self, layer: int, seq: SeqSlice) -> bool:
        return seq.request_id in self._step_of(layer).decoding

    def latent_for(self, layer: int, seq: SeqSlice) -> torch.Tensor:
        return self.gather_latent(layer, seq, torch.arange(seq.context_len))

    def gather_latent(self, layer: int, seq: SeqSlice, positions: torch.Tensor) -> torch.Tensor:
        """Latents of the selected positions [S, k] -> [S, k, latent_dim], in the order asked for. The
        rows of a prefill block select overlapping positions: each distinct one is read from the host
        (and decoded) once. A block of one row goes the same way: a prompt's last block may be one row
        (a real geometry's CPU block budget holds one row), and it primes the working set too."""
        flat = positions.reshape(-1)
        if not self._uses_working_set(layer, seq):
            distinct, inverse = distinct_positions(flat, seq.context_len)
            stored = self._stream(layer, seq, seq.slots[distinct.to(seq.slots.device)])
            inverse = inverse.to(stored.device)
            if positions.dim() == 2 and seq.request_id in self._step.priming and layer not in self.mtp_layers:
                self._prime_block(layer, seq, positions, distinct, inverse, stored)
            return self.fmt.decode(stored).index_select(0, inverse).view(*positions.shape, -1)
        return self.fmt.decode(self._rows_at(layer, seq, flat)).view(*positions.shape, -1)

    def _prime_block(self, layer: int, seq: SeqSlice, positions: torch.Tensor, distinct: torch.Tensor,
                     inverse: torch.Tensor, stored: torch.Tensor) -> None:
        """Place a prefill block's selected rows (stored form, already on the device: `stored` holds
        `distinct`'s) in the request's working set: every position the block selected when they fit in
        it, then its last row's again (the most recently used), else its last row's alone. The
        prompt's last rows select much of what the first decode will, so that step starts warm instead
        of missing up to k entries per layer (no host traffic: the rows were read for the prefill). A
        short last chunk (the page a prefix hit leaves to compute, as on a disaggregated decode side)
        fills it from all its rows, as a long prefill does from its last blocks. The last block's call
        is the one that stays."""
        last = positions.shape[1]
        if distinct.numel() <= self.device_buffer_tokens:
            self._prime(layer, seq, distinct, stored)
        self._prime(layer, seq, positions[-1], stored.index_select(0, inverse[-last:]))

    def _prime(self, layer: int, seq: SeqSlice, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Place the rows of `positions` in the request's working set: the full layer resolves them in
        its group's LRU, each shared layer fills the slots its group holds them in. Final positions
        only: a preempted request's recomputation ends in the drafts it kept, and a rejected draft's
        position is written again by the next decode, which finds it in the LRU (a hit, never copied)."""
        ws, wanted = self._resident[seq.request_id], positions.cpu().numpy().astype(np.int64)
        final = wanted < seq.context_len - seq.num_drafts
        if not final.all():
            wanted, rows = wanted[final], rows[self.link.index(np.flatnonzero(final))]
        if wanted.size > self.device_buffer_tokens:
            return
        lru = ws.lrus[self.leader[layer]]
        slots = lru.resolve(wanted).slots if layer == self.leader[layer] else lru.slots_of(wanted)
        held = slots >= 0
        self.ws[layer].index_copy_(0, self.link.index(self._base(ws) + slots[held]),
                                   rows[self.link.index(np.flatnonzero(held))])

    def _warm(self, ch) -> None:
        """A first decode's working set, filled before it runs from the selections a disaggregated
        prefill's tail made (`ch.warm`: per full layer, the distinct positions the tail's rows selected
        and the last row's), as `_prime_block` fills it from a last chunk computed here: the union when
        it fits, then the last row's as the most recently used. The rows come from the host store
        (counted as host -> device bytes and as warmed entries, not as lookups); on CUDA a group's
        shared layers copy on the side stream, as a step's misses do."""
        ws = self._resident[ch.request_id]
        base = self._base(ws)
        for leader, union, last in ch.warm:
            group = self.groups[leader]
            for positions in ((union, last) if len(union) <= self.device_buffer_tokens else (last,)):
                if len(positions) > self.device_buffer_tokens:
                    continue
                res = ws.lrus[leader].resolve(np.asarray(positions, dtype=np.int64))
                moved = res.miss_positions
                if moved.size:
                    self.link.fetch(group, torch.from_numpy(self._host_slots(ch.page_ids, moved)), self.ws,
                                    self.link.index(base + res.miss_slots))
                    self._count(ch.request_id, h2d=moved.size * len(group) * self.host.row_bytes,
                                warmed=moved.size * len(group))

    def _rows_at(self, layer: int, seq: SeqSlice, positions: torch.Tensor) -> torch.Tensor:
        """Stored rows of the positions [n] (not decoded)."""
        if self._uses_working_set(layer, seq):
            return self._gather(layer, [seq], [positions.cpu().numpy()])
        return self._stream(layer, seq, seq.slots[positions.to(seq.slots.device)])

    def dense_decode_latents(self, layer: int, seqs: list[SeqSlice], length: int) -> torch.Tensor:
        """Decoding requests' whole histories (each `latent_for`), padded to `length` entries by
        repeating the last: [B, length, latent_dim]. Resolved as one group when all use the working set."""
        if all(self._uses_working_set(layer, seq) for seq in seqs):
            flat = self._gather(layer, seqs, [np.arange(seq.context_len) for seq in seqs])
        else:
            flat = torch.cat([self._rows_at(layer, seq, torch.arange(seq.context_len)) for seq in seqs])
        flat = self.fmt.decode(flat)
        rows = padded_rows([seq.context_len for seq in seqs], length, flat.device)
        return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, -1)

    def piece_reads(self, rows: int, mtp: bool = False) -> WorkingSetPieceReads:
        """How the decode pieces of a `rows`-row bucket (model/decode_graphs.py) address this pool; `mtp`:
        the MTP layer's pieces (its extend pass and draft steps)."""
        return WorkingSetPieceReads(self, rows, mtp)

    def decode_pieces_unbuilt(self) -> str | None:
        """Why the decode pieces cannot read this pool (None: they can). A piece reads the working sets
        only, so a decode must never stream: the union of its rows' selections (1 + drafts rows of k)
        must fit in a working set."""
        k = self.cfg.index_topk
        if self.new_rows * k > self.device_buffer_tokens:
            return (f"a working set of {self.device_buffer_tokens} entries, which holds less than a decode with its "
                    f"drafts may select ({self.new_rows} rows x top-k {k}; raise device_buffer_tokens to "
                    f"{self.new_rows * k})")
        return None

    def pieces_read(self, request_ids: list[str], mtp: bool = False) -> bool:
        """Whether the decode pieces can read these requests' rows now: each decoded in the pass through
        its working set (an MTP pass over a prompt's rows streams them from the host store)."""
        decoding = (self._mtp_step if mtp else self._step).decoding
        return all(request_id in decoding for request_id in request_ids)

    def gather_decode_latents(self, layer: int, picks) -> torch.Tensor:
        """A batch of decode rows' selected entries (context.DecodePicks) -> [rows, k, latent_dim]. The
        whole batch is resolved together: one device -> host read of the selections, one host -> device
        copy of every request's misses, per full layer; its shared layers replay that plan without
        reading the selections again (no synchronisation on an accelerator)."""
        k = picks.selected.shape[-1]
        return self.fmt.decode(self._decode_rows(layer, picks)).view(-1, k, self.cfg.latent_dim)

    def _decode_rows(self, layer: int, picks) -> torch.Tensor:
        """`gather_decode_latents`' stored rows, flat (not decoded)."""
        seqs, k = picks.seqs, picks.selected.shape[-1]
        uses = [self._uses_working_set(layer, seq) for seq in seqs]
        if not any(uses):  # not decodes of this step: stream them all through the slot table
            for seq in seqs:
                self._count(seq.request_id, h2d=seq.num_new_tokens * k * self.host.row_bytes)
            return self.link.read(layer, picks.slots().reshape(-1))
        sizes = [seq.num_new_tokens * k for seq in seqs]
        plan = self._replay(layer, seqs, sizes) if all(uses) else None
        if plan is not None and not plan.streamed:
            return self.ws[layer].index_select(0, plan.rows)
        positions = self._picked_positions(picks)
        if all(uses):
            return self._gather(layer, seqs, positions)
        return torch.cat([self._rows_at(layer, seq, torch.from_numpy(p)) for seq, p in zip(seqs, positions)])

    @staticmethod
    def _picked_positions(picks) -> list[np.ndarray]:
        """Each request's selected positions (all its rows') of a batch's picks (context.DecodePicks),
        on the host: the one device -> host read of a full layer's resolution."""
        sizes = [seq.num_new_tokens * picks.selected.shape[-1] for seq in picks.seqs]
        flat = picks.selected.reshape(-1).cpu().numpy()
        return [flat[end - n:end] for end, n in zip(accumulate(sizes), sizes)]

    def _gather(self, layer: int, seqs: list[SeqSlice], positions: list[np.ndarray]) -> torch.Tensor:
        """[sum of len(positions), row width]: working-set rows, or the host store's for streamed requests."""
        plan = self._plan_for(layer, seqs, positions)
        if not plan.streamed:
            return self.ws[layer].index_select(0, plan.rows)
        parts, done = [], 0
        for i, (seq, pos) in enumerate(zip(seqs, positions)):
            if i in plan.streamed:
                parts.append(self._stream(layer, seq, seq.slots[torch.from_numpy(pos).to(seq.slots.device)]))
            else:
                parts.append(self.ws[layer].index_select(0, plan.rows[done:done + len(pos)]))
                done += len(pos)
        return torch.cat(parts)

    def _stream(self, layer: int, seq: SeqSlice, slots: torch.Tensor) -> torch.Tensor:
        self._count(seq.request_id, h2d=slots.numel() * self.host.row_bytes)
        return self.link.read(layer, slots)

    # -- resolution ----------------------------------------------------------------------------
    def _plan_for(self, layer: int, seqs: list[SeqSlice], positions: list[np.ndarray]) -> _Plan:
        """A full layer resolves its requests' positions; its shared layers replay the plan."""
        plan = self._replay(layer, seqs, [len(p) for p in positions])
        if plan is None:
            key = (tuple(seq.request_id for seq in seqs), self.leader[layer])
            plan = self._step_of(layer).plans[key] = self._resolve(self.leader[layer], seqs, positions)
        return plan

    def _replay(self, layer: int, seqs: list[SeqSlice], sizes: list[int]) -> _Plan | None:
        """A shared layer's plan: its full layer's for the same requests this step (whose copies were
        issued with the full layer's: wait for them), or None (a full layer, or no plan yet)."""
        leader, plans = self.leader[layer], self._step_of(layer).plans
        plan = plans.get((tuple(seq.request_id for seq in seqs), leader))
        if layer == leader or plan is None:
            return None
        self.link.wait(layer)
        resolved = sum(n for i, n in enumerate(sizes) if i not in plan.streamed)
        assert (0 if plan.rows is None else plan.rows.numel()) == resolved, \
            "a shared layer read other positions than its full layer"
        return plan

    def _resolve(self, leader: int, seqs: list[SeqSlice], positions: list[np.ndarray]) -> _Plan:
        """LRU-resolve every request's positions for the whole group, all requests in one batched pass
        (`LRUTable.resolve`, kept for `_plan`); copy all misses at once."""
        wanted = [self._older(leader, seq, pos) for seq, pos in zip(seqs, positions)]
        kept = [i for i, (_, _, older, _) in enumerate(wanted) if older.size <= self.device_buffer_tokens]
        resolved = self.lru_tables[leader].resolve([self._resident[seqs[i].request_id].buffer for i in kept],
                                                   [wanted[i][2] for i in kept])
        self._resolved = {seqs[i].request_id: (wanted[i], res) for i, res in zip(kept, resolved)}
        rows, streamed, src, dst = [], set(), [], []
        for i, (seq, pos) in enumerate(zip(seqs, positions)):
            planned = self._plan(leader, seq, pos, src, dst)
            if planned is None:
                streamed.add(i)
            else:
                rows.append(planned)
        if sum(s.size for s in src):
            self.link.fetch(self.groups[leader], torch.from_numpy(np.concatenate(src)), self.ws,
                            self.link.index(np.concatenate(dst)))
        return _Plan(self.link.index(np.concatenate(rows)) if rows else None, frozenset(streamed))

    def _older(self, leader: int, seq: SeqSlice, positions: np.ndarray):
        """(first new position, which `positions` are older, the distinct older ones ascending, whether
        those had to be made distinct): what the request's LRU resolves."""
        first_new = self._resident[seq.request_id].new["mtp" if leader in self.mtp_layers else "target"][0]
        is_older = positions < first_new  # a draft step's rows: the pass's
        older = positions[is_older]
        # several rows select overlapping positions: resolve their union (one row's come ascending)
        merged = seq.num_new_tokens > 1 or not (older[1:] > older[:-1]).all()
        return first_new, is_older, (np.unique(older) if merged else older), merged

    def _plan(self, leader: int, seq: SeqSlice, positions: np.ndarray, src: list, dst: list) -> np.ndarray | None:
        """One request's working-set rows for `positions` (None when its older positions exceed N: it
        streams instead), from its LRU's resolution in `_resolve`; counts, and appends its misses' host
        slots and rows."""
        found = self._resolved.pop(seq.request_id, None)
        if found is None:
            return None
        (first_new, is_older, older, merged), res = found
        ws, group = self._resident[seq.request_id], self.groups[leader]
        base, misses = self._base(ws), res.miss_positions
        distinct = np.unique(positions).size if merged else positions.size
        new_hits = distinct - older.size  # this step's new tokens, on their own rows
        self._count(seq.request_id, hits=(res.hits + new_hits) * len(group), misses=misses.size * len(group),
                    h2d=misses.size * len(group) * self.host.row_bytes)
        src.append(self._host_slots(self._step_of(leader).decoding[seq.request_id], misses))
        dst.append(base + res.miss_slots)
        slots = res.slots[np.searchsorted(older, positions[is_older])] if merged else res.slots
        rows = np.empty(positions.size, dtype=np.int64)
        rows[is_older] = base + slots
        rows[~is_older] = base + self.device_buffer_tokens - first_new + positions[~is_older]
        return rows

    def _host_slots(self, page_ids: list[int], positions: np.ndarray) -> np.ndarray:
        """The logical slots (host rows) of a request's `positions`, through its page ids."""
        ps = self.page_size
        return np.array([page_ids[i] for i in (positions // ps).tolist()], dtype=np.int64) * ps + positions % ps

    def _promote(self, ws: _WorkingSet, name: str, upto: int, final: list) -> None:
        """The pass's last new tokens before position `upto` are final and on the device: noted in
        `final` as (working set, first new position, final positions), kept by `_move`. The others
        were rejected drafts: dropped."""
        start, count = ws.new.pop(name, (None, 0))
        if start is not None and upto > start:
            final.append((ws, start, np.arange(start, min(start + count, upto))))

    def _move(self, name: str, final: list) -> None:
        """Keep every request's final new tokens, as most recently used: each group's LRUs resolve them
        in one batched pass, then one row copy per layer for the whole step (a device copy, no host
        traffic)."""
        if not final:
            return
        for leader in self.passes[name]:
            resolved = self.lru_tables[leader].resolve([ws.buffer for ws, _, _ in final], [p for _, _, p in final])
            src = [self._base(ws) + self.device_buffer_tokens + res.miss_positions - start
                   for (ws, start, _), res in zip(final, resolved)]
            dst = [self._base(ws) + res.miss_slots for (ws, _, _), res in zip(final, resolved)]
            if sum(d.size for d in dst):
                src, dst = self.link.index(np.concatenate(src)), self.link.index(np.concatenate(dst))
                for layer in self.groups[leader]:
                    self.ws[layer].index_copy_(0, dst, self.ws[layer].index_select(0, src))

    # -- bookkeeping ---------------------------------------------------------------------------
    def _working_set(self, request_id: str) -> _WorkingSet:
        ws = self._resident.get(request_id)
        if ws is None:
            buffer = self.buffers.allocate(request_id, 1)[0]
            for table in self.lru_tables.values():
                table.reset(buffer)
            ws = _WorkingSet(buffer, {g: table.lru(buffer) for g, table in self.lru_tables.items()})
            self._resident[request_id] = ws
        return ws

    def _base(self, ws: _WorkingSet) -> int:
        return ws.buffer * (self.device_buffer_tokens + self.new_rows)

    def _count(self, request_id: str, hits: int = 0, misses: int = 0, h2d: int = 0, d2h: int = 0,
               warmed: int = 0) -> None:
        self._counters.setdefault(request_id, TierCounters()).add(hits, misses, h2d, d2h, warmed)
        self.totals.add(hits, misses, h2d, d2h, warmed)

    # -- observability -------------------------------------------------------------------------
    def request_metrics(self, request_id: str, held_tokens: int) -> dict:
        latent = self.working_set_bytes() if request_id in self._resident else 0
        indexer = held_tokens * self.selector_bytes_per_token
        return {"device_kv_bytes": latent + indexer, "device_latent_bytes": latent, "device_indexer_bytes": indexer,
                "host_kv_bytes": held_tokens * self.host.bytes_per_token, **self.request_counters(request_id)}

    def stats(self, used_tokens: int) -> dict:
        latent = self.num_working_sets * self.working_set_bytes()
        indexer = used_tokens * self.selector_bytes_per_token
        return {"device_kv_bytes": latent + indexer, "device_latent_bytes": latent, "device_indexer_bytes": indexer,
                "device_working_sets": self.num_working_sets, "device_buffer_tokens": self.device_buffer_tokens,
                "host_kv_bytes": used_tokens * self.host.bytes_per_token,
                "host_kv_budget_bytes": self.host.capacity_bytes, "host_store": self.host.kind,
                **self.totals.as_dict()}

    def layout(self) -> dict[str, str]:
        return {"kv_tiering": "True", "host_store": self.host.kind, "device_buffer_tokens": str(self.device_buffer_tokens)}

    def flush(self) -> None:
        """Finish pending host writes (backups of new rows): every host row is current after it."""
        self.link.flush()

    def check_integrity(self, active: set[str] | None = None, waiting: set[str] = frozenset()) -> None:
        """`active`: the running requests (working sets and counters); `waiting`: queued ones, whose
        counters a preemption keeps."""
        self.buffers.check_integrity()
        self.host.check_integrity()
        owned = [ws.buffer for ws in self._resident.values()]
        assert len(owned) == len(set(owned)), "a working set is owned by two requests"
        assert len(owned) == self.buffers.num_pages - self.buffers.num_free, "working sets and allocator disagree"
        for ws in self._resident.values():
            for lru in ws.lrus.values():
                lru.check_integrity()
        if active is not None:
            stale = (set(self._resident) - set(active)) | (set(self._counters) - set(active) - set(waiting))
            assert not stale, f"tier state kept for finished requests {sorted(stale)}"


class WorkingSetPieceReads:
    """The decode pieces' view of a TieredKVPool (model/decode_graphs.py), for one bucket of rows.

    Inside the pieces (replayed from CUDA graphs: fixed tensors only) every row is a decode, so a
    layer's new latents go to the rows' new-token rows in their working sets (`new_rows`, the
    padding rows' to the pool's padding row), and its picks are read from the working sets through
    the bucket's [rows, k] table of working-set rows. Between the pieces, where the engine's decode
    path resolves a full layer's picks (`_decode_rows`, `dense_decode_latents`), the same resolution
    fills that table: the group's batched LRU pass, its misses copied in, and its shared layers'
    copies waited for at once (a captured piece cannot wait on an event). After the last piece the
    step's new rows are backed up to the host store, as `write_latent` backs them up on the engine's
    path. `mtp`: the MTP layer's pass (`begin_mtp_pass`), its working sets and its own rows. A
    request that would stream (its drafts' selections past N) cannot be read by a piece: the pieces
    are built only where a decode's rows always fit (`TieredKVPool.decode_pieces_unbuilt`)."""

    # every read resolves through the LRUs as the engine's path does (which moves them, and counts):
    # a history is placed per index group, and a draft step's picks resolve at every step
    resolves = True

    def __init__(self, pool: TieredKVPool, rows: int, mtp: bool):
        self.pool, self.cache, self.padding_pick, self.fmt = pool, self, pool.padding_row, pool.fmt
        self.mtp = mtp
        self.layers = [layer for leader in pool.passes["mtp" if mtp else "target"] for layer in pool.groups[leader]]
        self.new_rows = torch.full((rows,), pool.padding_row, dtype=torch.long, device=pool.device)

    # -- inside the pieces -------------------------------------------------------------------------
    def write_latent(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.ws[layer].index_copy_(0, self.new_rows, self.fmt.encode(values))

    def write_index_keys(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.write_index_keys(layer, slots, values)

    def gather_decode_latents(self, layer: int, picks) -> torch.Tensor:
        return gather_picked(self.pool.ws[layer], picks.slots(), self.fmt)

    # -- between the pieces ------------------------------------------------------------------------
    def load(self, step) -> None:
        """The step's rows' new-token rows (`begin_step` or `begin_mtp_pass` placed every decode's), the
        padding rows' after."""
        n, placed = step.num_tokens, self.pool._mtp_step if self.mtp else self.pool._step
        if n:  # none: a data-parallel rank's idle pass
            if placed.ws_rows is None or placed.ws_rows.numel() != n:
                raise RuntimeError("decode pieces over a tiered pool: a row of the step is not a decode's")
            self.new_rows[:n] = placed.new_rows
        self.new_rows[n:] = self.pool.padding_row

    def table(self, layer: int, picks) -> torch.Tensor:
        """[rows, k] working-set rows of a full layer's selection (context.DecodePicks), resolved."""
        return self._resolved(layer, picks.seqs, self.pool._picked_positions(picks)).view(-1, picks.selected.shape[-1])

    def history(self, layer: int, seqs: list[SeqSlice], k: int) -> torch.Tensor:
        """[len(seqs), k] working-set rows of each request's whole history (within top-k, so within N),
        resolved, padded by repeating its last."""
        rows = self._resolved(layer, seqs, [np.arange(seq.context_len) for seq in seqs])
        return rows[padded_rows([seq.context_len for seq in seqs], k, rows.device)]

    def _resolved(self, layer: int, seqs: list[SeqSlice], positions: list[np.ndarray]) -> torch.Tensor:
        pool = self.pool
        plan = pool._plan_for(layer, seqs, positions)
        if plan.streamed:
            raise RuntimeError(f"decode pieces over a tiered pool: {len(plan.streamed)} request(s) read more "
                               f"positions than a working set holds ({pool.device_buffer_tokens})")
        for shared in pool.groups[pool.leader[layer]][1:]:
            pool.link.wait(shared)
        return plan.rows

    def finish(self, step) -> None:
        """The step's new rows backed up to the host store, every layer of the pass."""
        if not step.num_tokens:  # a data-parallel rank's idle pass
            return
        rows, pool = self.new_rows[:step.num_tokens], self.pool
        for layer in self.layers:
            pool.link.backup(layer, step.slot_mapping, pool.ws[layer].index_select(0, rows))


def _group_leaders(cfg: ModelConfig) -> dict[int, int]:
    """Layer -> the full layer whose selection it uses (itself for full layers)."""
    leaders, current = {}, 0
    for layer, kind in enumerate(cfg.indexer_types):
        current = layer if kind == "full" else current
        leaders[layer] = current
    return leaders


def build_tiered_cache(config: EngineConfig, model, dtype: torch.dtype, device, default_pages: int) -> TieredKVPool:
    """The tiered pool for `config`, sized by its budgets; installs Quest if selected. With speculative
    decoding the MTP layer is one more layer, with its own group (it has its own indexer)."""
    cfg, itemsize = model.cfg, dtype.itemsize
    fmt = latent_format(config.kv_cache_dtype, cfg, dtype)
    quest = config.selector == "quest"
    fp8 = config.indexer_key_dtype == "fp8_e4m3"
    mtp = [cfg.num_hidden_layers] if config.num_speculative_tokens and model.mtp is not None else []
    key_fmt = format_of(itemsize, fp8)
    mtp_index_bytes = len(mtp) * indexer_bytes_per_token_layer(cfg, key_fmt)
    selector_bytes = mtp_index_bytes + (quest_bytes_per_token(cfg, config.quest_page_tokens) if quest
                                        else index_bytes_per_token(cfg, key_fmt))
    latent_bytes = latent_bytes_per_token(cfg, fmt.row_bytes) + len(mtp) * fmt.row_bytes
    sizes = plan_tier_sizes(config, cfg, latent_bytes, selector_bytes, default_pages)
    rows = sizes.device_buffer_tokens + 1 + config.num_speculative_tokens  # a working set's slots
    tokens = sizes.num_pages * config.kv_page_size
    check_tiered_fits(tokens * latent_bytes, tokens * selector_bytes + sizes.num_buffers * rows * latent_bytes,
                      torch.device(device), config.host_store_path, sizes.limit)
    host = make_host_store(list(range(cfg.num_hidden_layers)) + mtp, sizes.num_pages * config.kv_page_size,
                           fmt.row_width, fmt.row_dtype, config.host_store_path, pin=torch.device(device).type == "cuda")
    pool = TieredKVPool(cfg, sizes, config.kv_page_size, dtype, device, host, fp8, keep_index_keys=not quest,
                        mtp_layers=tuple(mtp), new_rows=1 + config.num_speculative_tokens, fmt=fmt,
                        padding_page=config.decode_graph_mode() != "off")
    if quest:
        pool.selector_bytes_per_token = selector_bytes
    return pool
