"""The layer-by-layer send (docs/disaggregation.md): the engine hands a prompt's page rows out layer
by layer as its steps compute them (cache/layer_tap.py), the prefill worker sends them at once, and
the decode worker keeps them until the pages are named, then completes each page with the rest of
its rows. The rows handed out are the ones the page exports; every page of every layer once; the
decode worker's pages are the prefill engine's, and the answer is one colocated engine's."""
from __future__ import annotations

import asyncio

import pytest
import torch

from disagg_util import WorkerServer, send_pair
from sparsekv import LLM, SamplingParams
from sparsekv.disagg.decode import Inbox
from sparsekv.disagg.layers import LayerFeed, named_parts
from sparsekv.disagg.wire import TransferError, at_once
from sparsekv.paths import default_model_path
from test_disagg_workers import BASE, BODY, GREEDY, PAGE, _prompt, _slowed, assert_as_colocated
from tolerances import logprob_tolerance

CHUNKED = dict(prefill_chunk_tokens=8, max_num_batched_tokens=8)  # two pages a step


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="needs CUDA (scripts/gpu_check.py --disagg runs it)"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True, device_buffer_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["plain", "tiered", "fp8"])
def test_each_page_is_handed_out_once_per_layer_with_the_rows_it_exports(glm_ckpt, options, device):
    """On CUDA the rows are copied to pinned host memory asynchronously; `ready()` waits for them."""
    engine = LLM(glm_ckpt[0], **BASE, **CHUNKED, **options, device=device).engine
    prompt, skip = _prompt(256, 42), 3  # 10 full pages, the first 3 held by the other side
    got = []
    kinds = engine.tap_layers("r", len(prompt), skip, got.append)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    _finish(engine)
    layers = len(engine.model.layers)
    full, tails = [d for d in got if not d.tail], [d for d in got if d.tail]
    for layer in range(layers):
        pages = [d.first + i for d in full if d.layer == layer for i in range(d.count)]
        assert pages == list(range(skip, len(prompt) // PAGE)), layer  # in order, once, none past the prompt
    # the last token's page (10) through that token (position 41): two rows, once per layer, every kind
    assert [(d.layer, d.first, d.count, d.tail) for d in tails] == [(layer, 10, 1, 2) for layer in range(layers)]
    assert all(r.shape[:2] == (1, 2) for d in tails for r in d.ready())
    assert sorted(k for d in tails for k in d.kinds) == kinds  # each kind once, from the layer that writes it
    assert sorted({k for d in got for k in d.kinds}) == kinds
    assert kinds == list(range(len(engine.kv.page_tensors())))  # no MTP layer, no selector state: every kind
    exported = engine.kv.export_prefix(prompt, skip=skip)
    for d in full:
        for i in range(d.count):
            rows = exported[d.first - skip + i][1]
            assert all(torch.equal(rows[k], d.ready()[j][i]) for j, k in enumerate(d.kinds))
    engine.untap_layers("r")
    engine.add_request("s", _prompt(256, 42, seed=5), SamplingParams(max_tokens=1))
    _finish(engine)
    assert len(got) == layers * 5  # four steps of 8 tokens completed pages, the last one the tail; none since


def test_the_mtp_layers_entries_are_left_to_the_pages_export():
    engine = LLM(default_model_path(), **BASE, num_speculative_tokens=2).engine
    kinds = engine.tap_layers("r", 40, 0, lambda rows: None)
    tensors = [t for t, _ in engine.kv.page_tensors()]
    mtp = engine.model_config.num_hidden_layers
    mtp_kinds = [j for j, t in enumerate(tensors) if any(t is m for m in engine.executor.pool.layer_slot_tensors(mtp))]
    assert mtp_kinds and not set(mtp_kinds) & set(kinds)
    assert sorted(set(kinds) | set(mtp_kinds)) == list(range(len(tensors)))


# -- the decode side: rows kept until their pages are named ------------------------------------------------

def _inbox(held=(0,)) -> Inbox:
    return Inbox(None, None, torch.device("cpu"), None, held=list(held))


def _page(i: int) -> list[torch.Tensor]:
    return [torch.full((PAGE, 2), float(10 * i + k)) for k in range(3)]  # three kinds of row


def _layer(prompt: int, first: int, pages: list[int], kinds: list[int]) -> tuple[dict, list]:
    meta = {"layer_rows": {"prompt": prompt, "first": first, "count": len(pages)}, "kinds": kinds}
    return meta, [torch.stack([_page(i)[k] for i in pages]) for k in kinds]


def _named(pages: list[int], kinds: list[int] | None, counts: list[int]) -> tuple[dict, list[bytes], list]:
    carried = kinds if kinds is not None else [0, 1, 2]
    meta = {"pages": counts, "kinds": kinds, "num_kinds": None if kinds is None else 3}
    return meta, [bytes([i]) * 4 for i in pages], [torch.stack([_page(i)[k] for i in pages]) for k in carried]


def test_rows_that_came_layer_by_layer_complete_their_pages_when_named():
    inbox = _inbox(held=(2,))
    inbox._keep_layer_rows(*_layer(0, 2, [2, 3], [0]), at_once)
    inbox._keep_layer_rows(*_layer(0, 2, [2, 3], [2]), at_once)
    inbox._keep_layer_rows(*_layer(0, 4, [4], [0, 2]), at_once)  # the next step's, before the names
    pages = inbox._named_pages(*_named([2, 3], [1], [2]), at_once)
    assert [name for name, _ in pages] == [b"\x02" * 4, b"\x03" * 4]
    assert all(torch.equal(r, w) for i, (_, rows) in zip((2, 3), pages) for r, w in zip(rows, _page(i)))
    assert list(inbox.partial) == [(0, 4)] and (inbox.pages_by_layer, inbox.layer_batches) == (3, 3)
    pages = inbox._named_pages(*_named([4], [1], [1]), at_once)
    assert all(torch.equal(r, w) for r, w in zip(pages[0][1], _page(4))) and not inbox.partial


def test_a_page_whose_rows_do_not_add_up_fails_the_room():
    inbox = _inbox()
    inbox._keep_layer_rows(*_layer(0, 0, [0], [0]), at_once)
    with pytest.raises(TransferError, match="twice"):
        inbox._keep_layer_rows(*_layer(0, 0, [0], [0]), at_once)
    with pytest.raises(TransferError, match="not 0 to 2"):  # kind 2 never came
        inbox._named_pages(*_named([0], [1], [1]), at_once)
    inbox = _inbox()
    inbox._keep_layer_rows(*_layer(0, 0, [0], [0]), at_once)
    with pytest.raises(TransferError, match="twice"):  # a whole page named over rows that came before
        inbox._named_pages(*_named([0], None, [1]), at_once)
    with pytest.raises(TransferError, match="already named"):
        inbox._keep_layer_rows(*_layer(0, 0, [0], [1]), at_once)
    for bad in ({"prompt": 1, "first": 1, "count": 1}, {"prompt": 0, "first": 1, "count": 0}, {"prompt": 0}):
        with pytest.raises(TransferError, match="malformed"):
            inbox._keep_layer_rows({"layer_rows": bad, "kinds": [0]}, [], at_once)


def _tail(prompt: int, page: int, rows: int, kinds: list[int]) -> tuple[dict, list]:
    meta = {"layer_rows": {"prompt": prompt, "first": page, "count": 1, "tail": rows}, "kinds": kinds}
    return meta, [torch.stack([_page(page)[k][:rows]]) for k in kinds]


def test_a_prompts_tail_is_kept_whole_for_the_import_or_fails_the_room():
    """The rows of a prompt's last token's page through that token: complete when every kind came once,
    at the page after its cacheable ones and as long as that page's rows of the prompt."""
    prompt = list(range(1, 12))  # 11 tokens: 2 cacheable pages, then page 2 with 3 rows through the last token
    inbox = _inbox()
    inbox._keep_layer_rows(*_tail(0, 2, 3, [0, 2]), at_once)
    assert inbox.complete_tails([prompt], PAGE, 3) == [None]  # kind 1 has not come
    inbox._keep_layer_rows(*_tail(0, 2, 3, [1]), at_once)
    tails = inbox.complete_tails([prompt], PAGE, 3)
    assert all(torch.equal(t, _page(2)[k][:3]) for k, t in enumerate(tails[0]))
    with pytest.raises(TransferError, match="twice"):
        inbox._keep_layer_rows(*_tail(0, 2, 3, [1]), at_once)
    assert not inbox.partial  # a tail is no page to be named
    for page, rows in ((3, 3), (2, 2)):  # another page, or another length, than the prompt's
        inbox = _inbox()
        inbox._keep_layer_rows(*_tail(0, page, rows, [0, 1, 2]), at_once)
        with pytest.raises(TransferError, match="tail came as"):
            inbox.complete_tails([prompt], PAGE, 3)
    meta, tensors = _tail(0, 2, 2, [0])
    meta["layer_rows"]["tail"] = 3  # announced longer than the rows received
    with pytest.raises(TransferError, match="rows announced"):
        _inbox()._keep_layer_rows(meta, tensors, at_once)


def test_a_tails_selections_come_with_its_rows_or_fail_the_room():
    """A full layer's tail batch carries its rows' selections (union, last row's) after the rows: kept
    by layer for FirstToken.warm; with rows that are no tail, twice, or not 1-D int64, they fail."""
    inbox = _inbox()
    union, last = torch.tensor([1, 4, 6]), torch.tensor([6, 1])
    meta, tensors = _tail(0, 2, 3, [0])
    meta["layer_rows"]["selected"] = [3]
    inbox._keep_layer_rows(meta, tensors + [union, last], at_once)
    assert [(layer, u.tolist(), r.tolist()) for layer, u, r in inbox.warm(0)] == [(3, [1, 4, 6], [6, 1])]
    assert inbox.warm(1) == ()
    for target, bad in ((inbox, [union, last]), (_inbox(), [union.float(), last]), (_inbox(), [union[None], last])):
        meta, tensors = _tail(0, 2, 3, [1])  # layer 3's again; floats; 2-D
        meta["layer_rows"]["selected"] = [3]
        with pytest.raises(TransferError, match="selections"):
            target._keep_layer_rows(meta, tensors + bad, at_once)
    meta, tensors = _layer(0, 0, [0], [0])
    meta["layer_rows"]["selected"] = [3]
    with pytest.raises(TransferError, match="not a prompt's tail"):
        _inbox()._keep_layer_rows(meta, tensors + [union, last], at_once)


def test_a_tail_that_did_not_come_whole_warms_nothing():
    """Selections that came with some kinds of a prompt's tail only (the rest never came): the decode
    side computes that page itself, so its first tokens carry no warm selections (`DecodeWorker._warm`);
    with the whole tail, they carry them."""
    from types import SimpleNamespace
    from sparsekv.disagg.decode import DecodeWorker
    prompt = list(range(1, 12))  # 11 tokens: page 2's 3 rows are its tail
    w = DecodeWorker.__new__(DecodeWorker)
    w.state = SimpleNamespace(engine=SimpleNamespace(model_config=SimpleNamespace(full_layers=[3], index_topk=2)))
    inbox = _inbox()
    meta, tensors = _tail(0, 2, 3, [0])
    meta["layer_rows"]["selected"] = [3]
    inbox._keep_layer_rows(meta, tensors + [torch.tensor([1, 4, 6]), torch.tensor([6, 1])], at_once)
    tails = inbox.complete_tails([prompt], PAGE, 3)
    assert tails == [None] and w._warm(inbox, [prompt], tails) == [()]
    inbox._keep_layer_rows(*_tail(0, 2, 3, [1, 2]), at_once)
    tails = inbox.complete_tails([prompt], PAGE, 3)
    assert [layer for layer, _, _ in w._warm(inbox, [prompt], tails)[0]] == [3]


def test_rows_for_pages_never_named_fail_the_last_batch():
    inbox = _inbox()
    inbox._keep_layer_rows(*_layer(0, 3, [3], [0]), at_once)
    with pytest.raises(TransferError, match="never named"):
        inbox.receive({"names": [], "pages": [0], "tensors": [], "last": True})


# -- the prefill side: a look's pages split by what went layer by layer ------------------------------------

def test_a_looks_pages_go_whole_then_with_the_kinds_not_sent_layer_by_layer():
    feed = LayerFeed(asyncio.new_event_loop(), 3)
    feed.tap_kinds, feed.tapped = [0, 2], {(0, 4), (0, 5), (1, 1)}
    pages = [(bytes([i]), _page(i)) for i in range(5)]  # prompt 0: pages 3, 4, 5; prompt 1: pages 0, 1
    parts = named_parts(pages, [3, 2], [3, 0], feed)
    assert [(counts, [name for name, _ in part], kinds) for counts, part, kinds in parts] == [
        ([1, 1], [b"\x00", b"\x03"], None), ([2, 1], [b"\x01", b"\x02", b"\x04"], [1])]
    assert named_parts(pages, [3, 2], [3, 0], None) == [([3, 2], pages, None)]
    feed.tapped = {(0, 3), (0, 5)}
    with pytest.raises(TransferError, match="out of order"):
        named_parts(pages, [3, 2], [3, 0], feed)


# -- through two workers --------------------------------------------------------------------------------

@pytest.mark.parametrize("setup", ["plain", "prefill-tiered", "fp8", "mtp"])
def test_rows_go_layer_by_layer_and_the_answer_is_one_engines(setup, glm_ckpt, monkeypatch):
    path = default_model_path() if setup == "mtp" else glm_ckpt[0]
    options = {"prefill-tiered": dict(kv_tiering=True, device_buffer_tokens=16), "fp8": dict(kv_cache_dtype="fp8"),
               "mtp": dict(num_speculative_tokens=2)}.get(setup, {})
    decode_options = {k: v for k, v in options.items() if k != "device_buffer_tokens" and k != "kv_tiering"}
    prompt = _prompt(256, 48)  # page-aligned: the page of its last token is not named
    colocated = LLM(path, **BASE, **decode_options)
    want = colocated.generate([prompt], GREEDY)[0]
    with WorkerServer(path, "prefill", **BASE, **CHUNKED, **options) as p, \
            WorkerServer(path, "decode", **BASE, **decode_options) as d:
        _slowed(p.engine, monkeypatch, 0.02)
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert_as_colocated(want, rd.json(), d, logprob_tolerance(colocated, extra_layers=setup == "mtp"))
        sent, got = rp.json()["sparsekv"]["disaggregation"], rd.json()["sparsekv"]["disaggregation"]
        assert sent["pages_sent"] == got["pages_sent"] == got["pages_by_layer"] == sent["pages_by_layer"] == 11
        assert got["layer_batches"] == sent["layer_batches"] >= 5  # at least one per chunk that completed pages
        assert got["batches"] == sent["batches"] > got["layer_batches"]
        assert 0 < got["pages_kept_early"] <= got["pages_sent"]  # kept as their batches came, during the prefill
        # the last page's rows came too (with an MTP layer, its entries after the MTP pass), with the
        # first token: that token alone was computed
        assert (got["tail_tokens"], got["first_tokens"]) == (PAGE, 1)
        assert rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * PAGE
        p.check_clean()
        d.check_clean()


def test_each_prompt_of_a_request_of_n_choices_has_its_own_rows_tapped(glm_ckpt, monkeypatch):
    """Two prompts of two choices each: each prompt's rows are tapped on its first choice's engine
    request (the other choice hits its pages), so every page of both prompts goes layer by layer and
    each choice gets its own prompt's answer."""
    prompts = [_prompt(256, 24, seed=5), _prompt(256, 28, seed=6)]  # page-aligned: 5 and 6 pages named
    colocated = LLM(glm_ckpt[0], **BASE)
    want = colocated.generate(prompts, GREEDY)
    with WorkerServer(glm_ckpt[0], "prefill", **BASE, **CHUNKED) as p, WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        _slowed(p.engine, monkeypatch, 0.02)
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompts, "n": 2})
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        choices = rd.json()["sparsekv"]["choices"]
        assert [c["token_ids"] for c in choices] == [w.token_ids for w in want for _ in range(2)]
        sent, got = rp.json()["sparsekv"]["disaggregation"], rd.json()["sparsekv"]["disaggregation"]
        assert sent["pages_sent"] == got["pages_sent"] == got["pages_by_layer"] == sent["pages_by_layer"] == 11
        assert (got["tail_tokens"], got["first_tokens"]) == (2 * PAGE, 4)
        p.check_clean()
        d.check_clean()


