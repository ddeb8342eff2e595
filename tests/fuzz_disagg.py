"""Random option combinations of a prefill worker and a decode worker behind `sparsekv router`, each
trial's workload against one plain process: a developer's tool for the combinations no test lists, not
a CI step (tests/fuzz_options.py does the same for one engine).

    PYTHONPATH=tests python tests/fuzz_disagg.py --trials 20 [--first 0] [--parallel]

A trial draws a family (the tiny GLM or DeepSeek checkpoint, with an MTP layer); what both workers must
share (MTP drafting on or off, Quest or DSA); the prefill worker's chunk size, batch, pool size,
admission and send (layer by layer or chunk by chunk); the decode worker's drafts, tiering and its
working set, admission and pool size, decode graphs' pieces, dense-regime batching and host tier size;
with --parallel, one of the two workers as a two-process layout (TP or DP, either with expert
parallelism: one process holds one torch.distributed world). The workload is the soak's
(tests/test_engine_soak.py: prompts sharing prefixes across tenants and salts, greedy and seeded
requests, some of them two choices, aborts), sent through the router's native /generate as token ids,
each request at its arrival time, an aborted one's /abort_request some time after. Then both workers
must be clean (no room, no request, every pool's integrity, the prefill store's keys gone, no page kept,
every decode page free), and every request not aborted must give the tokens of the same request alone in
one process (untiered, no prefix cache, the decode worker's drafting and selector), its logprobs within
the rounding bound. Greedy requests whose reference has a near-tie are skipped. Exits 1 if any trial
failed or differed; a trial is reproduced by its number (`--first N --trials 1`).

FP8 latents are left out, as in tests/fuzz_options.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sys
import tempfile

import httpx

from disagg_util import WorkerServer
from fuzz_options import LAYOUTS, checkpoints, run_trials, trial_args
from sparsekv import LLM
from sparsekv.disagg.router import Router, create_app
from sparsekv.disagg.router_workers import WorkerPool, check_modes
from test_disagg_router import Served
from test_engine_soak import Planned, workload
from test_server_util import wait_until
from tolerances import assert_clear_lead, assert_logprobs_close, logprob_tolerance

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
BASE = dict(max_model_len=256, kv_page_size=4, num_threads=1)
ARRIVAL_S = 0.04  # one step of the soak's schedule, in seconds


def options(rng: random.Random) -> tuple[dict, dict, str]:
    """(the prefill worker's options, the decode worker's, the prefill worker's send)."""
    shared = {}
    if rng.random() < 0.5:
        shared.update(selector="quest", quest_page_tokens=rng.choice([1, 2, 4]))
    drafting = rng.random() < 0.5
    prefill = dict(shared, prefill_chunk_tokens=rng.choice([8, 16, 32]), max_num_seqs=rng.choice([1, 2, 4]),
                   num_kv_pages=rng.choice([24, 64]), kv_admission=rng.choice(["reserve", "optimistic"]))
    prefill["max_num_batched_tokens"] = rng.choice([prefill["prefill_chunk_tokens"] + 4, 64])
    if drafting:
        prefill["num_speculative_tokens"] = rng.choice([1, 2, 3])
    decode = dict(shared, prefill_chunk_tokens=rng.choice([8, 16]), max_num_seqs=rng.choice([2, 4, 6]),
                  num_kv_pages=rng.choice([24, 40, 64, 128]), kv_admission=rng.choice(["reserve", "optimistic"]))
    drafts = rng.choice([1, 2, 3]) if drafting else 0
    if drafts:
        decode["num_speculative_tokens"] = drafts
    if rng.random() < 0.5:  # top-k 8: a working set under (1 + drafts) x 8 entries streams (or is refused)
        decode.update(kv_tiering=True, device_buffer_tokens=rng.choice([8, 16, 32]) if not drafts else
                      rng.choice([16, (1 + drafts) * 8, 40]))
    if rng.random() < 0.5:
        decode.update(decode_graphs="eager", cuda_graph_max_bs=rng.choice([1, 2, 4, 8]))
    if rng.random() < 0.2:
        decode["batch_dense_decodes"] = False
    decode["prefix_cache_host_bytes"] = rng.choice([1 << 24, 1 << 20])  # a small host tier evicts
    return prefill, decode, rng.choice(["layers", "chunks"])


def draw(number: int, parallel: bool = False) -> tuple[str, dict, dict, str]:
    """Trial `number`'s family, the prefill and decode workers' options and the send; with `parallel`,
    half the trials run one of the two workers as a two-process layout (TP or DP, either with EP)."""
    rng = random.Random(number)
    family, (prefill, decode, send) = rng.choice(["glm", "ds"]), options(rng)
    if parallel and rng.random() < 0.5:
        (prefill if rng.random() < 0.5 else decode).update(rng.choice(LAYOUTS), dist_startup_timeout_s=120.0)
    return family, prefill, decode, send


@contextlib.contextmanager
def routed(path: str, prefill: dict, decode: dict, send: str):
    """A prefill and a decode worker served in this process behind a router: (its URL, prefill, decode)."""
    keys = [f"{key}:{tenant}" for tenant, key in KEYS.items()]
    with WorkerServer(path, "prefill", api_keys=keys, send=send, **BASE, **prefill) as p, \
            WorkerServer(path, "decode", api_keys=keys, **BASE, **decode) as d:
        pool = WorkerPool([p.url], [d.url])
        check_modes(pool, timeout=10, interval=0.05)
        with Served(create_app(Router(pool, request_timeout=60, health_interval=0.2))) as router:
            yield router.url, p, d


def with_choices(planned: list[Planned], seed: int) -> list[Planned]:
    """The workload, some seeded requests asking for two choices (each its own request on the decode
    side, seeded as the server seeds them, the prompt's pages moved once)."""
    rng = random.Random(seed)
    return [dataclasses.replace(p, params=dataclasses.replace(p.params, n=2))
            if p.params.seed is not None and rng.random() < 0.5 else p for p in planned]


def body_of(p: Planned) -> dict:
    params = p.params
    sampling = dict(max_new_tokens=params.max_tokens, temperature=params.temperature, ignore_eos=True, n=params.n)
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    body = dict(input_ids=p.prompt, sampling_params=sampling, rid=p.request_id, return_logprob=True,
                top_logprobs_num=params.logprobs)
    if p.cache_salt is not None:
        body["cache_salt"] = p.cache_salt
    return body


async def send_all(url: str, planned: list[Planned]) -> dict[str, tuple[int, dict]]:
    """Each request at its arrival, an aborted one's /abort_request after its delay: rid -> (status, answer)."""
    answers = {}

    async def one(p: Planned):
        headers = {"Authorization": f"Bearer {KEYS[p.tenant]}"}
        await asyncio.sleep(p.arrives * ARRIVAL_S)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
            sent = asyncio.ensure_future(client.post("/generate", json=body_of(p)))
            if p.aborted_after is not None:
                await asyncio.sleep(p.aborted_after * ARRIVAL_S)
                r = await client.post("/abort_request", json={"rid": p.request_id})
                assert r.status_code == 200, r.text
            r = await sent
            answers[p.request_id] = (r.status_code, r.json())
    await asyncio.gather(*(one(p) for p in planned))
    return answers


def as_logprobs(meta: dict) -> list[dict]:
    """Each output token's logprobs as the engine lists them (its own and the top ones): token -> logprob."""
    steps = []
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        steps.append({t: v for v, t, _ in top} | {token: lp})
    return steps


def check_clean(p: WorkerServer, d: WorkerServer) -> None:
    for worker in (p, d):
        assert wait_until(lambda: worker.worker.rooms == {}, 30), worker.worker.rooms
        worker.check_clean()
    assert wait_until(lambda: p.worker.store.num_keys() == 0, 10), "the prefill store kept keys"
    stats = d.on_engine(d.engine.stats)
    assert stats["kv_pages_free"] == stats["kv_pages_total"], "decode pages left held"


def trial(path: str, prefill: dict, decode: dict, send: str, number: int) -> str:
    """"ok", "refused: why", or what differed."""
    planned = with_choices(workload(number, 256), number)
    try:
        with routed(path, prefill, decode, send) as (url, p, d):
            answers = asyncio.run(send_all(url, planned))
            check_clean(p, d)
    except ValueError as e:  # ConfigError included: a combination the configuration refuses
        return f"refused: {e}"
    drafting = {key: decode[key] for key in ("num_speculative_tokens", "selector", "quest_page_tokens")
                if key in decode}
    alone = LLM(path, **BASE, enable_prefix_caching=False, prefill_chunk_tokens=16, max_num_batched_tokens=40,
                max_num_seqs=6, **drafting)
    tol, differ = logprob_tolerance(alone), []
    for p in planned:
        status, answer = answers[p.request_id]
        assert status == 200, (p.request_id, answer)
        choices = answer if isinstance(answer, list) else [answer]
        assert len(choices) == p.params.n, (p.request_id, answer)
        if p.aborted_after is not None and any(c["meta_info"]["finish_reason"]["type"] == "abort" for c in choices):
            continue
        wants = alone.generate([p.prompt], p.params)[0].outputs
        for i, (choice, want) in enumerate(zip(choices, wants, strict=True)):
            meta = choice["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": p.params.max_tokens}, (p.request_id, meta)
            if p.params.greedy:
                try:
                    assert_clear_lead(want, tol)
                except AssertionError:
                    continue  # a near-tie: the two may choose either token
            if choice["output_ids"] != want.token_ids:
                differ.append(f"{p.request_id}/{i}")
            else:
                assert_logprobs_close(want.logprobs, as_logprobs(meta), tol)
    return f"tokens differ: {differ}" if differ else "ok"


def main() -> int:
    args = trial_args(__doc__, 20, "one worker a two-process layout too (gloo)")
    paths = checkpoints(tempfile.mkdtemp(prefix="fuzz-disagg-"))

    def one(number: int):
        family, prefill, decode, send = draw(number, args.parallel)
        return (f"{family} send={send} prefill={prefill} decode={decode}",
                lambda: trial(paths[family], prefill, decode, send, number))
    return run_trials(range(args.first, args.first + args.trials), one)


if __name__ == "__main__":
    sys.exit(main())
