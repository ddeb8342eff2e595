"""The rows a data-parallel rank keeps for a prefill worker (parallel/dp_held.py): how rank 0 names them
(`Held`, `Stacked`: the slices the prefill worker takes give the shapes torch gives), and the rank's
store (`HeldRows`): rows leave once, go with their owner, and the integrity check finds rows of an
owner that ended. The calls between the ranks run in tests/test_disagg_parallel.py."""
from __future__ import annotations

import pickle
import threading

import pytest
import torch

from sparsekv.parallel.dp_held import Held, HeldRows, RankSide, Stacked, is_held, ranks_of, stack


def _rows(seed: int, shape=(3, 4, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_slices_of_held_rows_have_the_shapes_and_values_torch_gives():
    held = HeldRows(rank=1)
    t = _rows(0)
    name = held.keep(("tap", 0), [t])[0]
    keys = [(slice(1, None),), (slice(None), slice(None, 3)), (slice(5, None),), (slice(0, 2), slice(2, 2))]
    for key in keys:
        assert name[key].shape == tuple(t[key].shape), key
    cut = name[1:][:, :3]  # a delivery cut at a held page, then a short tail
    assert cut.shape == (2, 3, 5) and cut.numel() == 30 and cut.element_size() == 4
    assert torch.equal(held.take([cut])[0], t[1:][:, :3])
    with pytest.raises(TypeError, match="no step"):
        name[::2]
    with pytest.raises(TypeError, match="no step"):
        name[0]


def test_rows_leave_once_and_a_batch_takes_each_entry_it_names():
    held = HeldRows(rank=2)
    a, b = _rows(1), _rows(2)
    rows_a = held.keep(("room", "r"), [a, torch.arange(4)])
    rows_b = held.keep(("room", "r"), [b])
    assert len(held) == 2 and held.nbytes() == a.numel() * 4 + 4 * 8 + b.numel() * 4
    stacked = stack([rows_a[0], rows_b[0]])
    assert isinstance(stacked, Stacked) and stacked.shape == (2, 3, 4, 5) and stacked.rank == 2
    got = held.take([stacked, rows_a[1]])
    assert torch.equal(got[0], torch.stack([a, b])) and torch.equal(got[1], torch.arange(4))
    assert got[0].is_contiguous() and len(held) == 0  # both entries left with the batch
    with pytest.raises(KeyError, match=r"rows \[0\] are no longer held on data-parallel rank 2"):
        held.take([rows_a[0]])


def test_an_owner_takes_its_rows_with_it_and_dropped_rows_go():
    held = HeldRows(rank=1)
    tap = held.keep(("tap", 3), [_rows(3)])[0]
    held.keep(("tap", 3), [_rows(4)])
    room = held.keep(("room", "r"), [_rows(5)])[0]
    assert held.release(("tap", 3)) == 2 and held.owners() == {("room", "r")}
    held.drop([room.handle, tap.handle, 99])  # gone or never kept: nothing to do
    assert len(held) == 0 and held.nbytes() == 0


def test_the_integrity_check_finds_rows_of_a_tap_or_room_that_ended():
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    side.live_taps.add(("tap", 0))
    side.rooms["r"] = None
    side.held.keep(("tap", 0), [_rows(6)])
    side.held.keep(("room", "r"), [_rows(7)])
    side.held.check_integrity(side.live_owners())
    assert side.figures() == {"held_rows_bytes": 2 * 60 * 4, "held_rooms": 1}
    side.live_taps.discard(("tap", 0))  # untapped, its rows not released
    with pytest.raises(AssertionError, match="rows of ended taps or rooms"):
        side.held.check_integrity(side.live_owners())
    side.held.release(("tap", 0))
    del side.rooms["r"]
    with pytest.raises(AssertionError, match="room"):
        side.held.check_integrity(side.live_owners())


def test_rank_0_tells_held_rows_from_its_own_and_pickles_their_names():
    t = torch.zeros(2, 3)
    a = Held(1, 0, 0, (2, 3), torch.float32)
    b = Held(2, 5, 1, (2, 3), torch.bfloat16)[1:]
    assert is_held(a) and is_held(Stacked((a,))) and not is_held(t)
    assert ranks_of([t, a, b, Stacked((a, a))]) == {1, 2} and ranks_of([t]) == set()
    assert torch.equal(stack([t, t]), torch.stack([t, t]))
    assert pickle.loads(pickle.dumps(b)) == b and b.shape == (1, 3) and b.element_size() == 2


def test_empty_and_whole_slices_of_held_rows_are_torchs():
    held = HeldRows(rank=1)
    t = _rows(8)
    name = held.keep(("tap", 0), [t])[0]
    for key in [(slice(2, 1),), (slice(None), slice(3, 1)), (slice(None, None, 1),)]:  # stop before start: empty
        assert name[key].shape == tuple(t[key].shape), key
    cut = name[1:][:, 1:3]
    got = held.take([cut])[0]
    assert torch.equal(got, t[1:][:, 1:3]) and got.is_contiguous()  # a view's storage never leaves whole


def _fake_engine_of_ranks(sides: dict):
    """What `DataParallelEngine.fetch_held` reads: `call_rank` (run at once on the rank's side) and the timeout."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    def call_rank(rank, fn, *args):
        future = Future()
        try:
            future.set_result(fn(sides[rank], *args))
        except Exception as e:
            future.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))
        return future
    return SimpleNamespace(call_rank=call_rank, config=SimpleNamespace(dist_timeout_s=5.0))


def test_rows_held_on_several_ranks_are_fetched_each_from_its_own_in_order():
    from sparsekv.parallel.data_parallel import DataParallelEngine
    sides = {r: RankSide(HeldRows(rank=r), torch.device("cpu")) for r in (1, 2)}
    a, b, c, own = _rows(9), _rows(10), _rows(11), torch.ones(2)
    na = sides[1].held.keep(("tap", 0), [a])[0]
    nb = sides[2].held.keep(("tap", 0), [b])[0]  # the same handle, 0, on another rank
    nc = sides[1].held.keep(("tap", 0), [c])[0]
    got = DataParallelEngine.fetch_held(_fake_engine_of_ranks(sides), [nb, own, na[1:], stack([nc])])
    assert [tuple(g.shape) for g in got] == [(3, 4, 5), (2,), (2, 4, 5), (1, 3, 4, 5)]
    assert torch.equal(got[0], b) and got[1] is own and torch.equal(got[2], a[1:]) and torch.equal(got[3], c[None])
    assert all(len(side.held) == 0 for side in sides.values())


def test_a_room_is_sent_by_a_rank_only_when_every_prompt_of_it_runs_there():
    from types import SimpleNamespace
    from sparsekv.parallel.data_parallel import DataParallelEngine
    watched = {"done": 1, "zero": 0, "unadded": None}  # watched requests, the first two finished
    engine = SimpleNamespace(rank_of={"a": 1, "b": 1, "c": 0}, _watched=watched)
    rank = lambda ids: DataParallelEngine.rank_running(engine, ids)  # noqa: E731
    assert rank(["a", "b"]) == 1 and rank(["a", "done"]) == 1 and rank(["c"]) == 0 and rank(["zero"]) == 0
    assert rank(["a", "c"]) is None and rank(["a", "zero"]) is None and rank(["a", "unknown"]) is None
    assert rank(["unknown"]) is None and rank(["unadded"]) is None
    assert DataParallelEngine.rank_running(SimpleNamespace(rank_of={}, _watched={}), ["a"]) is None


def test_pages_a_rank_exports_for_a_room_are_kept_for_it_and_its_integrity_holds_until_it_ends():
    from types import SimpleNamespace
    from sparsekv.disagg.dp_send import close_room
    from sparsekv.parallel.lanes import export_held, lane_integrity
    pages = [("p0", [_rows(12), _rows(13)]), ("p1", [_rows(14), _rows(15)])]
    engine = SimpleNamespace(kv=SimpleNamespace(export_prefix=lambda token_ids, tenant, salt, skip=0: pages[skip:]),
                             check_integrity=lambda: None, executor=SimpleNamespace(model=SimpleNamespace(comm=SimpleNamespace(rank=1))))
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    named = export_held(engine, side, [1, 2, 3], "default", None, 1, "room-a")
    assert [n for n, _ in named] == ["p1"] and [h.shape for h in named[0][1]] == [(3, 4, 5)] * 2
    assert "room-a" in side.rooms and side.figures()["held_rooms"] == 1  # known before its first batch
    assert lane_integrity(engine, side) is None
    side.rooms.clear()  # a room ended without its rows released: the rank's integrity check says so
    message = lane_integrity(engine, side)
    assert message is not None and message.startswith("data-parallel rank 1:") and "room-a" in message
    side.rooms["room-a"] = None
    assert close_room(side, "room-a") == 1 and len(side.held) == 0 and side.rooms == {}
    assert lane_integrity(engine, side) is None


def test_a_pushed_batch_leaves_the_rank_and_a_closed_room_takes_its_rows_with_it():
    from types import SimpleNamespace
    from sparsekv.disagg import dp_send
    done = []
    path = SimpleNamespace(push=lambda tensors, first: done.append((len(tensors), first)), close=lambda: done.append("closed"))
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    side.rooms["r"] = dp_send.RankRoom(link=None, path=path, tensors=[torch.ones(3), torch.ones(2)])
    assert dp_send.push(side, "r", 4) == 5 and done == [(2, 4)] and side.rooms["r"].tensors == []  # not kept past its send
    side.held.keep(("room", "r"), [_rows(16)])
    side.held.keep(("room", "other"), [_rows(17)])
    assert dp_send.close_room(side, "r") == 1 and done[-1] == "closed" and "r" not in side.rooms
    assert side.held.owners() == {("room", "other")} and dp_send.close_room(side, "r") == 0


def test_a_rank_on_another_node_connects_from_its_own_address(monkeypatch):
    import socket
    from sparsekv.disagg import dp_send
    from sparsekv.disagg.worker import DisaggSettings
    connected, paths = [], []
    monkeypatch.setattr(dp_send, "connect", lambda host, port, timeout: connected.append((host, port)) or object())
    monkeypatch.setattr(dp_send, "sender", lambda backend, link, settings, device, agent: paths.append(settings) or link)
    settings = DisaggSettings("prefill", "10.1.2.3", 0, b"s" * 32)
    for node, own in ((0, "10.1.2.3"), (1, socket.gethostname())):
        side = RankSide(HeldRows(rank=1), torch.device("cpu"), node_rank=node)
        state = dp_send._room(side, settings, 4321, "r", "gloo")
        assert dp_send._room(side, settings, 4321, "r", "gloo") is state and side.rooms == {"r": state}  # made once
        assert connected[-1] == ("10.1.2.3", 4321) and paths[-1].bootstrap_host == own and len(paths) == node + 1


def test_rows_rank_0_drops_go_on_the_rank_that_keeps_them_by_handle():
    from types import SimpleNamespace
    from sparsekv.disagg.prefill import PrefillWorker
    from sparsekv.parallel.dp_held import drop_held
    calls = {}

    def call_rank(rank, fn, handles, in_order=False):
        assert in_order  # before any call sent after it starts there (the room's end)
        calls.setdefault(rank, []).append((fn, handles))
    worker = SimpleNamespace(state=SimpleNamespace(engine=SimpleNamespace(call_rank=call_rank)))
    f32 = torch.float32
    PrefillWorker._discard(worker, [Held(1, 9, 2, (2,), f32), Held(1, 4, 0, (3, 2), f32)[1:], Held(2, 7, 1, (2,), f32),
                                    torch.ones(1), Held(1, 4, 1, (2,), f32)])
    assert calls == {1: [(drop_held, [4, 9])], 2: [(drop_held, [7])]}
    PrefillWorker._discard(worker, [torch.ones(1)])  # nothing kept elsewhere: no call
    assert len(calls) == 2


class _Inbox:
    """What `recv_message` reads from each rank: a message (call id, flag, payload, its source rank), or
    an exception (that rank is gone)."""

    def __init__(self):
        import queue
        from collections import defaultdict
        self.queues = defaultdict(queue.Queue)

    def put(self, message, src: int | None = None) -> None:
        self.queues[message[3] if src is None else src].put(message)

    def get(self, src: int):
        message = self.queues[src].get(timeout=10)
        if isinstance(message, Exception):
            raise message
        return message


def _scripted(monkeypatch):
    """dp_held's messages without torch.distributed: what `recv_message` reads (`_Inbox`), and what
    `send_message` sent."""
    import queue
    from sparsekv.parallel import dp_held
    incoming, sent = _Inbox(), queue.Queue()
    monkeypatch.setattr(dp_held, "recv_message", lambda group, src: incoming.get(src)[:3])
    monkeypatch.setattr(dp_held, "send_message", lambda call_id, ok, payload, dst, group: sent.put((call_id, ok, payload, dst)))
    return incoming, sent


def test_an_answer_rank_0_cannot_read_fails_its_call_alone_and_a_rank_gone_fails_the_rest(monkeypatch):
    from sparsekv.parallel import dp_held
    incoming, sent = _scripted(monkeypatch)
    before = set(threading.enumerate())
    calls = dp_held.RankCalls(None, None, 3)
    receivers = {t.name: t for t in set(threading.enumerate()) - before}  # one per rank
    first, second, third = (calls.call(rank, dp_held.drop_held, []) for rank in (1, 2, 1))
    ids = [sent.get(timeout=5) for _ in range(3)]
    assert [dst for *_, dst in ids] == [1, 2, 1] and len({i for i, *_ in ids}) == 3
    assert pickle.loads(ids[0][2]) == (dp_held.drop_held, ([],))
    incoming.put((ids[1][0], True, b"\x80\x05not a pickle", 2))
    incoming.put((ids[0][0], False, pickle.dumps("KeyError: gone"), 1))
    incoming.put((99, True, pickle.dumps(None), 1))  # no such call: ignored
    incoming.put((ids[2][0], True, pickle.dumps([1, 2]), 1))
    with pytest.raises(RuntimeError, match="the answer of data-parallel rank 2 cannot be read"):
        second.result(5)
    with pytest.raises(RuntimeError, match="KeyError: gone"):
        first.result(5)
    assert third.result(5) == [1, 2]  # read after the unreadable one
    fourth, fifth = calls.call(1, dp_held.drop_held, []), calls.call(2, dp_held.drop_held, [])
    incoming.put(ConnectionError("rank 1 died"), src=1)  # seen by rank 1's own receive, while rank 2's waits
    for call in (fourth, fifth):  # every call in flight fails with it: the engine fails with any rank
        with pytest.raises(RuntimeError, match="rank 1 stopped answering: rank 1 died"):
            call.result(5)
    incoming.put(ConnectionError("rank 2 closed"), src=2)  # rank 2's receive fails after it
    receivers["sparsekv-rank-replies-2"].join(10)
    with pytest.raises(RuntimeError, match="rank calls failed: rank 1 died"):  # the first failure is why
        calls.call(2, dp_held.drop_held, [])


def test_a_rank_answers_a_call_it_cannot_read_or_run_with_why_and_goes_on(monkeypatch):
    from sparsekv.parallel import dp_held
    incoming, sent = _scripted(monkeypatch)
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    kept = side.held.keep(("tap", 0), [_rows(18)])[0]
    dropped = side.held.keep(("tap", 0), [_rows(21)])[0]
    incoming.put((7, False, b"\x80\x05not a pickle", 0))
    incoming.put((8, False, pickle.dumps((dp_held.take_held, ([Held(1, 42, 0, (1,), torch.float32)],))), 0))
    incoming.put((9, True, pickle.dumps((dp_held.take_held, ([kept],))), 0))  # in order, on the receiving thread
    # a drop sent in order is done before a call sent after it starts: the take finds the rows gone
    incoming.put((10, True, pickle.dumps((dp_held.drop_held, ([dropped.handle],))), 0))
    incoming.put((11, False, pickle.dumps((dp_held.take_held, ([dropped],))), 0))
    thread = dp_held.serve_calls(None, None, side)
    answers = {call_id: (ok, pickle.loads(payload), dst) for call_id, ok, payload, dst in (sent.get(timeout=5) for _ in range(5))}
    assert answers[10] == (True, None, 0) and answers[11][0] is False and "no longer held" in answers[11][1]
    assert answers[7][0] is False and answers[7][1].startswith("UnpicklingError") and answers[7][2] == 0
    assert answers[8][0] is False and "KeyError" in answers[8][1] and "[42]" in answers[8][1]
    assert answers[9][0] is True and torch.equal(answers[9][1][0], _rows(18)) and len(side.held) == 0
    incoming.put(ConnectionError("rank 0 is gone"), src=0)
    thread.join(5)
    assert not thread.is_alive()


def test_a_rank_publishes_a_batch_of_its_rows_signed_with_their_specs_from_the_rooms_tag(monkeypatch):
    from types import SimpleNamespace
    from sparsekv.disagg import dp_send
    from sparsekv.disagg.transfer import CORRUPT_ENV
    from sparsekv.disagg.wire import as_bytes, tensor_specs, verify
    from sparsekv.disagg.worker import DisaggSettings
    settings, put = DisaggSettings("prefill", "127.0.0.1", 0, b"s" * 32), {}
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    offered = []  # what the data path names in the metadata (NIXL's descriptors; nothing for torch.distributed)
    path = SimpleNamespace(offer=lambda tensors: offered.append(len(tensors)) or {"offered": len(tensors)})
    side.rooms["r"] = dp_send.RankRoom(link=SimpleNamespace(put=put.__setitem__), path=path, tensors=[])
    a, b = _rows(19), _rows(20)
    rows = side.held.keep(("room", "r"), [a, b])
    monkeypatch.setenv(CORRUPT_ENV, "4")  # the room's fifth tensor: this batch's second, its first at tag 3
    meta = {"backend": "gloo", "last": False}
    assert dp_send.publish(side, settings, 0, "r", meta, [rows[0], stack([rows[1][1:]])], 2, 3) == (60 + 40) * 4
    assert list(put) == ["meta/2"] and len(side.held) == 0
    body = verify(settings.secret, put["meta/2"], "metadata")
    assert body["tensors"] == tensor_specs(settings.secret, [a, b[1:][None]])  # the specs of the rows as taken
    assert offered == [2] and body["offered"] == 2  # the data path's names, signed with the rest
    sent = side.rooms["r"].tensors
    assert torch.equal(sent[0], as_bytes(a)) and not torch.equal(sent[1], as_bytes(b[1:][None].contiguous()))


def test_a_call_that_outlives_its_room_opens_nothing_and_publishes_nothing(monkeypatch):
    """Rank 0 ends a room (it stopped waiting for rank r's call) before or while rank r publishes its
    batch: the publish fails, and neither a metadata key (which the decode worker, gone, would never
    delete) nor the room's state (a store connection, a data path) is left on the rank; rows it would
    have kept for the room are refused too. A rank remembers the last ENDED_ROOMS ended rooms."""
    from types import SimpleNamespace
    from sparsekv.disagg import dp_send
    from sparsekv.disagg.worker import DisaggSettings
    from sparsekv.parallel import dp_held
    settings, put, closed = DisaggSettings("prefill", "127.0.0.1", 0, b"s" * 32), {}, []
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    path = SimpleNamespace(offer=lambda tensors: {}, close=lambda: closed.append(1))
    monkeypatch.setattr(dp_send, "sender", lambda *args: path)
    ending = []  # rank 0 ends the room while rank 1 connects to the store (a slow connect)
    monkeypatch.setattr(dp_send, "connect", lambda *args: ending and dp_send.close_room(side, ending.pop()) or object())
    monkeypatch.setattr(dp_send, "Room", lambda store, room: SimpleNamespace(put=put.__setitem__))

    def publish(room):
        rows = side.held.keep(("tap", room), [_rows(21)])
        return dp_send.publish(side, settings, 0, room, {"backend": "gloo", "last": False}, rows, 0, 0)
    assert publish("open") == 60 * 4 and list(put) == ["meta/0"] and list(side.rooms) == ["open"]
    put.clear()
    dp_send.close_room(side, "before")
    with pytest.raises(RuntimeError, match="room before has ended on data-parallel rank 1"):
        publish("before")
    ending.append("while")
    with pytest.raises(RuntimeError, match="room while has ended"):
        publish("while")
    assert put == {} and list(side.rooms) == ["open"] and closed == [1]  # the path made meanwhile closed
    real = dp_send.as_published  # rank 0 ends a room whose state exists while rank 1 cuts its rows

    def ended_meanwhile(*args):
        dp_send.close_room(side, "during")
        return real(*args)
    dp_send._room(side, settings, 0, "during", "gloo")
    monkeypatch.setattr(dp_send, "as_published", ended_meanwhile)
    with pytest.raises(RuntimeError, match="room during has ended"):
        publish("during")
    assert put == {} and list(side.rooms) == ["open"] and closed == [1, 1]
    with pytest.raises(RuntimeError, match="has ended"):
        side.open_room("before")
    monkeypatch.setattr(dp_held, "ENDED_ROOMS", 2)
    dp_send.close_room(side, "open")
    assert list(side.ended) == ["during", "open"] and side.rooms == {}


def test_each_request_of_a_room_watched_on_one_rank_follows_the_rank_of_whichever_of_it_was_added():
    """`DataParallelEngine._rank_of_room`, which `add_request` asks before the router: a request of a
    room watched with `one_rank` goes to the rank another request of that room was added to, whatever
    its place in the room and also once that one finished; a request of no room, of a room no longer
    watched, or of one watched without `one_rank` (the default), has none (the router decides)."""
    from types import SimpleNamespace
    from sparsekv.parallel.data_parallel import DataParallelEngine
    engine = SimpleNamespace(rank_of={"b2": 1}, _watched={}, _room_of={})
    DataParallelEngine.watch_ranks(engine, ["b1", "b2"])
    assert DataParallelEngine._rank_of_room(engine, "b1") is None and engine._watched == {"b1": None, "b2": 1}
    DataParallelEngine.unwatch_ranks(engine, ["b1", "b2"])
    engine = SimpleNamespace(rank_of={"a3": 1}, _watched={}, _room_of={})  # the room's last request added first
    DataParallelEngine.watch_ranks(engine, ["a1", "a2", "a3"], one_rank=True)
    engine.rank_of.clear()  # a3 finished, still watched
    rank = lambda request_id: DataParallelEngine._rank_of_room(engine, request_id)  # noqa: E731
    assert [rank("a1"), rank("a2"), rank("x")] == [1, 1, None]
    DataParallelEngine.unwatch_ranks(engine, ["a1", "a2", "a3"])
    assert rank("a1") is None and engine._room_of == {} and engine._watched == {}


def test_a_room_ends_only_after_a_publish_of_it_under_way():
    """`RankSide.while_open`: rank 0 ending a room (close_room, on another call's thread) while a call of
    the room puts its metadata key waits for the put, so no key is put once the room ended (nothing
    would delete it)."""
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    side.open_room("r")
    entered, release, order = threading.Event(), threading.Event(), []

    def put():
        entered.set()
        release.wait(10)
        order.append("put")
    publishing = threading.Thread(target=side.while_open, args=("r", put))
    publishing.start()
    assert entered.wait(10)
    ending = threading.Thread(target=lambda: order.append(("ended", side.end_room("r"))))
    ending.start()
    ending.join(0.2)  # bounded: it waits for the put
    release.set()
    publishing.join(10)
    ending.join(10)
    assert order == ["put", ("ended", None)]
    with pytest.raises(RuntimeError, match="room r has ended"):
        side.while_open("r", order.append, "late")


def test_a_room_rank_0_ended_exports_no_pages_on_the_rank():
    """`lanes.export_held` for a room rank 0 already ended (its export arrived late): the rank refuses it
    before exporting, and keeps neither rows nor the room."""
    from types import SimpleNamespace
    from sparsekv.disagg.dp_send import close_room
    from sparsekv.parallel.lanes import export_held
    exported = []
    engine = SimpleNamespace(kv=SimpleNamespace(
        export_prefix=lambda token_ids, tenant, salt, skip=0: exported.append(skip) or [("p0", [_rows(22)])]))
    side = RankSide(HeldRows(rank=1), torch.device("cpu"))
    close_room(side, "room-a")
    with pytest.raises(RuntimeError, match="room room-a has ended on data-parallel rank 1"):
        export_held(engine, side, [1, 2, 3], "default", None, 0, "room-a")
    assert exported == [] and len(side.held) == 0 and side.rooms == {}


def test_rank_0_reads_each_answer_whole_from_the_rank_it_receives_from(monkeypatch):
    """`recv_message(group, src)`: the header and the payload both come from rank `src`, whatever the other
    ranks sent meanwhile (rank 0 has a receiving thread per rank; a header or payload read from any rank
    would be another rank's)."""
    import torch.distributed as dist
    from sparsekv.parallel import dp_held
    frames = []  # what each send_message sent, in order
    monkeypatch.setattr(dist, "send", lambda tensor, dst, group: frames.append(tensor.clone()))
    dp_held.send_message(5, True, b"from rank 1", 0, None)
    dp_held.send_message(6, False, b"rank 2's", 0, None)
    arrived = [(1, frames[0]), (2, frames[2]), (1, frames[1]), (2, frames[3])]  # the two ranks' sends interleaved

    def recv(tensor, src=None, group=None):
        i = next(i for i, (s, _) in enumerate(arrived) if src is None or s == src)
        s, frame = arrived.pop(i)
        tensor.copy_(frame)
        return s
    monkeypatch.setattr(dist, "recv", recv)
    assert dp_held.recv_message(None, 2) == (6, False, b"rank 2's")
    assert dp_held.recv_message(None, 1) == (5, True, b"from rank 1") and arrived == []


def test_a_call_waiting_for_its_rank_to_receive_it_holds_back_no_answer(monkeypatch):
    """A call's send waits for rank r to receive it, and rank r may first wait for rank 0 to take an
    answer of its own (it sends one message at a time): the answer must be taken meanwhile. With the
    pending calls' lock held through the send, rank 0's receiving thread waited for it: both ranks hung."""
    from sparsekv.parallel import dp_held
    incoming, sent = _scripted(monkeypatch)
    calls = dp_held.RankCalls(None, None, 2)
    first = calls.call(1, dp_held.drop_held, [])
    first_id = sent.get(timeout=5)[0]

    def send_once_answer_taken(call_id, ok, payload, dst, group):
        incoming.put((first_id, True, pickle.dumps("done"), 1))  # rank 1 answers the first call now
        assert first.result(timeout=5) == "done"  # rank 0 took it: rank 1 receives this call
        sent.put((call_id, ok, payload, dst))
    monkeypatch.setattr(dp_held, "send_message", send_once_answer_taken)
    second = calls.call(1, dp_held.drop_held, [])
    assert sent.get(timeout=5)[0] != first_id and not second.done()
