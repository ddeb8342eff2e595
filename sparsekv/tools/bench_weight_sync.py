"""`sparsekv bench weight-sync`: an RL step's weight update, broadcast by the trainer over a
torch.distributed group (`/update_weights_from_distributed`, sparsekv/weight_sync.py) against reading
a checkpoint (`/update_weights_from_disk`), in the same run.

One engine; the trainer is a thread of this process holding the checkpoint's tensors in memory, rank 0
of a gloo group with the engine's side formed once, as an RL run forms it once. Timed per update:
"save + disk" is the trainer writing the checkpoint (safetensors, one file) and the engine reading it,
the loop an RL run on disk makes; "disk" is the read alone, `update_weights_from_disk` (the files are
in the page cache after the first read, and the writes land there: the figures leave the disk's own
speed out, which only favours them); "broadcast" is receiving
every tensor (`receive_weights`) then the update; "in process" is `update_weights` from tensors
already in memory, the floor both share (building the new weights part by part and copying them in).
With `--tensor-parallel-size N` the engine has N processes: on "broadcast" each joins the trainer's
group and receives every tensor itself, while "in process" has rank 0 relay the tensors to the others
over the engine's control group (the path an update given to rank 0 takes).
Printed: seconds per update (medians of `--repeats`), the weights' GB/s, the ratio against disk, how far
the process's resident set rose during the update (against the weights' size), the host copy of the
update's tensors rank 0 keeps after it (for later partial updates; none with
`--no-weight-update-host-copy`), and whether a greedy answer after each update is the same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import report_console, run_bench

MODES = ("save + disk", "disk", "broadcast", "in process")


def checkpoint_tensors(path: str) -> list:
    """Every (name, tensor) of a checkpoint as stored (its shards found as the engine finds them), in
    name order: what a trainer holds and broadcasts."""
    from safetensors.torch import load_file
    from ..model.checkpoint import list_tensor_files
    out = {}
    for file in sorted(set(list_tensor_files(path).values())):
        out.update(load_file(os.path.join(path, file)))
    return sorted(out.items())


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GROUP = "bench"


def _groups(world_port: int, engine, processes: int):
    """(trainer's group, engine rank 0's group): a gloo group formed once, the trainer as rank 0 and the
    engine's `processes` as ranks 1 to `processes` (each joins and receives itself: weight_sync.py)."""
    from sparsekv.weight_sync import join_group, trainer_group
    box, world = {}, 1 + processes
    thread = threading.Thread(target=lambda: box.setdefault("trainer", trainer_group("127.0.0.1", world_port, world)))
    thread.start()
    engine.weight_groups("join", GROUP, "127.0.0.1", world_port, 1, world, "gloo")
    engine_side = join_group("127.0.0.1", world_port, 1, world, "gloo")
    thread.join()
    return box["trainer"], engine_side


def _broadcast_update(engine, trainer, engine_side, tensors) -> float:
    """The trainer broadcasts every tensor; each engine rank receives them, then the update loads (as
    /update_weights_from_distributed runs it)."""
    import torch
    from sparsekv.weight_sync import TIMEOUT_S, broadcast_weights, receive_weights
    sender = threading.Thread(target=broadcast_weights, args=(trainer, tensors))
    names, dtypes, shapes = ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                             [list(t.shape) for _, t in tensors])
    t0 = time.perf_counter()
    ticket = engine.weights_version + 1  # a number of its own per update
    engine.weight_groups("receive", GROUP, ticket, names, dtypes, shapes)
    sender.start()
    received = receive_weights(engine_side, names, [t.dtype for _, t in tensors], [tuple(t.shape) for _, t in tensors],
                               "gloo", torch.device("cpu"))
    missing = [why for why in engine.weight_groups("outcome", GROUP, ticket, TIMEOUT_S) if why]
    if missing:
        raise RuntimeError(f"a rank did not receive the update: {missing}")
    engine.update_weights_from_group(GROUP, ticket, received)
    seconds = time.perf_counter() - t0
    sender.join()
    return seconds


def _save_and_load(engine, tensors, path: str, saved: str) -> float:
    """The trainer writes the checkpoint (into `saved`, which holds `path`'s other files), the engine
    reads it: the from-disk loop as an RL run does it."""
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    save_file(dict(tensors), os.path.join(saved, "model.safetensors"), metadata={"format": "pt"})
    engine.update_weights_from_disk(saved)
    return time.perf_counter() - t0


