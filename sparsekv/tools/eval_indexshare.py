"""`sparsekv eval indexshare MODEL`: top-k overlap between layers, and the training-free IndexShare search.

Both run through the engine's model on held-out stdlib code, in the sparse regime (sequences longer
than index_topk). Every layer needs an indexer to be compared or searched: the shipped model keeps
auxiliary indexers for its shared layers in indexshare/indexers.safetensors (trained by
`sparsekv train`, never used for serving). Layers without one are reported as such.

Overlap (IndexCache's observation): for query rows with more than k visible keys,
|TopK_a ∩ TopK_b| / k, averaged over rows, for every pair of layers with indexers.

Search (IndexCache Algorithm 1): start all-full; at each step try flipping each remaining full
layer (never layer 0) to shared, keep the flip with the lowest held-out loss; print every step.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..engine_args import at_least


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--seq-len", type=int, default=2048, help="held-out sequence length (> index_topk)")
    p.add_argument("--num-seqs", type=at_least(1), default=2)
    p.add_argument("--num-shared", type=at_least(0), default=None,
                   help="report the pattern with this many shared layers, at most the model's layers - 1 (layer 0 "
                        "always runs its own indexer) (default: as many as the checkpoint)")
    p.add_argument("--no-search", action="store_true")
    p.add_argument("--threads", type=int, default=1)


def calibration_set(tok, seq_len: int, num_seqs: int) -> list[list[int]]:
    from .eval_common import heldout_stream
    ids = heldout_stream(tok)
    stride = max((len(ids) - seq_len) // max(num_seqs, 1), 1)
    return [ids[i * stride:i * stride + seq_len] for i in range(num_seqs) if i * stride + seq_len <= len(ids)]


def selections(model, seqs: list[list[int]]) -> dict[int, list[torch.Tensor]]:
    """layer -> per sequence, the selected positions [rows past k, k] each layer attended to."""
    from .eval_common import sequence_logits
    k = model.cfg.index_topk
    out: dict[int, list[torch.Tensor]] = {}

    def record(layer, seq, selected):
        out.setdefault(layer, []).append(selected[k:].clone())   # rows with more than k visible keys
    for ids in seqs:
        sequence_logits(model, ids, "sparse", record)
    return out


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a ∩ b| / k, for sorted position sets [rows, k]."""
    k = a.shape[1]
    hits = torch.zeros(a.shape[0])
    for i in range(a.shape[0]):
        hits[i] = torch.isin(a[i], b[i]).sum()
    return float((hits / k).mean())


def overlap_matrix(sel: dict[int, list[torch.Tensor]], layers: list[int]) -> dict[tuple[int, int], float]:
    m = {}
    for x in layers:
        for y in layers:
            if y > x:
                m[(x, y)] = sum(overlap(a, b) for a, b in zip(sel[x], sel[y])) / len(sel[x])
    return m


def format_matrix(m: dict[tuple[int, int], float], layers: list[int]) -> str:
    lines = ["      " + "".join(f"{'L' + str(y):>7}" for y in layers)]
    for x in layers:
        cells = []
        for y in layers:
            v = 1.0 if x == y else m.get((min(x, y), max(x, y)))
            cells.append(f"{'-' if v is None else f'{100 * v:.0f}%':>7}")
        lines.append(f"{'L' + str(x):<6}" + "".join(cells))
    return "\n".join(lines)


def pattern(types) -> str:
    return "".join("F" if t == "full" else "S" for t in types)


def mean_loss(cfg, tensors, types, seqs) -> float:
    from .eval_common import build_model, sequence_loss
    model = build_model(cfg.replace(indexer_types=tuple(types)), tensors)
    k = cfg.index_topk
    return sum(sequence_loss(model, ids, "sparse", skip=k) for ids in seqs) / len(seqs)


