"""Torch reference kernels for DSA: deterministic top-k selection and MLA attention in latent space.

All functions are shape-generic and allocation-bounded: nothing here builds a context x context
tensor. Query blocks keep the working set near `BLOCK_ELEMENTS` floats.
"""
from __future__ import annotations

import math

import torch

# Working-set bound per query block. On a CPU, 4 MB blocks stay cache-friendly, and staying well
# under glibc's dynamic mmap threshold (32 MB) avoids heap fragmentation: with 32 MB blocks a 64K
# GLM-geometry prefill peaked at 13.9 GB RSS instead of under 1 GB, and ran 2x slower.
BLOCK_ELEMENTS = 1 << 20
BLOCK_ELEMENTS_ACCELERATOR = 1 << 26


def query_block_size(per_query_elements: int, num_queries: int, device: torch.device | None = None) -> int:
    budget = BLOCK_ELEMENTS if device is None or device.type == "cpu" else BLOCK_ELEMENTS_ACCELERATOR
    return max(1, min(num_queries, budget // max(per_query_elements, 1)))


def fill_blocks(num_rows: int, block: int, compute) -> torch.Tensor:
    """`compute(start, end)` for each block of rows, written into one tensor allocated at the first.

    Not a list and a `torch.cat`: each kept block result sits between the block's large transients
    in the heap and pins them, so glibc cannot reuse that memory. The dense attention loop over 16K
    positions peaked at 4.4 GB RSS that way and at 0.3 GB written in place; a 256K sparse prefill at
    1.37 GB and 0.70 GB (BENCHMARKS.md). tests/test_kernels.py checks the bound."""
    out = None
    for start in range(0, num_rows, block):
        part = compute(start, min(start + block, num_rows))
        if start == 0 and part.shape[0] == num_rows and part.is_contiguous():
            return part  # one block: nothing to assemble (a broadcast view is still copied)
        if out is None:
            out = part.new_empty((num_rows, *part.shape[1:]))
        out[start:start + part.shape[0]] = part
    return out


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest scores per row, sorted ascending.

    Tie-break (documented, deterministic): among scores exactly equal to the k-th largest value,
    the most recent positions (highest index) win. The result is a set, so chunking, batching or
    tiering never change it. scores: [S, T] fp32 with masked positions at -inf; requires k <= T.
    """
    if k == scores.shape[-1]:
        return torch.arange(k, device=scores.device).expand(scores.shape[0], k)
    values, idx = top_values(scores, k + 1)
    kth = values[:, k - 1:k]
    # torch.topk's choice among ties is arbitrary; it only matters where the (k+1)-th score equals
    # the k-th (a tie across the boundary, e.g. ReLU zeros when every head weight is negative).
    ambiguous = values[:, k] == values[:, k - 1]
    idx = idx[:, :k].sort(dim=-1).values
    rows = ambiguous.nonzero().flatten()
    if rows.numel():
        idx[rows] = _select_with_tie_break(scores[rows], kth[rows], k)
    return idx


def top_values(scores: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, positions) of the m largest scores per row, largest first, in two stages.

    torch.topk on a CPU degrades to O(T log m) with expensive heap updates on rows that trend upward,
    which recency makes common in index scores (20x slower on a rising row of 8K). So: the maximum
    of each block of B positions, the m best blocks by maximum, then the top m within them;
    B ~ sqrt(T / m) balances the two smaller top-ks.

    Exact as a multiset of values: any value outside the m best blocks is <= the m-th best block
    maximum, and those m blocks hold m values at least that large. Among equal values the positions
    may differ from a plain topk's, which only `select_topk`'s tie-break (on full rows) relies on.
    """
    rows, width = scores.shape
    block = 1 << max(3, round(math.log2(max(width / m, 1)) / 2))
    blocks = width // block
    if scores.device.type != "cpu" or blocks < 4 * m:
        return scores.topk(m, dim=-1)
    # Block j holds positions j, j + blocks, j + 2 blocks, ...: the maxima reduce over a strided
    # dimension, which vectorises (an inner reduction over 8-16 elements is 10x slower).
    head = scores[:, :blocks * block].view(rows, block, blocks)
    best = head.amax(dim=1).topk(m, dim=-1).indices                      # [rows, m] block ids
    cols = (best[..., None] + blocks * torch.arange(block, device=scores.device)).flatten(1)
    cols = torch.cat([cols, torch.arange(blocks * block, width, device=scores.device).expand(rows, -1)], 1)
    values, pick = scores.gather(1, cols).topk(m, dim=-1)
    return values, cols.gather(1, pick)


def _select_with_tie_break(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th scores tie: every score above the k-th, then the most recent ties."""
    above, tied = scores > kth, scores == kth
    need = k - above.sum(-1)
    tied_row, tied_col = tied.nonzero(as_tuple=True)            # row-major: each row's ties ascending
    per_row = tied.sum(-1)
    rank_from_end = per_row.cumsum(0)[tied_row] - torch.arange(tied_row.numel(), device=scores.device)
    keep = rank_from_end <= need[tied_row]
    above_row, above_col = above.nonzero(as_tuple=True)
    rows = torch.cat([above_row, tied_row[keep]])
    cols = torch.cat([above_col, tied_col[keep]])
    order = (rows * scores.shape[-1] + cols).sort().indices   # group by row, ascending positions
    return cols[order].view(scores.shape[0], k)


def causal_mask_scores(scores: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Set scores[i, j] = -inf (in place) where key position j is after query position i.

    Only the columns after the earliest query can be masked, so only that tail is touched: for a
    block of consecutive queries it is as wide as the block, not the context.
    """
    first = int(query_positions.min()) + 1
    if first >= scores.shape[-1]:
        return scores  # every key is visible to every query (decode)
    tail = scores[:, first:]
    keys = torch.arange(first, scores.shape[-1], device=scores.device)
    tail.masked_fill_(keys[None, :] > query_positions[:, None], float("-inf"))
    return scores


def latent_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, scale: float,
                     value_dim: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA (MQA mode) over given latent entries.

    q: [S, H, D] (D = kv_lora_rank + rope), keys: [S, K, D] or [K, D] shared by all queries,
    valid: [S, K] bool (or instead `hidden` [S, 1, K], its negation, made once for several layers).
    Returns the latent output [S, H, value_dim] (W_UV is applied by the caller).
    Softmax in fp32 as the reference; masked entries get finfo.min, never -inf, so no NaN.
    """
    if keys.dim() == 2:
        scores = torch.einsum("shd,kd->shk", q, keys)
    else:
        scores = torch.einsum("shd,skd->shk", q, keys)
    scores = scores * scale
    scores = scores.masked_fill(~valid[:, None, :] if hidden is None else hidden, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if probs.dtype != q.dtype:
        probs = probs.to(q.dtype)
    values = keys[..., :value_dim]
    if keys.dim() == 2:
        return torch.einsum("shk,kc->shc", probs, values)
    return torch.einsum("shk,skc->shc", probs, values)
