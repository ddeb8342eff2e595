"""A room's wait for a key of its peer (`Worker.take`, `Room.wait_for`): woken by the key itself, not
by polling; the room's other store calls go on meanwhile; a client that leaves, a deadline that
passes or a store that goes away end it, and the wait leaves no key and no thread behind."""
from __future__ import annotations

import asyncio
import datetime
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sparsekv.disagg import transfer as transfer_module
from sparsekv.disagg import worker as worker_module
from sparsekv.disagg.transfer import DECODE_RANK, PREFILL_RANK, RENDEZVOUS, Room, connect, host_bootstrap
from sparsekv.disagg.wire import TransferError
from sparsekv.disagg.worker import DisaggSettings, Worker

HANG_S = 20.0  # a bound on each wait below that only a hang reaches


class Client:
    """The HTTP request a worker serves, as `take` sees it."""

    def __init__(self):
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


def _worker(timeout_s: float) -> Worker:
    """A worker's waits and nothing else (no engine: `take` needs its settings and its transfer pool)."""
    w = Worker.__new__(Worker)
    w.settings = DisaggSettings("decode", "127.0.0.1", None, b"s" * 32, timeout_s=timeout_s)
    w.pool = ThreadPoolExecutor(2)
    return w


@pytest.fixture
def room():
    store = host_bootstrap("127.0.0.1", 0, 30)
    yield store, Room(connect("127.0.0.1", store.port, 30), "r1"), Room(connect("127.0.0.1", store.port, 30), "r1")
    del store


def _waits() -> int:
    return sum(t.name == "sparsekv-disagg-wait" for t in threading.enumerate())


def _ended(condition, seconds: float = HANG_S) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_wait_is_woken_by_the_key_and_never_polls(room, monkeypatch):
    """With the room's checks every hour, only the key's arrival can end the wait; `ready` (a poll)
    is never called; and the room's own side writes its keys while it waits."""
    _, mine, peer = room
    monkeypatch.setattr(worker_module, "WAIT_CHECK_S", 3600.0)
    monkeypatch.setattr(Room, "ready", lambda *a: pytest.fail("take polled the store"))
    w = _worker(timeout_s=3600)

    async def scenario():
        take = asyncio.ensure_future(w.take(mine, "meta/0", "the batch", Client()))
        await asyncio.sleep(0.2)
        assert not take.done()
        await asyncio.wait_for(w.blocking(mine.put, "claim", b"mine"), HANG_S)  # not queued behind the wait
        await w.blocking(peer.put, "meta/0", b"batch 0")
        return await asyncio.wait_for(take, HANG_S)
    assert asyncio.run(scenario()) == b"batch 0"
    assert peer.get("claim") == b"mine"
    assert _ended(lambda: _waits() == 0)


@pytest.mark.parametrize("why", ["client", "deadline"])
def test_a_wait_that_ends_unanswered_leaves_no_key_and_no_thread(room, monkeypatch, why):
    store, mine, peer = room
    monkeypatch.setattr(worker_module, "WAIT_CHECK_S", 0.05)
    w = _worker(timeout_s=0.3 if why == "deadline" else 3600)
    client = Client()

    async def scenario():
        take = asyncio.ensure_future(w.take(mine, "done", "the verdict", client))
        await asyncio.sleep(0.2)
        client.gone = why == "client"
        with pytest.raises(TransferError, match="went away" if why == "client" else "no the verdict within"):
            await asyncio.wait_for(take, HANG_S)
    asyncio.run(scenario())
    assert _ended(lambda: _waits() == 0)
    assert _ended(lambda: store.num_keys() == 0)  # the wake is the wait's own to delete
    peer.put("done", b"late")  # the peer answering after it is nobody's business now
    assert mine.store.get(mine.key("done")) == b"late"


class ForgottenInBetween:
    """The room's waiting connection, with the room forgotten (its key deleted, as `Room.forget` does)
    between the wait's end and its read of the key."""

    def __init__(self, waiting, other):
        self.waiting, self.other = waiting, other

    def wait(self, keys, timeout):
        self.waiting.wait(keys, timeout)
        self.other.delete_key(keys[0])

    def __getattr__(self, name):
        return getattr(self.waiting, name)


