"""MLA attention, in the paper's notation (the DSA lightning indexer that picks its positions: indexer.py).

Per token the cache holds only the latent c (kv_lora_rank, after kv_a_layernorm) and the shared
rope key k_R (qk_rope_head_dim, after RoPE): `latent_dim` numbers per layer. Attention always runs
in the absorbed (MQA) form: W_UK is folded into the query, W_UV applied after attention, so the
cache is never decompressed, in prefill or decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..context import ForwardContext, SeqSlice, index_tensor
from ..kernels.attention import fill_blocks, latent_attention, query_block_size
from .decode_plan import DecodePlan, dense_length, groups_within as _groups_within, plan_of  # noqa: F401
from .indexer import LightningIndexer
from .layers import gemm_layout, rms_norm, rotate
from .selectors import DSASelector


@dataclass
class AttentionWeights:
    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o: torch.Tensor


class MLAttention:
    """One layer's MLA. `indexer` is None on IndexShare "shared" layers, which reuse the selection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, w: AttentionWeights, indexer: LightningIndexer | None):
        self.cfg, self.layer_idx, self.w, self.indexer = cfg, layer_idx, w, indexer
        # The token selector of a full layer (model/selectors.py); None on shared layers.
        self.selector = DSASelector(indexer) if indexer is not None else None
        H, C = cfg.num_attention_heads, cfg.kv_lora_rank
        kv_b = w.kv_b.view(H, cfg.qk_nope_head_dim + cfg.v_head_dim, C)
        self.w_uk = kv_b[:, :cfg.qk_nope_head_dim]   # [H, nope, C]
        self.w_uv = kv_b[:, cfg.qk_nope_head_dim:]   # [H, v, C]
        self.w_uv_t = self.w_uv.transpose(1, 2).contiguous()  # [H, C, v] for the batched GEMM
        # W_DQ and W_DKV both read x: one GEMM (q_a and kv_a become views of it)
        self.w_a = gemm_layout(torch.cat([w.q_a, w.kv_a]))
        w.q_a, w.kv_a = self.w_a[:w.q_a.shape[0]], self.w_a[w.q_a.shape[0]:]
        w.q_b, w.o = gemm_layout(w.q_b), gemm_layout(w.o)
        self.scale = cfg.softmax_scale

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache) -> torch.Tensor:
        q_cat, index_q = self.project(x, ctx, cache)
        return self.output(self._attention(q_cat, index_q, ctx, cache))

    def project(self, x: torch.Tensor, ctx: ForwardContext, cache) -> tuple[torch.Tensor, object]:
        """The rows' queries [N, H, C + rope] (W_UK absorbed) and the selector's state of them (a full
        layer's indexer queries; None on a shared layer or a draft step); the rows' latents (and indexer
        keys) written to the cache at `ctx.slot_mapping`."""
        cfg, w, n, heads = self.cfg, self.w, x.shape[0], self.cfg.num_attention_heads
        q_a, c, k_rot = F.linear(x, self.w_a).split([cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        q_resid = rms_norm(q_a, w.q_a_norm, cfg.attention_norm_eps)
        q = F.linear(q_resid, w.q_b).view(n, heads, cfg.qk_head_dim)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c = rms_norm(c, w.kv_a_norm, cfg.attention_norm_eps)
        # the query heads and the shared key rotated together, as H + 1 heads
        rotated = rotate(torch.cat([q_rot, k_rot.unsqueeze(1)], dim=1), ctx.cos, ctx.sin, interleaved=True)
        q_rot, k_rot = rotated[:, :heads], rotated[:, heads]
        latent = torch.cat([c, k_rot], dim=-1)
        index_q = None
        if not ctx.draft_step:
            cache.write_latent(self.layer_idx, ctx.slot_mapping, latent)
            if self.selector is not None:
                index_q = self.selector.prepare(self.layer_idx, ctx, x, q_resid, latent, cache)
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, self.w_uk)  # W_UK absorbed: [N, H, C] (one batched GEMM)
        return torch.cat([q_lat, q_rot], dim=-1), index_q

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The layer's output of the rows' latent attention outputs [N, H, C]: W_UV, then W_O."""
        out = torch.einsum("nhc,hcv->nhv", o_lat, self.w_uv_t)  # W_UV after attention, all rows
        return F.linear(out.reshape(o_lat.shape[0], -1), self.w.o)

    def attend_picked(self, q: torch.Tensor, picks, hidden: torch.Tensor, cache) -> torch.Tensor:
        """Latent attention of every row over its k picked entries: `picks.slots()` [N, k] cache slots,
        `hidden` [N, 1, k] the picks each row does not see."""
        return latent_attention(q, cache.gather_decode_latents(self.layer_idx, picks), None, self.scale,
                                self.cfg.kv_lora_rank, hidden=hidden)

    def _attention(self, q: torch.Tensor, index_q, ctx: ForwardContext, cache) -> torch.Tensor:
        """Latent attention output [N, H, C] for every row of the step, by the step's plan
        (decode_plan.py): the decodes in the sparse regime (a request's 1 new token, or 1 + its drafts)
        are selected, gathered and attended as one batch; those in the dense regime as one batch per
        length bucket; prefill chunks one request at a time."""
        plan = plan_of(ctx, self.cfg)
        if plan.only_sparse(ctx):  # every row a sparse decode (a plain decode step): no scatter into o_lat
            return self._sparse_decodes(plan, q, index_q, ctx, cache, ordered=True)
        o_lat = q.new_empty(q.shape[0], q.shape[1], self.cfg.kv_lora_rank)
        for seq in plan.single:
            rows = slice(seq.token_start, seq.token_end)
            iq = None if index_q is None else self.selector.rows(index_q, rows)
            o_lat[rows] = self._attend(seq, q[rows], ctx.positions[rows], iq, ctx, cache)
        if plan.sparse:
            self._attend_sparse_decodes(plan, q, index_q, ctx, cache, o_lat)
        for length, seqs in plan.dense.items():
            self._attend_dense_decodes(seqs, length, q, ctx, cache, o_lat)
        return o_lat

    def _attend_sparse_decodes(self, plan: DecodePlan, q: torch.Tensor, index_q, ctx: ForwardContext, cache,
                               o_lat: torch.Tensor) -> None:
        o_lat[plan.row_index(ctx)] = self._sparse_decodes(plan, q, index_q, ctx, cache, ordered=False)

    def _sparse_decodes(self, plan: DecodePlan, q: torch.Tensor, index_q, ctx: ForwardContext, cache,
                        ordered: bool) -> torch.Tensor:
        """Every sparse-regime decode row at once, in plan order: k selected entries each, one gather
        through a [rows, k] slot table, one attention. `ordered`: the plan's rows are all of q's, in order.
        The slot table and the mask are made once per selection (a shared layer reuses both)."""
        selected = self._decode_selection(plan, q, index_q, ctx, cache)               # [rows, k]
        picks, hidden = plan.picks(ctx, selected)
        return self.attend_picked(q if ordered else q[plan.row_index(ctx)], picks, hidden, cache)

    def _decode_selection(self, plan: DecodePlan, q: torch.Tensor, index_q, ctx: ForwardContext, cache) -> torch.Tensor:
        """The sparse decodes' selections [rows, k]: a full layer's own (also kept per request in
        ctx.selection, for the shared layers of chunks and for MTP drafting); a shared layer's or a
        draft step's, reused."""
        if ctx.draft_step and ctx.decode_selection is None:
            missing = [s.request_id for s in plan.sparse if s.request_id not in ctx.selection]
            if missing:
                raise RuntimeError(f"draft step without the drafting row's selection for {missing}")
            ctx.decode_selection = torch.cat([ctx.selection[s.request_id] for s in plan.sparse])
        elif self.selector is not None and not ctx.draft_step:
            ctx.decode_selection = self._select_decodes(plan, q, index_q, ctx, cache)
            parts = ctx.decode_selection.split(plan.sizes) if len(plan.sparse) > 1 else [ctx.decode_selection]
            ctx.selection.update(zip([s.request_id for s in plan.sparse], parts))
        if ctx.decode_selection is None:
            raise RuntimeError(f"layer {self.layer_idx} is 'shared' but no earlier full layer selected tokens")
        if ctx.record_selection is not None:
            for seq, part in zip(plan.sparse, ctx.decode_selection.split(plan.sizes)):
                ctx.record_selection(self.layer_idx, seq, part)
        return ctx.decode_selection

    def _select_decodes(self, plan: DecodePlan, q: torch.Tensor, index_q, ctx: ForwardContext, cache) -> torch.Tensor:
        """A full layer's selections of the plan's sparse decodes, in plan order: each group of two or
        more in one batched pass where the selector batches (`DSASelector.batches`), the rest alone."""
        batches, parts, done = self.selector.batches(index_q[0].device), [], 0
        for major, group in plan.groups:
            if batches and len(group) > 1:
                parts.append(self._select_group(group, q, index_q, ctx, cache, major))
            else:
                parts.extend(self._select_alone(seq, q, index_q, ctx, cache) for seq in group)
            done += len(group)
        parts.extend(self._select_alone(seq, q, index_q, ctx, cache) for seq in plan.sparse[done:])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_dense_decodes(self, seqs: list[SeqSlice], length: int, q: torch.Tensor, ctx: ForwardContext,
                              cache, o_lat: torch.Tensor) -> None:
        """Decodes below top-k context (DSA's dense regime: every entry is read), batched: each
        request's history padded to `length` entries, masked by position (padding adds exact zeros to
        the softmax). The padded length is a power of two of the request's own context, not the
        batch's longest, so a short request is not padded to a long one."""
        per_row = q.shape[1] * length
        group = max(1, query_block_size(per_row * ctx.decode_rows, len(seqs), q.device))
        for start in range(0, len(seqs), group):
            part = seqs[start:start + group]
            keys = cache.dense_decode_latents(self.layer_idx, part, length)      # [B, length, D]
            rows = ctx.rows_index([r for seq in part for r in range(seq.token_start, seq.token_end)])
            if rows.numel() != len(part):  # drafts: each request's rows share its keys
                owner = [i for i, seq in enumerate(part) for _ in range(seq.num_new_tokens)]
                keys = keys[ctx.rows_index(owner)]
            visible = ctx.positions[rows]
            if ctx.draft_step:  # the row sits past its history (speculative.py): the padding after it is not history
                ends = index_tensor([seq.context_len - 1 for seq in part for _ in range(seq.num_new_tokens)], q.device)
                visible = torch.minimum(visible, ends)
            valid = torch.arange(length, device=q.device)[None, :] <= visible[:, None]
            o_lat[rows] = latent_attention(q[rows], keys, valid, self.scale, self.cfg.kv_lora_rank)

    def _select_alone(self, seq: SeqSlice, q: torch.Tensor, index_q, ctx: ForwardContext, cache) -> torch.Tensor:
        if seq.token_start == 0 and seq.token_end == q.shape[0]:  # the step's only rows: nothing to cut
            return self.selector.select_decode(self.layer_idx, seq, index_q, q, ctx.positions, self.cfg.index_topk,
                                               cache)
        rows = slice(seq.token_start, seq.token_end)
        return self.selector.select_decode(self.layer_idx, seq, self.selector.rows(index_q, rows), q[rows],
                                           ctx.positions[rows], self.cfg.index_topk, cache)

    def _select_group(self, group: list[SeqSlice], q: torch.Tensor, index_q, ctx: ForwardContext, cache,
                      major: bool) -> torch.Tensor:
        """One group's selections [its rows, k], in one batched pass of the selector (`select_group`)."""
        k, r = self.cfg.index_topk, max(s.num_new_tokens for s in group)  # shorter decodes repeat their last row
        rows = ctx.rows_index([[s.token_start + min(i, s.num_new_tokens - 1) for i in range(r)] for s in group])
        selected = self.selector.select_group(self.layer_idx, group, self.selector.rows(index_q, rows), q[rows],
                                              ctx.positions[rows], k, cache, major).view(-1, k)
        if all(s.num_new_tokens == r for s in group):
            return selected
        return selected[ctx.rows_index([i * r + j for i, s in enumerate(group) for j in range(s.num_new_tokens)])]

    def _sparse(self, seq: SeqSlice, ctx) -> bool:
        return ctx.attention != "dense" and seq.context_len > self.cfg.index_topk

    def _attend(self, seq: SeqSlice, q: torch.Tensor, positions: torch.Tensor, index_q, ctx, cache):
        if not self._sparse(seq, ctx):
            return self._attend_dense(seq, q, positions, cache)
        selected = self._select(seq, q, positions, index_q, ctx, cache)
        return self._attend_selected(seq, q, positions, selected, cache)

    def _select(self, seq: SeqSlice, q: torch.Tensor, positions: torch.Tensor, index_q, ctx, cache) -> torch.Tensor:
        """This layer's selection for the request: its own (full layer) or its group's (shared layer)."""
        if self.selector is not None and not ctx.draft_step:
            select = self.selector.select_decode if seq.num_new_tokens <= ctx.decode_rows else self.selector.select
            ctx.selection[seq.request_id] = select(self.layer_idx, seq, index_q, q, positions, self.cfg.index_topk, cache)
        selected = ctx.selection.get(seq.request_id)
        if selected is None:
            raise RuntimeError(f"layer {self.layer_idx} is 'shared' but no earlier full layer selected tokens")
        if ctx.record_selection is not None:
            ctx.record_selection(self.layer_idx, seq, selected)
        return selected

    def _attend_dense(self, seq, q, positions, cache) -> torch.Tensor:
        keys = cache.latent_for(self.layer_idx, seq)             # [T, D]
        key_pos = torch.arange(seq.context_len, device=q.device)

        def block(start: int, end: int) -> torch.Tensor:
            valid = key_pos[None, :] <= positions[start:end, None]
            return latent_attention(q[start:end], keys, valid, self.scale, self.cfg.kv_lora_rank)
        return fill_blocks(q.shape[0], query_block_size(q.shape[1] * seq.context_len, q.shape[0], q.device), block)

    def _attend_selected(self, seq, q, positions, selected, cache) -> torch.Tensor:
        def block(start: int, end: int) -> torch.Tensor:
            idx = selected[start:end]
            keys = cache.gather_latent(self.layer_idx, seq, idx)     # [Sb, k, D]
            valid = idx <= positions[start:end, None]
            return latent_attention(q[start:end], keys, valid, self.scale, self.cfg.kv_lora_rank)
        rows = query_block_size(selected.shape[1] * (q.shape[1] + q.shape[2]), q.shape[0], q.device)
        return fill_blocks(q.shape[0], rows, block)