def _checkpoint_without_weights(path: str, directory: str) -> str:
    import shutil
    saved = os.path.join(directory, "saved")
    os.makedirs(saved)
    for name in os.listdir(path):
        if not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json") \
                and os.path.isfile(os.path.join(path, name)):
            shutil.copy(os.path.join(path, name), saved)
    return saved


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> dict:
    import torch
    from sparsekv import LLM, SamplingParams
    from sparsekv.paths import default_model_path
    from .bench import make_checkpoint
    from .bench_worker import rss_rise_mb
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or (make_checkpoint(args.preset, tmp) if args.preset else default_model_path())
        llm = LLM(path, max_model_len=256, num_threads=args.threads, tensor_parallel_size=args.tensor_parallel_size,
                  weight_update_host_copy=args.weight_update_host_copy)
        engine, tensors = llm.engine, checkpoint_tensors(path)
        trainer, engine_side = _groups(_free_port(), engine, args.tensor_parallel_size)
        prompt, greedy = list(range(1, 33)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        answer = lambda: llm.generate([prompt], greedy)[0].token_ids
        before, answers = answer(), []
        saved = _checkpoint_without_weights(path, tmp)
        updates = {"save + disk": lambda: _save_and_load(engine, tensors, path, saved),
                   "disk": lambda: _timed(lambda: engine.update_weights_from_disk(path)),
                   "broadcast": lambda: _broadcast_update(engine, trainer, engine_side, tensors),
                   "in process": lambda: _timed(lambda: engine.update_weights(tensors))}
        runs, rises, kept = ({mode: [] for mode in MODES} for _ in range(3))
        for _ in range(args.repeats):
            for mode in MODES:
                seconds, rise = rss_rise_mb(updates[mode])
                runs[mode].append(seconds)
                rises[mode].append(rise)
                kept[mode].append(_host_copy_mb(engine))
                answers.append(answer())
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        loaded = engine.weights_version
        llm.close()
    return {"tensor_parallel_size": args.tensor_parallel_size, "host_copy": args.weight_update_host_copy,
            "kept_mb": kept, "runs": runs, "rss_rise_mb": rises, "bytes": nbytes, "tensors": len(tensors), "model": args.model or args.preset or "bundled",
            "identical": all(a == before for a in answers), "updates_loaded": loaded}


def _host_copy_mb(engine) -> float:
    """The MB of update tensors rank 0 keeps for later partial updates (weights.WeightSource.overlay)."""
    return sum(t.numel() * t.element_size() for t in engine.executor.weights.overlay.values()) / 1e6


def report(result: dict) -> dict:
    seconds = {mode: statistics.median(rs) for mode, rs in result["runs"].items()}
    gb = result["bytes"] / 1e9
    tp = result["tensor_parallel_size"]
    ranks = f", tensor parallel {tp} (in process: rank 0 relays every tensor to the other ranks)" if tp > 1 else ""
    copy = "" if result["host_copy"] else ", no host copy of updates"
    table = Table(title=f"weight update of {result['model']}{ranks}{copy}: {result['tensors']} tensors, {gb:.3f} GB "
                        f"(medians of {len(result['runs']['disk'])}, gloo over loopback)")
    rises = {mode: _largest(rs) for mode, rs in result["rss_rise_mb"].items()}
    kept = {mode: max(ks) for mode, ks in result["kept_mb"].items()}
    for col in ("update", "seconds", "weights GB/s", "against save + disk", "host memory rise, MB (of the weights)",
                "host copy kept after, MB"):
        table.add_column(col)
    for mode, s in seconds.items():
        rise = "n/a" if rises[mode] is None else f"{rises[mode]:.0f} ({rises[mode] * 1e6 / result['bytes']:.2f}x)"
        table.add_row(mode, f"{s:.3f}", f"{gb / s:.2f}", f"{seconds['save + disk'] / s:.2f}x", rise, f"{kept[mode]:.0f}")
    console = report_console()
    console.print(table)
    console.print("host memory rise: the largest, over the repeats, of how far the resident set rose above where "
                  "it stood before the update, at its peak during it")
    console.print(f"greedy answer after every update identical: {result['identical']}")
    return {"seconds": seconds, "rss_rise_mb": rises, "kept_mb": kept, "bytes": result["bytes"], "identical": result["identical"],
            "updates_loaded": result["updates_loaded"]}


def _largest(values: list) -> float | None:
    return None if any(v is None for v in values) else max(values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench weight-sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--preset", default=None, help="a `sparsekv bench` preset instead (e.g. glm5.2-proportions)")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--tensor-parallel-size", type=at_least(1), default=1,
                   help="an engine of this many processes (gloo): each joins the trainer's group and receives itself")
    p.add_argument("--weight-update-host-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine keeps a host copy of in-process updates' tensors (the engine's default; "
                        "--no-weight-update-host-copy: none, docs/rl.md)")
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("repeats",), run, report)
