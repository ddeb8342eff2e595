"""`sparsekv train`: tokenizer, data, the training stages (four, plus PoSE, plus the optional far
stage), export to an HF directory."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from ..engine_args import at_least, positive_finite

PRESETS = {
    # The bundled model: ~8M parameters (about 4M active per token), 5 layers, IndexShare FSFSS.
    # 32 RoPE dimensions per head: with 16, retrieval broke past 4K tokens (docs/training.md).
    "tiny": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, index_topk=256, index_head_dim=64, index_n_heads=4, first_k_dense_replace=1,
        index_topk_pattern="FSFSS", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=1 << 21, rms_norm_eps=1e-5,
    ),
    # For tests: seconds per stage. 8 indexer heads make exact top-k ties (ReLU zeros) improbable.
    "test": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, index_topk=8, index_head_dim=8, index_n_heads=8, first_k_dense_replace=1,
        index_topk_pattern="FSFS", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=1 << 21, rms_norm_eps=1e-5,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv train", description=__doc__)
    p.add_argument("--out", default=None, help="output HF directory (default: the bundled models/sparsekv-tiny); "
                   "one that holds files is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds (e.g. the bundled model)")
    p.add_argument("--work-dir", default=None, help="tokenizer, token cache and resumable state (default runs/train-NAME)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", default="700,100,500,150",
                   help="steps per stage: pretrain,warmup,sparse,mtp[,far] (PoSE applies in all of them; "
                        "far, 0 when not given, needs --far-negatives)")
    p.add_argument("--time-budget-minutes", type=positive_finite, default=None,
                   help="wall budget; stages shrink to fit (shares 50/10/30/10%%)")
    p.add_argument("--seq-len", type=at_least(2), default=512)
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--vocab-size", type=at_least(1), default=4096, help="BPE tokens learned from the corpus")
    p.add_argument("--digit-group", type=int, default=1, choices=(1, 2, 3),
                   help="digits per number token, cut from the left (3: as DeepSeek-V3 and GLM; adds the "
                        "1100 groups of 2 and 3 digits to the vocabulary)")
    p.add_argument("--lr", type=positive_finite, default=3e-3)
    p.add_argument("--synth-frac", type=float, default=0.6, help="share of rows that are retrieval documents")
    p.add_argument("--pose-max-position", type=at_least(1), default=1 << 20)
    p.add_argument("--doc-min-frac", type=float, default=1.0,
                   help="retrieval documents take a random length in [F, 1] x the row, at a random offset in "
                        "code (1.0: the document fills the row and its answers end it)")
    p.add_argument("--copy-warmup-steps", type=int, default=0,
                   help="the first N pretraining steps use short retrieval-only rows without PoSE "
                        "(counted in the pretrain steps)")
    p.add_argument("--copy-warmup-seq-len", type=at_least(2), default=128, help="row length of the copy warm-up")
    p.add_argument("--copy-warmup-repeat-frac", type=float, default=0.0,
                   help="share of copy warm-up rows that repeat random digit strings (the induction task)")
    p.add_argument("--copy-warmup-lr", type=positive_finite, default=1e-3, help="constant learning rate of the copy warm-up")
    p.add_argument("--copy-warmup-freeze-mlp", action="store_true",
                   help="MLPs and experts do not train during the copy warm-up (attention forms the copy circuit)")
    p.add_argument("--embed-init-std", type=float, default=0.02,
                   help="std of the initial token embeddings (other weights: 0.02)")
    p.add_argument("--answer-weight", type=positive_finite, default=3.0, help="loss weight of answer tokens")
    p.add_argument("--far-negatives", type=at_least(0), default=0,
                   help="far stage: negatives per row and layer (layer 0: copies of the batch's tokens "
                        "--far-min-distance to --pose-max-position positions back; a later full layer: other "
                        "rows' tokens interleaved with the row)")
    p.add_argument("--far-min-distance", type=at_least(1), default=512,
                   help="far stage, layer 0: the nearest far copy's distance before the row (default 512, the "
                        "row length: layers 0-1 never attend further in training; 4096 let layer 0 keep "
                        "picking copies within a few thousand tokens, docs/training.md, \"Layer 0's churn\")")
    p.add_argument("--far-layers", default="0",
                   help="far stage: the full layers whose indexers train, comma-separated (default: 0; the "
                        "bundled model ran it twice: 0 with --far-smoothing 0.3, then 2 with --far-smoothing 0)")
    p.add_argument("--far-smoothing", type=float, default=0.3,
                   help="far stage: share of the uniform distribution over the row in the indexer's target")
    p.add_argument("--far-lr", type=positive_finite, default=2e-3, help="far stage: peak learning rate")
    p.add_argument("--init-from", default=None,
                   help="start from this exported directory (its config, weights and tokenizer) instead of "
                        "random weights, e.g. with --steps 0,0,0,0,N to run only the far stage")
    p.add_argument("--heldout-rows", type=at_least(1), default=32)
    p.add_argument("--probe-length", type=at_least(0), default=384,
                   help="length of the fixed held-out retrieval prompts scored after each stage (0: none)")
    p.add_argument("--max-files", type=at_least(1), default=None, help="use only the first N stdlib files (tests)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="storage dtype of model.safetensors (router bias and indexer weights_proj stay fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--device", default="cpu", help="cpu (the shipped model), cuda or cuda:N")
    p.add_argument("--checkpoint-every", type=at_least(1), default=50)
    p.add_argument("--log-every", type=at_least(1), default=10)
    p.add_argument("--no-aux-indexers", action="store_true",
                   help="do not train indexers for shared layers (they feed only the IndexShare search)")
    p.add_argument("--stop-after-steps", type=at_least(1), default=None,
                   help="save the state and exit after this many steps (rerun the same command to continue)")
    p.add_argument("--fresh", action="store_true", help="ignore a saved state in the work dir")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def prepare_data(args, work_dir: str):
    """Tokenizer and token streams, built once and cached in the work dir. With --init-from the
    tokenizer is the checkpoint's own (its --digit-group is not checked: the checkpoint decides)."""
    import torch
    from .data import read_split
    from .tokenizer import digit_group_of, load_tokenizer, save_tokenizer, train_tokenizer
    cache, tok_file = os.path.join(work_dir, "corpus.pt"), os.path.join(work_dir, "tokenizer.json")
    if args.init_from:
        tok = load_tokenizer(args.init_from)
        if not os.path.exists(tok_file) or load_tokenizer(work_dir).to_str() != tok.to_str():
            save_tokenizer(tok, work_dir)
            if os.path.exists(cache):
                os.remove(cache)   # made with another tokenizer
        if os.path.exists(cache):
            return tok, torch.load(cache)
        return tok, _tokenize_corpus(tok, *read_split(max_files=args.max_files), cache)
    if os.path.exists(cache) and os.path.exists(tok_file):
        tok = load_tokenizer(work_dir)
        if digit_group_of(tok) != args.digit_group:
            raise SystemExit(f"sparsekv train: error: {work_dir} holds a tokenizer with digit groups of "
                             f"{digit_group_of(tok)}, not --digit-group {args.digit_group}; use another --work-dir")
        return tok, torch.load(cache)
    train, heldout = read_split(max_files=args.max_files)
    tok = train_tokenizer(train, args.vocab_size, args.digit_group)
    save_tokenizer(tok, work_dir)
    return tok, _tokenize_corpus(tok, train, heldout, cache)


