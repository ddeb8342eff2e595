"""A data-parallel prefill or decode worker (`-dp 2`, parallel/dp_kv.py): each rank has its own cache,
so a decode worker's pages land on the rank its request then runs on, and a prefill worker's leave from
the rank that computed them. Answers are one colocated engine's; the routing itself is checked in
process (`DataParallelKV` over a fake engine) and through a decode worker that skips the pages one of
its ranks holds."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
import torch

from conftest import STARTUP_FLAGS, STARTUP_S
from disagg_util import SECRET, WorkerServer, process_and_local_pair, secret_file, send_pair, start_worker_process
from sparsekv.disagg import dp_send
from sparsekv.disagg.nixl import nixl_available
from sparsekv.disagg.transfer import CORRUPT_ENV, DELAY_ENV
from sparsekv.server.loop import DELAY_ENV as STEP_DELAY_ENV
from test_server_util import scrape_labelled, wait_healthy, wait_until
from sparsekv import LLM, SamplingParams
from sparsekv.parallel.dp_held import Held, drop_held, is_held, take_held
from sparsekv.parallel.dp_kv import DataParallelKV, kv_call
from sparsekv.parallel.router import PrefixAffinityRouter
from test_disagg_workers import BASE, BODY, GREEDY, PAGE, _prompt, assert_as_colocated
from tolerances import logprob_tolerance


class FakeKV:
    """One rank's `engine.kv`: which prompts' pages it holds, what it imported."""

    def __init__(self):
        self.prefix, self.held, self.imported, self.forgotten, self.refuse = object(), {}, [], [], False

    def held_prefix(self, token_ids, tenant, cache_salt):
        return self.held.get(tuple(token_ids), 0)

    def import_prefix(self, pages, tenant, prompts, cache_salt, tails=None):
        if pages == "bad" or self.refuse:
            raise ValueError("page 0: its rows do not fit")
        self.imported.append((pages, [tuple(p) for p in prompts]))
        return len(pages)

    def forget_prefix(self, names):
        self.forgotten.append(names)
        return len(names)

    def export_prefix(self, token_ids, tenant, cache_salt, skip=0):
        return [f"page {i}" for i in range(skip, self.held.get(tuple(token_ids), 0))]

    def prompt_chains(self, prompts, tenant, cache_salt):  # every test prompt names the pages p0 and p1
        return [[b"p0", b"p1"] for _ in prompts]


class FakeEngine:
    """What `DataParallelKV` reads of a DataParallelEngine: the router, rank 0, and `kv_call`."""

    def __init__(self, ranks: int = 2):
        self.ranks = [type("Engine", (), {"kv": FakeKV()})() for _ in range(ranks)]
        self.local, self.router = self.ranks[0], PrefixAffinityRouter(ranks, PAGE)

    def kv_call(self, wanted, method, args, kwargs):
        return [kv_call(engine, rank, wanted, method, args, kwargs) for rank, engine in enumerate(self.ranks)]


def test_claims_spread_the_load_and_pin_the_request_to_its_pages():
    engine = FakeEngine()
    kv = DataParallelKV(engine)
    a, b = list(range(1, 10)), list(range(20, 29))
    engine.ranks[1].kv.held[tuple(b)] = 2
    assert kv.held_prefix(a, "t", None) == 0  # claims rank 0 (nothing cached anywhere, both idle)
    assert kv.held_prefix(b, "t", None) == 2  # claims rank 1: rank 0 now has a claim in flight
    assert engine.router.in_flight == [1, 1]
    assert kv.import_prefix(["p0", "p1"], "t", [b], None) == 2
    assert engine.ranks[1].kv.imported == [(["p0", "p1"], [tuple(b)])] and engine.ranks[0].kv.imported == []
    with pytest.raises(ValueError, match="do not fit"):  # an error on the rank is raised here
        kv.import_prefix("bad", "t", [b], None)
    assert kv.take_claim(b, "t", None) == 1 and engine.router.in_flight == [1, 0]  # the caller assigns it
    assert kv.take_claim(b, "t", None) is None  # taken once
    assert kv.take_claim(a, "t", "another salt") is None  # a claim is per tenant and cache_salt


def test_pages_refused_by_one_rank_are_kept_by_none():
    """Two prompts claimed by different ranks get the same pages on each: when the second rank refuses
    them, the first forgets what it kept (all or none across the ranks)."""
    engine = FakeEngine()
    kv = DataParallelKV(engine)
    a, b = [1, 2, 3], [4, 5, 6]
    kv.held_prefix(a, "t", None)
    kv.held_prefix(b, "t", None)  # claims: rank 0, then rank 1
    engine.ranks[1].kv.refuse = True
    pages = [(b"p0", []), (b"p1", [])]
    with pytest.raises(ValueError, match="do not fit"):
        kv.import_prefix(pages, "t", [a, b], None)
    assert len(engine.ranks[0].kv.imported) == 1 and engine.ranks[0].kv.forgotten == [[b"p0", b"p1"]]
    assert engine.ranks[1].kv.imported == [] and engine.ranks[1].kv.forgotten == []
    engine.ranks[1].kv.refuse = False
    assert kv.import_prefix(pages, "t", [a, b], None) == 2
    assert engine.ranks[0].kv.forgotten == [[b"p0", b"p1"]]  # nothing undone when every rank kept them


def test_a_claim_whose_request_never_comes_stops_counting():
    engine = FakeEngine()
    kv = DataParallelKV(engine, claim_ttl_s=0.0)
    kv.held_prefix([1, 2, 3], "t", None)
    assert kv.num_claims == 1
    assert kv.take_claim([9], "t", None) is None  # any call expires the old claims
    assert kv.num_claims == 0 and engine.router.in_flight == [0, 0]


def test_each_room_counts_its_claim_once_and_a_room_that_ends_without_its_request_releases_it():
    """Two rooms of one prompt share its claim and rank, each counted in the rank's load; the import's
    lookup counts nothing more. One room failing (or aborted) releases its share at once, and the other's
    request then takes the claim: nothing is left counting."""
    engine = FakeEngine()
    kv = DataParallelKV(engine)
    prompt = [1, 2, 3]
    kv.held_prefix(prompt, "t", None)
    kv.held_prefix(prompt, "t", None)
    assert kv.num_claims == 1 and 2 in engine.router.in_flight  # both rooms on the claimed rank
    rank = engine.router.in_flight.index(2)
    kv.import_prefix([(b"p", [])], "t", [prompt], None)
    assert engine.router.in_flight[rank] == 2
    kv.release_claims([prompt], "t", None)
    assert kv.num_claims == 1 and engine.router.in_flight[rank] == 1
    assert kv.take_claim(prompt, "t", None) == rank
    assert kv.num_claims == 0 and engine.router.in_flight == [0, 0]
    kv.release_claims([prompt, [4]], "t", None)  # nothing left to release: nothing goes below zero
    assert engine.router.in_flight == [0, 0]


def test_export_reads_the_rank_that_holds_most_of_the_prompt():
    engine = FakeEngine()
    engine.ranks[0].kv.held[(1, 2)] = 1
    engine.ranks[1].kv.held[(1, 2)] = 3
    assert DataParallelKV(engine).export_prefix([1, 2], "t", None, skip=1) == ["page 1", "page 2"]


def test_export_ties_go_to_the_lowest_rank():
    engine = FakeEngine(3)
    for rank, e in enumerate(engine.ranks):
        e.kv.export_prefix = lambda token_ids, tenant, cache_salt, skip=0, rank=rank: rank
    kv = DataParallelKV(engine)
    assert kv.export_prefix([1, 2], "t", None) == 0  # nobody holds it
    for e in engine.ranks[1:]:
        e.kv.held[(1, 2)] = 2
    assert kv.export_prefix([1, 2], "t", None) == 1


def test_each_rank_imports_with_the_tails_and_chains_of_its_own_prompts():
    """Prompts claimed by two ranks: each rank gets its own prompts' tails and chains, in their order,
    and only the pages those chains name (a page two prompts share goes to both ranks); prompts all
    on one rank get every page, as one engine does."""
    engine = FakeEngine()
    calls = {0: [], 1: []}
    for rank, e in enumerate(engine.ranks):
        e.kv.import_prefix = (lambda pages, tenant, prompts, cache_salt, tails=None, chains=None, rank=rank:
                              calls[rank].append(([tuple(p) for p in prompts], tails, chains, [n for n, _ in pages]))
                              or len(pages))
    kv = DataParallelKV(engine)
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    assert [kv.held_prefix(p, "t", None) for p in (a, b, c)] == [0, 0, 0]  # claims: ranks 0, 1, 0
    pages = [(b"shared", []), (b"ca", []), (b"cb", []), (b"cc", [])]
    chains = [[b"shared", b"ca"], [b"shared", b"cb"], [b"cc"]]
    assert kv.import_prefix(pages, "t", [a, b, c], None, tails=["ta", "tb", "tc"], chains=chains) == 4
    assert calls == {0: [([tuple(a), tuple(c)], ["ta", "tc"], [chains[0], chains[2]], [b"shared", b"ca", b"cc"])],
                     1: [([tuple(b)], ["tb"], [chains[1]], [b"shared", b"cb"])]}
    calls[0].clear()
    assert kv.import_prefix(pages, "t", [a, c], None, chains=[chains[0], chains[2]]) == 4  # rank 0 alone
    assert [names for *_, names in calls[0]] == [[b"shared", b"ca", b"cb", b"cc"]]


def test_claims_are_bounded_and_the_oldest_stops_counting(monkeypatch):
    from sparsekv.parallel import dp_kv
    monkeypatch.setattr(dp_kv, "MAX_CLAIMS", 2)
    engine = FakeEngine()
    kv = DataParallelKV(engine)
    for prompt in ([1], [2], [3]):
        kv.held_prefix(prompt, "t", None)
    assert kv.num_claims == 2 and sum(engine.router.in_flight) == 2
    assert kv.take_claim([1], "t", None) is None and kv.take_claim([3], "t", None) is not None


def test_a_rank_answers_a_failing_kv_call_with_its_error_and_runs_only_the_calls_for_it():
    """`kv_call` is each rank's side of a routed prefix-cache call: an exception there (pages that do
    not fit) is its answer, raised by the front end, and never escapes into the rank's command loop,
    where it would end the rank; a rank another call is for answers None and runs nothing."""
    rank1 = FakeEngine().ranks[1]
    status, error = kv_call(rank1, 1, 1, "import_prefix", ("bad", "t", [], None), {})
    assert status == "error" and isinstance(error, ValueError) and "do not fit" in str(error)
    assert kv_call(rank1, 1, 0, "import_prefix", (["p0"], "t", [[1]], None), {}) is None
    assert rank1.kv.imported == []
    assert kv_call(rank1, 1, None, "import_prefix", (["p0"], "t", [[1]], None), {}) == ("ok", 1)
    assert rank1.kv.imported == [(["p0"], [(1,)])]


def test_a_room_that_a_rank_sends_pairs_from_that_rank_s_gpu(monkeypatch):
    """NCCL refuses a pair of two ranks on one GPU, so the backend is decided by the GPU the tensors
    leave from: a data-parallel rank > 0 sends from its own, asked once (`dp_send.gpu_of`)."""
    import asyncio
    from types import SimpleNamespace
    from sparsekv.disagg.prefill import PrefillWorker
    calls = []

    async def on_rank(rank, fn):
        calls.append((rank, fn))
        return f"GPU-{rank}"
    worker = SimpleNamespace(gpu="GPU-0", rank_gpus={}, _on_rank=on_rank)
    gpu_of = lambda rank: asyncio.run(PrefillWorker._gpu_of(worker, rank))  # noqa: E731
    assert [gpu_of(None), gpu_of(1), gpu_of(1), gpu_of(2)] == ["GPU-0", "GPU-1", "GPU-1", "GPU-2"]
    assert calls == [(1, dp_send.gpu_of), (2, dp_send.gpu_of)]
    side = SimpleNamespace(device=torch.device("cpu"))
    assert dp_send.gpu_of(side) is None
    monkeypatch.setattr(dp_send, "gpu_identity", lambda device: f"uuid of {device}")
    assert dp_send.gpu_of(SimpleNamespace(device=torch.device("cuda", 1))) == "uuid of cuda:1"  # the rank's own


def test_a_tap_header_round_trips_and_holds_at_most_eight_kinds():
    from sparsekv.cache.layer_tap import LayerRows
    from sparsekv.parallel.dp_taps import HEADER_LEN, decode_header, encode_header
    selected = (torch.arange(5), torch.arange(3))
    full = encode_header(7, LayerRows(2, 10, 3, [0, 2], [], tail=0), handle=11)
    tail = encode_header(8, LayerRows(1, 4, 1, [1], [], tail=2, selected=selected), handle=12)
    assert full.shape == (HEADER_LEN,) and full.dtype == torch.int64
    assert decode_header(full) == (7, 2, 10, 3, 0, None, 11, [0, 2])
    assert decode_header(tail) == (8, 1, 4, 1, 2, [5, 3], 12, [1])
    assert decode_header(encode_header(0, LayerRows(0, 0, 1, list(range(8)), [])))[-1] == list(range(8))
    with pytest.raises(ValueError, match="at most 8"):
        encode_header(0, LayerRows(0, 0, 1, list(range(9)), []))


def _pairs(p_url: str, d_url: str, prompts: list[list[int]], **extra) -> list:
    """One request per prompt, all at once (each as the router sends it); the decode workers' bodies."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: send_pair(p_url, d_url, {**BODY, "prompt": prompt, **extra}), prompts))
    for rp, rd in answers:
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    return [rd.json() for _, rd in answers]


