"""A server of this process run by uvicorn in a background thread (no signal handlers there), for the
benchmarks and tests that serve workers in-process: on a socket bound when its port is chosen, so no
other process can take the port in between."""
from __future__ import annotations

import socket
import threading
import time

START_TIMEOUT_S = 20.0


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the system picked, held until uvicorn serves on it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def serve_in_thread(app, state, sock: socket.socket, shutdown_timeout: float):
    """uvicorn serving `app` (a DrainingServer) on `sock` in a daemon thread, once it has started:
    (server, thread). RuntimeError if it does not start within START_TIMEOUT_S."""
    import uvicorn
    from .cli import DrainingServer
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, state, shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    return server, thread


def stop_thread_server(server, thread, timeout_s: float = 15.0) -> None:
    """Stop a serve_in_thread server; RuntimeError if its thread is still running after `timeout_s`."""
    server.should_exit = True
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError("the in-process server's thread did not stop")
