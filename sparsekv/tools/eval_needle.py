"""`sparsekv eval needle MODEL`: RULER-style retrieval through the engine, by context length and depth.

Prompts come from `sparsekv.train.tasks` in the model's own token space (exact lengths, needles at
the requested depths; the code haystack is held-out stdlib code). Each length runs with sparse
attention (tiered KV cache when the engine offers it) and, up to --dense-max-length, with dense
attention for comparison. Greedy decoding; a sample is correct when the first number generated is
the key.

With sparse attention it also reports, per full layer, the share of the key's tokens in the prompt
that the layer's top-k selected while answering (the union over the rows that wrote the output: the
prompt's last row and each decode row): whether the selector surfaced the needle at all, apart from
whether the model then copied it right.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

from ..engine_args import engine_error, json_object, output_path
from ..train.tasks import TASKS, TaskBuilder, score
from .plan_workload import parse_token_list, parse_tokens

MAX_TOKENS = {"passkey": 8, "multikey": 8, "niah": 8, "vartrack": 24}
PROGRESS_MIN_LENGTH = 1 << 16   # a prefill bar per sample from here: these prompts take minutes to hours


def checked_grid(args: argparse.Namespace) -> tuple[list[str], list[int], list[float], int]:
    """(tasks, lengths, depths, dense max length) from the flags; ValueError naming the bad flag."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown or args.tasks!r}; choose from {TASKS}")
    try:
        lengths = parse_token_list(args.lengths)
        dense_max = 0 if args.dense_max_length.strip() == "0" else parse_tokens(args.dense_max_length)
    except ValueError as e:
        raise ValueError(f"--lengths / --dense-max-length: {e}") from None
    try:
        depths = [float(x) for x in args.depths.split(",")]
    except ValueError:
        raise ValueError(f"--depths takes numbers in [0, 1], got {args.depths!r}") from None
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--depths must lie in [0, 1], got {args.depths!r}")
    if args.samples < 1:
        raise ValueError(f"--samples must be at least 1, got {args.samples}")
    return tasks, lengths, depths, dense_max


def length_label(n: int) -> str:
    for suffix, unit in (("M", 1 << 20), ("K", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--lengths", default="4K,16K,64K,256K,1M", help="context lengths in tokens (K = 1024)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="samples per task, length and depth")
    p.add_argument("--dense-max-length", default="16K", help="also run dense attention up to this length")
    p.add_argument("--no-tiering", action="store_true", help="do not ask the engine for the tiered KV cache")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (by default prompts of one length share their common prefix)")
    p.add_argument("--device-buffer-tokens", type=int, default=32768)
    p.add_argument("--prefill-chunk-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto (default): float32 on CPU, the checkpoint's 16-bit dtype on CUDA")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="latents in the model dtype, or FP8 (FlashMLA's rows): does retrieval survive the quantization?")
    p.add_argument("--device", default="cpu", help="engine device (cpu, cuda)")
    p.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="config.json fields to override (e.g. '{\"max_position_embeddings\": 2097152}' to "
                        "test past the model's trained length)")
    p.add_argument("--heatmap", type=output_path, default="needle_heatmap.png",
                   help="the depth x length heatmap PNG to write (default: %(default)s in the current directory)")
    p.add_argument("--json", type=output_path, default=None, help="write every sample's result here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true",
                   help=f"no prefill progress bar (shown for prompts of {length_label(PROGRESS_MIN_LENGTH)} tokens and more)")


def llm_options(args, attention: str, max_len: int) -> dict:
    """The LLM(...) keywords of one length's engine, tiering aside."""
    return dict(max_model_len=max_len, attention=attention, prefill_chunk_tokens=args.prefill_chunk_tokens,
                max_num_seqs=1, max_num_batched_tokens=args.prefill_chunk_tokens, dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype, device=args.device, enable_prefix_caching=not args.no_prefix_caching,
                hf_overrides=args.hf_overrides)


def tiering_options(args) -> dict:
    return dict(kv_tiering=True, device_buffer_tokens=args.device_buffer_tokens)


def check_engine_options(model: str, args, max_len: int) -> None:
    """The engine options the flags make, checked against the model before any work (ConfigError
    naming the field): an invalid --device-buffer-tokens is the user's error, not a reason to run
    without tiering."""
    from ..config import EngineConfig, ModelConfig
    tiering = {} if args.no_tiering else tiering_options(args)
    config = EngineConfig(model=model, **llm_options(args, "sparse", max_len), **tiering)
    config.validate()
    config.validate_for_model(ModelConfig.from_json(model, args.hf_overrides))


