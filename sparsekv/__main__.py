"""The `sparsekv` command: dispatch only. Each subcommand's module owns its options."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("sparsekv.cli", "generate_main", "generate text from a prompt"),
    "make-tiny-model": ("sparsekv.cli", "make_tiny_main", "write a tiny random-weight checkpoint"),
    "serve": ("sparsekv.server.cli", "main", "OpenAI-compatible server"),
    "bench": ("sparsekv.tools.bench", "main",
              "benchmarks: decode | prefill | modes | tiers | spec | indexer | serve | prefix | batch | sampling | admission | kv-dtype"),
    "plan": ("sparsekv.tools.plan", "main", "capacity planner and decode roofline"),
    "eval": ("sparsekv.tools.evals", "main", "long-context and IndexShare evals"),
    "train": ("sparsekv.train.cli", "main", "train the small bundled model"),
}


def usage() -> str:
    lines = ["usage: sparsekv COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"sparsekv: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
