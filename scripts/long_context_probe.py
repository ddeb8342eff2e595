"""Why retrieval breaks at long context: attention of the training model on passkey prompts.

  python scripts/long_context_probe.py MODEL [--lengths 2K,4K,8K] [--depth 1.0] [--dense]

For one passkey prompt per length (the same builder seed at every length, needle at --depth), at the
row that predicts the key's first digit, it prints:

* per layer: attention (head mean) on the key digit, on the previous token and on the last 256
  positions, its entropy, and for full layers whether the previous token is selected;
* for layer 0's previous-token head (the head that puts the most attention on the previous token at
  the shortest length): its logit on the previous token, the largest logit on an earlier position
  holding the same token (more than 64 back), and the attention mass those far copies take.

Runs the model of `sparsekv.train` (it materialises L x L scores: 8K needs ~6 GB, 16K ~20 GB).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparsekv.tools.eval_common import heldout_stream, load_parts, load_text_tokenizer  # noqa: E402
from sparsekv.train.model import GlmDsaForTraining, Rope  # noqa: E402
from sparsekv.train.tasks import TaskBuilder  # noqa: E402
from sparsekv.tools.plan_workload import parse_tokens  # noqa: E402


def load(model_dir: str) -> GlmDsaForTraining:
    cfg, tensors = load_parts(model_dir)
    model = GlmDsaForTraining(cfg, aux_indexers=True)
    model.load_state_dict(tensors, strict=False)  # auxiliary indexers: only when the checkpoint has them
    return model.eval()


def layer0_logits(model: GlmDsaForTraining, ids: torch.Tensor, row: int) -> torch.Tensor:
    """Layer 0's attention logits [heads, row + 1] of query `row` (embeddings only: exact)."""
    cfg, attn = model.cfg, model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[:, :row + 1]))
    rope = Rope(cfg, torch.arange(row + 1)[None])
    h, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope, q_rot = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x[:, row:]))).view(1, 1, h, -1).split([nope, r], -1)
    c, k_rot = attn.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, r], -1)
    k_nope = attn.kv_b_proj(attn.kv_a_layernorm(c)).view(1, row + 1, h, -1)[..., :nope]
    pos = Rope(cfg, torch.tensor([[row]]))
    q = torch.cat([q_nope, pos(q_rot)], -1)[0, 0]
    k = torch.cat([k_nope, rope(k_rot.unsqueeze(2)).expand(1, row + 1, h, r)], -1)[0]
    return torch.einsum("hd,shd->hs", q, k) * cfg.softmax_scale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--lengths", default="2K,4K,8K")
    p.add_argument("--depth", type=float, default=1.0)
    p.add_argument("--dense", action="store_true", help="dense attention (default: the indexers' top-k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model), load_text_tokenizer(args.model)
    code, head = heldout_stream(tok), None
    for length in (parse_tokens(x) for x in args.lengths.split(",")):
        sample = TaskBuilder(tok, code, args.seed).make("passkey", length, args.depth, with_answer=True)
        ids, row = torch.tensor(sample.prompt)[None], length - len(sample.answer_ids)
        key = next(i for i in range(sample.needle_starts[0], length) if tok.id_to_token(sample.prompt[i]) == sample.answer[0])
        with torch.no_grad():
            out = model(ids[:, :row + 1], torch.arange(row + 1)[None], sparse=not args.dense, want_probs=True)
            logits = layer0_logits(model, ids, row)
        guess = tok.id_to_token(int(out.logits[0, row].argmax()))
        print(f"{length} tokens: key digit at {key}, row {row}; predicts {guess!r}, want {sample.answer[0]!r}")
        for i, trace in enumerate(out.traces):
            prob = trace.probs[0, row]
            ent = -(prob.clamp_min(1e-12).log() * prob).sum().item()
            line = (f"  layer {i}: key {prob[key]:.3f}  previous {prob[row - 1]:.3f}  last 256 "
                    f"{prob[max(row - 255, 0):].sum():.3f}  entropy {ent:.2f}")
            if trace.selected is not None and i in model.cfg.full_layers:
                line += f"  previous selected: {bool(trace.selected[0, row, row - 1])}"
            print(line)
        probs = logits.softmax(-1)
        head = int(probs[:, row - 1].argmax()) if head is None else head
        same = (ids[0, :row] == ids[0, row - 1]).nonzero().flatten()
        far = same[same < row - 64]
        lg = logits[head]
        print(f"  layer 0 previous-token head {head} (dense): logit on previous {lg[row - 1]:.2f}, max on "
              f"{len(far)} far copies {lg[far].max():.2f}; attention previous {probs[head, row - 1]:.3f}, "
              f"far copies {probs[head, far].sum():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