def needle_parser() -> argparse.ArgumentParser:
    """`eval needle`'s options alone (for naming the flag behind an engine option)."""
    p = argparse.ArgumentParser(prog="sparsekv eval needle")
    add_args(p)
    return p


def make_llm(model: str, attention: str, max_len: int, args) -> tuple[object, str]:
    """An engine for one length; tiering on unless the engine cannot hold a tiered cache here (its
    options were checked by `check_engine_options`: what it refuses now is the machine's, e.g. the
    host store's memory), in which case it runs without and says why."""
    from ..config import ConfigError
    from ..llm import LLM
    opts = llm_options(args, attention, max_len)
    if attention != "sparse" or args.no_tiering:
        return LLM(model, **opts), "tiering off"
    try:
        return LLM(model, **opts, **tiering_options(args)), "tiering on"
    except ConfigError as e:
        return LLM(model, **opts), f"tiering not possible here ({e}); ran without"


def build_samples(builder: TaskBuilder, tasks, length: int, depths, n: int):
    return [builder.make(t, length, d) for t in tasks for d in depths for _ in range(n)]


def key_positions(prompt: list[int], key_ids: list[int]) -> list[int]:
    """Positions covered by any occurrence of the key's token sequence in the prompt, each once, in order."""
    n = len(key_ids)
    starts = [i for i in range(len(prompt) - n + 1) if prompt[i:i + n] == key_ids] if n else []
    return sorted({i + j for i in starts for j in range(n)})


class AnswerRowSelections:
    """Records, for each full layer, the union of the top-k its selector picks for the rows that
    write the output (the prompt's last row, then each decode row), through the engine's selectors
    wrapped by `observe_selections`."""

    def __init__(self, llm):
        from ..model.selectors import observe_selections
        self.prompt_len, self.selected = 0, {}
        observe_selections(llm.engine.model, self._observe)

    def start(self, prompt_len: int) -> None:
        self.prompt_len, self.selected = prompt_len, {}

    def _observe(self, layer, seq, positions, selected) -> None:
        answering = positions >= self.prompt_len - 1
        if bool(answering.any()):
            self.selected.setdefault(layer, set()).update(selected[answering].flatten().tolist())

    def key_share(self, positions: list[int]) -> dict[str, float] | None:
        """Per full layer, the share of `positions` selected while answering (None: no selection was
        made, because the context fits in the top-k, or the key is not in the prompt)."""
        if not positions or not self.selected:
            return None
        return {str(layer): len(set(positions) & chosen) / len(positions) for layer, chosen in sorted(self.selected.items())}


def run_length(model: str, samples, length: int, attention: str, args, log, tok=None,
               on_result=None) -> tuple[list[dict], str]:
    """Every sample through the engine; `on_result(results so far)` after each one."""
    from ..request import SamplingParams
    llm, note = make_llm(model, attention, length + max(MAX_TOKENS.values()), args)
    recorder = AnswerRowSelections(llm) if attention == "sparse" and tok is not None else None
    results = []
    for i, s in enumerate(samples):
        t0 = time.perf_counter()
        if recorder:
            recorder.start(len(s.prompt))
        out = llm.generate([s.prompt], SamplingParams(max_tokens=MAX_TOKENS[s.task], temperature=0.0),
                           use_tqdm=length >= PROGRESS_MIN_LENGTH and not args.no_progress)[0]
        text = out.text or (llm.tokenizer.decode(out.token_ids) if llm.tokenizer else "")
        ok = score(s.answer, text)
        results.append({"task": s.task, "length": length, "depth": s.depth, "attention": attention,
                        "answer": s.answer, "output": text, "output_ids": list(out.token_ids), "correct": ok,
                        "seconds": time.perf_counter() - t0, "metrics": dict(out.metrics or {})})
        found = ""
        if recorder:
            share = recorder.key_share(key_positions(s.prompt, tok.encode(s.answer, add_special_tokens=False).ids))
            results[-1]["key_in_topk"] = share
            found = "" if share is None else " key selected: " + ", ".join(
                f"L{layer} {100 * v:.0f}%" for layer, v in share.items())
        log(f"  {length_label(length)} {attention} {s.task} depth={s.depth:.2f} {'OK ' if ok else 'MISS'} "
            f"want {s.answer} got {text.strip()[:40]!r}{found} ({results[-1]['seconds']:.1f} s) [{i + 1}/{len(samples)}]"
            f"{memory_note(results[-1]['metrics'])}")
        if on_result:
            on_result(results)
    return results, note


