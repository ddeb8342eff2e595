"""`sparsekv generate` and `sparsekv make-tiny-model`. The engine options they share with `serve` are in
engine_args.py."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time

from .config import ConfigError
from .engine_args import add_engine_args, engine_error, engine_options, non_default_args, read_text_option
from .request import InvalidRequest

PROMPT_ARGS = ("prompt", "prompt_file", "prompt_token_ids")  # data, not settings: left out of the startup line


def _prompt(args) -> str | list[int]:
    if args.prompt_token_ids is not None:  # NOTE: not truthiness: an empty value is an error, not no prompt
        try:
            return [int(t) for t in args.prompt_token_ids.split(",")]
        except ValueError:
            raise InvalidRequest(f"--prompt-token-ids must be comma-separated integers, got {args.prompt_token_ids!r}")
    if args.prompt_file is not None:
        return read_text_option(args.prompt_file, "--prompt-file")
    return args.prompt


def _structured_output(args) -> dict | None:
    if args.json_schema is not None:
        return {"type": "json_schema", "schema": read_text_option(args.json_schema, "--json-schema")}
    if args.json_object:
        return {"type": "json_object"}
    if args.regex:
        return {"type": "regex", "pattern": args.regex}
    if args.choice is not None:  # NOTE: not truthiness: --choice '' must not generate free text
        return {"type": "choice", "choices": args.choice.split(",")}
    return None


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv generate")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face repo id ORG/NAME (default: the bundled model)")
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
    parser = generate_parser()
    args = parser.parse_args(argv)
    print(f"sparsekv {importlib.metadata.version('sparsekv')}, non-default args: "
          f"{non_default_args(parser, args, inputs=PROMPT_ARGS)}", file=sys.stderr)
    from .llm import LLM
    from .parallel.launch import RankFailure, StartupError
    from .request import SamplingParams
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, logprobs=args.logprobs, seed=args.seed,
                                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                                structured_output=_structured_output(args))
        prompt = _prompt(args)  # read first: a wrong --prompt-file fails before the weights load
        llm = LLM(args.model, **engine_options(args))
        with llm:  # saves the prefix cache to its disk tier, if one is given
            out, timing = _timed_generate(llm, prompt, params)
    except (InvalidRequest, ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"sparsekv generate: error: {engine_error(e, parser)}", file=sys.stderr)
        return 2
    except (StartupError, RankFailure) as e:  # a worker rank's own error, one that never came, or one that died
        print(f"sparsekv generate: error: {e}", file=sys.stderr)
        return 1
    _print_output(out, args.json, llm.tokenizer is not None)
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


def _print_output(out, as_json: bool, has_tokenizer: bool) -> None:
    if as_json:
        logprobs = None if out.logprobs is None else [{str(k): v for k, v in d.items()} for d in out.logprobs]
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason, "cached_tokens": out.num_cached_tokens,
                          "cached_tokens_disk": (out.metrics or {}).get("prefix_cached_tokens_disk", 0)}))
    else:
        print(out.text if has_tokenizer else " ".join(map(str, out.token_ids)))  # no tokenizer: no text


def make_tiny_parser() -> argparse.ArgumentParser:
    from .tools.tiny import PRESETS
    p = argparse.ArgumentParser(prog="sparsekv make-tiny-model")
    p.add_argument("path", help="the checkpoint directory to write; one that holds files is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what PATH holds, whole: files only the old checkpoint had go")
    p.add_argument("--family", default="glm_moe_dsa", choices=["glm_moe_dsa", "deepseek_v32"])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    return p


def make_tiny_main(argv: list[str]) -> int:
    """As `sparsekv train --out`: PATH is checked before any work, and replaced whole or not at all."""
    from .tools.tiny import PRESETS, save_reference_checkpoint
    from .train.cli import UsageError, check_output_dir, write_dir_whole
    args = make_tiny_parser().parse_args(argv)
    try:
        check_output_dir(args.path, args.overwrite, label=args.path)
    except UsageError as e:
        print(f"sparsekv make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    try:
        write_dir_whole(args.path, lambda staging: save_reference_checkpoint(
            staging, args.family, args.seed, **PRESETS[args.preset]))
    except OSError as e:
        print(f"sparsekv make-tiny-model: error: {args.path}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} {args.family} checkpoint to {args.path}")
    return 0