@pytest.mark.parametrize("dp_side", ["prefill", "decode"])
def test_a_data_parallel_worker_on_either_side(dp_side, glm_ckpt, tmp_path):
    """Two requests at once reach both ranks of a `-dp 2` worker (a `sparsekv serve` process of its
    own) paired with a one-rank worker: every page is sent, from the rank that computed it (layer by
    layer) or to the rank that decodes, and the answers are one colocated engine's. Decode side: a third request for
    the second prompt claims the rank that holds its pages, and none is sent."""
    path = glm_ckpt[0]
    prompts = [_prompt(256, 44, seed) for seed in (3, 4)]  # 10 cacheable pages, then the last token's full page
    colocated = LLM(path, **BASE)
    want = colocated.generate(prompts, GREEDY)
    with process_and_local_pair(path, dp_side, tmp_path, ("-dp", "2", "--threads", "1", *STARTUP_FLAGS), **BASE) as (p_url, d_url, local):
        bodies = _pairs(p_url, d_url, prompts)
        for body, expected in zip(bodies, want):
            figures = body["sparsekv"]["disaggregation"]
            assert figures["pages_sent"] == (len(prompts[0]) - 1) // PAGE and figures["pages_skipped"] == 0
            # the first token alone computed, on the rank that decodes
            assert (figures["tail_tokens"], figures["first_tokens"]) == (PAGE, 1)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[0])
            if dp_side == "prefill":  # each rank's rows went layer by layer (rank 1's through rank 0)
                assert figures["pages_by_layer"] == figures["pages_sent"] and figures["layer_batches"] >= 1
                assert figures["prefill_s"] > 0  # rank 1's request too: its first step is known on rank 0
                assert_as_colocated(expected, body, local, logprob_tolerance(colocated))
            else:
                assert body["sparsekv"]["choices"][0]["token_ids"] == expected.token_ids
        if dp_side == "decode":
            again = _pairs(p_url, d_url, prompts[1:])[0]
            assert again["sparsekv"]["disaggregation"]["pages_sent"] == 0
            assert again["sparsekv"]["disaggregation"]["pages_skipped"] == (len(prompts[1]) - 1) // PAGE
            assert again["sparsekv"]["choices"][0]["token_ids"] == want[1].token_ids
        local.check_clean()


