"""The `sparsekv` command: dispatch only. Each subcommand's module owns its options."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

COMMANDS = {
    "generate": ("sparsekv.cli", "generate_main", "generate text from a prompt"),
    "make-tiny-model": ("sparsekv.cli", "make_tiny_main", "write a tiny random-weight checkpoint"),
    "serve": ("sparsekv.server.cli", "main", "OpenAI-compatible server"),
    "router": ("sparsekv.disagg.router", "main", "prefill/decode disaggregation's front end"),
    "bench": ("sparsekv.tools.bench", "main",
              "benchmarks: decode | prefill | modes | tiers | spec | indexer | serve | prefix | batch | sampling | "
              "admission | kv-dtype | parallel | transfer | weight-sync"),
    "plan": ("sparsekv.tools.plan", "main", "capacity planner and decode roofline"),
    "eval": ("sparsekv.tools.evals", "main", "long-context and IndexShare evals"),
    "train": ("sparsekv.train.cli", "main", "train the small bundled model"),
    "rollout": ("sparsekv.rollout.cli", "rollout_main", "agentic RL episodes with reward-hack interception"),
    "rl": ("sparsekv.rollout.cli", "rl_main", "reward-hack filter on logged actions: screen | eval-filter"),
}


# each command's parser, built without running anything (`parser_for`; tests/test_docs_commands.py)
PARSERS = {
    "generate": ("sparsekv.cli", "generate_parser"),
    "make-tiny-model": ("sparsekv.cli", "make_tiny_parser"),
    "serve": ("sparsekv.server.cli", "build_parser"),
    "router": ("sparsekv.disagg.router", "build_parser"),
    "bench": ("sparsekv.tools.bench", "parser_for"),   # takes the arguments: each sub-benchmark has its own
    "plan": ("sparsekv.tools.plan", "build_parser"),
    "eval": ("sparsekv.tools.evals", "build_parser"),
    "train": ("sparsekv.train.cli", "build_parser"),
    "rollout": ("sparsekv.rollout.cli", "build_rollout_parser"),
    "rl": ("sparsekv.rollout.cli", "build_rl_parser"),
}


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The argparse parser `sparsekv ARGV` hands its options to, and the arguments it gets. Builds the
    parser only: no model is loaded, nothing runs. KeyError for a command that does not exist."""
    module, func = PARSERS[argv[0]]
    build = getattr(importlib.import_module(module), func)
    return build(argv[1:]) if argv[0] == "bench" else (build(), argv[1:])


def usage() -> str:
    lines = ["usage: sparsekv COMMAND [options] | sparsekv --version", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):  # the version GET /version answers
        print(importlib.metadata.version("sparsekv"))
        return 0
    if argv[0] not in COMMANDS:
        print(f"sparsekv: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
