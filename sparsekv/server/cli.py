"""`sparsekv serve [MODEL] --host --port [--api-key KEY[:TENANT] ... | --api-key-file PATH] [engine options]`.

MODEL: a checkpoint directory or a Hugging Face repo id ORG/NAME (hub.py). The startup log names the
version and every option that differs from its default, keys redacted (`startup_settings`).

Shutdown: the first SIGTERM/SIGINT starts a drain (new requests get 503 and /health turns 503 so a
load balancer stops routing here; requests in flight run on for up to --shutdown-timeout seconds;
whatever is left is then aborted, its clients get an error) and the process then exits 0. A second
signal ends the drain at once: what is in flight is aborted with an error to its clients, and the
process exits 0 as soon as they have it. A third (or a second once the drain is over) exits without
waiting for clients. uvicorn's own shutdown would just wait for connections with no engine-side
abort, so `DrainingServer` runs the drain before handing over to it.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import socket
import sys

import uvicorn

from ..config import ConfigError
from ..engine_args import (add_engine_args, at_least, engine_error, engine_options, non_default_args, port_number,
                           read_text_option)
from .limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES
from .reasoning import PARSERS

log = logging.getLogger("sparsekv.server")
SECRET_ARGS = ("api_key", "metrics_api_key", "admin_api_key")  # never printed, not even in the startup line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv serve", description="OpenAI-compatible server")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face repo id ORG/NAME (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--fd", type=at_least(0), default=None, metavar="FD",
                   help="serve on this inherited, listening TCP socket (a file descriptor, as uvicorn's --fd: "
                        "sockets handed over by a supervisor); --host and --port are then not bound")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]",
                   help="require 'Authorization: Bearer KEY'; repeat for several keys; TENANT names the key's tenant "
                        "(visible in `ps`: prefer --api-key-file or SPARSEKV_API_KEY)")
    p.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                   help="API keys, one KEY[:TENANT] a line ('#' comments); refused if other users may read it. "
                        "SPARSEKV_API_KEY in the environment adds one more")
    p.add_argument("--admin-api-key", action="append", default=[], metavar="KEY",
                   help="opens the admin endpoints (/update_weights_from_disk, /pause_generation, "
                        "/continue_generation, /flush_cache, /init_weights_update_group, "
                        "/update_weights_from_distributed, /destroy_weights_update_group: docs/rl.md), which are "
                        "refused without one; "
                        "repeatable (prefer --admin-api-key-file or SPARSEKV_ADMIN_API_KEY)")
    p.add_argument("--admin-api-key-file", action="append", default=[], metavar="PATH",
                   help="admin keys, one a line; refused if other users may read it")
    p.add_argument("--weight-update-policy", default="drain", choices=["drain", "abort"],
                   help="requests running when weights update: drain (they finish under the old weights, new "
                        "ones wait) or abort (they end with finish_reason abort; the client retries)")
    p.add_argument("--metrics-api-key", action="append", default=[], metavar="KEY",
                   help="a scrape of /metrics sending 'Authorization: Bearer KEY' also gets the per-tenant series "
                        "(without it they are public only when there is no --api-key); repeatable (prefer "
                        "--metrics-api-key-file or SPARSEKV_METRICS_API_KEY)")
    p.add_argument("--metrics-api-key-file", action="append", default=[], metavar="PATH",
                   help="metrics keys, one a line; refused if other users may read it")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="a larger request body is refused with 413 before it is read (default 4 MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="a completion may carry at most this many prompts (default 128, as n)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) clients use (default: MODEL as given, or the bundled model's directory name)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="at most this many requests waiting for a batch slot; beyond it 503 + Retry-After")
    p.add_argument("--max-queued-requests-per-tenant", dest="max_queued_per_tenant", type=int, default=None,
                   help="at most this many of one tenant's requests waiting; beyond it that tenant gets 503 + "
                        "Retry-After while others are still queued")
    p.add_argument("--shutdown-timeout", type=at_least(0.0, float), default=30.0,
                   help="seconds to drain in-flight requests after SIGTERM before aborting them")
    p.add_argument("--default-max-tokens", type=at_least(1), default=None,
                   help="max_tokens when a request gives none (default: 16 for completions; for chat the rest "
                        "of the context, at most KV pool tokens / max-num-seqs)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file replacing the tokenizer's (default: the tokenizer's; for a "
                        "deepseek_v32 tokenizer without one, the bundled sparsekv/server/chat_templates/deepseek_v32.jinja)")
    p.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                   help="chat: split the model's <think>...</think> out of the content into reasoning_content "
                        "(vLLM's names; GLM-5 and DeepSeek-V3.2 share the format)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="chat: leave the tools out of the prompt when tool_choice is \"none\" (vLLM's flag; by "
                        "default the template sees them and the output is not parsed for calls)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_disaggregation_args(p)
    add_engine_args(p)
    return p


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    from ..disagg.transfer import TRANSFERS
    from ..disagg.worker import DEFAULT_TIMEOUT_S, MODES, SENDS
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument("--disaggregation-mode", default="null", choices=MODES,
                   help="prefill: compute prompts and send their KV; decode: take the KV and generate (requests "
                        "come through `sparsekv router`); null: a colocated server")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill worker: the port of its bootstrap store, where decode workers claim a request's "
                        "KV (0: any free port)")
    g.add_argument("--disaggregation-bootstrap-host", default=None,
                   help="the address the other worker reaches this one at for the transfer (default: --host, or "
                        "this machine's host name when --host is a wildcard)")
    g.add_argument("--disaggregation-secret-file", default=None, metavar="PATH",
                   help="the secret both workers share to authenticate every transfer (required with a mode; "
                        "private file, at least 16 bytes)")
    g.add_argument("--disaggregation-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a worker waits for the other side of a transfer, the prefill of the prompt "
                        "included, before the request fails with 503")
    g.add_argument("--disaggregation-transfer-backend", default="torch", choices=TRANSFERS,
                   help="how the KV's bytes move, the same on both workers: torch (torch.distributed: NCCL when "
                        "both run on CUDA, gloo otherwise) or nixl (the decode worker reads them from the "
                        "prefill worker's memory over NIXL's UCX backend; needs NIXL installed)")
    g.add_argument("--disaggregation-send", default="layers", choices=SENDS,
                   help="prefill worker: when a prompt's KV leaves, layers (each layer's rows while the next layer "
                        "computes) or chunks (a chunk's pages once every layer computed them)")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("sparsekv %s, non-default args: %s", importlib.metadata.version("sparsekv"),
             startup_settings(parser, args))
    idle = unused_disaggregation_flags(parser, args)
    if idle and args.disaggregation_mode == "decode":  # NOTE: a launcher may give both roles the same flags
        one = len(idle) == 1
        print(f"sparsekv serve: warning: {', '.join(idle)} {'applies' if one else 'apply'} only to a prefill worker; "
              f"this decode worker ignores {'it' if one else 'them'}", file=sys.stderr)
    elif idle:
        parser.error(f"{', '.join(idle)} {'applies' if len(idle) == 1 else 'apply'} only with "
                     "--disaggregation-mode prefill or decode")
    hosted = host_ranks(parser, args)  # another node's ranks, or torchrun's rank > 0: no server here
    if hosted is not None:
        return hosted
    from ..parallel.launch import StartupError
    bound: list[socket.socket] = []

    def bind() -> None:  # NOTE: before the weights load: a port in use is said at once, not after minutes
        bound.append(listening_socket(args.host, args.port) if args.fd is None else inherited_socket(args.fd))
    try:
        app, state = build_app(args, bind)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        _close(bound)
        print(f"sparsekv serve: error: {engine_error(e, parser)}", file=sys.stderr)
        return 2
    except StartupError as e:  # a worker rank's own error (its option, its file), or a rank that never came
        _close(bound)
        print(f"sparsekv serve: error: {e}", file=sys.stderr)
        return 1
    sock = bound[0] if bound else None
    return serve(app, state, args.host, args.port, args.shutdown_timeout, args.log_level, sock)


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (as uvicorn would bind it); ValueError naming --host/--port."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:  # in use, not this machine's address, a name that does not resolve
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def inherited_socket(fd: int) -> socket.socket:
    """The listening TCP socket open as file descriptor `fd`; ValueError naming --fd otherwise."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ValueError(f"--fd {fd}: not an open socket ({e.strerror or e})") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) or not listening:
        sock.detach()
        raise ValueError(f"--fd {fd}: not a listening TCP socket")
    return sock