@pytest.mark.parametrize("transfer,direct,send", [("torch", True, "layers"), ("torch", False, "layers"),
                                                  ("nixl", True, "layers"), ("torch", True, "chunks")])
def test_a_data_parallel_prefill_rank_sends_its_rooms_tensors_itself(transfer, direct, send, glm_ckpt, monkeypatch):
    """In process, a `-dp 2` prefill worker and a decode worker, two prompts at once, one per rank. The
    room of rank 1's prompt is published and sent by rank 1 (disagg/dp_send.py: its tensors never
    cross rank 0; over NIXL read from rank 1's own agent; chunk by chunk its named pages, exported
    there), rank 0's by rank 0; with the direct send off, both by rank 0, rank 1's rows fetched from
    it. Either way the same bytes go, the answers are one colocated engine's, and afterwards rank 1
    keeps no rows and knows no room, and every pool's integrity holds. Three rounds: the prompts new;
    cached on the prefill side; then held by the decode worker alone, whose rows, computed again, are
    dropped on rank 1 as they come rather than kept until the tap ends."""
    if transfer == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    if send == "chunks":  # a room is sent by the rank its prompt runs on, known while the prompt runs
        monkeypatch.setenv(STEP_DELAY_ENV, "0.2")
    path = glm_ckpt[0]
    prompts = [_prompt(256, 44, seed) for seed in (3, 4)]  # 10 cacheable pages, then the last token's full page
    colocated = LLM(path, **BASE)
    want = colocated.generate(prompts, GREEDY)
    with (WorkerServer(path, "prefill", data_parallel_size=2, dist_startup_timeout_s=STARTUP_S, transfer=transfer,
                       send=send, **BASE) as prefill,
          WorkerServer(path, "decode", transfer=transfer, **BASE) as decode):
        prefill.worker.direct_send = direct
        _prompt_per_rank(monkeypatch, prefill.engine, prompts)
        engine, left, dropped = prefill.engine, [], []
        call_rank = engine.call_rank

        def calls_seen(rank, fn, *args, **options):  # each room's rows still kept when rank 1 closes it
            future = call_rank(rank, fn, *args, **options)
            if fn is dp_send.close_room:
                future.add_done_callback(lambda f: left.append(f.result()))
            if fn is drop_held:
                dropped.append(len(args[0]))
            return future
        engine.call_rank = calls_seen
        pages = (len(prompts[0]) - 1) // PAGE
        # again, each prompt's pages now cached on its prefill rank: sent whole from there; then the decode
        # worker alone holds them: none sent
        for held in ("none", "prefill", "decode"):
            if held == "prefill":
                decode.on_engine(decode.engine.reset_prefix_cache)
            if held == "decode":
                prefill.on_engine(prefill.engine.reset_prefix_cache)
            dropped.clear()
            answers = _two_at_once(prefill.url, decode.url, prompts)
            assert all(rp.status_code == 200 and rd.status_code == 200 for rp, rd in answers), answers
            sent = [rp.json()["sparsekv"]["disaggregation"] for rp, _ in answers]
            assert [f["prefill_rank"] for f in sent] == ([0, 1] if direct else [0, 0])
            assert {f["backend"] for f in sent} == {"gloo" if transfer == "torch" else "nixl"}
            assert [f["bytes"] for f in sent] == [rd.json()["sparsekv"]["disaggregation"]["bytes"] for _, rd in answers]
            by_layer = pages if send == "layers" and held == "none" else 0
            sending = 0 if held == "decode" else pages
            assert [(f["pages_sent"], f["pages_skipped"], f["pages_by_layer"]) for f in sent] == \
                [(sending, pages - sending, by_layer)] * 2, held
            if held == "decode":  # rank 1's layer rows of the held pages, dropped as they came (none chunk by chunk)
                assert (sum(dropped) > 0) == (send == "layers"), dropped
            for (_, rd), expected in zip(answers, want):
                assert_as_colocated(expected, rd.json(), decode, logprob_tolerance(colocated))
            _rank_1_keeps_nothing(prefill)
            decode.check_clean()
        # every row rank 1 kept for its rooms left or was dropped before the room ended there (a drop runs in
        # the order rank 1 receives its calls)
        assert left == ([0, 0, 0] if direct else [])
        assert prefill.worker.rank_gpus == ({1: None} if direct else {})  # asked once, at rank 1's first room