def memory_note(metrics: dict) -> str:
    """The request's tiers as it finished: device and host KV bytes, misses (tiering on only)."""
    if "host_kv_bytes" not in metrics:
        return ""
    mb = 1 << 20
    return (f" device KV {metrics['device_kv_bytes'] / mb:.1f} MB (latent {metrics['device_latent_bytes'] / mb:.1f}),"
            f" host KV {metrics['host_kv_bytes'] / mb:.1f} MB, tier miss rate {100 * metrics['tier_miss_rate']:.1f}%")


def key_in_topk_table(results: list[dict]) -> str:
    """Mean share of the key's tokens each full layer selected while answering, by length."""
    by_length: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        for layer, v in (r.get("key_in_topk") or {}).items():
            by_length[r["length"]][layer].append(v)
    lines = [f"{length_label(L)}: " + ", ".join(f"layer {layer} {100 * sum(v) / len(v):.0f}%"
                                                 for layer, v in sorted(layers.items(), key=lambda x: int(x[0])))
             for L, layers in sorted(by_length.items())]
    return "\n".join(["key tokens selected while answering (sparse, mean over prompts):"] + lines) if lines else ""


def accuracy(results: list[dict], keys) -> dict:
    acc = defaultdict(lambda: [0, 0])
    for r in results:
        k = tuple(r[key] for key in keys)
        acc[k][0] += int(r["correct"])
        acc[k][1] += 1
    return {k: c / n for k, (c, n) in acc.items()}


def format_table(results: list[dict], tasks, lengths) -> str:
    acc = accuracy(results, ("task", "length", "attention"))
    cols = [(L, a) for L in lengths for a in ("sparse", "dense") if (tasks[0], L, a) in acc]
    head = f"{'task':<10}" + "".join(f"{length_label(L) + ' ' + a:>14}" for L, a in cols)
    lines = [head, "-" * len(head)]
    for t in list(tasks) + ["all"]:
        cells = []
        for L, a in cols:
            if t == "all":
                rs = [r for r in results if r["length"] == L and r["attention"] == a]
                v = sum(r["correct"] for r in rs) / len(rs) if rs else None
            else:
                v = acc.get((t, L, a))
            cells.append(f"{'-' if v is None else f'{100 * v:.0f}%':>14}")
        lines.append(f"{t:<10}" + "".join(cells))
    return "\n".join(lines)


def write_heatmap(results: list[dict], tasks, lengths, depths, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    acc = accuracy([r for r in results if r["attention"] == "sparse"], ("task", "length", "depth"))
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks) + 1, 3.4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        grid = [[acc.get((t, L, d), float("nan")) for L in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [length_label(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_title(t)
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy (sparse)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    import torch
    torch.set_num_threads(args.threads)
    from ..paths import default_model_path
    from .eval_common import heldout_stream, load_text_tokenizer
    model = args.model or default_model_path()
    try:
        tasks, lengths, depths, dense_max = checked_grid(args)
        check_engine_options(model, args, max(lengths) + max(MAX_TOKENS.values()))
    except ValueError as e:  # a ConfigError too: named by its flag
        print(f"sparsekv eval needle: error: {engine_error(e, needle_parser())}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, flush=True)
    tok = load_text_tokenizer(model)
    builder = TaskBuilder(tok, heldout_stream(tok), args.seed)
    results, notes = [], {}

    def save(done: list[dict], complete: bool) -> None:
        """The JSON after every sample, so a run that is stopped (a 1M prompt takes hours here) keeps
        what it measured; written whole and renamed, never left half-written."""
        if args.json:
            write_json(args.json, {"model": os.path.abspath(model), "complete": complete, "notes": notes,
                                   "results": done})
    for L in lengths:
        samples = build_samples(builder, tasks, L, depths, args.samples)
        for attention in ["sparse"] + (["dense"] if L <= dense_max else []):
            log(f"length {length_label(L)}, {attention} attention: {len(samples)} prompts")
            rs, note = run_length(model, samples, L, attention, args, log, tok,
                                  on_result=lambda partial: save(results + partial, complete=False))
            notes[f"{length_label(L)} {attention}"] = note
            results += rs
            log(f"  ({note})")
    print(format_table(results, tasks, lengths))
    recall = key_in_topk_table(results)
    if recall:
        print(recall)
    if len(builder.code) < max(lengths):
        print(f"note: held-out haystack is {len(builder.code)} tokens; longer code haystacks repeat it")
    if args.heatmap:
        write_heatmap(results, tasks, lengths, depths, args.heatmap)
        print(f"heatmap: {args.heatmap}")
    save(results, complete=True)
    return 0


def write_json(path: str, data: dict) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(partial, path)