def startup_settings(parser: argparse.ArgumentParser, args) -> dict:
    """The options that differ from their defaults (keys redacted), and whether SPARSEKV_API_KEY is set."""
    from .auth import API_KEY_ENV
    settings = non_default_args(parser, args, SECRET_ARGS)
    if os.environ.get(API_KEY_ENV):
        settings[API_KEY_ENV] = "<redacted>"
    return settings


def host_ranks(parser: argparse.ArgumentParser, args) -> int | None:
    """This process's part when it only hosts ranks for node 0's engine: node `--node-rank` > 0, or
    rank > 0 under torchrun. None: the engine and the server run here."""
    from ..config import EngineConfig
    from ..parallel.lanes import host_node, host_torchrun_rank
    from ..parallel.launch import StartupError
    from ..paths import default_model_path
    try:
        config = EngineConfig(model=args.model or default_model_path(), **engine_options(args))
        if args.node_rank > 0:
            return host_node(config)
        return 0 if host_torchrun_rank(config) else None
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"sparsekv serve: error: {engine_error(e, parser)}", file=sys.stderr)
        return 2
    except StartupError as e:
        print(f"sparsekv serve: error: {e}", file=sys.stderr)
        return 1


def build_app(args, bind=None):
    """The app and its state from the serve options; `bind()` takes the listening socket once the cheap
    checks passed, before the weights load."""
    from ..config import EngineConfig
    from ..llm import build_engine
    from ..paths import default_model_path
    from ..disagg.worker import DEFAULT_DECODE_HOST_BYTES
    from .app import ServerSettings, create_app
    from .auth import load_admin_keys, load_api_keys, load_metrics_keys

    keys = load_api_keys(args.api_key, args.api_key_file, os.environ)
    metrics_keys = load_metrics_keys(args.metrics_api_key, args.metrics_api_key_file, os.environ)
    admin_keys = load_admin_keys(args.admin_api_key, args.admin_api_key_file, os.environ)
    for flag, value in (("--max-queued-requests", args.max_queued_requests),
                        ("--max-queued-requests-per-tenant", args.max_queued_per_tenant),
                        ("--max-request-body-bytes", args.max_request_body_bytes),
                        ("--max-prompts-per-request", args.max_prompts_per_request)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    model = args.model or default_model_path()
    names = args.served_model_name or [args.model or os.path.basename(os.path.normpath(model))]
    if not all(name.strip() for name in names):
        raise ValueError("--served-model-name must not be empty")
    template = None
    if args.chat_template is not None:  # read first: a wrong path fails before the model loads
        template = read_text_option(args.chat_template, "--chat-template")
        check_template(template)
    role = disaggregation_settings(args)  # read first: a missing secret fails before the model loads
    options = engine_options(args)
    if role is not None and options.get("enable_prefix_caching") is False:
        raise ValueError("--disaggregation-mode needs the prefix cache (pages move through it): drop "
                         "--no-enable-prefix-caching")
    if role is not None and role.mode == "decode" and options.get("prefix_cache_host_bytes") is None:
        options["prefix_cache_host_bytes"] = DEFAULT_DECODE_HOST_BYTES  # transferred pages, when the pool has no room
    config = EngineConfig(model=model, tokenizer=args.tokenizer, **options)
    config.validate()  # NOTE: the options' own errors first, then the port's
    if bind is not None:
        bind()
    engine = build_engine(config)
    if args.default_max_tokens is not None and args.default_max_tokens >= engine.max_model_len:
        engine.close()
        raise ValueError(f"--default-max-tokens {args.default_max_tokens} leaves no room for a prompt within "
                         f"max_model_len {engine.max_model_len}")
    settings = ServerSettings(names, keys, args.max_queued_requests, args.default_max_tokens, template,
                              args.max_queued_per_tenant, args.reasoning_parser, args.max_request_body_bytes,
                              args.max_prompts_per_request, metrics_keys, role)
    settings.admin_api_keys, settings.weight_update_policy = admin_keys, args.weight_update_policy
    settings.exclude_tools_when_tool_choice_none = args.exclude_tools_when_tool_choice_none
    app = create_app(engine, settings)
    return app, app.state.server


PREFILL_ONLY = ("disaggregation_bootstrap_port", "disaggregation_send")  # a decode worker has no bootstrap, sends nothing


def unused_disaggregation_flags(parser: argparse.ArgumentParser, args) -> list[str]:
    """The --disaggregation-* flags given to a server whose role would ignore them: any to a colocated
    server, a prefill worker's own to a decode worker."""
    if args.disaggregation_mode == "prefill":
        return []
    names = [name for name in vars(args) if name.startswith("disaggregation_") and name != "disaggregation_mode"] \
        if args.disaggregation_mode == "null" else list(PREFILL_ONLY)
    return [f"--{name.replace('_', '-')}" for name in sorted(names) if getattr(args, name) != parser.get_default(name)]


def check_template(template: str) -> None:
    """A --chat-template that does not compile is the operator's error, at start (not each request's 400)."""
    import jinja2
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a Jinja template: {e.message} (line {e.lineno})") from None


def disaggregation_settings(args):
    """The worker's prefill or decode role from the --disaggregation-* flags (None: colocated)."""
    from ..disagg.worker import DisaggSettings, default_bootstrap_host
    from ..disagg.wire import load_secret
    if args.disaggregation_mode == "null":
        return None
    if args.disaggregation_secret_file is None:
        raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} needs --disaggregation-secret-file (the "
                         f"secret the prefill and decode workers share)")
    host = args.disaggregation_bootstrap_host or default_bootstrap_host(args.host)
    port = args.disaggregation_bootstrap_port if args.disaggregation_mode == "prefill" else None
    return DisaggSettings(args.disaggregation_mode, host, port, load_secret(args.disaggregation_secret_file),
                          args.disaggregation_timeout, args.disaggregation_transfer_backend, args.disaggregation_send)


