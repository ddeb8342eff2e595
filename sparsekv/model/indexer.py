"""The DSA lightning indexer, in the paper's notation, and how its scores are blocked on each device.

I[t,s] = sum_h w_h(x_t) H^-1/2 * ReLU(<q_{t,h}, k_s> D^-1/2), top-k over s <= t. A prefill scores a
block of queries at a time against tiles of keys (never an L x L tensor); a decode row scores its
keys once, page by page (`select_decode_pages`), or keys-major past a threshold. `IndexerWeights` and `ScoreScratch` are shared with MLA's
assembly (model.py); the selector interface around it is selectors.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..context import index_tensor
from ..kernels.attention import causal_mask_scores, fill_blocks, query_block_size, select_topk
from .layers import layer_norm, rotate

# On a CPU, queries are scored a block at a time against key tiles: the [block x H, tile] GEMM output
# (INDEX_TILE_ELEMENTS_CPU, 2 MB) stays in cache, and the block is as large as the [block, T] score rows
# allow (INDEX_SCORE_ELEMENTS_CPU, 512 MB), so each key tile is read once for up to 128 queries: 128 up to
# 1M keys. 8 queries against 32K-key tiles ran the indexer GEMM at ~30 GFLOP/s on this machine's core; 64
# against 512-key tiles at ~60. With two threads small blocks parallelise badly: at 1M keys a block
# of 32 queries cost 14.8 ms a query, 64 10.3 and 128 7.1 (one thread: 12.2, 11.3, 11.2). Tiles of 1024
# keys for 128 queries of 4 heads beat 256 by 1.08-1.35x (fewer ops per key, each of them a few us of
# launch; BENCHMARKS.md, "Indexer prefill").
INDEX_QUERY_BLOCK_CPU = 8
INDEX_QUERY_BLOCK_CPU_MAX = 128
INDEX_SCORE_ELEMENTS_CPU = 1 << 27
INDEX_TILE_ELEMENTS_CPU = 1 << 19
INDEX_SCORE_ELEMENTS_GPU = 1 << 28  # on an accelerator, larger blocks amortise launches (1 GiB fp32)
# A CPU scores a group of decodes at once (model/decode_plan.py) within this many padded elements
# (64 MB fp32): past it, a group's transients leave the cache and a second group costs a few ops.
INDEX_DECODE_BATCH_ELEMENTS_CPU = 1 << 24
# A decode row (one query) scores keys-major from this many keys on (`decode_head_scores`). On a CPU
# below 32K keys a layer's keys stay in cache and the query-major GEMM is as fast or faster. On an
# accelerator keys-major has not been measured yet (`sparsekv bench indexer --decode --device cuda`,
# run by scripts/gpu_check.py): query-major there.
DECODE_KEYS_MAJOR_MIN_KEYS_CPU = 1 << 15
DECODE_KEYS_MAJOR_MIN_KEYS_GPU = 1 << 62


@dataclass(frozen=True)
class BlockPolicy:
    """Block constants of one indexer in place of the module's above (None: the module's). The engine's
    indexers use the module's; `sparsekv bench indexer` times other policies beside them in one run."""

    query_block_cpu_max: int | None = None
    score_elements_cpu: int | None = None
    tile_elements_cpu: int | None = None
    keys_major_min_keys: int | None = None  # on any device

    def pick(self, name: str, module_value: int) -> int:
        value = getattr(self, name)
        return module_value if value is None else value


MODULE_POLICY = BlockPolicy()


def keys_major(device: torch.device, rows: int, keys: int, policy: BlockPolicy = MODULE_POLICY) -> bool:
    """Whether `rows` query rows over `keys` keys are scored keys-major (one decode row, long history).
    The per-request and the batched decode paths both ask this, so each request's scores are the same bits."""
    least = DECODE_KEYS_MAJOR_MIN_KEYS_CPU if device.type == "cpu" else DECODE_KEYS_MAJOR_MIN_KEYS_GPU
    return rows == 1 and keys >= policy.pick("keys_major_min_keys", least)