def _tokenize_corpus(tok, train: list[str], heldout: list[str], cache: str) -> dict:
    import torch
    from .data import tokenize_stream
    from .tokenizer import EOS
    eos = tok.token_to_id(EOS)
    corpus = {"train": tokenize_stream(tok, train, eos), "heldout": tokenize_stream(tok, heldout, eos)}
    torch.save(corpus, cache)
    return corpus


def parse_far_layers(text: str) -> tuple[int, ...] | None:
    """"0,2" -> (0, 2); None when malformed or empty."""
    try:
        layers = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        return None
    return layers or None


class UsageError(ValueError):
    """A flag value `sparsekv train` cannot run with; main prints it and exits with status 2."""


def checked_options(args, stages) -> tuple[dict, tuple[int, ...]]:
    """(steps per stage, far layers) from the flags, or UsageError naming the bad flag. Checked before
    any data is prepared, so a typo costs nothing."""
    try:
        counts = [int(s) for s in args.steps.split(",")]
    except ValueError:
        raise UsageError(f"--steps must be 4 or 5 comma-separated integers, got {args.steps!r}") from None
    if len(counts) not in (4, 5):
        raise UsageError("--steps needs 4 or 5 values: pretrain,warmup,sparse,mtp[,far]")
    if min(counts) < 0:
        raise UsageError(f"--steps cannot be negative, got {args.steps!r}")
    steps = dict(zip(stages, counts + [0] * (len(stages) - len(counts))))
    if steps["far"] and args.far_negatives <= 0:
        raise UsageError("far stage steps need --far-negatives M (M > 0)")
    far_layers = parse_far_layers(args.far_layers)
    if far_layers is None:
        raise UsageError(f"--far-layers must be comma-separated layer numbers, got {args.far_layers!r}")
    if steps["far"] and args.batch_size < 2 and any(far_layers):
        raise UsageError(f"--far-layers {args.far_layers}: the haystack negatives of a full layer after 0 are other "
                         f"rows' tokens; they need --batch-size 2 or more")
    for needed in ("config.json", "model.safetensors") if args.init_from else ():
        if not os.path.isfile(os.path.join(args.init_from, needed)):
            raise UsageError(f"--init-from {args.init_from}: no {needed} there (a directory `sparsekv train` wrote)")
    if not 0 <= args.copy_warmup_steps <= steps["pretrain"]:
        raise UsageError("--copy-warmup-steps must be between 0 and the pretrain steps")
    if not 0.0 <= args.copy_warmup_repeat_frac <= 1.0:
        raise UsageError("--copy-warmup-repeat-frac must be in [0, 1]")
    if not 0.0 < args.doc_min_frac <= 1.0:
        raise UsageError("--doc-min-frac must be in (0, 1]")
    if not 0.0 <= args.synth_frac <= 1.0:
        raise UsageError("--synth-frac must be in [0, 1]")
    if not 0.0 <= args.far_smoothing < 1.0:
        raise UsageError("--far-smoothing must be in [0, 1)")
    if not 0.0 <= args.embed_init_std < float("inf"):
        raise UsageError("--embed-init-std must be a finite number >= 0")
    check_train_device(args.device)
    return steps, far_layers