@pytest.mark.parametrize("one_rank", [False, True], ids=["spread", "one_rank"])
def test_a_room_of_two_prompts_prefills_on_the_ranks_the_router_gives(one_rank, glm_ckpt, monkeypatch):
    """In process, a `-dp 2` prefill worker: one request of two prompts is one room. The router gives its
    first prompt rank 1 and its second rank 0, and each prefills there, at once; rank 0 sends the room,
    fetching rank 1's rows. With `one_rank_rooms` (the bench's baseline) the second follows the first
    to rank 1 instead (`watch_ranks`), unasked of the router, and rank 1 sends the whole room itself.
    Either way the answers are one colocated engine's and rank 1 keeps nothing."""
    path = glm_ckpt[0]
    prompts = [_prompt(256, 44, seed) for seed in (3, 4)]
    colocated = LLM(path, **BASE)
    want = colocated.generate(prompts, GREEDY)
    with (WorkerServer(path, "prefill", data_parallel_size=2, dist_startup_timeout_s=STARTUP_S, **BASE) as prefill,
          WorkerServer(path, "decode", **BASE) as decode):
        prefill.worker.one_rank_rooms = one_rank
        chosen = []
        monkeypatch.setattr(prefill.engine.router, "peek", lambda *args: chosen.append(args) or (1 if len(chosen) == 1 else 0))
        rp, rd = send_pair(prefill.url, decode.url, {**BODY, "prompt": prompts})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        sent, body = rp.json()["sparsekv"]["disaggregation"], rd.json()
        ranks = prefill.on_engine(prefill.engine.stats)["by_data_parallel_rank"]
        prompt_tokens = [r["prompt_tokens"] for r in ranks]
        if one_rank:
            assert len(chosen) == 1 and sent["prefill_rank"] == 1 and prompt_tokens[0] == 0, (chosen, prompt_tokens)
        else:
            assert len(chosen) == 2 and sent["prefill_rank"] == 0 and min(prompt_tokens) > 0, (chosen, prompt_tokens)
        assert sent["pages_sent"] == 2 * ((len(prompts[0]) - 1) // PAGE)
        assert sent["bytes"] == body["sparsekv"]["disaggregation"]["bytes"]
        assert [c["token_ids"] for c in body["sparsekv"]["choices"]] == [w.token_ids for w in want]
        _rank_1_keeps_nothing(prefill)
        decode.check_clean()


def test_a_rank_on_another_node_sends_its_room_from_there(glm_ckpt, monkeypatch):
    """--nnodes 2 on localhost: rank 1 of a `-dp 2` prefill worker lives in `sparsekv serve --node-rank 1`
    (another process, with no role flags of its own). It sends its room itself, making its transfer
    connections from this machine's name as a rank on another machine does (`dp_send._room`), and the
    answer is one colocated engine's."""
    from test_parallel import _node1
    from test_server_util import free_port
    path, port = glm_ckpt[0], free_port()
    prompt = _prompt(256, 44, 4)
    colocated = LLM(path, **BASE)
    want = colocated.generate([prompt], GREEDY)[0]
    node1 = _node1(path, port, layout=("-dp", "2"))
    try:
        with (WorkerServer(path, "prefill", data_parallel_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}",
                           dist_startup_timeout_s=STARTUP_S, **BASE) as prefill,
              WorkerServer(path, "decode", **BASE) as decode):
            monkeypatch.setattr(prefill.engine.router, "peek", lambda *args: 1)
            rp, rd = send_pair(prefill.url, decode.url, {**BODY, "prompt": prompt})
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            sent = rp.json()["sparsekv"]["disaggregation"]
            assert sent["prefill_rank"] == 1 and sent["pages_sent"] == (len(prompt) - 1) // PAGE
            assert_as_colocated(want, rd.json(), decode, logprob_tolerance(colocated))
            _rank_1_keeps_nothing(prefill)
            decode.check_clean()
        assert node1.wait(timeout=60) == 0
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()


def test_a_data_parallel_decode_worker_lands_each_prompt_s_pages_on_its_rank_alone(glm_ckpt):
    """In process, a `-dp 2` decode worker: one request of two prompts claims a rank per prompt (claims
    spread), and each rank keeps only its own prompt's pages, not the other's; the answers are one
    colocated engine's."""
    path = glm_ckpt[0]
    prompts = [_prompt(256, 44, seed) for seed in (3, 4)]
    colocated = LLM(path, **BASE)
    want = colocated.generate(prompts, GREEDY)
    with (WorkerServer(path, "prefill", **BASE) as prefill,
          WorkerServer(path, "decode", data_parallel_size=2, dist_startup_timeout_s=STARTUP_S, **BASE) as decode):
        rp, rd = send_pair(prefill.url, decode.url, {**BODY, "prompt": prompts})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert [c["token_ids"] for c in rd.json()["sparsekv"]["choices"]] == [w.token_ids for w in want]
        kv, pages = decode.engine.kv, (len(prompts[0]) - 1) // PAGE
        held = [[decode.on_engine(kv.on_rank, rank, "held_prefix", p) for p in prompts] for rank in (0, 1)]
        assert held == [[pages, 0], [0, pages]], held
        decode.check_clean()


