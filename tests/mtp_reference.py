"""An MTP draft chain computed without the engine: transformers' modules for the MTP layer (loaded from
the checkpoint's `model.layers.{num_hidden_layers}.*`), attention written out per query row, dense over
the positions the row may see (its own top-k when past index_topk).

It follows the chain speculative.py documents, one request at a time, with C positions known to the
MTP cache (0 .. C - 1, each made from the target's hidden state at p and token p + 1):

  * step 1 (the extend row, position C - 1): causal attention over 0 .. C - 1, itself included,
    restricted to its own indexer's top-k;
  * step j = 2 .. K (position C - 2 + j): input = eh_proj(enorm(embed(draft j - 1)), hnorm(the previous
    step's hidden after shared_head.norm)); attention over the same positions as step 1 (index reuse)
    and nothing else: not its own row, not earlier draft rows (they write no cache entries).

Top-k ties are broken as the engine documents (kernels/attention.select_topk: among equal scores the
most recent positions win), so the reference selects one definite set.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (transformers' apply_rotary_pos_emb_interleave) of x [S, heads, d]; cos, sin [S, d]."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    return apply_rotary_pos_emb_interleave(x, x, cos, sin, unsqueeze_dim=1)[0]


class ReferenceMTP:
    """The checkpoint's MTP layer in transformers' modules; `chain` gives the draft logits of steps 1..K."""

    def __init__(self, path: str):
        from safetensors.torch import load_file
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        cfg = GlmMoeDsaConfig.from_pretrained(path)
        n = cfg.num_hidden_layers
        # one more layer than the target: transformers loads the MTP layer's decoder weights into it
        # (its eh_proj, norms and head are read below; transformers drops them)
        with_mtp = GlmMoeDsaConfig.from_pretrained(path, num_hidden_layers=n + 1,
                                                   indexer_types=list(cfg.indexer_types) + ["full"],
                                                   mlp_layer_types=list(cfg.mlp_layer_types) + ["sparse"])
        model = GlmMoeDsaForCausalLM.from_pretrained(path, config=with_mtp, dtype=torch.float32).eval()
        self.layer, self.rotary, self.cfg = model.model.layers[n], model.model.rotary_emb, cfg
        weights = {name: w.float() for name, w in load_file(f"{path}/model.safetensors").items()}
        p = f"model.layers.{n}."
        self.enorm, self.hnorm = weights[p + "enorm.weight"], weights[p + "hnorm.weight"]
        self.eh_proj, self.head_norm = weights[p + "eh_proj.weight"], weights[p + "shared_head.norm.weight"]
        self.embed = weights.get(p + "embed_tokens.weight", model.model.embed_tokens.weight)
        self.head = weights.get(p + "shared_head.head.weight", model.lm_head.weight)

    def inputs(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat(enorm(embed(token p + 1)), hnorm(hidden at p))): the MTP layer's input rows."""
        eps = self.cfg.rms_norm_eps
        e = F.embedding(next_tokens, self.embed)
        return F.linear(torch.cat([_rms(e, self.enorm, eps), _rms(hidden, self.hnorm, eps)], -1), self.eh_proj)

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary(x, positions[None])
        return cos[0], sin[0]

    def _query(self, xn: torch.Tensor, position: int):
        """(attention query [1, heads, qk_head_dim] with RoPE, q_resid) of one normed input row [1, H]."""
        a = self.layer.self_attn
        q_resid = a.q_a_layernorm(a.q_a_proj(xn))
        q = a.q_b_proj(q_resid).view(1, a.num_heads, a.qk_head_dim)
        q_nope, q_rot = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        cos, sin = self._cos_sin(xn, torch.tensor([position]))
        return torch.cat([q_nope, _rope(q_rot, cos, sin)], -1), q_resid

    def _keys_values(self, xn: torch.Tensor, positions: torch.Tensor):
        """Keys and values [heads, S, d] of normed input rows at `positions`, decompressed from the latent."""
        a = self.layer.self_attn
        kv_pass, k_rot = a.kv_a_proj_with_mqa(xn).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        cos, sin = self._cos_sin(xn, positions)
        k_rot = _rope(k_rot[:, None], cos, sin)[:, 0]
        s = xn.shape[0]
        keys, values = a.expand_kv(a.kv_a_layernorm(kv_pass).view(1, 1, s, -1), k_rot.view(1, 1, s, -1))
        return keys[0], values[0]

    def selection(self, x_known: torch.Tensor, position: int) -> list[int]:
        """The extend row's top-k among 0 .. position (all of them up to index_topk), engine's tie-break."""
        if position + 1 <= self.cfg.index_topk:
            return list(range(position + 1))
        ix, xn = self.layer.self_attn.indexer, self.layer.input_layernorm(x_known[:position + 1])
        _, q_resid = self._query(xn[-1:], position)
        q = ix.wq_b(q_resid).view(ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(xn))
        rope = ix.qk_rope_head_dim
        cos, sin = self._cos_sin(xn, torch.arange(position + 1))
        q = torch.cat([_rope(q[None, :, :rope], cos[-1:], sin[-1:])[0], q[:, rope:]], -1)
        k = torch.cat([_rope(k[:, None, :rope], cos, sin)[:, 0], k[:, rope:]], -1)
        per_head = F.relu(q @ k.T * ix.softmax_scale)                                  # [heads, S]
        scores = (ix.weights_proj(xn[-1]) * ix.n_heads ** -0.5) @ per_head             # [S]
        ranked = sorted(range(position + 1), key=lambda s: (-float(scores[s]), -s))
        return sorted(ranked[:self.cfg.index_topk])

    def row(self, x: torch.Tensor, position: int, key_x: torch.Tensor, key_positions: list[int]):
        """The MTP layer on one input row x [1, H] at `position`, attending to exactly the rows key_x
        (inputs at key_positions): (logits [V], hidden after shared_head.norm [1, H])."""
        layer, a = self.layer, self.layer.self_attn
        q, _ = self._query(layer.input_layernorm(x), position)
        keys, values = self._keys_values(layer.input_layernorm(key_x), torch.tensor(key_positions))
        weights = torch.softmax(torch.einsum("hd,hsd->hs", q[0], keys) * a.scaling, -1)
        attended = torch.einsum("hs,hsd->hd", weights, values).reshape(1, -1)
        h = x + a.o_proj(attended)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = _rms(h, self.head_norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.head)[0], h

    @torch.no_grad()
    def chain(self, ids: list[int], target_hidden: torch.Tensor, known: int, drafts: list[int]) -> list[torch.Tensor]:
        """Logits of draft steps 1 .. len(drafts) + 1 for a request whose MTP cache holds positions
        0 .. known - 1 (target_hidden: the target's final hidden states, rows >= known - 1). Step j + 1
        is fed drafts[j - 1], the engine's draft j, so one near-tie cannot derail the later steps."""
        x_known = self.inputs(torch.tensor(ids[1:known + 1]), target_hidden[:known])
        selected = self.selection(x_known, known - 1)
        logits, h = self.row(x_known[-1:], known - 1, x_known[selected], selected)
        out = [logits]
        for step, token in enumerate(drafts, start=1):
            logits, h = self.row(self.inputs(torch.tensor([token]), h), known - 1 + step, x_known[selected], selected)
            out.append(logits)
        return out
