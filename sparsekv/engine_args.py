"""The engine options every command that builds an engine shares (`generate`, `serve`), as argparse
arguments named after the LLM(...) / EngineConfig keywords. Below both `cli.py` and `server/cli.py`
(the server must not depend on the top-level CLI; tests/test_imports.py), and torch-free."""
from __future__ import annotations

import argparse
import re

from .config import COMPUTE_DTYPES, ConfigError
from .units import parse_bytes


def port_number(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {port}")
    return port


def at_least(low, kind=int, high=None):
    """An argparse type: a finite number of `kind` that is >= low (and <= high, where given). Infinity is
    refused: the options taking it are timeouts, and a wait without end is what a timeout exists to stop."""
    def parse(text: str):
        value = kind(text)
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def above(low, kind=float):
    """An argparse type: a number of `kind` that is > low (infinity allowed, NaN not)."""
    def parse(text: str):
        value = kind(text)
        if not value > low:
            raise argparse.ArgumentTypeError(f"must be > {low}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def positive_finite(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, a learning rate)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def output_path(text: str) -> str:
    """An argparse type: a file to write, in a directory that exists (checked before any work runs)."""
    import os
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: its directory {parent} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    return text


def json_object(text: str) -> dict:
    """An argparse type: a JSON object."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options of `generate` and `serve` (names match the LLM(...) keywords)."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", *COMPUTE_DTYPES],
                   help="the compute dtype; auto (default): float32 on CPU, on CUDA the checkpoint's 16-bit dtype "
                        "(bfloat16 for a float32 or FP8 checkpoint)")
    g.add_argument("--revision", default=None,
                   help="the Hub branch, tag or commit of a MODEL given as a repo id ORG/NAME (default: main)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="config.json fields to override, as vLLM's: e.g. '{\"max_position_embeddings\": 1048576}'")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="the most alternatives per token a request may ask for (logprobs, top_logprobs, "
                        "prompt_logprobs; default 20, vLLM's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--kv-page-size", type=int, default=64)
    g.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    g.add_argument("--num-kv-pages", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="latents in the model dtype (auto), or FlashMLA's FP8 rows (fp8: 656 B per token and layer "
                        "at GLM-5's size, vLLM's fp8_ds_mla); a quantization, see BENCHMARKS.md")
    g.add_argument("--kv-admission", default="reserve", choices=["reserve", "optimistic"],
                   help="reserve: pages for prompt + max_tokens at admission, never preempt (default); optimistic: "
                        "pages as tokens come, preempting (and later recomputing) the newest request when they run out")
    g.add_argument("--tenant-kv-share", type=float, default=None, metavar="F",
                   help="a tenant's share (0-1] of the KV cache: a cap with reserving admission (its other requests "
                        "wait), a guarantee with --kv-admission optimistic (those over theirs are preempted for a "
                        "tenant within it) (default: none)")
    g.add_argument("--attention", default="sparse", choices=["sparse", "dense"],
                   help="dense turns top-k selection off (baseline for measuring the mechanism)")
    graphs = g.add_mutually_exclusive_group()
    graphs.add_argument("--decode-graphs", default="auto", choices=["auto", "off", "eager"],
                   help="decode steps as fixed-shape pieces per batch-size bucket: auto replays them from "
                        "CUDA graphs on a CUDA device, except drafts with working sets under "
                        "(1 + drafts) x top-k (there the engine's decode path); eager runs the pieces uncaptured, for checking (docs/exactness.md)")
    graphs.add_argument("--disable-cuda-graph", dest="decode_graphs", action="store_const", const="off",
                   help="the same as --decode-graphs off")
    g.add_argument("--cuda-graph-max-bs", type=int, default=64, metavar="N",
                   help="the largest decode batch run through the decode graphs (buckets: powers of two up to N, "
                        "and N)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--weight-update-host-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the tensors of in-process weight updates in host memory, for later partial "
                        "updates and to put a failed one back (default on; off: no host copy, see docs/rl.md)")
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="torch threads (default: LLM()'s, one per GiB of weights a decode token reads, so 1 for "
                        "small models, whose small ops only wait on more; threads.py; 0 = torch's default)")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="MTP draft tokens per step (0 = off; 1 = one draft, verified exactly)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse earlier prompts' full KV pages, per tenant and cache_salt (default on; "
                        "docs/prefix_cache.md)")
    g.add_argument("--prefix-cache-host-bytes", type=parse_bytes, default=None,
                   help="host memory for evicted prefix-cache pages, copied back on a hit (e.g. 8G; default none)")
    g.add_argument("--prefix-cache-disk-path", default=None,
                   help="directory for prefix-cache pages pushed out of host memory, kept across restarts "
                        "(needs --prefix-cache-disk-bytes)")
    g.add_argument("--prefix-cache-disk-bytes", type=parse_bytes, default=None,
                   help="the disk tier's budget (e.g. 100G)")
    g.add_argument("--prefix-cache-disk-key-file", default=None, metavar="PATH",
                   help="the disk tier's pages are encrypted (AES-256-GCM) with a key derived from this file's "
                        "secret (at least 32 bytes) (default: a key generated in the tier's directory)")
    g.add_argument("--prefix-cache-disk-old-key-file", dest="prefix_cache_disk_old_key_files", action="append",
                   default=None, metavar="PATH",
                   help="a key being rotated out (repeatable): its pages are still read, and re-sealed with "
                        "the current key in the background")
    g.add_argument("--prefix-cache-disk-unencrypted", action="store_true",
                   help="write the disk tier's pages in plaintext (anyone who can read them can read the "
                        "prompts back; default: encrypted)")
    g.add_argument("--prefix-cache-ttl", dest="prefix_cache_ttl_s", type=float, default=None, metavar="SECONDS",
                   help="forget prefix-cache pages unused for this long, in every tier (default: kept until evicted)")
    g.add_argument("--prefix-cache-max-pages-per-tenant", type=int, default=None, metavar="N",
                   help="at most N cached KV pool pages per tenant; older ones go to the lower tiers (default: no bound)")
    g.add_argument("--prefix-cache-tenant-share", type=float, default=None, metavar="F",
                   help="a tenant holds at most this fraction (0-1] of each prefix-cache tier: pool, host, disk "
                        "(default: no bound)")
    d = p.add_argument_group("parallelism (docs/parallel.md)")
    d.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks sharing each layer: query heads, MLPs and the vocabulary split across them")
    d.add_argument("-dp", "--data-parallel-size", type=int, default=1, help="data-parallel attention groups")
    d.add_argument("--enable-expert-parallel", action="store_true",
                   help="whole routed experts per rank (E / world each) instead of each expert sharded")
    d.add_argument("--nnodes", type=int, default=1, help="nodes the ranks run on (each runs this command)")
    d.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 serves, the others host ranks")
    d.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address (default: MASTER_ADDR:MASTER_PORT, else a free local port)")
    d.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=60.0, metavar="SECONDS",
                   help="a collective waiting longer than this fails the engine instead of hanging")
    d.add_argument("--dist-startup-timeout", dest="dist_startup_timeout_s", type=float, default=900.0, metavar="SECONDS",
                   help="how long the ranks may take to join, load their shards and report (start-up fails after)")
    t = p.add_argument_group("tiered KV cache (docs/tiers.md)")
    t.add_argument("--kv-tiering", action="store_true", help="device working set per request, history in a host store")
    t.add_argument("--device-buffer-tokens", type=int, default=None, help="latent slots of each device working set per request and layer (default 2 x top-k)")
    t.add_argument("--host-kv-budget-bytes", type=parse_bytes, default=None, help="e.g. 64G")
    t.add_argument("--device-kv-budget-bytes", type=parse_bytes, default=None, help="e.g. 8G (also without tiering)")
    t.add_argument("--host-store-path", default=None, help="memory-map the host store: a directory (a fresh file is made in it) or a new file name")
    t.add_argument("--selector", default="dsa", choices=["dsa", "quest"], help="token selector of full layers")
    t.add_argument("--quest-page-tokens", type=int, default=None,
                   help="positions per Quest page, dividing --kv-page-size (--selector quest only; default 16)")
    t.add_argument("--indexer-key-dtype", default="auto", choices=["auto", "fp8_e4m3"])


ENGINE_ARG_NAMES = ("dtype", "revision", "device", "max_model_len", "hf_overrides", "max_num_seqs", "max_logprobs", "max_num_batched_tokens", "kv_page_size",
                    "prefill_chunk_tokens", "num_kv_pages", "kv_cache_dtype", "kv_admission", "attention", "decode_graphs",
                    "cuda_graph_max_bs", "seed", "weight_update_host_copy", "num_threads",
                    "kv_tiering", "device_buffer_tokens", "host_kv_budget_bytes", "device_kv_budget_bytes",
                    "host_store_path", "selector", "quest_page_tokens", "indexer_key_dtype", "num_speculative_tokens",
                    "enable_prefix_caching", "prefix_cache_host_bytes",
                    "prefix_cache_disk_path", "prefix_cache_disk_bytes", "prefix_cache_disk_key_file",
                    "prefix_cache_disk_old_key_files", "prefix_cache_disk_unencrypted", "prefix_cache_ttl_s",
                    "prefix_cache_max_pages_per_tenant", "prefix_cache_tenant_share", "tenant_kv_share",
                    "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "nnodes", "node_rank",
                    "dist_init_addr", "dist_timeout_s", "dist_startup_timeout_s")


def read_text_option(path: str, flag: str) -> str:
    """The UTF-8 text of the file an option names; ValueError naming the option when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine options as LLM(...) / EngineConfig keywords. ConfigError for an option that
    only applies with another one which is not given (the engine would ignore it)."""
    options = {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}
    if options.get("quest_page_tokens", 0) is None:
        del options["quest_page_tokens"]  # the engine's default
    elif "quest_page_tokens" in options and options.get("selector") != "quest":
        raise ConfigError("--quest-page-tokens only applies with --selector quest")
    return options


def flags_by_dest(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's dest -> its long flag (`num_threads` -> `--threads`): the engine options' dests
    are the EngineConfig fields, so this names the flag behind a field a ConfigError names."""
    flags = {}
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in flags:
            flags[action.dest] = long[0]
    return flags


_FIELD_REFERENCE = re.compile(r"(?<![\w./-])([a-z][a-z0-9_]*)(?![\w-])(=True\b|='([^'\s]*)')?")


def with_flag_names(message: str, flags: dict[str, str]) -> str:
    """A ConfigError's message with the config fields it names replaced by their flags (`num_threads
    must be ...` -> `--threads must be ...`, `kv_tiering=True` -> `--kv-tiering`, `selector='quest'` ->
    `--selector quest`). A field name that is also an English word (device, seed) counts only as the
    message's first word or before `=`."""
    def replace(match: re.Match) -> str:
        name, value = match.group(1), match.group(3)
        is_field = "_" in name or match.start() == 0 or match.string.startswith("=", match.end(1))
        if name not in flags or not is_field:
            return match.group(0)
        if value is not None:
            return f"{flags[name]} {value}"
        return flags[name]
    return _FIELD_REFERENCE.sub(replace, message)


def engine_error(error: Exception, parser: argparse.ArgumentParser) -> str:
    """The text of an error building an engine from the command line: a ConfigError's fields named by
    the parser's flags, any other error as it is."""
    if isinstance(error, ConfigError):
        return with_flag_names(str(error), flags_by_dest(parser))
    return str(error)


def non_default_args(parser: argparse.ArgumentParser, args: argparse.Namespace, secret: tuple[str, ...] = (),
                     inputs: tuple[str, ...] = ()) -> dict:
    """The parsed options that differ from their defaults, in the parser's order, for the startup log
    (vLLM's "non-default args" line): the values of `secret` options replaced by '<redacted>', `inputs`
    (prompts: data, not settings) left out."""
    return {name: "<redacted>" if name in secret else value for name, value in vars(args).items()
            if name not in inputs and value != parser.get_default(name)}