def test_a_wait_whose_key_is_deleted_before_its_read_ends_without_waiting_again(room):
    store, mine, peer = room
    mine.waiting = ForgottenInBetween(connect("127.0.0.1", store.port, 30), peer.store)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(mine.wait_for, "meta/3", HANG_S)
        time.sleep(0.2)
        mine.wake("meta/3")
        assert future.result(timeout=HANG_S) is None  # a get() would wait for the key again
    assert store.num_keys() == 0


def test_a_wake_after_the_wait_ended_writes_no_marker(room):
    """A wait can end before the wake that gives it up (at its own deadline, or woken by a compare_set
    on its missing key, which the store treats as a write); the wake then writes nothing (its marker
    would stay in the store for good)."""
    store, mine, peer = room
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(mine.wait_for, "claim", HANG_S)
        absent = transfer_module.ABSENT
        # NOTE: repeated, as a compare_set before the wait reaches the store wakes nothing
        assert _ended(lambda: peer.store.compare_set(peer.key("claim"), absent, absent) and future.done())
        assert future.result() is None
        mine.wake("claim")
    assert store.num_keys() == 0


def test_asking_whether_the_peer_wrote_a_key_does_not_end_a_wait_for_it(room):
    store, mine, peer = room
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(mine.wait_for, "claim", HANG_S)
        assert _ended(lambda: mine.waiting is not None)
        time.sleep(0.5)  # the wait reaches the store
        assert not peer.written_by_peer("claim")
        time.sleep(0.2)
        assert not future.done()
        peer.put("claim", b"the claim")
        assert future.result(timeout=HANG_S) == b"the claim"
        assert peer.written_by_peer("claim")


def test_a_wake_before_the_wait_began_ends_it_at_once(room):
    store, mine, _ = room
    mine.wake("claim")
    started = time.monotonic()
    assert mine.wait_for("claim", HANG_S) is None
    assert time.monotonic() - started < HANG_S / 2  # a wait that began would last until HANG_S
    assert store.num_keys() == 0


def test_a_store_that_goes_away_ends_the_wait():
    """The prefill worker's store closing (its process gone) ends the decode side's wait at once."""
    w = _worker(timeout_s=3600)
    stores = [host_bootstrap("127.0.0.1", 0, 30)]
    mine = Room(connect("127.0.0.1", stores[0].port, 30), "r1")

    async def scenario():
        take = asyncio.ensure_future(w.take(mine, "meta/0", "the batch", Client()))
        await asyncio.sleep(0.2)
        stores.clear()  # its last reference: the server closes
        with pytest.raises(TransferError, match="waiting for meta/0 failed"):
            await asyncio.wait_for(take, HANG_S)
    asyncio.run(scenario())
    assert _ended(lambda: _waits() == 0)



PEER = """
import sys, time
from sparsekv.disagg.transfer import DECODE_RANK, Room, connect
Room(connect("127.0.0.1", int(sys.argv[1]), 30), sys.argv[2]).pair_group(DECODE_RANK, "127.0.0.1", 30, "gloo")
time.sleep(3600)
"""


def _connect_to_a_stopped_peer(store, name: str, timeout_s: float):
    """This side's pair_group for room `name` (prefill rank) against a decode rank that published its
    address and was then stopped: the group, or the TransferError it raised and the seconds it took."""
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), name])
    mine = Room(connect("127.0.0.1", store.port, 30), name)
    try:
        store.wait([mine.key("pg/0/1")], datetime.timedelta(seconds=HANG_S))
        peer.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            return mine.pair_group(PREFILL_RANK, "127.0.0.1", timeout_s, "gloo"), None
        except TransferError as e:
            return e, time.monotonic() - started
    finally:
        peer.kill()
        peer.wait()


def test_a_pair_group_whose_peer_stops_answering_fails_within_the_timeout():
    """A decode worker that published its address for the room's group and then stopped answering (hung,
    or its host gone) leaves gloo's full-mesh connect retrying for about five times its timeout when
    this side is the one that waits for the peer's connection (gloo picks it by the two addresses, so
    a room may take a few tries); the room fails at the timeout instead, and the connect's thread ends
    when gloo gives up."""
    store, timeout_s = host_bootstrap("127.0.0.1", 0, 30), 2.0
    for attempt in range(8):
        error, seconds = _connect_to_a_stopped_peer(store, f"r{attempt}", timeout_s)
        if seconds is not None:
            break
    else:
        pytest.fail("gloo never made this side wait for the stopped peer")
    assert "could not connect for the transfer" in str(error)
    assert seconds < 2.5 * timeout_s  # gloo alone: about 5 x timeout_s
    assert _ended(lambda: not any(t.name == "sparsekv-pair-connect" for t in threading.enumerate()))


