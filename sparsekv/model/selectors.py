"""Token selectors: which k cached positions a full layer's query rows attend to.

Two real implementations behind one interface, so tiering (cache/tiers.py) never depends on how a
selection was made:

  * `DSASelector`: the DeepSeek Sparse Attention lightning indexer (keys cached per token);
  * `QuestSelector`: Quest (Tang et al., 2024), training-free. Per page of `page_tokens` positions
    it keeps the element-wise min m and max M of the cached latents [c_KV ++ k_R]. For query q the
    score of any key in the page is at most  sum_i max(q_i m_i, q_i M_i) = q+ . M + q- . m  (q+/q-
    the positive/negative parts). MLA shares one latent across heads, so a page's score is the max
    of that bound over heads. Every position takes its page's score; the deterministic `select_topk`
    then keeps the top pages (whole pages; ties at the boundary go to the most recent positions).

Both return sorted positions [S, k], so selection is a set and attention's summation order is fixed.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..kernels.attention import causal_mask_scores, query_block_size, select_topk


class TokenSelector:
    """Interface. `prepare` runs once per layer per step over all new rows (it stores what later
    steps need); `rows` cuts its result to one request; `select` picks positions for that request."""

    name = "abstract"

    def prepare(self, layer: int, ctx, x: torch.Tensor, q_resid: torch.Tensor, latent: torch.Tensor, cache):
        raise NotImplementedError

    def rows(self, state, rows: slice):
        return None if state is None else state[rows]

    def select(self, layer: int, seq, state, q: torch.Tensor, positions: torch.Tensor, k: int, cache) -> torch.Tensor:
        raise NotImplementedError


class DSASelector(TokenSelector):
    """The lightning indexer: keys in the cache pool, queries computed per step."""

    name = "dsa"

    def __init__(self, indexer):
        self.indexer = indexer

    def prepare(self, layer, ctx, x, q_resid, latent, cache):
        cache.write_index_keys(layer, ctx.slot_mapping, self.indexer.keys(x, ctx.cos, ctx.sin))
        return self.indexer.queries(q_resid, x, ctx.cos, ctx.sin)

    def rows(self, state, rows):
        return state[0][rows], state[1][rows]

    def select(self, layer, seq, state, q, positions, k, cache):
        return self.indexer.select(*state, cache.index_key_segments(layer, seq), positions, k)


class QuestSelector(TokenSelector):
    """Quest page bounds, device-resident, indexed by logical page (slot // page_tokens).

    One instance serves every full layer. The bounds live here rather than in the cache pool so that
    both pools (tiered or not) get the same selector; the engine sizes it to the pool's slots.
    """

    name = "quest"

    def __init__(self, cfg: ModelConfig, num_slots: int, page_tokens: int, device, layers: list[int]):
        self.page_tokens = page_tokens
        pages = -(-num_slots // page_tokens)
        self.lo = {l: torch.empty(pages, cfg.latent_dim, dtype=torch.float32, device=device) for l in layers}
        self.hi = {l: torch.empty(pages, cfg.latent_dim, dtype=torch.float32, device=device) for l in layers}

    def prepare(self, layer, ctx, x, q_resid, latent, cache):
        slots, v = ctx.slot_mapping, latent.float()
        page = slots // self.page_tokens
        fresh = page[slots % self.page_tokens == 0]  # a page's first position resets its bounds
        self.lo[layer][fresh], self.hi[layer][fresh] = float("inf"), float("-inf")
        idx = page[:, None].expand_as(v)
        self.lo[layer].scatter_reduce_(0, idx, v, "amin")
        self.hi[layer].scatter_reduce_(0, idx, v, "amax")
        return None

    def rows(self, state, rows):
        return None

    def page_scores(self, layer: int, seq, q: torch.Tensor) -> torch.Tensor:
        """Upper bound of q . k over each of the request's pages: [S, num_pages] fp32."""
        pages = seq.slots[::self.page_tokens] // self.page_tokens
        lo, hi = self.lo[layer].index_select(0, pages), self.hi[layer].index_select(0, pages)
        qf = q.float()
        bound = qf.clamp(min=0) @ hi.t() + qf.clamp(max=0) @ lo.t()   # [S, H, P]
        return bound.amax(dim=1)

    def select(self, layer, seq, state, q, positions, k, cache):
        total = seq.context_len
        block = query_block_size(total + q.shape[1] * total // self.page_tokens, q.shape[0])
        out = []
        for i in range(0, q.shape[0], block):
            pages = self.page_scores(layer, seq, q[i:i + block])
            scores = pages.repeat_interleave(self.page_tokens, dim=1)[:, :total]
            out.append(select_topk(causal_mask_scores(scores, positions[i:i + block]), k))
        return torch.cat(out)


def quest_bytes_per_token(cfg: ModelConfig, page_tokens: int) -> int:
    """Device metadata bytes per cached token over the full layers (fp32 min + max per page)."""
    return 2 * cfg.latent_dim * 4 * len(cfg.full_layers) // page_tokens


def install_quest(model, config, num_slots: int, device) -> QuestSelector:
    """Replace the DSA selector of every full layer by one Quest selector sized to `num_slots`."""
    quest = QuestSelector(model.cfg, num_slots, config.quest_page_tokens, device, model.cfg.full_layers)
    use_selector(model, quest)
    return quest


def use_selector(model, selector: TokenSelector) -> None:
    """Install `selector` in every full layer (layers that run their own selection)."""
    for layer in model.layers:
        if layer.attn.selector is not None:
            layer.attn.selector = selector
