"""`sparsekv eval needle|indexshare|loss MODEL`: dispatch to the eval modules."""
from __future__ import annotations

import argparse
import sys

from ..config import ConfigError
from ..engine_args import at_least, engine_error


def loss_main(args: argparse.Namespace) -> int:
    """Held-out LM loss with dense and with sparse attention, through the engine's model."""
    import torch
    torch.set_num_threads(args.threads)
    from ..paths import default_model_path
    from .eval_common import build_model, load_parts, load_text_tokenizer, sequence_loss
    from .eval_indexshare import calibration_set
    path = args.model or default_model_path()
    cfg, tensors = load_parts(path)
    model = build_model(cfg, tensors)
    seqs = calibration_set(load_text_tokenizer(path), args.seq_len, args.num_seqs)
    if not seqs:
        print(f"sparsekv eval loss: error: the held-out text holds no sequence of --seq-len {args.seq_len} tokens",
              file=sys.stderr)
        return 2
    skip = min(cfg.index_topk, args.seq_len - 2) if args.skip_dense_prefix else 0
    result = {}
    for attention in ("dense", "sparse"):
        result[attention] = sum(sequence_loss(model, ids, attention, skip) for ids in seqs) / len(seqs)
    gap = 100 * (result["sparse"] / result["dense"] - 1)
    scope = f"targets after position {skip}" if skip else "all targets"
    print(f"held-out loss ({len(seqs)} x {args.seq_len} tokens, {scope}, index_topk {cfg.index_topk}): "
          f"dense {result['dense']:.4f}  sparse {result['sparse']:.4f}  ({gap:+.2f}%)")
    return 0


def _loss_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--seq-len", type=at_least(2), default=4096)
    p.add_argument("--num-seqs", type=at_least(1), default=4)
    p.add_argument("--skip-dense-prefix", action="store_true",
                   help="score only positions that see more than index_topk keys (where sparse differs)")
    p.add_argument("--threads", type=at_least(1), default=1)


def build_parser() -> argparse.ArgumentParser:
    from . import eval_indexshare, eval_needle
    p = argparse.ArgumentParser(prog="sparsekv eval")
    sub = p.add_subparsers(dest="which", required=True)
    eval_needle.add_args(sub.add_parser("needle", help="RULER-style retrieval by length and depth"))
    eval_indexshare.add_args(sub.add_parser("indexshare", help="top-k overlap and the greedy IndexShare search"))
    _loss_args(sub.add_parser("loss", help="held-out LM loss, dense vs sparse attention"))
    return p


def main(argv: list[str] | None = None) -> int:
    from . import eval_indexshare, eval_needle
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    run = {"needle": eval_needle.main, "indexshare": eval_indexshare.main, "loss": loss_main}[args.which]
    try:
        return run(args)
    except (FileNotFoundError, ConfigError) as e:  # a ConfigError's fields named by the command's flags
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.which]
        print(f"sparsekv eval {args.which}: error: {engine_error(e, command)}", file=sys.stderr)
        return 2
