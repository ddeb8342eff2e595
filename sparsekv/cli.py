"""`sparsekv generate` and `sparsekv make-tiny-model`, plus the engine options every command shares."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .config import ConfigError
from .request import InvalidRequest


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate, serve, bench and eval (names match the LLM(...) keywords)."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=16)
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
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", dest="num_threads", type=int, default=1,
                   help="torch threads (default 1: small models gain nothing from more, and on a shared "
                        "CPU an op split across a busy core waits for it; 0 = torch's default)")
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
                   help="encrypt the disk tier's pages (AES-256-GCM) with a key derived from this file's "
                        "secret (at least 32 bytes)")
    g.add_argument("--prefix-cache-disk-old-key-file", dest="prefix_cache_disk_old_key_files", action="append",
                   default=None, metavar="PATH",
                   help="a key being rotated out (repeatable): its pages are still read, and re-sealed with "
                        "--prefix-cache-disk-key-file in the background")
    g.add_argument("--prefix-cache-ttl", dest="prefix_cache_ttl_s", type=float, default=None, metavar="SECONDS",
                   help="forget prefix-cache pages unused for this long, in every tier (default: kept until evicted)")
    g.add_argument("--prefix-cache-max-pages-per-tenant", type=int, default=None, metavar="N",
                   help="at most N cached KV pool pages per tenant; older ones go to the lower tiers (default: no bound)")
    g.add_argument("--prefix-cache-tenant-share", type=float, default=None, metavar="F",
                   help="a tenant holds at most this fraction (0-1] of each prefix-cache tier: pool, host, disk "
                        "(default: no bound)")
    t = p.add_argument_group("tiered KV cache (docs/tiers.md)")
    t.add_argument("--kv-tiering", action="store_true", help="device working set per request, history in a host store")
    t.add_argument("--device-buffer-tokens", type=int, default=None, help="working-set slots N (default 2 x top-k)")
    t.add_argument("--host-kv-budget-bytes", type=parse_bytes, default=None, help="e.g. 64G")
    t.add_argument("--device-kv-budget-bytes", type=parse_bytes, default=None, help="e.g. 8G (also without tiering)")
    t.add_argument("--host-store-path", default=None, help="memory-map the host store: a directory (a fresh file is made in it) or a new file name")
    t.add_argument("--selector", default="dsa", choices=["dsa", "quest"], help="token selector of full layers")
    t.add_argument("--quest-page-tokens", type=int, default=16)
    t.add_argument("--indexer-key-dtype", default="auto", choices=["auto", "fp8_e4m3"])


def parse_bytes(text: str) -> int:
    """'123', '64K', '8M', '2G', '1T' (binary multiples) -> bytes."""
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 4096, 64K, 8G)") from None


ENGINE_ARG_NAMES = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_page_size",
                    "prefill_chunk_tokens", "num_kv_pages", "kv_cache_dtype", "kv_admission", "attention", "seed", "num_threads",
                    "kv_tiering", "device_buffer_tokens", "host_kv_budget_bytes", "device_kv_budget_bytes",
                    "host_store_path", "selector", "quest_page_tokens", "indexer_key_dtype", "num_speculative_tokens",
                    "enable_prefix_caching", "prefix_cache_host_bytes",
                    "prefix_cache_disk_path", "prefix_cache_disk_bytes", "prefix_cache_disk_key_file",
                    "prefix_cache_disk_old_key_files", "prefix_cache_ttl_s",
                    "prefix_cache_max_pages_per_tenant", "prefix_cache_tenant_share", "tenant_kv_share")


def engine_options(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}


def _prompt(args) -> str | list[int]:
    if args.prompt_token_ids:
        try:
            return [int(t) for t in args.prompt_token_ids.split(",")]
        except ValueError:
            raise InvalidRequest(f"--prompt-token-ids must be comma-separated integers, got {args.prompt_token_ids!r}")
    if args.prompt_file:
        with open(args.prompt_file) as f:
            return f.read()
    return args.prompt


def _structured_output(args) -> dict | None:
    if args.json_schema:
        with open(args.json_schema) as f:
            return {"type": "json_schema", "schema": f.read()}
    if args.json_object:
        return {"type": "json_object"}
    if args.regex:
        return {"type": "regex", "pattern": args.regex}
    if args.choice:
        return {"type": "choice", "choices": args.choice.split(",")}
    return None


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv generate")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    src.add_argument("--prompt-token-ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="prompt and output tokens; 1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output must match this JSON schema (a file)")
    shape.add_argument("--json-object", action="store_true", help="the output must be a JSON object")
    shape.add_argument("--regex", help="the output must match this regular expression")
    shape.add_argument("--choice", help="the output must be one of these comma-separated strings")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true")
    add_engine_args(p)
    return p


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    from .llm import LLM
    from .request import SamplingParams
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, logprobs=args.logprobs, seed=args.seed,
                                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                                structured_output=_structured_output(args))
        llm = LLM(args.model, **engine_options(args))
        with llm:  # saves the prefix cache to its disk tier, if one is given
            out, timing = _timed_generate(llm, _prompt(args), params)
    except (InvalidRequest, ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"sparsekv generate: error: {e}", file=sys.stderr)
        return 2
    _print_output(out, args.json)
    print(timing, file=sys.stderr)
    return 0


def _timed_generate(llm, prompt, params):
    """Prefill timed separately (max_tokens=1 semantics via the engine's first step output)."""
    engine = llm.engine
    req = engine.add_request(None, prompt, params)
    t0 = time.perf_counter()
    t_first = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            t_first = t_first or time.perf_counter()
            out = o
    t_end = time.perf_counter()
    n_prompt, n_out = req.num_prompt_tokens, len(out.token_ids)
    decode_ms = (t_end - t_first) * 1000 / max(n_out - 1, 1)
    timing = (f"prefill: {n_prompt} tokens in {t_first - t0:.3f} s ({n_prompt / (t_first - t0):.1f} tokens/s); "
              f"decode: {n_out} tokens, {decode_ms:.2f} ms/token")
    return out, timing


def _print_output(out, as_json: bool) -> None:
    if as_json:
        logprobs = None if out.logprobs is None else [{str(k): v for k, v in d.items()} for d in out.logprobs]
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason, "cached_tokens": out.num_cached_tokens,
                          "cached_tokens_disk": (out.metrics or {}).get("prefix_cached_tokens_disk", 0)}))
    else:
        print(out.text if out.text else " ".join(map(str, out.token_ids)))


def make_tiny_parser() -> argparse.ArgumentParser:
    from .tools.tiny import PRESETS
    p = argparse.ArgumentParser(prog="sparsekv make-tiny-model")
    p.add_argument("path")
    p.add_argument("--family", default="glm_moe_dsa", choices=["glm_moe_dsa", "deepseek_v32"])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    return p


def make_tiny_main(argv: list[str]) -> int:
    from .tools.tiny import PRESETS, save_reference_checkpoint
    args = make_tiny_parser().parse_args(argv)
    save_reference_checkpoint(args.path, args.family, args.seed, **PRESETS[args.preset])
    print(f"wrote {args.preset} {args.family} checkpoint to {args.path}")
    return 0