def index_query_block(device: torch.device, heads: int, total: int, policy: BlockPolicy = MODULE_POLICY) -> int:
    if device.type == "cpu":
        most = policy.pick("query_block_cpu_max", INDEX_QUERY_BLOCK_CPU_MAX)
        scores = policy.pick("score_elements_cpu", INDEX_SCORE_ELEMENTS_CPU)
        return max(INDEX_QUERY_BLOCK_CPU, min(most, scores // max(total, 1)))
    return max(INDEX_QUERY_BLOCK_CPU, min(1024, INDEX_SCORE_ELEMENTS_GPU // (heads * total)))


def index_key_tile(device: torch.device, queries: int, heads: int, total: int,
                   policy: BlockPolicy = MODULE_POLICY) -> int:
    """Keys scored per GEMM: L2-sized for a block of queries on a CPU. One query (decode) streams the
    keys once whatever the tile, and smaller tiles only add copies (5% at 128K keys)."""
    if device.type == "cpu" and queries > 1:
        return max(1, min(total, policy.pick("tile_elements_cpu", INDEX_TILE_ELEMENTS_CPU) // (queries * heads)))
    return query_block_size(queries * heads, total, device)


class ScoreScratch:
    """Reused CPU buffers, one per purpose, shared by one model's indexers (they run one at a time):
    "scores", the fp32 buffer a prefill block's index scores are written into; "keys", a decode
    group's padded key histories (`gather_rows`). A tensor taken is valid until the next take of its
    purpose.

    On a CPU a fresh [rows, T] buffer is above glibc's mmap threshold, so allocating one per call maps
    and faults it again for every chunk and full layer (33.9 M minor faults in a 1M prefill; a 32-request
    decode group's 4K histories, 34 MB of keys, gathered ~5x slower into fresh memory than into a kept
    buffer). Each grows by doubling (beyond what a call asks only up to INDEX_SCORE_ELEMENTS_CPU) and is
    kept until the model is dropped or `release()`. On an accelerator the caching allocator already
    reuses memory, so each call gets a fresh tensor there."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32,
             purpose: str = "scores") -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            grown = 0 if buffer is None or buffer.dtype != dtype else min(2 * buffer.numel(), INDEX_SCORE_ELEMENTS_CPU)
            self._buffers.pop(purpose, None)  # free the old one before allocating its successor
            buffer = self._buffers[purpose] = torch.empty(max(numel, grown), dtype=dtype)
        return buffer[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()


def gather_rows(table: torch.Tensor, slots: torch.Tensor, scratch: ScoreScratch | None) -> torch.Tensor:
    """`table`'s rows at `slots` (any shape) -> [*slots.shape, row], one index_select written into
    `scratch`'s "keys" buffer (None: fresh memory)."""
    flat = slots.reshape(-1)
    if scratch is None:
        return table.index_select(0, flat).view(*slots.shape, -1)
    out = scratch.take(flat.numel() * table.shape[1], table.device, table.dtype, "keys").view(flat.numel(), -1)
    return torch.index_select(table, 0, flat, out=out).view(*slots.shape, -1)


def at_owners(counts: list[int], at, rows: int, device: torch.device) -> torch.Tensor:
    """Which request owns each of `rows` key pages (`paged_keys`' result): the pairs' requests in
    order, placed at `at` (None: row i is pair i). A page of the span no request owns is scored with
    the first request's query, and its scores are never read."""
    owners = np.repeat(np.arange(len(counts)), counts)
    if at is None:
        return index_tensor(owners, device)
    placed = np.zeros(rows, dtype=np.int64)
    placed[at] = owners
    return index_tensor(placed, device)


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor          # [H_I * D_I, q_lora]
    wk: torch.Tensor            # [D_I, hidden]
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor  # [H_I, hidden], kept fp32 as in the reference


class LightningIndexer:
    """DSA token selector: I[t,s] = sum_h w_h(x_t) H^-1/2 * ReLU(<q_{t,h}, k_s> D^-1/2), top-k over s <= t."""

    name = "dsa"

    def __init__(self, cfg: ModelConfig, w: IndexerWeights, scratch: ScoreScratch | None = None,
                 policy: BlockPolicy = MODULE_POLICY):
        self.cfg, self.w, self.policy = cfg, w, policy
        self.scratch = ScoreScratch() if scratch is None else scratch
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim

    def keys_and_queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(keys [N, D_I] to cache, (queries [N, H_I, D_I] fp32, head weights [N, H_I] fp32)) of the new
        rows; cos/sin: `RotaryTable.cos_sin`. The key is rotated with the queries, as head H_I."""
        k = layer_norm(F.linear(x, self.w.wk), self.w.k_norm_weight, self.w.k_norm_bias, 1e-6)
        q = F.linear(q_resid, self.w.wq_b).view(x.shape[0], self.n_heads, self.head_dim)
        weights = F.linear(x if x.dtype == torch.float32 else x.float(), self.w.weights_proj)
        both, r = torch.cat([q, k.unsqueeze(1)], dim=1), self.cfg.qk_rope_head_dim
        rope = rotate(both[..., :r], cos, sin, self.cfg.indexer_rope_interleave)
        both = torch.cat([rope, both[..., r:]], dim=-1)
        q = both[:, :self.n_heads]
        return both[:, self.n_heads], (q if q.dtype == torch.float32 else q.float(), weights * self.n_heads ** -0.5)

    def scores(self, q: torch.Tensor, weights: torch.Tensor, segments, total: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores [S, total] fp32 of queries q [S, H_I, D_I] against the first `total` positions,
        written into `out` when given (a reused buffer: see `select`).

        `segments` are (positions, keys [n, D_I]) pieces of the key history (`history_segments`):
        an int first position for a view of consecutive positions, a tensor of positions otherwise.
        D_I^-1/2 > 0 commutes with the ReLU, so it is folded into the head weights; the ReLU runs in
        place. Keys are scored a tile at a time, so the [S x H_I, tile] intermediate stays in cache.
        """
        w = weights * self.head_dim ** -0.5
        major = keys_major(q.device, q.shape[0], total, self.policy)
        first, keys = segments[0]
        if len(segments) == 1 and isinstance(first, int) and keys.shape[0] >= total:
            return self._score_tiles(q, w, keys[:total], major, out)          # one view
        out = torch.empty(q.shape[0], total, dtype=torch.float32, device=q.device) if out is None else out
        for positions, keys in segments:
            if isinstance(positions, int):
                n = min(keys.shape[0], total - positions)
                if n > 0:
                    self._score_tiles(q, w, keys[:n], major, out[:, positions:positions + n])
            else:
                visible = positions < total
                out[:, positions[visible]] = self._score_tiles(q, w, keys[visible], major)
        return out

    def _score_tiles(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, major: bool,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        total = keys.shape[0]
        tile = index_key_tile(q.device, q.shape[0], self.n_heads, total, self.policy)
        if tile >= total and out is None:
            return self._score_tile(q, w, keys, major)   # decode: no output copy
        out = torch.empty(q.shape[0], total, dtype=torch.float32, device=q.device) if out is None else out
        for start in range(0, total, tile):
            out[:, start:start + tile] = self._score_tile(q, w, keys[start:start + tile], major)
        return out

    @staticmethod
    def _score_tile(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, major: bool) -> torch.Tensor:
        keys = keys if keys.dtype == torch.float32 else keys.float()
        if major:  # a decode row over a long history
            return torch.mm(decode_head_scores(keys, q[0].t()), w[0][:, None]).t()
        if q.shape[0] == 1:  # a decode row over a short history: [H, D] x [D, T]
            s = torch.matmul(q[0], keys.t()).relu_()        # [H, T]
            return torch.matmul(w[0], s).unsqueeze(0)
        s = torch.mm(q.flatten(0, 1), keys.t()).relu_()    # [S * H, T]: one plain GEMM
        return torch.bmm(w.unsqueeze(1), s.view(q.shape[0], q.shape[1], -1)).squeeze(1)

    def select_decode_batch(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                            positions: torch.Tensor, k: int, major: bool = False) -> torch.Tensor:
        """Sorted top-k positions [B, R, k] of the decode rows of B requests at once (accelerators: a
        handful of launches for the whole batch instead of a dozen per request). q [B, R, H_I, D_I],
        weights [B, R, H_I], positions [B, R] (each >= k: every row sees more than k keys), keys
        [B, T, D_I] (each request's history, padded; positions past a row's are masked). `major`:
        the requests are all scored keys-major (`keys_major`: R = 1, long histories), else none is."""
        b, r, h, d = q.shape
        w = weights * self.head_dim ** -0.5
        if major:  # as `_score_tile`'s keys-major decode row, so each request's scores are the same bits
            s = decode_head_scores(keys.float(), q.float().view(b, h, d).transpose(1, 2))      # [B, T, H]
            scores = torch.bmm(s, w.view(b, h, 1)).view(b, 1, -1)                                # [B, 1, T]
        else:
            s = torch.bmm(q.float().view(b, r * h, d), keys.float().transpose(1, 2)).relu_()  # [B, R*H, T]
            scores = torch.bmm(w.view(b * r, 1, h), s.view(b * r, h, -1)).view(b, r, -1)       # [B, R, T]
        later = torch.arange(keys.shape[1], device=keys.device)[None, None, :] > positions[:, :, None]
        return select_topk(scores.masked_fill_(later, float("-inf")).view(b * r, -1), k).view(b, r, k)

    def select_decode_pages(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, at, counts: list[int],
                            lengths: list[int], positions: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted top-k positions [B, R, k] of the decode rows of B requests, each scored page by page:
        one [R x H, D] x [D, page] GEMM per (request, page) pair, the same bits for a request alone
        or in any batch. q [B, R, H, D], weights [B, R, H], positions [B, R] (each >= k); `keys`,
        `at`, `counts`: the requests' pages in order (cache `index_key_pages`); `lengths`: their
        histories (context lengths)."""
        b, r, h, d = q.shape
        m, page = keys.shape[0], keys.shape[1]
        qs, ws = q.float().reshape(b, r * h, d), (weights * self.head_dim ** -0.5).reshape(b, r, h)
        if b == 1 and at is None:  # one request's pages, in order: its query for each
            qs, ws = qs.expand(m, r * h, d), ws.expand(m, r, h)
        else:
            owner = at_owners(counts, at, m, q.device)
            qs, ws = qs.index_select(0, owner), ws.index_select(0, owner)
        s = torch.bmm(qs, keys.float().transpose(1, 2)).relu_()                               # [m, R*H, page]
        scores = torch.bmm(ws.reshape(m * r, 1, h), s.view(m * r, h, page)).view(m, r, page)   # [m, R, page]
        if at is not None:
            scores = scores.index_select(0, index_tensor(at, q.device))                       # [pairs, R, page]
        flat = scores.view(1, -1) if r == 1 else scores.transpose(0, 1).reshape(r, -1)         # [R, pairs * page]
        if b == 1:
            padded = flat[:, :lengths[0]]                                                      # [R, T]
        else:
            longest = max(lengths)
            starts = index_tensor([0, *accumulate(n * page for n in counts[:-1])], q.device)
            last = index_tensor(lengths, q.device) - 1
            cols = starts[:, None] + torch.minimum(torch.arange(longest, device=q.device)[None, :], last[:, None])
            padded = flat.index_select(1, cols.view(-1)).view(r, b, longest).transpose(0, 1)  # [B, R, T]
        if r > 1 or b > 1:  # a row past which keys are padding or later drafts
            later = torch.arange(padded.shape[-1], device=q.device)[None, :] > positions.reshape(b * r, 1)
            padded = padded.reshape(b * r, -1).masked_fill(later, float("-inf"))
        return select_topk(padded, k).view(b, r, k)

    def select(self, q, weights, segments, query_positions, k: int) -> torch.Tensor:
        """Sorted top-k positions [S, k] for each query; peak memory O(block x T), never T x T.

        Rows that see at most k positions select all of them (positions 0..k-1, the later ones
        masked as invalid by the caller), exactly the reference's dense regime.
        """
        total = sum(keys.shape[0] for _, keys in segments)
        rows = index_query_block(q.device, self.n_heads, total, self.policy)
        # Every block's scores go to one buffer (`ScoreScratch`): fresh [rows, T] tensors above glibc's
        # mmap threshold cost a page fault per 4 KB each time (29 M faults in a 256K prefill). A decode
        # row's scores are returned without a copy instead.
        several = q.shape[0] > 1 and total > k
        buffer = self.scratch.take(min(rows, q.shape[0]) * total, q.device) if several else None

        def block(start: int, end: int) -> torch.Tensor:
            positions = query_positions[start:end]
            visible = int(positions.max()) + 1  # no key after the block's last query is visible to it
            if visible <= k:
                return torch.arange(k, device=q.device).expand(end - start, k)
            out = buffer[:(end - start) * visible].view(end - start, visible) if several else None
            scores = self.scores(q[start:end], weights[start:end], segments, visible, out)
            return select_topk(causal_mask_scores(scores, positions), k)
        return fill_blocks(q.shape[0], rows, block)


def decode_head_scores(keys: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """ReLU(keys @ q_t): a decode row's per-head scores, keys-major. keys [T, D] with q_t [D, H] gives
    [T, H]; batched, [B, T, D] with [B, D, H] gives [B, T, H]. The key cache streams once through a
    GEMM whose small side is the H heads; the query-major form, [H, D] x [D, T], runs 1.4-2.3x slower
    on a CPU from 64K keys on and does not gain from a second thread (BENCHMARKS.md, "Decode scores,
    keys-major")."""
    return torch.matmul(keys, q_t).relu_()