def test_a_pair_connect_that_does_not_return_fails_the_room_at_the_timeout(room, monkeypatch):
    """The bound itself, whatever gloo does: a connect that never returns fails the room at the timeout."""
    _, mine, peer = room
    stuck = threading.Event()
    monkeypatch.setattr(transfer_module, "_gloo_group", lambda *a: stuck.wait(HANG_S))
    peer.put(RENDEZVOUS[DECODE_RANK], b"the decode side's address")  # what the prefill side waits for first
    started = time.monotonic()
    with pytest.raises(TransferError, match="could not connect for the transfer.*no connection within 0.5 s"):
        mine.pair_group(PREFILL_RANK, "127.0.0.1", 0.5, "gloo")
    assert time.monotonic() - started < HANG_S / 2
    stuck.set()
    assert _ended(lambda: not any(t.name == "sparsekv-pair-connect" for t in threading.enumerate()))


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_room_both_workers_fail_at_once_leaves_no_key(room, first):
    """The decode worker fails the room (its verdict) while the prefill worker fails it too (its error,
    in the next batch's metadata): neither reads the other's key, and each used to leave the room's keys
    to the other. Whichever writes second sees the first's key and deletes them, in either order."""
    from sparsekv.disagg.decode import DecodeWorker
    from sparsekv.disagg.outbox import Batches
    from sparsekv.disagg.wire import sign
    store, prefill_link, decode_link = room
    settings = DisaggSettings("decode", "127.0.0.1", None, b"s" * 32, timeout_s=5.0)
    decode = DecodeWorker.__new__(DecodeWorker)
    decode.settings = settings
    out = Batches(prefill_link, settings, torch.device("cpu"), None)
    decode_link.put("claim", b"the claim")
    meta = {"room": "r1", "nonce": "n", "names": []}
    prefill_link.put(transfer_module.meta_key(0), sign(settings.secret, meta))  # one batch, read by the decode side
    out.index, out.claimed = 1, True
    if first == "decode":
        decode._verdict(decode_link, meta, "a digest did not match", 1)
        assert store.num_keys() > 0 and decode_link.ready("done")  # the prefill worker's to read: kept
        out.error({"error": "the engine went away"})
    else:
        out.error({"error": "the engine went away"})
        assert decode_link.ready(transfer_module.meta_key(1))  # the decode worker's to read: kept
        decode._verdict(decode_link, meta, "its client went away", 1)
    assert _ended(lambda: store.num_keys() == 0, 5), store.num_keys()


def test_a_verdict_leaves_the_room_to_the_prefill_worker_when_no_error_of_its_came():
    """Without an error from the prefill worker the verdict stays for it to read (a batch's metadata it
    wrote, not an error, is not one)."""
    from sparsekv.disagg.decode import DecodeWorker
    from sparsekv.disagg.wire import sign
    store = host_bootstrap("127.0.0.1", 0, 30)
    link = Room(connect("127.0.0.1", store.port, 30), "r2")
    decode = DecodeWorker.__new__(DecodeWorker)
    decode.settings = DisaggSettings("decode", "127.0.0.1", None, b"s" * 32, timeout_s=5.0)
    link.put("claim", b"the claim")
    for batch in range(2):
        link.put(transfer_module.meta_key(batch), sign(decode.settings.secret, {"room": "r2", "names": []}))
    decode._verdict(link, {"nonce": "n"}, "a digest did not match", 1)
    assert link.ready("done") and link.ready("claim") and link.ready(transfer_module.meta_key(1))


class _PairGroup:
    """A made pair group as `TorchPath.close` sees it."""

    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


@pytest.mark.parametrize("backend, aborts", [("nccl", 1), ("gloo", 0)])
def test_closing_a_room_aborts_its_nccl_pair_and_drops_a_gloo_one(room, monkeypatch, backend, aborts):
    """An NCCL pair's communicator is freed when the room closes (not left to the destructor); a gloo
    pair is dropped; a room that never connected has nothing to free."""
    _, mine, peer = room
    made = _PairGroup()
    monkeypatch.setattr(transfer_module, "_nccl_group", lambda *a: made)
    monkeypatch.setattr(transfer_module, "_gloo_group", lambda *a: made)
    settings = DisaggSettings("decode", "127.0.0.1", None, b"s" * 32, timeout_s=5.0)
    never = transfer_module.TorchPath(peer, settings, torch.device("cpu"), backend, DECODE_RANK)
    never.close()
    path = transfer_module.TorchPath(mine, settings, torch.device("cpu"), backend, DECODE_RANK)
    path.connect()
    assert not path.needs_connect and made.aborted == 0
    path.close()
    path.close()
    assert path.needs_connect and made.aborted == aborts