def check_train_device(device: str) -> None:
    """--device as `generate --device` checks it: a device this torch can use, or the same one line
    (training would otherwise prepare its data first, then fail moving the model)."""
    from ..config import ConfigError, check_device
    try:
        check_device(device, "--device")
    except ConfigError as e:
        raise UsageError(str(e)) from None


def build(args, tok):
    import torch
    from .export import hf_config, model_config
    from .model import GlmDsaForTraining
    from .tokenizer import EOS
    if args.init_from:
        return _load_exported(args.init_from, not args.no_aux_indexers)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    raw = hf_config(PRESETS[args.preset], vocab, tok.token_to_id(EOS))
    torch.manual_seed(args.seed)
    return raw, GlmDsaForTraining(model_config(raw), aux_indexers=not args.no_aux_indexers,
                                  embed_init_std=args.embed_init_std)


def _load_exported(path: str, aux_indexers: bool):
    """(config dict, training model) of a directory `export` wrote, auxiliary indexers included."""
    from safetensors.torch import load_file
    from .export import AUX_INDEXERS, model_config
    from .model import GlmDsaForTraining
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    model = GlmDsaForTraining(model_config(raw), aux_indexers=aux_indexers)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    aux = os.path.join(path, AUX_INDEXERS)
    if aux_indexers and os.path.exists(aux):
        tensors.update(load_file(aux))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise SystemExit(f"sparsekv train: error: {path} does not match its config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return raw, model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    import torch
    torch.set_num_threads(args.threads)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    from .trainer import UnusableState
    try:
        train(args, log)
    except (UsageError, UnusableState) as e:
        print(f"sparsekv train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sparsekv train: interrupted; the same command resumes from the work directory's last checkpoint",
              file=sys.stderr)
        return 130
    return 0


def check_output_dir(out: str, overwrite: bool, label: str | None = None) -> None:
    """Before any work: --out is a directory this run may write (made at export), empty unless
    --overwrite (the default is the bundled model: a bare `sparsekv train` replaced it). `label`
    names the output in the message (default `--out OUT`)."""
    label = f"--out {out}" if label is None else label
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{label}: not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UsageError(f"{label} already holds files (a checkpoint?); pass --overwrite to replace them")
    if os.path.islink(out) or os.path.ismount(out):  # the export replaces the directory by renames
        raise UsageError(f"{label}: a symbolic link or a mount point cannot be replaced whole; give a "
                         f"directory inside it")
    existing = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(existing):  # the export writes beside `out`, then renames it into place
        existing = os.path.dirname(existing)
    if not (os.path.isdir(existing) and os.access(existing, os.W_OK)):
        raise UsageError(f"{label}: {existing} is not a writable directory")


def train(args, log) -> None:
    """Every stage from the flags, resuming from the work directory; writes the HF directory when done."""
    from ..paths import DEFAULT_MODEL_DIR
    from .stages import STAGES
    from .trainer import Trainer
    steps, far_layers = checked_options(args, STAGES)
    out = args.out or DEFAULT_MODEL_DIR
    check_output_dir(out, args.overwrite)
    work_dir = args.work_dir or os.path.join("runs", f"train-{os.path.basename(os.path.normpath(out))}")
    os.makedirs(work_dir, exist_ok=True)
    t0 = time.time()
    tok, corpus = prepare_data(args, work_dir)
    raw, model = build(args, tok)
    not_full = [i for i in far_layers if not (0 <= i < len(raw["indexer_types"]) and raw["indexer_types"][i] == "full")]
    if not_full:
        raise UsageError(f"--far-layers {not_full}: not full layers (indexer_types {raw['indexer_types']})")
    model.to(args.device)
    log(f"model: {model_parameters(model) / 1e6:.2f}M parameters; train {len(corpus['train'])} tokens, "
        f"held-out {len(corpus['heldout'])} tokens ({time.time() - t0:.1f} s to prepare)")
    rows, probe = heldout_sets(args, tok, corpus)
    trainer = Trainer(model, batch_source(args, tok, corpus, far_layers), rows, train_options(args, steps, far_layers),
                      work_dir, probe)
    if not args.fresh and trainer.try_resume():
        log(f"resumed from {work_dir} at stage {trainer.state.stage + 1}, step {trainer.state.step}")
    state = trainer.run(log)
    if state.done:
        write_model(args, model, raw, tok, out, state)
        log(f"wrote {out}: " + json.dumps(state.heldout[list(state.heldout)[-1]] if state.heldout else {}))


def model_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_source(args, tok, corpus: dict, far_layers: tuple[int, ...]):
    from .data import BatchSource
    return BatchSource(tok, corpus["train"], args.seq_len, args.batch_size, args.seed, args.synth_frac,
                       args.pose_max_position, answer_weight=args.answer_weight, doc_min_frac=args.doc_min_frac,
                       copy_warmup_steps=args.copy_warmup_steps, copy_warmup_seq_len=args.copy_warmup_seq_len,
                       copy_warmup_repeat_frac=args.copy_warmup_repeat_frac,
                       far_count=args.far_negatives, far_min_distance=args.far_min_distance,
                       far_layers=far_layers)


def heldout_sets(args, tok, corpus: dict) -> tuple:
    """(held-out loss rows, teacher-forced retrieval probe or None)."""
    from .data import heldout_rows, retrieval_probe
    rows = heldout_rows(corpus["heldout"], args.seq_len, args.heldout_rows)
    return rows, retrieval_probe(tok, corpus["heldout"], args.probe_length) if args.probe_length > 0 else None


def train_options(args, steps: dict, far_layers: tuple[int, ...]):
    from .trainer import TrainOptions
    return TrainOptions(steps=steps, lr=args.lr, checkpoint_every=args.checkpoint_every,
                        stop_after_steps=args.stop_after_steps, log_every=args.log_every,
                        copy_warmup_steps=args.copy_warmup_steps, copy_warmup_lr=args.copy_warmup_lr,
                        copy_warmup_freeze_mlp=args.copy_warmup_freeze_mlp,
                        far_lr=args.far_lr, far_smoothing=args.far_smoothing, far_layers=far_layers,
                        time_budget_s=None if args.time_budget_minutes is None else args.time_budget_minutes * 60)


def write_model(args, model, raw: dict, tok, out: str, state) -> None:
    """The HF directory, with training.json: the flags, held-out figures and the machine it ran on."""
    import torch
    from .export import export, machine_fingerprint
    summary = {"args": vars(args), "parameters": model_parameters(model), "planned_steps": state.planned,
               "elapsed_s": state.elapsed, "heldout": state.heldout, "pose": "two-chunk PoSE, log-uniform skip",
               "machine": machine_fingerprint()}
    if args.init_from and os.path.exists(os.path.join(args.init_from, "training.json")):
        with open(os.path.join(args.init_from, "training.json")) as f:
            summary["init_from"] = {"path": args.init_from, "training": json.load(f)}
    dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    write_dir_whole(out, lambda staging: export(model, raw, tok, staging, summary, dtype=dtype))


def write_dir_whole(out: str, write) -> None:
    """`write(directory)` fills a hidden directory beside `out`, which then replaces `out` whole: files
    only the old `out` had go, and a write cut short leaves the old `out` as it was."""
    staging = _sibling(out, "partial")
    try:
        write(staging)
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sibling(path: str, what: str) -> str:
    """A hidden name next to `path` (the same file system, so a rename moves it)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{what}-{os.getpid()}")


def _replace_dir(new: str, out: str) -> None:
    """`out` becomes `new` by renames: an export cut short leaves the old directory whole, and files
    only the old one had (an IndexShare file a run without auxiliary indexers does not write) go."""
    old = _sibling(out, "old") if os.path.exists(out) else None
    if old:
        os.rename(out, old)
    try:
        os.rename(new, out)
    except OSError:
        if old:
            os.rename(old, out)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)
