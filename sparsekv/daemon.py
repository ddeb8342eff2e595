"""Blocking calls that wait on another process, run off the event loop without holding up its exit."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future


def on_daemon_thread(fn, *args, name: str = "sparsekv-wait") -> asyncio.Future:
    """`fn(*args)` on a daemon thread of its own, as a future of the running loop: for a call that waits
    on another process for as long as it takes (a disaggregated room's peer, a trainer's broadcast). A
    pool could run out of threads, and a pool's threads (asyncio.to_thread's too) would hold the
    process's exit up while such a wait lasts."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except Exception as e:
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop closed: nobody waits for it
            pass
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def daemon_future(fn, *args, name: str = "sparsekv-wait") -> Future:
    """`fn(*args)` on a daemon thread of its own, as a concurrent future: the same, for a caller with
    no event loop (a worker rank's trainer group, a transfer's connect waited for with a bound)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits
            future.set_exception(e)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future
