"""Helpers for the prefill/decode worker tests (no tests here): a worker server in a thread of this
process, a worker as a `sparsekv serve` subprocess, and one request sent to a prefill and a decode
worker at once, as `sparsekv router` sends it."""
from __future__ import annotations

import asyncio
import os
import sys
import uuid
from contextlib import contextmanager

import httpx

from test_server_util import listening_socket, serve_in_thread, serve_subprocess, stop_thread_server, wait_healthy

SECRET = b"a-shared-test-secret-0123456789"
ADMIN_KEY = "sk-admin-of-the-test-workers"


def secret_file(tmp_path, secret: bytes = SECRET) -> str:
    path = os.path.join(str(tmp_path), f"secret-{uuid.uuid4().hex[:6]}")
    with open(path, "wb") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return path


class WorkerServer:
    """A prefill or decode worker (`mode`) served by uvicorn in a background thread (`transfer`: its
    --disaggregation-transfer-backend)."""

    def __init__(self, model: str, mode: str, secret: bytes = SECRET, timeout_s: float = 20.0,
                 api_keys: list[str] = (), bootstrap_port: int = 0, transfer: str = "torch", send: str = "layers",
                 **engine_options):
        from sparsekv.config import EngineConfig
        from sparsekv.disagg.worker import DisaggSettings
        from sparsekv.llm import build_engine
        from sparsekv.server.app import ServerSettings, create_app
        from sparsekv.server.auth import load_admin_keys, parse_api_keys
        if mode == "decode":
            engine_options.setdefault("prefix_cache_host_bytes", 1 << 24)
        self.engine = build_engine(EngineConfig(model=model, **engine_options))  # data-parallel with data_parallel_size
        role = DisaggSettings(mode, "127.0.0.1", bootstrap_port if mode == "prefill" else None, secret, timeout_s,
                              transfer, send)
        self.app = create_app(self.engine, ServerSettings(["tiny"], parse_api_keys(list(api_keys)), disaggregation=role,
                                                          admin_api_keys=load_admin_keys([ADMIN_KEY], [], {})))
        self.state = self.app.state.server
        self.worker = self.state.disagg
        self.sock = listening_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.server, self.thread = serve_in_thread(self.app, self.state, self.sock, 5.0)
        return self

    def __exit__(self, *exc):
        stop_thread_server(self.server, self.thread)
        config = self.engine.config
        if config.data_parallel_size > 1 or config.tensor_parallel_size > 1:  # its ranks' processes stop with it
            self.engine.close()

    def update_weights_from_disk(self, path: str) -> int:
        """The engine's weights from `path`, as an RL trainer loads them (POST /update_weights_from_disk);
        the new weights_version."""
        r = httpx.post(self.url + "/update_weights_from_disk", json={"model_path": path}, timeout=60,
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["weights_version"]

    def on_engine(self, fn, *args):
        """`fn(*args)` on the server's engine loop (a data-parallel engine's calls reach every rank: only
        one thread may make them)."""
        return asyncio.run_coroutine_threadsafe(self.state.loop.call(fn, *args), self.state.loop._aloop).result(60)

    def check_clean(self) -> None:
        """Everything of the transfers is gone: no room, no request, no page kept for a room (on every
        data-parallel rank), the pools' integrity holds."""
        assert self.worker.rooms == {}
        self.on_engine(self.engine.check_integrity)
        assert not self.on_engine(self.engine.has_unfinished_requests)
        stats = self.on_engine(self.engine.stats)
        kept = [stats["kv_pages_kept"], *(rank["kv_pages_kept"] for rank in stats.get("by_data_parallel_rank", []))]
        assert not any(kept), f"pages kept for rooms that ended: {kept}"


def start_worker_process(model: str, mode: str, secret_path: str, bootstrap_port: int = 0, *args: str,
                         env: dict | None = None):
    """A `sparsekv serve` worker of `mode` in a process of its own: (it, its URL)."""
    return serve_subprocess([sys.executable, "-m", "sparsekv", "serve", model, "--max-model-len", "128",
                             "--kv-page-size", "4", "--log-level", "warning", "--disaggregation-mode", mode,
                             "--disaggregation-secret-file", secret_path, "--disaggregation-bootstrap-host",
                             "127.0.0.1", "--disaggregation-bootstrap-port", str(bootstrap_port), *args], env)


@contextmanager
def process_and_local_pair(model: str, side: str, tmp_path, args: tuple, **local_options):
    """A `side` worker as a `sparsekv serve` process of its own (started with `args`: one process holds
    one torch.distributed world), paired with a worker of the other role served in this process:
    yields (prefill url, decode url, the local WorkerServer)."""
    other = "decode" if side == "prefill" else "prefill"
    secret = secret_file(tmp_path)
    proc, url = start_worker_process(model, side, secret, 0, *args)
    try:
        wait_healthy(url, proc, timeout=180)  # -dp 2 / -tp 2: a second rank spawned, torch imported twice, gloo set up
        with open(secret, "rb") as f:
            key = f.read()
        with WorkerServer(model, other, secret=key, **local_options) as local:
            yield (url, local.url, local) if side == "prefill" else (local.url, url, local)
    finally:
        proc.terminate()
        proc.wait(30)


def field(prefill_info: dict, room: str | None = None) -> dict:
    return {"room": room or uuid.uuid4().hex, "bootstrap_host": prefill_info["bootstrap_host"],
            "bootstrap_port": prefill_info["bootstrap_port"]}


def send_pair(prefill_url: str, decode_url: str, body: dict, path: str = "/v1/completions", headers=None,
              timeout: float = 60.0, room: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """One request to both workers at once, as the router sends it: (prefill's answer, decode's); an
    answer that never came (a worker killed) is its exception."""
    info = httpx.get(prefill_url + "/disaggregation", timeout=5).json()
    tagged = {**body, "disaggregation": field(info, room)}
    to_prefill = {k: v for k, v in tagged.items() if k != "stream_options"} | {"stream": False}

    async def both():
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
            return await asyncio.gather(client.post(prefill_url + path, json=to_prefill),
                                        client.post(decode_url + path, json=tagged), return_exceptions=True)
    return tuple(asyncio.run(both()))


def assert_transfer_bytes(figures: dict, decode_engine, page_size: int) -> None:
    """A transfer's bytes: the pages' rows, the tail's rows and, for a tiered decode worker, the tail's
    selections (a one-row tail in the sparse regime: its row's top-k twice per full layer, int64)."""
    row_bytes = decode_engine.kv.prefix.tiers["host"].page_bytes // page_size
    rows = (figures["pages_sent"] * page_size + figures["tail_tokens"]) * row_bytes
    cfg = decode_engine.model_config
    tiered = decode_engine.config.kv_tiering
    assert not tiered or figures["tail_tokens"] == 1, "a one-row tail: its selections' size is known"
    assert figures["bytes"] == rows + (2 * cfg.index_topk * 8 * len(cfg.full_layers) if tiered else 0)


def http_answering_listener():
    """A listening socket on 127.0.0.1 that answers every connection with an HTTP 400 (something other
    than a bootstrap store at the address a request names); close it to stop."""
    import contextlib
    import socket
    import threading
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_as_http():
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    threading.Thread(target=answer_as_http, daemon=True).start()
    return listener