def test_rows_past_the_unclaimed_bound_are_dropped_and_the_pages_go_whole():
    from sparsekv.cache.layer_tap import LayerRows
    loop = asyncio.new_event_loop()
    rows = lambda first: LayerRows(0, first, 1, [0], [torch.zeros(1, PAGE, 8)])  # noqa: E731 (128 bytes)
    discarded = []  # what a data-parallel rank keeping the rows is told to let go of
    feed = LayerFeed(loop, 3, unclaimed_max_bytes=200, discard=lambda dropped: discarded.append([d.first for d in dropped]))
    feed.deliver_for(0)(rows(0))
    assert len(feed.items) == 1 and discarded == []
    feed.deliver_for(0)(rows(1))  # 256 bytes before any claim: everything goes
    assert discarded == [[0, 1]]
    feed.claim()
    feed.deliver_for(0)(rows(2))  # and nothing after it, or the pages would be part layer by layer
    assert feed.dropped and feed.take() == [] and not feed.tapped and discarded == [[0, 1], [2]]
    feed = LayerFeed(loop, 3, unclaimed_max_bytes=200)
    feed.claim()
    for first in range(3):
        feed.deliver_for(0)(rows(first))  # claimed: no bound
    assert [(p, first, n) for p, first, n, _ in feed.take()] == [(0, 0, 1), (0, 1, 1), (0, 2, 1)]
    assert feed.tapped == {(0, 0), (0, 1), (0, 2)}
    loop.close()