def test_the_prefill_sides_join_waits_for_the_decode_sides_address_and_ends_with_the_room(room, monkeypatch):
    """The prefill side starts its gloo rendezvous only once the decode side's address is in the store (a
    decode worker that refused the room never writes it): until then no connect runs, and the wait ends
    as soon as the room gives up on it (`abandon_join`), or at the timeout, naming the wait."""
    _, mine, _ = room
    monkeypatch.setattr(transfer_module, "_gloo_group", lambda *a: pytest.fail("connected before the peer's address"))
    ended = []

    def join():
        try:
            mine.pair_group(PREFILL_RANK, "127.0.0.1", HANG_S, "gloo")
        except TransferError as e:
            ended.append(str(e))
    joining = threading.Thread(target=join)
    joining.start()
    assert _ended(lambda: mine.waiting_on == RENDEZVOUS[DECODE_RANK])
    mine.abandon_join()
    joining.join(HANG_S)
    assert not joining.is_alive() and ended == ["room r1: this worker stopped waiting for the peer's transfer connection"]
    other = Room(mine.store, "r2")
    with pytest.raises(TransferError, match=r"waiting for pg/0/1 failed"):
        other.pair_group(PREFILL_RANK, "127.0.0.1", 0.5, "gloo")
    assert not any(t.name == "sparsekv-pair-connect" for t in threading.enumerate())


def _claim_checker():
    """A prefill worker's claim check alone (no engine): its secret and page layout."""
    from sparsekv.disagg.prefill import PrefillWorker
    w = PrefillWorker.__new__(PrefillWorker)
    w.settings = DisaggSettings("prefill", "127.0.0.1", 0, b"s" * 32)
    w.layout = [["latent", 8]]
    return w


@pytest.mark.parametrize("field, value, match", [
    ("room", "another", "names room 'another'"), ("tenant", "bob", "another tenant or cache_salt"),
    ("cache_salt", "x", "another tenant or cache_salt"), ("prompts", ["0" * 16], "tokenized the prompt differently"),
    ("layout", [["latent", 4]], "pages differ"), ("held", [-1], "held page counts are malformed"),
    ("held", [0, 0], "held page counts are malformed")])
def test_a_signed_claim_that_does_not_match_the_request_is_refused(field, value, match):
    """A decode worker's claim, signed with the shared secret, that differs from the request in one
    field: another room (a replay), another tenant or salt (isolation), another prompt, layout or a
    malformed count of held pages."""
    from types import SimpleNamespace
    from sparsekv.disagg.wire import prompt_digest, sign
    w, prompts = _claim_checker(), [[5, 6, 7]]
    job = SimpleNamespace(tenant="alice", cache_salt=None)
    good = {"room": "r1", "tenant": "alice", "cache_salt": None, "prompts": [prompt_digest(prompts[0])],
            "layout": w.layout, "held": [0]}
    assert w._check_claim(sign(w.settings.secret, good), "r1", job, prompts)["held"] == [0]
    with pytest.raises(TransferError, match=match):
        w._check_claim(sign(w.settings.secret, {**good, field: value}), "r1", job, prompts)


SECRET = b"s" * 32
WEIGHTS = {"weights_version": 0, "checkpoint": "c" * 64}


class _Link:
    """A room's store as `Batches.publish` writes it: the signed metadata under its keys."""

    def __init__(self):
        self.name, self.keys = "r1", {}

    def put(self, key: str, raw: bytes) -> None:
        self.keys[key] = raw


