"""Shared helpers for the server tests (no tests here): a tiny checkpoint with a small tokenizer,
live servers on 127.0.0.1 (in a thread, or as a `sparsekv serve` subprocess), /metrics parsing.

The tokenizer is a fixed 256-token BPE (characters plus letter pairs), so every id the random model
can emit decodes to readable text and stop strings can match. It is built here, not downloaded.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import string
import subprocess
import sys
import time

import httpx

from sparsekv.server.threaded import listening_socket, serve_in_thread, stop_thread_server  # noqa: F401 (shared)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
_CHECKPOINTS: dict[str, str] = {}


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    base = ["<eos>", "<unk>"] + list(string.ascii_letters + string.digits + ".,!?'-:;") + ["\u2581"]
    letters = "etaoinshrdlucm"
    pairs = [a + b for a, b in itertools.product("\u2581" + letters, letters)][:256 - len(base)]
    vocab = {t: i for i, t in enumerate(base + pairs)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(p[0], p[1]) for p in pairs], unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)


def tiny_checkpoint(root, with_tokenizer: bool = True) -> str:
    """The tiny random glm_moe_dsa checkpoint (vocab 256), written once per test session."""
    key = f"tok={with_tokenizer}"
    if key not in _CHECKPOINTS:
        from sparsekv.tools.tiny import save_reference_checkpoint
        path = os.path.join(str(root), "tiny-tok" if with_tokenizer else "tiny-notok")
        save_reference_checkpoint(path)
        if with_tokenizer:
            save_tokenizer(path)
        _CHECKPOINTS[key] = path
    return _CHECKPOINTS[key]


def free_port() -> int:
    """A port free now, for a server in another process (it may be taken before that server binds it;
    a server in this process takes a `listening_socket` instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_steps(engine) -> list[float]:
    """Wrap engine.step so a test can slow it down (delay[0] seconds per step) to keep requests in flight."""
    delay = [0.0]
    real = engine.step

    def step():
        if delay[0]:
            time.sleep(delay[0])
        return real()

    engine.step = step
    return delay


class ThreadServer:
    """`create_app` + DrainingServer run by uvicorn in a background thread (no signals there)."""

    def __init__(self, model: str, api_keys: list[str] = (), max_queued: int | None = None,
                 shutdown_timeout: float = 5.0, max_queued_per_tenant: int | None = None,
                 reasoning_parser: str | None = None, metrics_api_keys: list[str] = (), admin_api_keys: list[str] = (),
                 weight_update_policy: str = "drain", **engine_options):
        from sparsekv.config import EngineConfig
        from sparsekv.llm import build_engine
        from sparsekv.server.app import ServerSettings, create_app
        from sparsekv.server.auth import load_admin_keys, parse_api_keys, parse_metrics_keys
        opts = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "kv_page_size": 16, **engine_options}
        self.engine = build_engine(EngineConfig(model=model, **opts))  # data-parallel too (-dp)
        self.delay = slow_steps(self.engine)
        self.app = create_app(self.engine, ServerSettings(["tiny"], parse_api_keys(list(api_keys)), max_queued,
                                                          max_queued_per_tenant=max_queued_per_tenant,
                                                          reasoning_parser=reasoning_parser,
                                                          metrics_api_keys=parse_metrics_keys(list(metrics_api_keys)),
                                                          admin_api_keys=load_admin_keys(list(admin_api_keys), [], {}),
                                                          weight_update_policy=weight_update_policy))
        self.state = self.app.state.server
        self.sock = listening_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.shutdown_timeout = shutdown_timeout

    def __enter__(self):
        self.server, self.thread = serve_in_thread(self.app, self.state, self.sock, self.shutdown_timeout)
        return self

    def __exit__(self, *exc):
        stop_thread_server(self.server, self.thread)