def test_rows_up_to_the_unclaimed_bound_are_kept():
    """The bound is what may be kept before the claim: rows adding up to exactly it stay queued; the
    next byte past it drops them all."""
    from sparsekv.cache.layer_tap import LayerRows
    loop = asyncio.new_event_loop()
    rows = lambda first: LayerRows(0, first, 1, [0], [torch.zeros(1, PAGE, 8)])  # noqa: E731 (128 bytes)
    feed = LayerFeed(loop, 3, unclaimed_max_bytes=256, discard=lambda dropped: pytest.fail("nothing is past the bound"))
    feed.deliver_for(0)(rows(0))
    feed.deliver_for(0)(rows(1))  # 256 bytes: the bound itself
    assert not feed.dropped and len(feed.items) == 2
    feed.discard = lambda dropped: None
    feed.deliver_for(0)(LayerRows(0, 2, 1, [0], [torch.zeros(1)]))  # 4 bytes more
    assert feed.dropped and not feed.items
    loop.close()


def test_a_wait_for_rows_returns_at_once_when_rows_are_queued():
    """`LayerFeed.wait` clears its wake-up, then returns if rows are queued: rows whose wake-up an
    earlier wait used (or cleared) are sent now, not after the next delivery or the wait's timeout."""
    from sparsekv.cache.layer_tap import LayerRows

    async def ended(feed, never) -> bool:
        waiting = asyncio.ensure_future(feed.wait([never], None))
        for _ in range(3):
            await asyncio.sleep(0)
        done = waiting.done()
        waiting.cancel()
        return done

    async def scenario():
        never = asyncio.get_running_loop().create_future()
        feed = LayerFeed(asyncio.get_running_loop(), 3)
        assert not await ended(feed, never)  # nothing queued: it waits
        feed.deliver_for(0)(LayerRows(0, 0, 1, [0], [torch.zeros(1, PAGE, 8)]))
        assert await ended(feed, never)  # a row queued: it returns at once, its wake-up cleared
        assert await ended(feed, never)  # and again, with the row still queued and no wake-up set
        feed.take()
        assert not await ended(feed, never)
    asyncio.run(scenario())


