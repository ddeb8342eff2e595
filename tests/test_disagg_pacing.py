"""The decode worker's pacing of a batch's receive work (`decode.Pacer`, `Inbox.receive`): each slice
is followed by a pause that keeps the slices to the pacer's duty of the core while the engine has
requests running, none while it has none; every batch but the last is paced. A fake clock and a
fake data path: no time is measured and no peer runs."""
from __future__ import annotations

import pytest
import torch

from sparsekv.disagg.decode import Inbox, Pacer
from sparsekv.disagg.wire import as_bytes, at_once, pages_to_tensors, tensor_specs

SECRET = b"s" * 32


class Clock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _work(clock: Clock, seconds: float):
    def fn():
        clock.now += seconds
        return "done"
    return fn


def test_a_slice_is_followed_by_a_pause_keeping_it_to_the_duty_while_the_engine_is_busy():
    clock, busy = Clock(), [True]
    pacer = Pacer(lambda: busy[0], duty=0.2, clock=clock, sleep=clock.sleep)
    assert pacer(_work(clock, 0.002)) == "done"
    assert clock.slept == [pytest.approx(0.008)]  # 2 ms of work: 20 % of the 10 ms it takes
    busy[0] = False
    pacer(_work(clock, 0.002))
    assert len(clock.slept) == 1 and pacer.paused_s == pytest.approx(0.008)  # nothing running: no pause
    pacer.max_pause_s, busy[0] = 0.005, True
    pacer(_work(clock, 0.002))
    assert clock.slept[-1] == pytest.approx(0.005)  # at most max_pause_s
    for duty in (0, 1.5):
        with pytest.raises(ValueError, match="duty"):
            Pacer(lambda: True, duty)


def test_a_slice_is_measured_in_the_threads_cpu_time_not_in_waiting():
    """A receive that waits for bytes still on the wire takes no pause after it; work on the CPU does."""
    import time
    slept = []
    pacer = Pacer(lambda: True, duty=0.5, sleep=slept.append)
    pacer(lambda: time.sleep(0.05))
    assert slept[0] < 0.01  # 50 ms of waiting, almost no CPU

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    pacer(lambda: burn(0.003))
    assert slept[1] >= 0.003  # at least the 3 ms of CPU at a 50 % duty


class FakePath:
    """A data path handing back the batch's bytes, recording how it was asked to pace."""

    def __init__(self, tensors):
        self.tensors, self.paces = tensors, []

    def pull(self, meta, sizes, first, pace=None):
        self.paces.append(pace)
        return [as_bytes(t).clone() for t in self.tensors]


def _batch(names: list[bytes], last: bool):
    pages = [(n, [torch.full((4, 3), float(i)), torch.full((4,), i, dtype=torch.int32)]) for i, n in enumerate(names)]
    tensors = pages_to_tensors(pages)
    meta = {"names": [n.hex() for n in names], "pages": [len(names)], "tensors": tensor_specs(SECRET, tensors),
            "backend": "gloo", "last": last}
    return meta, tensors, pages


def test_every_batch_but_the_last_is_paced_slice_by_slice():
    calls = []

    class Counting(Pacer):
        def __call__(self, fn):
            calls.append(fn)
            return fn()
    settings = type("Settings", (), {"secret": SECRET})()
    inbox = Inbox(None, settings, torch.device("cpu"), None, pacer=Counting(lambda: True), held=[0])
    meta, tensors, pages = _batch([b"a" * 8, b"b" * 8], last=False)
    inbox.path = FakePath(tensors)
    inbox.receive(meta)
    assert inbox.path.paces == [inbox.pacer]
    assert len(calls) == 2  # a digest per tensor
    meta, tensors, more = _batch([b"c" * 8], last=True)
    inbox.path = FakePath(tensors)
    inbox.receive(meta)
    assert inbox.path.paces == [at_once] and len(calls) == 2  # the last: not paced
    for (name, rows), (want_name, want) in zip(inbox.pages, pages + more):
        assert name == want_name and all(torch.equal(r, w) for r, w in zip(rows, want))