def serve_subprocess(cmd: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`cmd`, a `sparsekv serve` command line, serving on a socket bound and listening here, handed over
    with --fd: no other process can take its port between its choice and the server's start (a port
    merely found free could be). Returns (the process, its URL)."""
    sock = listening_socket()
    sock.listen()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **(env or {})}
    try:
        proc = subprocess.Popen([*cmd, "--fd", str(sock.fileno())], pass_fds=(sock.fileno(),), env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()  # the server holds its own copy


def start_subprocess_server(model: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`sparsekv serve MODEL` with the tests' settings and `args`, in a process of its own: (it, its URL)."""
    return serve_subprocess([sys.executable, "-m", "sparsekv", "serve", model, "--max-model-len", str(MAX_MODEL_LEN),
                             "--kv-page-size", "16", "--log-level", "warning", *args], env)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name (labels dropped, summed): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape_samples(url: str, key: str | None = None) -> list:
    """Every sample of /metrics (name, labels, value); `key`: a --metrics-api-key (per-tenant series too)."""
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {key}"} if key else None
    text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_labelled(url: str, label: str, key: str | None = None) -> dict[str, dict[str, float]]:
    """/metrics as {sample name: {value of `label`: value}}, for the samples that carry `label`."""
    out: dict[str, dict[str, float]] = {}
    for s in scrape_samples(url, key):
        if label in s.labels:
            out.setdefault(s.name, {})[s.labels[label]] = s.value
    return out


def wait_until(predicate, timeout: float = 10, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def on_engine_loop(srv, fn, timeout: float = 30):
    """`fn()` on a served engine's loop thread, from a test's thread. A data-parallel engine's calls
    are collectives over its ranks: only the loop thread may make them, or two threads' collectives
    would interleave and hang."""
    import asyncio
    loop = srv.state.loop
    return asyncio.run_coroutine_threadsafe(loop.call(fn), loop._aloop).result(timeout)


def pages_all_free(url: str) -> bool:
    m = scrape(url)
    return m["sparsekv:kv_pages_free"] == m["sparsekv:kv_pages_total"] and m["sparsekv:num_requests_running"] == 0


# -- random requests --------------------------------------------------------------------------

ODD_VALUES = (None, True, False, 0, 1, -1, 3, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, -0.5, 0.5, float("nan"), float("inf"),
              float("-inf"), "", "a", "\x00", "\U0001f642" * 20, "x" * 3000, "<|endoftext|>", [], [-1], [2 ** 40],
              [[1, 2], [3]], {}, {"type": None}, {"text": 1}, {"role": "user"})
SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "allowed_token_ids",
                   "truncate_prompt_tokens", "include_stop_str_in_output", "skip_special_tokens", "response_format",
                   "guided_json", "guided_regex", "guided_choice", "stop", "stop_token_ids", "n", "stream",
                   "stream_options", "ignore_eos", "user", "cache_salt", "return_routed_experts", "logprobs", "rid",
                   "request_id")
CHAT_FIELDS = ("top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs", "max_completion_tokens")


def random_openai_body(rng, chat: bool, base: dict) -> bytes:
    """A completion (or `chat`) request made from `base` that is mostly valid, with a few fields of odd
    values and types (NaN and infinities as Python's json writes them, which a JSON parser may accept)."""
    body = dict(base, max_tokens=rng.choice([1, 3]), stream=rng.random() < 0.4)
    if rng.random() < 0.3:
        body.update(n=2, logprobs=True if chat else 2, top_logprobs=2) if chat else body.update(n=2, logprobs=2)
    for name in SAMPLING_FIELDS + (CHAT_FIELDS if chat else ("prompt",)):
        if rng.random() < 0.02:
            body[name] = rng.choice(ODD_VALUES)
    if chat and rng.random() < 0.2:
        body["messages"] = [{"role": rng.choice(["user", "assistant", "tool", "system", 1]),
                             "content": rng.choice(ODD_VALUES), "tool_calls": rng.choice([None, [], [{}], 1])}]
    return json.dumps(body).encode()