def test_without_first_tokens_a_tail_goes_short_and_one_of_a_single_row_not_at_all():
    """A feed whose choices' first tokens do not go keeps a tail (sent less its last row, `short_tail`)
    unless that tail is the last token's row alone; with the first tokens it keeps any."""
    from sparsekv.cache.layer_tap import LayerRows
    from sparsekv.disagg.layers import short_tail
    loop = asyncio.new_event_loop()
    tail = lambda n: LayerRows(0, 3, 1, [0], [torch.arange(n * 2.0).view(1, n, 2)], tail=n)  # noqa: E731
    for first_tokens, kept in ((False, [2, 3]), (True, [1, 2, 3])):
        feed = LayerFeed(loop, 3, first_tokens=first_tokens)
        for n in (1, 2, 3):
            feed.deliver_for(0)(tail(n))
        assert [d.tail for _, _, _, deliveries in feed.take() for d in deliveries] == kept
    assert [r.shape for r in short_tail(tail(3).rows, 3)] == [(1, 2, 2)]
    assert torch.equal(short_tail(tail(3).rows, 3)[0], tail(3).rows[0][:, :2])
    loop.close()


def test_disaggregation_send_chunks_sends_no_layer_rows(glm_ckpt, tmp_path):
    """`--disaggregation-send chunks`: the pages go once every layer computed them, none layer by layer."""
    from disagg_util import secret_file
    from sparsekv.server.cli import build_parser, disaggregation_settings
    flags = ["--disaggregation-mode", "prefill", "--disaggregation-secret-file", secret_file(tmp_path)]
    assert disaggregation_settings(build_parser().parse_args(["m", *flags])).send == "layers"
    settings = disaggregation_settings(build_parser().parse_args(["m", *flags, "--disaggregation-send", "chunks"]))
    assert settings.send == "chunks"
    with pytest.raises(ValueError, match="--disaggregation-send"):
        type(settings)(**{**settings.__dict__, "send": "pages"})
    prompt = _prompt(256, 48)
    with WorkerServer(glm_ckpt[0], "prefill", send=settings.send, **BASE, **CHUNKED) as p, \
            WorkerServer(glm_ckpt[0], "decode", **BASE) as d:
        rp, rd = send_pair(p.url, d.url, {**BODY, "prompt": prompt})
        figures = rd.json()["sparsekv"]["disaggregation"]
        assert (figures["pages_sent"], figures["pages_by_layer"], figures["layer_batches"]) == (11, 0, 0)


