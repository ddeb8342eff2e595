"""`sparsekv bench transfer`: one prompt's KV from a prefill worker to a decode worker, sent layer by
layer while the prefill computes (the default), streamed chunk by chunk (a chunk's pages once every
layer computed them), and sent after it (one look at the prefill's end), in the same run, per transfer
backend.

A prefill worker and a decode worker are served in this process (each its own engine, uvicorn in a
thread, bootstrap store and transfer as `sparsekv serve --disaggregation-mode` runs them), and each
prompt is sent to both at once, as `sparsekv router` sends it. Random prompts of `--prompt-tokens`
tokens, each new to both prefix caches. Printed per backend and mode, medians over `--repeats`: the
prefill's time, the transfer left after it (from its end to the decode worker's verdict, as the
prefill worker reports it), pages sent, streamed during the prefill and sent layer by layer, MB,
batches, and the transfer left after the prefill against sending after it. The modes alternate, so
machine noise hits them alike: after one untimed prompt per backend (its first request sets up the
pair's links), each repeat sends one prompt in every mode, the order rotated repeat by repeat. With
`--prefill-dp N` the prefill worker is data-parallel and N prompts go at once, one per rank: each
rank > 0 sends its room itself, in every mode and over either backend (its rows never cross rank 0),
and one more mode sends every room layer by layer from rank 0, which fetches the other ranks' rows
(the path with the direct send off, `PrefillWorker.direct_send`). With `--room-prompts R` as well, one request
of R prompts goes at a time (one room), layer by layer: each prompt where the router puts it (they prefill on
several ranks at once, and rank 0 sends the room, fetching the other ranks' rows) against every prompt of the
room on one rank (`PrefillWorker.one_rank_rooms`, which that rank sends itself); the figure to compare is the
prefill and the transfer left after it together. The two workers share this machine's cores: pin the process
(`taskset`) to compare runs.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
import uuid

from rich.table import Table

from ..engine_args import at_least, output_path
from .bench import report_console, run_bench

MODES = ("layers", "chunks", "after")
RANK_0 = "layers-rank-0"  # with --prefill-dp: layer by layer, every room sent by rank 0
ONE_RANK = "layers-one-rank"  # with --room-prompts: layer by layer, each room's prompts on one rank
MODE_NAMES = {"layers": "layer by layer while the prefill computes", "chunks": "chunk by chunk while it computes",
              "after": "after it", RANK_0: "layer by layer, every rank's rows through rank 0",
              ONE_RANK: "layer by layer, the room's prompts on one rank"}
SERVED_NAME = "bench"


class InProcessWorker:
    """A prefill or decode worker (`mode`) served in this process."""

    def __init__(self, model: str, mode: str, secret: bytes, transfer: str, **engine_options):
        from ..config import EngineConfig
        from ..disagg.worker import DisaggSettings
        from ..llm import build_engine
        from ..server.app import ServerSettings, create_app
        from ..server.auth import load_admin_keys
        from ..server.threaded import listening_socket, serve_in_thread
        self.engine = build_engine(EngineConfig(model=model, **engine_options))
        role = DisaggSettings(mode, "127.0.0.1", 0 if mode == "prefill" else None, secret, 120.0, transfer)
        self.admin_key = secrets.token_hex(16)  # the bench holds generation (/pause_generation) with it
        app = create_app(self.engine, ServerSettings([SERVED_NAME], disaggregation=role,
                                                     admin_api_keys=load_admin_keys([self.admin_key], [], {})))
        self.state = app.state.server
        sock = listening_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server, self.thread = serve_in_thread(app, self.state, sock, 5.0)

    @property
    def worker(self):
        return self.state.disagg

    def close(self) -> None:
        from ..server.threaded import stop_thread_server
        stop_thread_server(self.server, self.thread)
        self.engine.close()


def send_pair(prefill_url: str, decode_url: str, body: dict, timeout: float = 600.0) -> tuple[dict, dict]:
    """One completion request to both workers at once, as the router sends it: (prefill's answer,
    decode's); RuntimeError if either failed."""
    import httpx
    info = httpx.get(prefill_url + "/disaggregation", timeout=5).json()
    field = {"room": uuid.uuid4().hex, "bootstrap_host": info["bootstrap_host"], "bootstrap_port": info["bootstrap_port"]}
    tagged = {**body, "disaggregation": field}

    async def both():
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await asyncio.gather(client.post(prefill_url + "/v1/completions", json=tagged),
                                        client.post(decode_url + "/v1/completions", json=tagged))
    answers = asyncio.run(both())
    for side, r in zip(("prefill", "decode"), answers):
        if r.status_code != 200:
            raise RuntimeError(f"the {side} worker answered {r.status_code}: {r.text[:300]}")
    return answers[0].json(), answers[1].json()


def prompts_at_once(pair, mode: str, prompts: list) -> list[dict]:
    """The prompts through the pair in `mode`, all at once, a request each (a prompt, or a room's list of
    prompts); the prefill worker's transfer figures of each."""
    from concurrent.futures import ThreadPoolExecutor

    from ..disagg.prefill import STREAM_POLL_S
    prefill, decode = pair
    prefill.worker.stream_poll_s = None if mode == "after" else STREAM_POLL_S
    prefill.worker.layer_by_layer = mode in ("layers", RANK_0, ONE_RANK)
    prefill.worker.direct_send = mode != RANK_0
    prefill.worker.one_rank_rooms = mode == ONE_RANK
    body = {"model": SERVED_NAME, "max_tokens": 1, "temperature": 0.0}
    count = sum(len(p) if isinstance(p[0], list) else 1 for p in prompts)
    hold = count > 1  # a data-parallel prefill worker: every prompt routed before any runs
    before = rank_prompt_tokens(prefill.url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        if hold:
            _admin(prefill, "/pause_generation")
        try:
            sent = [pool.submit(send_pair, prefill.url, decode.url, {**body, "prompt": p}) for p in prompts]
            if hold:
                await_waiting(prefill.url, count)
        finally:
            if hold:
                _admin(prefill, "/continue_generation")
        answers = [future.result() for future in sent]
    prefilling = sum(a > b for a, b in zip(rank_prompt_tokens(prefill.url), before))
    return [{**answer["sparsekv"]["disaggregation"], "ranks_prefilling": prefilling} for answer, _ in answers]


def rank_prompt_tokens(url: str) -> list[float]:
    """Each data-parallel rank's prompt tokens so far (its `dp_rank_prompt_tokens_total` on /metrics; none
    for one rank)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "sparsekv:dp_rank_prompt_tokens":
            samples = [s for s in family.samples if s.name.endswith("_total")]
            return [s.value for s in sorted(samples, key=lambda s: int(s.labels["dp_rank"]))]
    return []


def await_waiting(prefill_url: str, prompts: int, timeout_s: float = 60.0) -> None:
    """Until the paused prefill worker holds `prompts` requests waiting. Its router then counted each in
    flight when it routed the next, so they went a rank each; unheld, a prompt of one prefill chunk
    could finish before the next came, and every prompt ran on rank 0."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while httpx.get(prefill_url + "/disaggregation", timeout=10).json()["num_waiting"] < prompts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the prefill worker did not receive {prompts} prompts within {timeout_s:g} s")
        time.sleep(0.01)


def _admin(worker: InProcessWorker, path: str) -> None:
    import httpx
    httpx.post(worker.url + path, headers={"Authorization": f"Bearer {worker.admin_key}"}, timeout=10).raise_for_status()


def backends(wanted: str) -> list[str]:
    from ..disagg.nixl import nixl_available
    from ..disagg.transfer import TRANSFERS
    names = [b.strip() for b in wanted.split(",") if b.strip()]
    unknown = [b for b in names if b not in TRANSFERS]
    if unknown or not names:
        raise ValueError(f"--backends: {unknown or wanted!r}: use {', '.join(TRANSFERS)}")
    if "nixl" in names and not nixl_available():
        raise ValueError("--backends nixl: NIXL is not installed (pip install 'sparsekv[nixl]')")
    return names


def run(args) -> dict:
    import torch
    from ..paths import default_model_path
    if args.room_prompts > 1 and args.prefill_dp == 1:
        raise ValueError("--room-prompts compares where a data-parallel prefill worker's ranks prefill a room: "
                         "give --prefill-dp 2 or more")
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    options = dict(max_model_len=args.prompt_tokens + 64, num_threads=args.threads,
                   prefix_cache_host_bytes=args.host_bytes)
    g = torch.Generator().manual_seed(0)
    secret = secrets.token_bytes(32)
    results = {}
    for backend in backends(args.backends):
        pair = (InProcessWorker(model, "prefill", secret, backend, **options, data_parallel_size=args.prefill_dp),
                InProcessWorker(model, "decode", secret, backend, **options))
        try:
            vocab = pair[0].engine.model_config.vocab_size

            def new_prompts():  # with -dp, a prompt per rank at once (the router spreads them), or one room
                prompts = [torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist()
                           for _ in range(args.room_prompts if args.room_prompts > 1 else args.prefill_dp)]
                return [prompts] if args.room_prompts > 1 else prompts
            prompts_at_once(pair, MODES[0], new_prompts())  # untimed: the pair's first request sets up its links
            modes = modes_of(args.prefill_dp, args.room_prompts)
            runs = {mode: [] for mode in modes}
            for repeat in range(args.repeats):
                for mode in mode_order(repeat, modes):
                    runs[mode] += prompts_at_once(pair, mode, new_prompts())
            results[backend] = {mode: summarize(figures) for mode, figures in runs.items()}
        finally:
            for worker in pair:
                worker.close()
    return {"model": model, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
            "prefill_dp": args.prefill_dp, "room_prompts": args.room_prompts, "backends": results}


def modes_of(prefill_dp: int, room_prompts: int = 1) -> tuple[str, ...]:
    if room_prompts > 1:
        return ("layers", ONE_RANK)
    return MODES + ((RANK_0,) if prefill_dp > 1 else ())


def mode_order(repeat: int, modes: tuple[str, ...] = MODES) -> tuple[str, ...]:
    """The modes in the order repeat `repeat` sends them: rotated each repeat, so none always goes first
    (after the other modes' prompts) or last."""
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def summarize(figures: list[dict]) -> dict:
    def median(key):
        return statistics.median(f[key] for f in figures)
    return {"prefill_s": median("prefill_s"), "after_prefill_ms": 1e3 * median("transfer_s"),
            "with_prefill_s": statistics.median(f["prefill_s"] + f["transfer_s"] for f in figures),
            "after_prefill_ms_each": [round(1e3 * f["transfer_s"], 1) for f in figures],
            "pages_sent": median("pages_sent"), "pages_streamed": median("pages_streamed"),
            "pages_by_layer": median("pages_by_layer"),
            "mb": median("bytes") / 1e6, "batches": median("batches"), "backend": figures[0]["backend"],
            "sent_by_other_ranks": sum(f.get("prefill_rank", 0) > 0 for f in figures),
            "ranks_prefilling": median("ranks_prefilling")}


def report(out: dict) -> dict:
    dp, room = out.get("prefill_dp", 1), out.get("room_prompts", 1)
    if room > 1:
        prompts, runs = f"one request of {room} prompts at a time (a data-parallel prefill worker, -dp {dp})", out["repeats"]
        versus, baseline, key = "prefill + transfer (s), against one rank", ONE_RANK, "with_prefill_s"
    else:
        prompts = "one prompt" if dp == 1 else f"{dp} prompts at once (a data-parallel prefill worker, a prompt per rank)"
        runs, versus, baseline, key = out["repeats"] * dp, "after the prefill, against after", "after", "after_prefill_ms"
    table = Table(title=f"{out['model']}: {prompts} of {out['prompt_tokens']} tokens, a prefill and a decode worker in "
                        f"this process, medians of {runs}")
    for column in ("backend", "sent", "prefill s", "transfer after the prefill (ms), each run",
                   "pages sent / streamed / by layer", "MB", "batches", versus,
                   *(["rooms sent by a rank > 0", "ranks prefilling"] if dp > 1 else [])):
        table.add_column(column)
    for name, modes in out["backends"].items():
        for mode in modes_of(dp, room):
            r = modes[mode]
            r["over_after" if room == 1 else "over_one_rank"] = over = r[key] / modes[baseline][key]
            against = f"x{over:.2f}" if mode != baseline else ""
            table.add_row(f"{name} ({r['backend']})", MODE_NAMES[mode], f"{r['prefill_s']:.2f}",
                          f"{r['after_prefill_ms']:.1f} ({', '.join(map(str, r['after_prefill_ms_each']))})",
                          f"{r['pages_sent']:g} / {r['pages_streamed']:g} / {r['pages_by_layer']:g}", f"{r['mb']:.1f}",
                          f"{r['batches']:g}", f"{r['with_prefill_s']:.2f} {against}" if room > 1 else against,
                          *([f"{r['sent_by_other_ranks']} of {runs}", f"{r['ranks_prefilling']:g}"] if dp > 1 else []))
    report_console().print(table)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench transfer", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=at_least(1), default=2, help="prompts per backend and mode")
    p.add_argument("--backends", default="torch", help="comma-separated --disaggregation-transfer-backend values: "
                                                        "torch, nixl")
    p.add_argument("--host-bytes", type=at_least(1), default=1 << 30, help="each worker's prefix-cache host tier, bytes")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (the two engines share them)")
    p.add_argument("--prefill-dp", type=int, default=1,
                   help="the prefill worker's data-parallel ranks (-dp); as many prompts go at once, one per rank")
    p.add_argument("--room-prompts", type=int, default=1,
                   help="with --prefill-dp: one request of this many prompts at a time, the router placing each "
                        "against the room's prompts on one rank")
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("prompt_tokens", "repeats", "threads", "prefill_dp", "room_prompts"), run,
                     report)