def _published(claim: dict) -> list[dict]:
    """A room's batches as a prefill worker publishes them (prefill.py's `_stream` and `_send_layers`,
    outbox.Batches) and a decode worker reads them back (verified): a prompt's layer rows (no pages named
    yet), then its 2 pages past the one the decode worker holds, then the last batch, naming none."""
    import torch
    from sparsekv.disagg.outbox import Batches
    from sparsekv.disagg.transfer import meta_key
    from sparsekv.disagg.wire import verify
    out = Batches(_Link(), DisaggSettings("prefill", "127.0.0.1", 0, SECRET), torch.device("cpu"), None)
    base = {"room": claim["room"], "nonce": claim["nonce"], "backend": "gloo", "weights": WEIGHTS}
    rows = [torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6), torch.ones(2, 3)]
    out.publish({**base, "names": [], "pages": [0], "last": False, "kinds": [0], "num_kinds": 2,
                 "layer_rows": {"prompt": 0, "first": 1, "count": 2, "layers": [0], "tail": 0, "selected": []}},
                rows[:1])
    out.publish({**base, "names": [(b"a" * 16).hex(), (b"b" * 16).hex()], "pages": [2], "kinds": None,
                 "num_kinds": None, "last": False}, rows)
    out.publish({**base, "names": [], "pages": [0], "kinds": None, "num_kinds": None, "last": True,
                 "skipped": claim["held"], "streamed": 2, "queue_s": 0.0, "prefill_s": 0.1}, [])
    return [verify(SECRET, out.link.keys[meta_key(i)], "prefill worker's metadata") for i in range(out.index)]


def _set(key, value):
    return lambda meta: meta.update({key: value})


def _drop(key):
    return lambda meta: meta.pop(key)


@pytest.mark.parametrize("batch, corrupt, weights, match", [
    (1, _set("nonce", "0" * 32), None, "answers another claim"),  # a replay of another claim's batch
    (1, _drop("nonce"), None, "answers another claim"),
    (1, _set("room", "r2"), None, "answers another claim"),
    (1, _set("names", "ab"), None, "is malformed"),  # not a list, though of the announced length
    (1, _set("pages", {2: 0}), None, "is malformed"),  # not a list, though one entry summing to the names
    (1, _set("pages", [1, 1]), None, "is malformed"),  # two prompts' counts for a claim of one
    (1, _set("pages", [3]), None, "is malformed"),  # 3 pages announced, 2 named
    (0, _set("pages", [1]), None, "is malformed"),  # a page announced, none named
    (1, _set("tensors", {}), None, "is malformed"),  # not a list
    (1, _drop("tensors"), None, "is malformed"),
    (0, _drop("layer_rows"), None, "announced tensors for no pages"),  # rows of no named page, nor a layer's
    (2, _set("tensors", [{"shape": [1], "dtype": "uint8", "nbytes": 1, "digest": "0" * 64}]), None,
     "announced tensors for no pages"),
    (1, _set("backend", "tcp"), None, "unknown transfer backend 'tcp'"),
    (2, _drop("backend"), None, "unknown transfer backend None"),
    (1, _set("weights", {**WEIGHTS, "weights_version": 1}), WEIGHTS, "weights changed during the transfer"),
    (2, _set("weights", {**WEIGHTS, "checkpoint": "d" * 64}), WEIGHTS, "weights changed during the transfer"),
    (1, _drop("weights"), WEIGHTS, "weights changed during the transfer"),
], ids=["other-nonce", "no-nonce", "other-room", "names-not-a-list", "pages-not-a-list", "pages-per-other-prompts",
        "pages-more-than-named", "pages-none-named", "tensors-not-a-list", "no-tensors", "tensors-for-no-pages",
        "last-with-tensors", "unknown-backend", "no-backend", "other-weights-version", "other-checkpoint",
        "no-weights"])
def test_a_batch_whose_metadata_does_not_fit_the_claim_is_refused(batch, corrupt, weights, match):
    """A decode worker's check of each batch's signed metadata (`DecodeWorker._check_meta`): the batches
    a prefill worker publishes for the claim pass, first (no weights seen yet) and later (the earlier
    batches' weights); each with one field wrong is refused, naming why (removing any of these checks,
    or one clause of the malformed check, survived every test)."""
    from sparsekv.disagg.decode import DecodeWorker
    claim = {"room": "r1", "nonce": "a1" * 16, "held": [1]}
    batches = _published(claim)
    assert [bool(m["tensors"]) for m in batches] == [True, True, False] and batches[1]["pages"] == [2]
    for meta in batches:
        DecodeWorker._check_meta(meta, claim, None)  # the first batch: any weights
        DecodeWorker._check_meta(meta, claim, WEIGHTS)  # a later one: the weights the batches before came under
    meta = batches[batch]
    corrupt(meta)
    with pytest.raises(TransferError, match=match):
        DecodeWorker._check_meta(meta, claim, weights)