# -- the engine side: LayerTaps alone, on small tensors ----------------------------------------------------

def _taps(page: int = 4, pages: int = 8):
    """LayerTaps over three slot-indexed tensors: layer 0 writes kinds 0 and 1 (a full layer), layer 1
    kind 2 and a page-indexed state (one row per page: not a kind handed out); row s of kind j holds
    100 * j + s. Each flush is counted in `taps.flushes`."""
    from sparsekv.cache.layer_tap import LayerTaps
    tensors = [(torch.arange(pages * page, dtype=torch.float32)[:, None] + 100 * j, 1) for j in range(3)]
    per_page = torch.zeros(pages, 1)
    layers = {0: [tensors[0][0], tensors[1][0]], 1: [tensors[2][0], per_page]}
    flushes = []

    def slots_of(page_ids, n):
        return torch.cat([torch.arange(p * page, (p + 1) * page) for p in page_ids])[:n]
    taps = LayerTaps([*tensors, (per_page, page)], layers, page, slots_of, lambda: flushes.append(1),
                     full_layers=frozenset({0}))
    taps.flushes = flushes
    return taps, tensors


class _Chunk:
    def __init__(self, first_position, context_len, page_ids, request_id="r"):
        self.request_id, self.first_position, self.context_len, self.page_ids = (
            request_id, first_position, context_len, page_ids)


