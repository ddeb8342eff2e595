"""Torch reference kernels for DSA: deterministic top-k selection and MLA attention in latent space.

All functions are shape-generic and allocation-bounded: nothing here builds a context x context
tensor. Query blocks keep the working set near `BLOCK_ELEMENTS` floats.
"""
from __future__ import annotations

import torch

# Working-set bound per query block. On a CPU, 4 MB blocks stay cache-friendly, and staying well
# under glibc's dynamic mmap threshold (32 MB) avoids heap fragmentation: with 32 MB blocks a 64K
# GLM-geometry prefill peaked at 13.9 GB RSS instead of under 1 GB, and ran 2x slower.
BLOCK_ELEMENTS = 1 << 20
BLOCK_ELEMENTS_ACCELERATOR = 1 << 26


def query_block_size(per_query_elements: int, num_queries: int, device: torch.device | None = None) -> int:
    budget = BLOCK_ELEMENTS if device is None or device.type == "cpu" else BLOCK_ELEMENTS_ACCELERATOR
    return max(1, min(num_queries, budget // max(per_query_elements, 1)))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest scores per row, sorted ascending.

    Tie-break (documented, deterministic): among scores exactly equal to the k-th largest value,
    the most recent positions (highest index) win. The result is a set, so chunking, batching or
    tiering never change it. scores: [S, T] fp32 with masked positions at -inf; requires k <= T.
    """
    if k == scores.shape[-1]:
        return torch.arange(k, device=scores.device).expand(scores.shape[0], k)
    values, idx = scores.topk(k + 1, dim=-1)
    kth = values[:, k - 1:k]
    # torch.topk's choice among ties is arbitrary; it only matters where the (k+1)-th score equals
    # the k-th (a tie across the boundary, e.g. ReLU zeros when every head weight is negative).
    ambiguous = values[:, k] == values[:, k - 1]
    idx = idx[:, :k].sort(dim=-1).values
    rows = ambiguous.nonzero().flatten()
    if rows.numel():
        idx[rows] = _select_with_tie_break(scores[rows], kth[rows], k)
    return idx


def _select_with_tie_break(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    above, tied = scores > kth, scores == kth
    need = k - above.sum(-1, keepdim=True)
    ties_to_the_right = tied.flip(-1).cumsum(-1).flip(-1)
    chosen = above | (tied & (ties_to_the_right <= need))
    return chosen.nonzero()[:, 1].view(scores.shape[0], k)


def causal_mask_scores(scores: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Set scores[i, j] = -inf where key position j is after query position i."""
    if int(query_positions.min()) >= scores.shape[-1] - 1:
        return scores  # every key is visible to every query (decode)
    keys = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(keys[None, :] > query_positions[:, None], float("-inf"))


def latent_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float,
                     value_dim: int) -> torch.Tensor:
    """Absorbed MLA (MQA mode) over given latent entries.

    q: [S, H, D] (D = kv_lora_rank + rope), keys: [S, K, D] or [K, D] shared by all queries,
    valid: [S, K] bool. Returns the latent output [S, H, value_dim] (W_UV is applied by the caller).
    Softmax in fp32 as the reference; masked entries get finfo.min, never -inf, so no NaN.
    """
    if keys.dim() == 2:
        scores = torch.einsum("shd,kd->shk", q, keys)
    else:
        scores = torch.einsum("shd,skd->shk", q, keys)
    scores = scores * scale
    scores = scores.masked_fill(~valid[:, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    values = keys[..., :value_dim]
    if keys.dim() == 2:
        return torch.einsum("shk,kc->shc", probs, values)
    return torch.einsum("shk,skc->shc", probs, values)