def _prompt_per_rank(monkeypatch, engine, prompts: list[list[int]]) -> None:
    """Prompt i runs on rank i of the data-parallel `engine` (the router would spread prompts sent
    together only when each is still running when the next comes)."""
    ranks = {tuple(p): i for i, p in enumerate(prompts)}
    monkeypatch.setattr(engine.router, "peek", lambda token_ids, *args: ranks[tuple(token_ids)])


def _two_at_once(prefill_url: str, decode_url: str, prompts: list[list[int]], timeout: float = 60.0) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: send_pair(prefill_url, decode_url, {**BODY, "prompt": p}, timeout=timeout),
                             prompts))


def _rank_1_keeps_nothing(prefill: WorkerServer) -> None:
    """Rank 1 lets go of every row and room (a removed tap's rows with the next step, which the engine
    runs for it, and deliveries dropped as the calls that drop them come)."""
    def kept():
        figures = prefill.on_engine(prefill.engine.stats)["by_data_parallel_rank"][1]
        return figures["held_rows_bytes"], figures["held_rooms"]
    assert wait_until(lambda: kept() == (0, 0), 10), kept()
    prefill.check_clean()


@pytest.mark.parametrize("transfer", ["torch", "nixl"])
def test_a_corrupted_tensor_sent_by_rank_1_fails_its_room_and_nothing_stays_kept(transfer, glm_ckpt, monkeypatch):
    """A `-dp 2` prefill worker whose every sender damages a room's second tensor after its digest (rank
    1, spawned with the engine, inherits the hook): the decode worker refuses both rooms, the rank-1
    one sent by rank 1 itself (over NIXL, read from its agent), and each side answers 503 naming it.
    Rank 1 then keeps no row and no room, both workers' pools are intact, and rank 1's rows still
    serve (fetched through rank 0, whose sends are whole again)."""
    if transfer == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    path = glm_ckpt[0]
    prompts = [_prompt(256, 44, seed) for seed in (3, 4)]
    monkeypatch.setenv(CORRUPT_ENV, "1")
    with (WorkerServer(path, "prefill", data_parallel_size=2, dist_startup_timeout_s=STARTUP_S, transfer=transfer,
                       **BASE) as prefill,
          WorkerServer(path, "decode", transfer=transfer, **BASE) as decode):
        _prompt_per_rank(monkeypatch, prefill.engine, prompts)
        for rp, rd in _two_at_once(prefill.url, decode.url, prompts):
            assert (rp.status_code, rd.status_code) == (503, 503), (rp.text, rd.text)
            assert "digest" in rd.json()["error"]["message"] and "refused the KV" in rp.json()["error"]["message"]
        _rank_1_keeps_nothing(prefill)
        decode.check_clean()
        monkeypatch.delenv(CORRUPT_ENV)
        prefill.worker.direct_send = False
        answers = _two_at_once(prefill.url, decode.url, prompts)
        assert [(rp.status_code, rd.status_code) for rp, rd in answers] == [(200, 200)] * 2
        _rank_1_keeps_nothing(prefill)


def test_a_room_the_decode_worker_refuses_ends_rank_1_s_wait_for_it_at_once(glm_ckpt, monkeypatch):
    """Rank 1 of a `-dp 2` prefill worker sends a room whose first batch of metadata the decode worker
    refuses (it names a transfer backend the decode worker does not know): rank 0 reads the refusal
    and has rank 1 give up its join of the pair group (`dp_send.abandon`), so rank 1's push ends then,
    not at the timeout; both answers name the refusal, and neither side keeps anything."""
    from sparsekv.disagg import decode as decode_module
    timeout, real = 10.0, decode_module.verify

    def refusing(secret, raw, what):
        meta = real(secret, raw, what)
        if what == "prefill worker's metadata" and "error" not in meta:
            meta["backend"] = "tcp"
        return meta
    monkeypatch.setattr(decode_module, "verify", refusing)
    prompt = _prompt(256, 44, 3)
    with (WorkerServer(glm_ckpt[0], "prefill", timeout_s=timeout, data_parallel_size=2,
                       dist_startup_timeout_s=STARTUP_S, **BASE) as prefill,
          WorkerServer(glm_ckpt[0], "decode", timeout_s=timeout, **BASE) as decode):
        monkeypatch.setattr(prefill.engine.router, "peek", lambda *args: 1)
        pushes, call_rank = [], prefill.engine.call_rank

        def calls_seen(rank, fn, *args, **options):
            future = call_rank(rank, fn, *args, **options)
            if fn is dp_send.push:
                pushes.append(future)
            return future
        prefill.engine.call_rank = calls_seen
        rp, rd = send_pair(prefill.url, decode.url, {**BODY, "prompt": prompt}, timeout=3 * timeout)
        refused = time.monotonic()
        for r, side in ((rp, "prefill worker"), (rd, "decode worker")):
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert side in message and "unknown transfer backend 'tcp'" in message, message
        assert len(pushes) == 1
        assert "stopped waiting for the peer's transfer connection" in str(pushes[0].exception(timeout=timeout / 2))
        assert time.monotonic() - refused < timeout / 2  # not at the timeout
        _rank_1_keeps_nothing(prefill)
        assert decode.engine.kv.held_prefix(prompt) == 0
        decode.check_clean()