def serve(app, state, host: str, port: int, shutdown_timeout: float, log_level: str = "info",
          sock: socket.socket | None = None) -> int:
    """Serve until a signal drains the engine; on `sock` (already listening) when given, else on host:port."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=log_level == "debug")
    server = DrainingServer(config, state, shutdown_timeout)
    if sock is not None:  # uvicorn names no address for a socket it was given
        address = sock.getsockname()
        log.info("serving on http://%s:%d", f"[{address[0]}]" if ":" in address[0] else address[0], address[1])
    server.run(sockets=None if sock is None else [sock])
    return server.exit_code


RANK_FAILURE_GRACE_S = 3.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains the engine on the first signal, aborts what is left on the second and
    exits without waiting on the third. When a rank
    of a parallel engine fails, it exits by itself with code 1 once the clients have their errors (a
    supervisor restarts it; the engine cannot step again)."""

    exit_code = 0
    _failed_at = None

    def __init__(self, config, state, shutdown_timeout: float):
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self._drain_requested = self._abort_requested = False
        self._drain_task = None

    def handle_exit(self, sig, frame) -> None:
        # NOTE: runs inside a signal handler; the drain itself starts on the next tick
        if self._abort_requested or self.should_exit:  # the drain is over: uvicorn waits for connections
            self.should_exit = self.force_exit = True
        elif self._drain_requested:
            self._abort_requested = True
        else:
            self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        from ..parallel.executor import RankFailure
        dead = self.state.loop.dead
        if isinstance(dead, RankFailure) and not self._drain_requested:
            # /health answers 503 for a while first, so that a load balancer sees why
            self._failed_at = self._failed_at or asyncio.get_running_loop().time()
            if asyncio.get_running_loop().time() - self._failed_at > RANK_FAILURE_GRACE_S:
                log.error("a rank failed; the server exits: %s", dead)
                self.exit_code, self._drain_requested = 1, True
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        loop = self.state.loop
        loop.draining = True
        log.info("draining %d request(s) for up to %.1f s", loop.num_active, self.shutdown_timeout)
        if not await loop.wait_idle(self.shutdown_timeout, lambda: self._abort_requested):
            why = "a second signal" if self._abort_requested else "shutdown timeout"
            log.warning("%s: aborting %d request(s)", why, loop.num_active)
            await loop.abort_all("the server is shutting down; the request was aborted")
        await asyncio.sleep(0.2)  # let the handlers send their last bytes
        self.should_exit = True