class _EngineLoop:
    """The engine loop as the decode worker's imports call it: `fn` run there, in order."""

    async def call(self, fn, *args):
        return fn(*args)


def test_a_room_already_in_use_on_a_worker_is_refused():
    """A second request naming a room this worker has in flight is refused (400), the room counted once;
    once the first is done the room may be used again."""
    from types import SimpleNamespace
    from sparsekv.server.errors import APIError
    counted = []
    w = _worker(timeout_s=30)
    w.rooms, w.metrics = {}, SimpleNamespace(in_flight=SimpleNamespace(inc=lambda: counted.append(1),
                                                                         dec=lambda: counted.append(-1)))
    field = SimpleNamespace(room="r1")
    assert w.open_room(field) == "r1"
    with pytest.raises(APIError) as refused:
        w.open_room(field)
    assert refused.value.status == 400 and "already in use" in refused.value.message
    assert w.rooms == {"r1": "open"} and counted == [1]
    w.close_room("r1")
    assert w.open_room(field) == "r1" and counted == [1, -1, 1]


def test_a_roles_settings_take_their_bounds_and_refuse_what_lies_past_them():
    """--disaggregation-timeout in (0, max]: 0 is refused; a prefill worker's bootstrap port in
    [0, 65535]: both ends taken, 65536 refused."""
    from sparsekv.units import MAX_TIMEOUT_S
    assert DisaggSettings("decode", "127.0.0.1", None, SECRET, timeout_s=MAX_TIMEOUT_S).timeout_s == MAX_TIMEOUT_S
    with pytest.raises(ValueError, match="--disaggregation-timeout must be in"):
        DisaggSettings("decode", "127.0.0.1", None, SECRET, timeout_s=0)
    for port in (0, 65535):
        assert DisaggSettings("prefill", "127.0.0.1", port, SECRET).bootstrap_port == port
    with pytest.raises(ValueError, match="--disaggregation-bootstrap-port must be in"):
        DisaggSettings("prefill", "127.0.0.1", 65536, SECRET)


def test_pages_are_not_kept_under_weights_updated_after_their_batch_was_checked():
    """`DecodeWorker._import` reads the weights version again on the engine loop, with the import: an
    update that came after the batch's stamp was checked (it forgot the cached pages) fails the room,
    and no page is kept under the new weights."""
    from types import SimpleNamespace
    from sparsekv.disagg.decode import DecodeWorker, Keep
    imported = []
    engine = SimpleNamespace(weights_version=1, kv=SimpleNamespace(import_prefix=lambda *a, **k: imported.append(a)))
    w = DecodeWorker.__new__(DecodeWorker)
    w.state = SimpleNamespace(engine=engine, loop=_EngineLoop())
    keep = Keep(SimpleNamespace(tenant="default", cache_salt=None, subs=[None]), [[5, 6, 7, 8, 9]], [[b"a" * 16]], [])
    pages = [(b"a" * 16, [])]
    asyncio.run(w._import({"weights_version": 1}, pages, keep, None))  # the version the batch was checked under
    assert len(imported) == 1
    with pytest.raises(TransferError, match=r"weights changed during the transfer \(weights_version 0 -> 1\)"):
        asyncio.run(w._import({"weights_version": 0}, pages, keep, None))
    assert len(imported) == 1


def test_a_wait_ended_by_a_read_of_its_missing_key_is_a_transfer_error(room, monkeypatch):
    """`take` never hands its caller a value nobody wrote: a wait that ends without the key (here a
    compare_set on the missing key, which the store treats as a write) fails the room."""
    _, mine, peer = room
    monkeypatch.setattr(worker_module, "WAIT_CHECK_S", 0.05)
    w, absent = _worker(timeout_s=3600), transfer_module.ABSENT

    async def scenario():
        take = asyncio.ensure_future(w.take(mine, "claim", "the claim", Client()))
        for _ in range(int(HANG_S / 0.05)):  # NOTE: repeated, as one before the wait reaches the store wakes nothing
            if take.done():
                break
            await w.blocking(peer.store.compare_set, peer.key("claim"), absent, absent)
            await asyncio.sleep(0.05)
        with pytest.raises(TransferError, match="the wait for the claim was ended"):
            await take
    asyncio.run(scenario())
    assert _ended(lambda: _waits() == 0)