def test_the_decode_worker_killed_while_rank_1_sends(glm_ckpt, tmp_path, monkeypatch):
    """The decode worker dies while a `-dp 2` prefill worker's ranks send it two rooms (each tensor
    waits first, so the sends are under way; rank 1's room shows in /metrics by rank): each room fails
    with a 503 within the timeout, rank 1's push failing on rank 1; rank 1 then keeps no row and no
    room, the pools are intact, and the worker still answers."""
    path = glm_ckpt[0]
    timeout = 8.0
    monkeypatch.setenv(DELAY_ENV, "0.5")
    proc, decode_url = start_worker_process(path, "decode", secret_file(tmp_path, SECRET), 0, "--disaggregation-timeout",
                                            str(timeout))
    try:
        wait_healthy(decode_url, proc)
        with (WorkerServer(path, "prefill", timeout_s=timeout, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S,
                           **BASE) as prefill, ThreadPoolExecutor(1) as pool):
            prompts = [_prompt(256, 44, s) for s in (3, 4)]
            _prompt_per_rank(monkeypatch, prefill.engine, prompts)
            sent = pool.submit(_two_at_once, prefill.url, decode_url, prompts, 3 * timeout)
            assert wait_until(lambda: list(prefill.worker.rooms.values()) == ["send", "send"], 30)
            # rank 1's room, open there, in /metrics by rank (its rows: whatever has not left yet)
            held = lambda: scrape_labelled(prefill.url, "dp_rank").get("sparsekv:dp_rank_held_rooms")  # noqa: E731
            assert wait_until(lambda: held() == {"1": 1}, 10), held()  # rank 0 keeps nothing of the kind
            time.sleep(0.7)  # inside the tensors' sends
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            for rp, rd in sent.result():
                assert rp.status_code == 503 and "prefill worker" in rp.json()["error"]["message"], rp.text
                assert isinstance(rd, httpx.HTTPError)  # the decode worker died without answering
            _rank_1_keeps_nothing(prefill)
            r = httpx.post(prefill.url + "/v1/completions", json={**BODY, "prompt": _prompt(256, 44, 5)}, timeout=10)
            assert r.status_code == 400  # still serving: a request without its room is refused as always
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_rank_1_killed_while_it_sends_fails_its_room_on_both_sides(glm_ckpt, monkeypatch):
    """Rank 1 of a `-dp 2` prefill worker dies while it sends its room (each tensor waits first, so the
    send is under way): rank 0 sees it at once (its receive of rank 1's answers fails, where a receive
    from any rank waited for the call's timeout), and answers 503 naming it; the decode worker answers
    503 too, well within the timeout, keeps no page of the prompt and no room, and its pools' integrity
    holds."""
    import multiprocessing
    timeout = 8.0
    monkeypatch.setenv(DELAY_ENV, "0.5")  # read by rank 1's process, spawned with this environment
    prompt = _prompt(256, 44, 3)
    with (WorkerServer(glm_ckpt[0], "prefill", timeout_s=timeout, data_parallel_size=2,
                       dist_startup_timeout_s=STARTUP_S, **BASE) as prefill,
          WorkerServer(glm_ckpt[0], "decode", timeout_s=timeout, **BASE) as decode,
          ThreadPoolExecutor(1) as pool):
        monkeypatch.setattr(prefill.engine.router, "peek", lambda *args: 1)
        rank1 = [p for p in multiprocessing.active_children() if p.name.startswith("sparsekv-rank")]
        assert len(rank1) == 1
        sent = pool.submit(send_pair, prefill.url, decode.url, {**BODY, "prompt": prompt}, timeout=3 * timeout)
        sending = lambda: prefill.on_engine(prefill.engine.stats)["by_data_parallel_rank"][1]["held_rooms"]  # noqa: E731
        assert wait_until(lambda: list(prefill.worker.rooms.values()) == ["send"] and sending() == 1, 30)
        time.sleep(0.7)  # inside the tensors' sends
        os.kill(rank1[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        rp, rd = sent.result()
        assert time.monotonic() - killed < timeout / 2  # not at the timeout
        for r, side in ((rp, "prefill worker"), (rd, "decode worker")):
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert side in message and "data-parallel rank 1: rank 1 stopped answering" in message, message
        assert wait_until(lambda: decode.worker.rooms == {}, timeout)
        assert decode.engine.kv.held_prefix(prompt) == 0 and decode.engine.stats()["prefix_host_pages"] == 0
        decode.check_clean()


def test_a_data_parallel_drafting_prefill_worker_sends_short_tails_for_sampled_choices(tmp_path):
    """Drafting on both sides, a `-dp 2` prefill worker: two seeded, sampled requests at once (the
    worker spreads them over its ranks; rank 1's rows reach the decode worker through rank 0). Each
    prompt's tail goes short, no first token goes, and the decode worker computes each prompt's last
    token alone: one engine's seeded tokens."""
    from sparsekv.paths import default_model_path
    path = default_model_path()
    prompts = [_prompt(4096, n, seed) for n, seed in ((46, 3), (47, 4))]  # tails of 2 and 3 rows
    sampled = dict(temperature=0.8, seed=5, logprobs=None)
    want = LLM(path, **BASE, num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.8, seed=5, ignore_eos=True))
    args = ("-dp", "2", "--threads", "1", "--num-speculative-tokens", "2", *STARTUP_FLAGS)
    with process_and_local_pair(path, "prefill", tmp_path, args, **BASE, num_speculative_tokens=2) as (p_url, d_url, local):
        bodies = _pairs(p_url, d_url, prompts, **sampled)
        for prompt, body, expected in zip(prompts, bodies, want):
            figures = body["sparsekv"]["disaggregation"]
            assert (figures["first_tokens"], figures["tail_tokens"]) == (0, (len(prompt) - 1) % PAGE)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
            assert body["sparsekv"]["choices"][0]["token_ids"] == expected.token_ids
        local.check_clean()


def test_a_claimed_prompt_runs_on_the_rank_its_pages_landed_on(glm_ckpt):
    """In process, a `DataParallelEngine` of two ranks: the second prompt's claim takes rank 1 (rank 0
    has a claim in flight), its pages (exported by another engine) land there and nowhere else, and
    the request, added later, runs there as a pool hit, although the router alone would now
    send it to rank 0 (both ranks have one request in flight)."""
    path = glm_ckpt[0]
    a, b = _prompt(256, 41, 3), _prompt(256, 41, 4)
    source = LLM(path, **BASE)
    want = source.generate([b], GREEDY)[0]
    pages = source.engine.kv.export_prefix(b)
    llm = LLM(path, **BASE, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S, prefix_cache_host_bytes=1 << 24)
    try:
        kv = llm.engine.kv
        assert kv.held_prefix(a) == 0 and kv.held_prefix(b) == 0  # claims: rank 0, then rank 1
        assert kv.import_prefix(pages, "default", [b]) == len(pages) == (len(b) - 1) // PAGE
        assert [kv.on_rank(rank, "held_prefix", b) for rank in (0, 1)] == [0, len(pages)]
        got = llm.generate([b], GREEDY)[0]
        assert llm.engine.router.in_flight == [1, 0]  # a's claim is still waiting for its request
        llm.engine.check_integrity()
    finally:
        llm.close()
    assert got.metrics["prefix_cached_tokens_device"] == len(pages) * PAGE  # landed in rank 1's pool
    assert got.token_ids == want.token_ids


def test_a_claimed_prompt_is_counted_and_remembered_on_its_claimed_rank(glm_ckpt):
    """In process, two ranks: prompts a and b claim ranks 0 and 1; a's request comes and is aborted, so
    rank 0 is now the less loaded. b's request still goes to rank 1, and the router counts it there and
    remembers its pages there (not where it would send b now)."""
    a, b = _prompt(256, 41, 3), _prompt(256, 41, 4)
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    engine = llm.engine
    router = engine.router
    try:
        assert engine.kv.held_prefix(a) == 0 and engine.kv.held_prefix(b) == 0  # claims: rank 0, then rank 1
        engine.add_request("a", a, GREEDY)
        assert engine.rank_of["a"] == 0 and engine.abort("a") and router.in_flight == [0, 1]
        engine.add_request("b", b, GREEDY)
        assert engine.rank_of["b"] == 1 and router.in_flight == [0, 1] and engine.kv.num_claims == 0
        chain = router.chain(b, "default", None)
        assert [router.matched_pages(rank, chain) for rank in (0, 1)] == [0, len(b) // PAGE]
        assert engine.abort("b") and router.in_flight == [0, 0]
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
    finally:
        llm.close()


@pytest.mark.parametrize("one_rank", [False, True], ids=["placed", "one_rank"])
def test_the_requests_of_a_watched_room_run_where_the_router_puts_them_or_on_the_rank_of_its_first(one_rank,
                                                                                                    glm_ckpt):
    """In process, two ranks: a prefill worker's room of two prompts. Each request goes where the router
    puts it (prompts of no shared page, equal load: the second to the other rank), and the room is then
    on no one rank. Watched with `one_rank`, its second request goes to the rank its first went to
    instead, and that rank sends all of it. Unwatched requests are balanced as before, and the rank of
    each watched request stays known after its requests end."""
    x, a1, a2, y = (_prompt(256, 41, seed) for seed in (3, 4, 5, 6))
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    engine = llm.engine
    try:
        engine.add_request("x", x, GREEDY)
        engine.watch_ranks(["a1", "a2"], one_rank)
        engine.add_request("a1", a1, GREEDY)
        assert engine.router.peek(a2) == 0  # where a2 would go alone: load [1, 1], no page matched
        engine.add_request("a2", a2, GREEDY)
        engine.add_request("y", y, GREEDY)
        a2_rank, y_rank = (1, 0) if one_rank else (0, 1)
        assert [engine.rank_of[r] for r in ("x", "a1", "a2", "y")] == [0, 1, a2_rank, y_rank]
        room_rank = 1 if one_rank else None
        assert engine.router.in_flight == [2, 2] and engine.rank_running(["a1", "a2"]) == room_rank
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.rank_running(["a1", "a2"]) == room_rank  # finished, still watched
        assert engine.rank_running(["a1"]) == 1
        engine.unwatch_ranks(["a1", "a2"])
        assert engine.rank_running(["a1"]) is None and engine._room_of == {} and engine._watched == {}
        engine.check_integrity()
    finally:
        llm.close()


def test_layer_rows_of_every_data_parallel_rank_reach_rank_0_before_their_pages_are_named(glm_ckpt):
    """In process, a `DataParallelEngine` of two ranks with both prompts tapped: rank 1's prompt's rows
    stay on rank 1, announced over the taps' group (parallel/dp_taps.py) and fetched from there
    (dp_held.py), rank 0's come from its own engine. Each page once per layer, in order, each delivery
    the rows the page exports from the rank that computed it, and all of a step's deliveries in before
    the step returns (so before any page of it is named). Nothing after the untap, and nothing left
    kept on rank 1. Each delivery is slow here, as on a busy machine."""
    path = glm_ckpt[0]
    prompts = [_prompt(256, 42, seed) for seed in (3, 4)]  # 10 full pages each
    llm = LLM(path, **BASE, prefill_chunk_tokens=8, max_num_batched_tokens=16, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    engine, got = llm.engine, {0: [], 1: []}
    slow = {i: (lambda rows, i=i: (time.sleep(0.02), got[i].append(_fetched(engine, rows)))) for i in got}
    try:
        kinds = [engine.tap_layers(f"r{i}", len(p), 0, slow[i]) for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0.0))
        assert sorted(engine.rank_of.values()) == [0, 1]
        ranks = dict(engine.rank_of)
        while engine.has_unfinished_requests():
            engine.step()
            for i, p in enumerate(prompts):  # every page named on its rank by now has all its layers' rows
                named = engine.kv.on_rank(ranks[f"r{i}"], "held_prefix", p)
                layers = len(engine.local.model.layers)
                pages = [d.first + j for d in got[i] for j in range(d.count)]
                assert all(pages.count(page) == layers for page in range(named)), (i, named)
        layers = len(engine.local.model.layers)
        for i, p in enumerate(prompts):
            exported = engine.kv.on_rank(ranks[f"r{i}"], "export_prefix", p)
            full, tails = [d for d in got[i] if not d.tail], [d for d in got[i] if d.tail]
            for layer in range(layers):
                pages = [d.first + j for d in full if d.layer == layer for j in range(d.count)]
                assert pages == list(range((len(p) - 1) // PAGE)), (i, layer)
            # the last token's page through it (page 10, two rows), fetched from rank 1 for its prompt
            assert [(d.layer, d.first, d.tail) for d in tails] == [(layer, 10, 2) for layer in range(layers)]
            assert all(r.shape[:2] == (1, 2) for d in tails for r in d.ready())
            # a full layer's tail carries its rows' selections: their union and the last row's
            assert [d.layer for d in tails if d.selected is not None] == engine.model_config.full_layers
            for union, last in (d.selected for d in tails if d.selected is not None):
                assert torch.equal(union, torch.unique(union)) and set(last.tolist()) <= set(union.tolist())
                assert last.numel() == engine.model_config.index_topk < len(p)
            for d in full:
                for j in range(d.count):
                    rows = exported[d.first + j][1]
                    assert all(torch.equal(rows[k], d.ready()[n][j]) for n, k in enumerate(d.kinds))
        assert kinds[0] == kinds[1] and sorted({k for d in got[1] for k in d.kinds}) == kinds[1]
        alone = _tail_selections(path, prompts[1], prefill_chunk_tokens=8, max_num_batched_tokens=16)
        assert {d.layer: d.selected for d in got[1] if d.selected is not None}.keys() == alone.keys()
        assert all(torch.equal(a, b) for d in got[1] if d.selected is not None
                   for a, b in zip(d.selected, alone[d.layer]))  # rank 1's, fetched, as one engine's
        counts = {i: len(got[i]) for i in got}
        for i in range(2):
            engine.untap_layers(f"r{i}")
        llm.generate([_prompt(256, 42, seed=5), _prompt(256, 42, seed=6)], SamplingParams(max_tokens=1))
        assert {i: len(got[i]) for i in got} == counts
        engine.check_integrity()
    finally:
        llm.close()


def _fetched(engine, rows):
    """A delivery with the rows another rank keeps fetched from there (rank 0's own as they are)."""
    parts = [*rows.rows, *(rows.selected or ())]
    if not any(is_held(t) for t in parts):
        return rows
    got = engine.fetch_held(parts)
    return replace(rows, rows=got[:len(rows.rows)], selected=None if rows.selected is None else tuple(got[len(rows.rows):]))


def test_a_prompt_untapped_mid_prefill_on_rank_1_sends_no_more_rows(glm_ckpt):
    """An untap reaches the rank the request runs on with the next step's command: from then on that rank
    announces nothing more for it, and the rows it kept for the tap go (the integrity check finds any
    kept for a tap that is gone)."""
    prompts = [_prompt(256, 42, seed) for seed in (3, 4)]  # 10 full pages each, 8 rows a step
    llm = LLM(glm_ckpt[0], **BASE, prefill_chunk_tokens=8, max_num_batched_tokens=16, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    engine, got = llm.engine, []
    try:
        engine.tap_layers("r1", len(prompts[1]), 0, got.append)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0.0))
        assert engine.rank_of["r1"] == 1
        engine.step()
        engine.step()
        received = list(engine.taps.receiver.received)
        assert received[1] > 0 and len(got) == received[1]
        engine.check_integrity()  # rank 1 keeps the rows of a tap still set: theirs, not stale
        engine.untap_layers("r1")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.taps.receiver.received == received and len(got) == received[1]
        engine.check_integrity()
    finally:
        llm.close()


def test_a_call_that_fails_on_rank_1_fails_alone(glm_ckpt):
    """In process, a `DataParallelEngine` of two ranks whose calls a tap opened (dp_held.RankCalls): a
    call that fails on rank 1 (rows no longer kept there) answers with its error, one that cannot be
    pickled is refused before it goes, and rank 0 is no rank to call; calls after them are answered."""
    llm = LLM(glm_ckpt[0], **BASE, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    engine = llm.engine
    try:
        engine.tap_layers("r", 8, 0, lambda rows: None)
        gone = Held(1, 12345, 0, (1, 4), torch.float32)
        with pytest.raises(RuntimeError, match=r"KeyError: .*rows \[12345\] are no longer held on data-parallel rank 1"):
            engine.call_rank(1, take_held, [gone]).result(30)
        with pytest.raises(RuntimeError, match="cannot be pickled"):
            engine.call_rank(1, lambda side: None)
        with pytest.raises(ValueError, match="no data-parallel rank 0 to call"):
            engine.call_rank(0, drop_held, [])
        assert engine.call_rank(1, drop_held, [12345]).result(30) is None
        assert engine.fetch_held([torch.ones(1)])[0].tolist() == [1.0]  # nothing held: nothing to call
        engine.untap_layers("r")
        engine.check_integrity()
    finally:
        llm.close()


def _tail_selections(path: str, prompt: list[int], **options) -> dict:
    """One engine's tail selections of `prompt` by full layer (LayerRows.selected)."""
    llm, got = LLM(path, **BASE, **options), []
    llm.engine.tap_layers("r", len(prompt), 0, got.append)
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return {d.layer: d.selected for d in got if d.tail and d.selected is not None}


def test_layer_taps_outlast_an_idle_spell_longer_than_the_collective_timeout(glm_ckpt):
    """Rank 0's tap receiver waits for the next delivery however long the worker stays idle: bounded
    by the collective timeout, it timed out, closed the taps' group, and rank 1's next tapped prompt
    killed the engine (a prefill worker idle for a minute, by default)."""
    timeout_s = 2.0
    llm = LLM(glm_ckpt[0], **BASE, prefill_chunk_tokens=8, max_num_batched_tokens=16, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S,
              dist_timeout_s=timeout_s)
    engine, got = llm.engine, []

    def tapped_round(tag: str, seeds: tuple[int, int]) -> None:
        prompts = [_prompt(64, 42, seed) for seed in seeds]  # not cached: every layer computes every page
        for i, p in enumerate(prompts):
            engine.tap_layers(f"{tag}{i}", len(p), 0, got.append)
            engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=2, temperature=0.0))
        assert sorted(engine.rank_of[f"{tag}{i}"] for i in range(2)) == [0, 1]  # one prompt on rank 1
        while engine.has_unfinished_requests():
            engine.step()
        for i in range(2):
            engine.untap_layers(f"{tag}{i}")
    try:
        tapped_round("a", (3, 4))
        first = len(got)
        time.sleep(2 * timeout_s + 1)
        tapped_round("b", (5, 6))
        assert first > 0 and len(got) == 2 * first
    finally:
        llm.close()


def test_a_claimed_prompt_with_a_logits_processor_runs_on_rank_0(glm_ckpt):
    """A logits processor is a Python callable given in this process, which no other rank could load: its
    request runs on rank 0 even when rank 1 claimed its prompt (rank 0 computes the pages again). Sent
    to rank 1, it failed there and the engine served no more (RankFailure)."""
    path = glm_ckpt[0]
    a, b = _prompt(256, 41, 3), _prompt(256, 41, 4)
    single = LLM(path, **BASE)
    first = single.generate([b], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]

    def ban(token_ids, logits):
        logits[first] = float("-inf")
        return logits
    params = SamplingParams(max_tokens=4, temperature=0.0, logits_processors=[ban])
    want = single.generate([b], params)[0]
    llm = LLM(path, **BASE, data_parallel_size=2, dist_startup_timeout_s=STARTUP_S)
    try:
        kv = llm.engine.kv
        assert kv.held_prefix(a) == 0 and kv.held_prefix(b) == 0  # claims: rank 0, then rank 1
        got = llm.generate([b], params)[0]
        assert got.token_ids == want.token_ids and got.token_ids[0] != first
        assert llm.engine.router.in_flight == [1, 0]  # a's claim still counts; b's ended on rank 0
        llm.engine.check_integrity()
    finally:
        llm.close()