def _step(taps, chunk, layers=(0, 1)):
    after_layer, _ = taps.begin_step([chunk])
    if after_layer is not None:
        for layer in layers:
            after_layer(layer)


def test_taps_hand_out_each_page_once_from_skip_then_the_tail_once():
    """A 16-token prompt of pages of 4 (pool pages 5, 2, 7, 3): the cache names its first 3 pages, the
    4th is its tail (4 rows through the last token). With skip 1, pages 1 and 2 go once per layer as
    the chunks complete them, never page 0 nor the tail page as a whole page; the tail once, after the
    chunk holding its last token; a step repeating a chunk hands out nothing again."""
    taps, tensors = _taps()
    got = []
    taps.add("r", 3, 1, got.append, tail=4)
    page_ids = [5, 2, 7, 3]
    for first, end in ((0, 6), (6, 11), (6, 11), (11, 16), (11, 16)):
        _step(taps, _Chunk(first, end, page_ids))
    assert [(d.layer, d.first, d.count, d.kinds, d.tail) for d in got] == [
        (0, 1, 1, [0, 1], 0), (1, 1, 1, [2], 0),
        (0, 2, 1, [0, 1], 0), (0, 3, 1, [0, 1], 4), (1, 2, 1, [2], 0), (1, 3, 1, [2], 4)]
    for d in got:
        pool_page = page_ids[d.first]
        for j, rows in zip(d.kinds, d.ready()):
            want = tensors[j][0][pool_page * 4:pool_page * 4 + (d.tail or 4)]
            assert torch.equal(rows, want.view(1, d.tail or 4, 1))
    assert taps.kinds == [0, 1, 2] and len(taps.flushes) == 4  # before each copy: 2 steps, 2 layers