class _Room(_Link):
    """A room's store as `Batches` reads and writes it: keys, the verdict's among them."""

    def ready(self, key: str) -> bool:
        return key in self.keys

    def written_by_peer(self, key: str) -> bool:
        return key in self.keys

    def forget(self, batches: int = 1) -> None:
        self.keys.clear()


def test_a_prefill_side_that_read_the_verdict_waits_for_nothing_and_writes_no_error():
    """Once the decode worker wrote its verdict (`Batches.answered`), the room's peer waits for no more
    batches (`peer_waiting`: the prefill worker then cleans the room up itself), and a failure after it
    writes no error batch that nobody would read or delete."""
    import torch
    from sparsekv.disagg.outbox import Batches
    out = Batches(_Room(), DisaggSettings("prefill", "127.0.0.1", 0, SECRET), torch.device("cpu"), None)
    out.claimed = True
    out.link.keys = {"claim": b"claim"}
    assert out.peer_waiting and not out.answered()
    out.link.keys["done"] = b"verdict"
    assert out.answered() and not out.peer_waiting
    out.error_unless_answered("the decode worker refused the KV")
    assert sorted(out.link.keys) == ["claim", "done"] and not out.told_error


def test_the_peer_waits_for_the_next_batch_once_a_batchs_tensors_are_sent():
    """While a batch's tensors move, a failure fails the decode worker's receive too (`peer_waiting` is
    false); once they are sent (here or by the data-parallel rank that sends the room: `pushed`), the
    decode worker waits for the next batch's metadata, so a failure then must be written for it."""
    from types import SimpleNamespace

    import torch
    from sparsekv.disagg.outbox import Batches
    out = Batches(_Room(), DisaggSettings("prefill", "127.0.0.1", 0, SECRET), torch.device("cpu"), None)
    out.claimed, out.path = True, SimpleNamespace(push=lambda tensors, first: None)
    out.published({"last": False}, [torch.zeros(4, dtype=torch.uint8)])
    assert out.sending and not out.peer_waiting and out.index == 1
    assert out.push([torch.zeros(4, dtype=torch.uint8)]) == 4 and not out.sending and out.peer_waiting
    out.published({"last": False}, [torch.zeros(8, dtype=torch.uint8)])
    assert out.pushed(1, 8) == 8 and out.peer_waiting and (out.index, out.tags) == (2, 2)
    out.published({"last": True}, [])
    assert out.ended and not out.peer_waiting


class _GoneRoom(_Room):
    """A room whose store is gone: every call of it fails as `Room`'s do then."""

    def ready(self, key: str) -> bool:
        raise TransferError("room r1: the bootstrap store is gone (Connection reset by peer)")

    def put(self, key: str, raw: bytes) -> None:
        raise TransferError("room r1: the bootstrap store failed: Connection reset by peer")


def test_a_prefill_side_whose_store_is_gone_reads_no_refusal_and_writes_no_error():
    """With the room's store gone, `refused` says the decode worker wrote no verdict: a failed send then
    raises its own failure (not a read of a verdict that is not there), and a join waiting for the peer
    is not ended as if the peer had left. `error_unless_answered` writes nothing and raises nothing."""
    import torch
    from sparsekv.disagg.outbox import Batches
    out = Batches(_GoneRoom(), DisaggSettings("prefill", "127.0.0.1", 0, SECRET), torch.device("cpu"), None)
    out.claimed = True
    assert not out.refused()
    with pytest.raises(TransferError, match="the bootstrap store is gone"):
        out.answered()
    out.error_unless_answered("the engine went away")
    assert out.link.keys == {} and not out.told_error


def test_a_bootstrap_that_answers_something_else_is_refused_naming_only_the_address():
    """`connect` to an address a request named that answers as no store (here an HTTP server): the
    TransferError names the address and nothing of what answered there (the worker would otherwise be
    a probe of its network); the cause goes to the log only."""
    from disagg_util import http_answering_listener
    listener = http_answering_listener()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(TransferError) as refused:
            connect("127.0.0.1", port, 0.5)
        assert str(refused.value) == f"cannot reach the prefill worker's bootstrap at 127.0.0.1:{port}"
    finally:
        listener.close()