def greedy_search(cfg, tensors, seqs, candidates: list[int], log) -> list[tuple[str, float]]:
    """Returns [(pattern, loss)] after 0, 1, 2, ... flips."""
    types = ["full" if i in candidates or i == 0 else "shared" for i in range(cfg.num_hidden_layers)]
    steps = [(pattern(types), mean_loss(cfg, tensors, types, seqs))]
    log(f"step 0: {steps[0][0]} loss {steps[0][1]:.4f}")
    remaining = [i for i in candidates if i != 0]
    while remaining:
        trials = {}
        for i in remaining:
            trial = list(types)
            trial[i] = "shared"
            trials[i] = mean_loss(cfg, tensors, trial, seqs)
            log(f"    try sharing layer {i}: loss {trials[i]:.4f}")
        best = min(trials, key=trials.get)
        types[best] = "shared"
        remaining.remove(best)
        steps.append((pattern(types), trials[best]))
        log(f"step {len(steps) - 1}: share layer {best} -> {steps[-1][0]} loss {trials[best]:.4f} "
            f"(+{100 * (trials[best] / steps[0][1] - 1):.2f}% over all-full)")
    return steps


def max_shared_layers(cfg) -> int:
    """Every layer but layer 0 can share: its indexer is the first the others could reuse."""
    return cfg.num_hidden_layers - 1


def option_problem(args: argparse.Namespace, cfg) -> str | None:
    """What is wrong with the flags for this model, before any work (None: nothing)."""
    if args.seq_len <= cfg.index_topk:
        return f"--seq-len must exceed index_topk {cfg.index_topk}"
    if args.num_shared is not None and args.num_shared > max_shared_layers(cfg):
        return (f"--num-shared {args.num_shared}: this {cfg.num_hidden_layers}-layer model shares at most "
                f"{max_shared_layers(cfg)} layers (layer 0 always runs its own indexer)")
    return None


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    from ..config import ModelConfig
    from ..paths import default_model_path
    from .eval_common import build_model, layers_with_indexers, load_parts, load_text_tokenizer
    path = args.model or default_model_path()
    problem = option_problem(args, ModelConfig.from_json(path))  # before the weights load
    if problem:
        print(f"sparsekv eval indexshare: error: {problem}", file=sys.stderr)
        return 2
    cfg, tensors = load_parts(path)
    log = lambda msg: print(msg, flush=True)
    seqs = calibration_set(load_text_tokenizer(path), args.seq_len, args.num_seqs)
    have = layers_with_indexers(cfg, tensors)
    missing = [i for i in range(cfg.num_hidden_layers) if i not in have]
    log(f"checkpoint pattern {pattern(cfg.indexer_types)}; layers with an indexer: {have}"
        + (f"; without: {missing} (compared only through their group's selection)" if missing else ""))
    all_full = ["full" if i in have else "shared" for i in range(cfg.num_hidden_layers)]
    sel = selections(build_model(cfg.replace(indexer_types=tuple(all_full)), tensors), seqs)
    log(f"\ntop-k overlap between layers' own indexers (k={cfg.index_topk}, {len(seqs)} x {args.seq_len} held-out tokens):")
    m = overlap_matrix(sel, have)
    log(format_matrix(m, have))
    adjacent = [m[(a, b)] for a, b in zip(have, have[1:])]
    log(f"adjacent layers: mean {100 * sum(adjacent) / max(len(adjacent), 1):.1f}%")
    for owner, members in groups(cfg.indexer_types).items():
        inside = [m[(owner, j)] for j in members[1:] if (owner, j) in m]
        if inside:
            log(f"group of layer {owner} (serves {members}): own top-k of members vs the shared one "
                f"{', '.join(f'{100 * v:.0f}%' for v in inside)}")
    if args.no_search:
        return 0
    log("\ngreedy training-free IndexShare search (held-out loss, sparse attention):")
    steps = greedy_search(cfg, tensors, seqs, have, log)
    n_shared = args.num_shared if args.num_shared is not None else list(cfg.indexer_types).count("shared")
    n_shared = max(n_shared - len(missing), 0)
    chosen = steps[min(n_shared, len(steps) - 1)][0]
    log(f"\nresulting indexer_types ({chosen.count('S')} shared): "
        f"{[{'F': 'full', 'S': 'shared'}[c] for c in chosen]}  (index_topk_pattern {chosen!r}; "
        f"checkpoint has {pattern(cfg.indexer_types)!r})")
    return 0


def groups(indexer_types) -> dict[int, list[int]]:
    from ..train.stages import index_groups
    return index_groups(indexer_types)