def test_a_step_that_completes_no_tail_asks_for_no_selections_and_one_past_the_prompt_hands_out_nothing():
    """`begin_step`'s `record_selection` hook is None unless a chunk of the step completes its tail; a chunk
    that starts at or after the prompt's end (a decode) computes none of its rows: it hands out
    nothing, not even a tail still owed (a tap added once the prompt was computed)."""
    taps, _ = _taps()
    got = []
    taps.add("r", 3, 0, got.append, tail=4)
    after_layer, record = taps.begin_step([_Chunk(0, 8, [5, 2, 7, 3])])  # pages 0 and 1, no tail
    assert after_layer is not None and record is None
    after_layer, record = taps.begin_step([_Chunk(8, 16, [5, 2, 7, 3])])  # page 2 and the tail
    assert after_layer is not None and record is not None
    late = []
    taps.add("s", 3, 3, late.append, tail=4)
    assert taps.begin_step([_Chunk(16, 17, [5, 2, 7, 3], request_id="s")]) == (None, None)
    assert late == []
    taps.add("u", 3, 0, got.append)  # a later step completing pages only: no tail of any step before
    after_layer, record = taps.begin_step([_Chunk(0, 4, [1, 4, 6, 0], request_id="u")])
    assert after_layer is not None and record is None


def test_a_removed_tap_hands_out_nothing_more():
    """`remove` (a request untapped, finished or aborted) forgets the tap: the taps are empty again, and
    a later chunk of that request id (a request resubmitted under it) hands none of its pages out."""
    taps, _ = _taps()
    got = []
    taps.add("r", 3, 0, got.append, tail=4)
    _step(taps, _Chunk(0, 4, [5, 2, 7, 3]))
    assert [(d.layer, d.first) for d in got] == [(0, 0), (1, 0)]
    taps.remove("r")
    assert not taps
    _step(taps, _Chunk(4, 16, [5, 2, 7, 3]))
    assert len(got) == 2


def test_a_tails_mtp_rows_go_once_after_its_own_steps_mtp_pass():
    """The MTP layer's rows of a tail are handed out by `after_mtp`, once, after the MTP pass of the step
    that completed the tail; a step whose MTP pass did not run (no draft was made) leaves nothing owed
    to a later step's pass, whose rows are another step's."""
    from sparsekv.cache.layer_tap import LayerTaps
    target, mtp = (torch.arange(32, dtype=torch.float32)[:, None] + 100 * j for j in range(2))

    def slots_of(page_ids, n):
        return torch.cat([torch.arange(p * 4, (p + 1) * 4) for p in page_ids])[:n]
    taps = LayerTaps([(target, 1), (mtp, 1)], {0: [target]}, 4, slots_of, lambda: None, mtp_tensors={1: [mtp]})
    got = []
    for rid, passes in (("r", 2), ("s", 0)):
        taps.add(rid, 1, 0, got.append, tail=2)  # 6 tokens: page 0 named, the tail its 2 rows of page 1
        _step(taps, _Chunk(0, 6, [5, 2], request_id=rid), layers=(0,))
        for _ in range(passes):
            taps.after_mtp()
    _step(taps, _Chunk(0, 4, [6, 1], request_id="t"), layers=(0,))  # another step (untapped), then its pass
    taps.after_mtp()
    assert [(d.layer, d.first, d.tail) for d in got if d.layer == 1] == [(1, 1, 2)]
    assert torch.equal(got[2].ready()[0], mtp[8:10].view(1, 2, 1))