class _Counted:
    """torch's TCPStore, counting the client connections made."""
    made = 0

    def __new__(cls, *args, **kwargs):
        if not kwargs.get("is_master", args[2] if len(args) > 2 else False):
            _Counted.made += 1
        return _REAL_STORE(*args, **kwargs)


_REAL_STORE = torch.distributed.TCPStore


def _gone() -> None:
    import gc
    gc.collect()  # a room in a reference cycle gives its connections back at the next collection


def _pair_and_wait(store, name: str) -> None:
    """Two rooms as the two workers use them: a pair group (the prefill side first waits for the decode
    side's address on a connection of its own) and a wait for a key the other side writes."""
    mine, theirs = Room(connect("127.0.0.1", store.port, 30), name), Room(connect("127.0.0.1", store.port, 30), name)
    with ThreadPoolExecutor(2) as pool:
        groups = [pool.submit(mine.pair_group, PREFILL_RANK, "127.0.0.1", 30, "gloo"),
                  pool.submit(theirs.pair_group, DECODE_RANK, "127.0.0.1", 30, "gloo")]
        assert [g.result(timeout=HANG_S).size() for g in groups] == [2, 2]
    theirs.put("claim", b"c")
    assert mine.wait_for("claim", 30) == b"c"


def test_a_rooms_store_connections_serve_the_next_rooms(monkeypatch):
    """The connections of two rooms (each its own and its pair group's rendezvous, the prefill side also
    its waits') go back when the rooms are gone, and the next two take them: no connection is made
    again. A new one cost a connect and, inside torch, reverse DNS lookups of both ends, which a
    rate-limited resolver stretched to 5 s a room."""
    monkeypatch.setattr(torch.distributed, "TCPStore", _Counted)
    monkeypatch.setattr(_Counted, "made", 0)
    clients, store = transfer_module.STORE_CLIENTS, host_bootstrap("127.0.0.1", 0, 30)
    _pair_and_wait(store, "r1")
    _gone()
    assert _Counted.made == clients.idle("127.0.0.1", store.port) == 5
    _pair_and_wait(store, "r2")
    _gone()
    assert _Counted.made == clients.idle("127.0.0.1", store.port) == 5


def test_a_connection_a_wait_was_cut_off_on_serves_no_other_room():
    """A wait that ends at its deadline leaves the store's answer pending on its connection, which the
    next call on it would read: the room keeps that one out of the pool, and gives its own back."""
    clients, store = transfer_module.STORE_CLIENTS, host_bootstrap("127.0.0.1", 0, 30)
    room = Room(connect("127.0.0.1", store.port, 30), "r1")
    with pytest.raises(TransferError, match="waiting for never failed"):
        room.wait_for("never", 0.2)
    del room
    _gone()
    assert clients.idle("127.0.0.1", store.port) == 1


def test_a_kept_connection_whose_store_is_gone_is_not_handed_out():
    """A prefill worker started again at the same address has a new store: a kept connection to the
    old one fails its check and is dropped, and the room gets a new connection that works."""
    from test_server_util import free_port
    clients, port = transfer_module.STORE_CLIENTS, free_port()
    old = host_bootstrap("127.0.0.1", port, 30)
    Room(connect("127.0.0.1", port, 30), "r1").put("claim", b"c")
    _gone()
    assert clients.idle("127.0.0.1", port) == 1
    del old
    _gone()
    new = host_bootstrap("127.0.0.1", port, 30)
    room = Room(connect("127.0.0.1", port, 30), "r2")
    room.put("claim", b"d")
    assert room.get("claim") == b"d" and new.get("sparsekv/room/r2/claim") == b"d"
    assert clients.idle("127.0.0.1", port) == 0


def test_a_connection_two_rooms_use_goes_back_once_by_the_room_that_owns_it():
    """A room made with another room's connection does not own it: the connection goes back when its
    owner is gone, once, and the other room's calls still work meanwhile."""
    clients, store = transfer_module.STORE_CLIENTS, host_bootstrap("127.0.0.1", 0, 30)
    mine = Room(connect("127.0.0.1", store.port, 30), "r1")
    other = Room(mine.store, "r2")
    del mine
    _gone()
    assert clients.idle("127.0.0.1", store.port) == 1
    other.put("claim", b"c")
    assert other.get("claim") == b"c"
    del other
    _gone()
    assert clients.idle("127.0.0.1", store.port) == 1