def test_a_tails_delivery_on_a_full_layer_carries_the_positions_its_rows_selected():
    """The tail (positions 12..15) completed by a chunk of positions 13..15: a full layer's selections of
    the chunk's rows come with the tail's rows, as the union of the positions selected at or before each
    row (a later one is padding) and the last row's selection; a layer that is not full carries none."""
    from types import SimpleNamespace
    taps, _ = _taps()
    got = []
    taps.add("r", 3, 0, got.append, tail=4)
    _step(taps, _Chunk(0, 13, [5, 2, 7, 3]))
    after_layer, record = taps.begin_step([_Chunk(13, 16, [5, 2, 7, 3])])
    seq = SimpleNamespace(request_id="r", context_len=16)
    selected = torch.tensor([[13, 2], [14, 20], [3, 15]])  # rows at positions 13, 14, 15
    for layer in (0, 1):
        record(layer, seq, selected)
        after_layer(layer)
    tails = [d for d in got if d.tail]
    assert [(d.layer, d.first, d.tail) for d in tails] == [(0, 3, 4), (1, 3, 4)] and tails[1].selected is None
    union, last = tails[0].selected
    assert union.tolist() == [2, 3, 13, 14, 15] and last.tolist() == [3, 15]


def test_the_event_loop_polls_a_deliverys_device_copy_instead_of_blocking_in_it():
    """On CUDA a delivery's rows land once the GPU has run its step up to their layer (`LayerRows.event`):
    the prefill worker's send, on the server's event loop, polls `done()` (event.query) and reads the
    rows only once they landed; it never waits in `ready()`'s event.synchronize(), which would hold
    every other request's streaming meanwhile. A fake event stands for CUDA's."""
    import asyncio
    from sparsekv.cache.layer_tap import LayerRows
    from sparsekv.disagg.layers import LayerFeed
    from sparsekv.disagg.prefill import PrefillWorker

    class Event:
        def __init__(self, busy: int):
            self.busy, self.queries = busy, 0

        def query(self) -> bool:
            self.queries += 1
            return self.queries > self.busy

        def synchronize(self) -> None:
            assert self.queries > self.busy, "the event loop blocked in a copy still in flight"

    sent = []

    async def send(out, meta, tensors, request):
        sent.append((meta["layer_rows"], tensors))
        return sum(t.numel() for t in tensors)

    async def scenario():
        feed = LayerFeed(asyncio.get_running_loop(), 2)
        events = [Event(3), Event(5)]
        rows = [torch.full((2, 4, 3), float(layer)) for layer in range(2)]
        for layer, (event, r) in enumerate(zip(events, rows)):
            feed.deliver_for(0)(LayerRows(layer, 1, 2, [layer], [r], event))
        worker = object.__new__(PrefillWorker)
        worker._send = send
        ticks = 0

        async def other_work():  # the event loop's other tasks go on while the copies land
            nonlocal ticks
            while not sent:
                ticks += 1
                await asyncio.sleep(0)
        _, nbytes = await asyncio.gather(other_work(), worker._send_layers(feed, None, {}, {"held": [2]}, None, [2]))
        return events, nbytes, ticks

    events, nbytes, ticks = asyncio.run(scenario())
    assert all(e.queries > e.busy for e in events) and ticks > 0
    (layer_rows, tensors), = sent
    assert layer_rows["first"] == 2 and layer_rows["count"] == 1 and layer_rows["layers"] == [0, 1]
    assert [t.shape for t in tensors] == [(1, 4, 3), (1, 4, 3)] and nbytes == 24
