"""Every `sparsekv ...` command in README.md, BENCHMARKS.md and docs/*.md parses with the real CLI.

What is a command: a shell word `sparsekv` (also after `python -m`, `/usr/bin/time -v`, `VAR=1`) and
what follows it, in a fenced code block (except python/json ones) or an inline code span. Lines ending
in `\\` join the next line (in a code block, so does an indented line starting with `-` or `[`), a
code span may run over several lines, a line is cut into commands at `&&`, `||` and `;`, and a
command ends at a pipe, a redirection or a `#` comment. `from sparsekv import ...` and the bare word
`sparsekv` are not commands.

The rule, one of three checks per command:

* A **usage summary** (synopsis) is a command with `[` `]`, `...` / `…`, or `a|b` alternatives in it
  (outside quotes), e.g. `sparsekv generate [MODEL] --prompt TEXT | --prompt-file F` or
  `sparsekv bench decode|prefill|...`. It is checked for its command path (every alternative must be
  a command, sub-benchmark, eval or `bench` kind that exists) and for its option names (each `--flag`
  must be an option of that command's parser); values are not checked.
* A **mention**, only command names (`sparsekv plan`, `sparsekv bench serve` in prose), is checked for
  those names.
* Anything else is a **concrete command** and is parsed in full by the parser `sparsekv` itself would
  use (`sparsekv.__main__.parser_for`), without running it. An upper-case word (`K`, `F`, `MODEL`) or
  `<name>` given as an option's value is a placeholder: it is replaced by a value that option accepts
  (its first choice, else `1`), so the option name and the rest of the line are still checked.

Options are spelled in full (argparse would take `--context` for `--contexts`). Only argparse's
parse is checked: what a command validates once it runs (a checkpoint that exists, a
bench's ">= 1" checks) is not.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparsekv.__main__ import COMMANDS, PARSERS, parser_for

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = ["README.md", "BENCHMARKS.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
SKIP_FENCES = {"python", "py", "pycon", "json", "jsonl", "jinja", "yaml", "toml"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SYNOPSIS = re.compile(r"\[|\]|\.\.\.|…|\S\|\S")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^<>\s]+>)$")
WORD = re.compile(r"(?:^|(?<=\s))sparsekv(?=\s|$)")
OPTION = re.compile(r"(?:^|(?<=[\s\[|(]))(--?[A-Za-z][\w-]*)")


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int
    text: str          # what follows `sparsekv`
    synopsis: bool

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: `sparsekv {self.text}`"


# ---------------------------------------------------------------- extraction

def snippets(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of each logical line of a fenced block and each inline code span."""
    out: list[tuple[int, str]] = []
    lines = markdown.splitlines()
    fence, fence_lang, para, para_start = None, "", [], 0

    def flush_paragraph():
        text = "\n".join(para)
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
            line = para_start + text.count("\n", 0, m.start())
            out.append((line, m.group(2).replace("\n", " ").strip()))
        para.clear()

    i = 0
    while i < len(lines):
        raw, number = lines[i], i + 1
        i += 1
        m = FENCE.match(raw)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
                fence = None
            elif fence_lang not in SKIP_FENCES:
                logical = raw
                while i < len(lines) and not FENCE.match(lines[i]) and (
                        logical.rstrip().endswith("\\") or re.match(r"\s+[-\[]", lines[i])):
                    logical = logical.rstrip().removesuffix("\\") + " " + lines[i]
                    i += 1
                out.append((number, re.sub(r"^\s*\$\s+", "", logical).strip()))
            continue
        if m:
            flush_paragraph()
            fence, fence_lang = m.group(1), m.group(2).lower()
        elif not raw.strip():
            flush_paragraph()
        elif raw.lstrip().startswith("|"):       # a table row: its spans end with it; \| is a literal |
            flush_paragraph()
            para_start = number
            para.append(raw.replace("\\|", "|"))
            flush_paragraph()
        else:
            if not para:
                para_start = number
            para.append(raw)
    flush_paragraph()
    return out


def commands_in(text: str) -> list[tuple[str, bool]]:
    """(what follows `sparsekv`, is it a synopsis) for each command in one snippet."""
    out = []
    for segment in re.split(r"\s*(?:&&|\|\||;)\s*", text):
        m = WORD.search(segment)
        if m is None or segment[:m.start()].split()[-1:] in (["from"], ["import"]):
            continue
        rest = segment[m.end():].strip()
        unquoted = re.sub(r"\"[^\"]*\"|'[^']*'", "", rest)
        if SYNOPSIS.search(unquoted):
            out.append((rest, True))
            continue
        rest = re.split(r"\s\|\s", rest)[0].strip()          # a pipe into another program
        if rest and not rest.startswith("#"):
            out.append((rest, False))
    return out


def doc_commands(files=DOC_FILES, root: Path = ROOT) -> list[DocCommand]:
    found = []
    for name in files:
        for line, text in snippets((root / name).read_text()):
            found += [DocCommand(name, line, rest, synopsis) for rest, synopsis in commands_in(text)]
    return found


# ---------------------------------------------------------------- checking

class DocCommandError(Exception):
    pass


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings]


def resolve(words: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The innermost parser of a command path (`eval needle` -> needle's), checking each command word,
    and how many of `words` are command words."""
    if words[0] not in PARSERS:
        raise DocCommandError(f"unknown command {words[0]!r} (commands: {', '.join(COMMANDS)})")
    parser, rest = parser_for(words)
    positionals, i, used = _positionals(parser), 0, len(words) - len(rest)
    for word in rest:
        if i >= len(positionals) or not positionals[i].choices or word.startswith("-"):
            break
        choices = positionals[i].choices
        if word not in choices:
            raise DocCommandError(f"{parser.prog}: {word!r} is not one of {', '.join(choices)}")
        if isinstance(positionals[i], argparse._SubParsersAction):
            parser, positionals, i = choices[word], _positionals(choices[word]), 0
        else:
            i += 1
        used += 1
    return parser, used


def _run_parser(parser: argparse.ArgumentParser, args: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as e:
        if e.code:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            raise DocCommandError(lines[-1] if lines else f"exit status {e.code}") from None
    except Exception as e:   # sparsekv plan's parser raises its usage errors (PlanError)
        raise DocCommandError(f"{parser.prog}: error: {e}") from None


def _accepted_value(action: argparse.Action, word: str) -> str:
    convert = action.type if callable(action.type) else str
    for value in [word, *map(str, action.choices or ()), "1", "1K", "0.5"]:
        try:
            converted = convert(value)
        except Exception:
            continue
        if not action.choices or converted in action.choices:
            return value
    return word


def fill_placeholders(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`--threads T` -> `--threads 1`: a placeholder given as an option's value becomes one it accepts."""
    inner = _subparser(parser, args)
    out, action = [], None
    for word in args:
        if word.startswith("-") and not re.fullmatch(r"-[\d.]+", word):
            action = inner._option_string_actions.get(word.split("=")[0])
        elif action is not None and action.nargs != 0:
            if PLACEHOLDER.match(word):
                word = _accepted_value(action, word)
            if action.nargs in (None, "?"):     # its one value given: what follows is positional
                action = None
        out.append(word)
    return out


def _subparser(parser: argparse.ArgumentParser, args: list[str]) -> argparse.ArgumentParser:
    sub = next((a for a in _positionals(parser) if isinstance(a, argparse._SubParsersAction)), None)
    if sub is not None and args and args[0] in sub.choices:
        return sub.choices[args[0]]
    return parser


def check_concrete(text: str) -> None:
    try:
        words = shlex.split(text, comments=True)
    except ValueError as e:
        raise DocCommandError(f"cannot split it into shell words: {e}") from None
    cut = next((i for i, w in enumerate(words) if re.match(r"^(\d?>|&>|<(?![^<>\s]+>$)|&$|\|)", w)), len(words))
    words = words[:cut]
    if not words or resolve(words)[1] == len(words):   # `sparsekv bench serve` in prose: a mention, its name is checked
        return
    parser, args = parser_for(words)
    _run_parser(parser, fill_placeholders(parser, args))
    inner = _subparser(parser, args)
    short = [w for w in args if w.startswith("--") and w.split("=")[0] not in inner._option_string_actions]
    if short:   # argparse takes a unique prefix; a new option sharing it would break the doc
        raise DocCommandError(f"{inner.prog}: {', '.join(short)}: abbreviated, write the option in full")


def check_synopsis(text: str) -> None:
    words = re.sub(r"\"[^\"]*\"|'[^']*'", "", text).split()
    path = list(itertools.takewhile(
        lambda w: not (w.startswith(("-", "[", "<", "#")) or PLACEHOLDER.match(w) or "..." in w or "…" in w), words))
    options = OPTION.findall(" ".join(words).split(" #")[0])
    if not path:                          # `sparsekv ...`: the command in general
        return
    for alternative in itertools.product(*(w.split("|") for w in path)):
        parser = resolve(list(alternative))[0]
        unknown = [o for o in options if o not in parser._option_string_actions]
        if unknown:
            raise DocCommandError(f"{parser.prog}: no option {', '.join(unknown)}")


def check(command: DocCommand) -> None:
    (check_synopsis if command.synopsis else check_concrete)(command.text)


# ---------------------------------------------------------------- the tests

COMMANDS_IN_DOCS = doc_commands()


@pytest.mark.parametrize("command", COMMANDS_IN_DOCS, ids=lambda c: f"{c.file}:{c.line}")
def test_doc_command_parses(command: DocCommand):
    try:
        check(command)
        error = None
    except DocCommandError as e:
        error = str(e)
    if error:
        pytest.fail(f"{command}\n  {'usage summary' if command.synopsis else 'command'} does not parse: {error}",
                    pytrace=False)


def test_commands_found_in_every_kind_of_doc():
    by_file = {c.file for c in COMMANDS_IN_DOCS}
    assert {"README.md", "BENCHMARKS.md", "docs/server.md", "docs/tiers.md", "docs/plan.md"} <= by_file
    assert sum(not c.synopsis for c in COMMANDS_IN_DOCS) >= 100
    assert sum(c.synopsis for c in COMMANDS_IN_DOCS) >= 10


def test_every_command_has_a_parser():
    assert PARSERS.keys() == COMMANDS.keys()
    for name in COMMANDS:
        assert isinstance(parser_for([name])[0], argparse.ArgumentParser)


SAMPLE = """\
Run `sparsekv bench prefill --contexts 16K --threads 1
--decode-steps 4` (a span over two lines), then `sparsekv bench serve --url ...` and
`/usr/bin/time -v sparsekv bench decode --contexts 4K --threads T`.

| figure | `sparsekv plan glm-5.2 --context 1M` |

```bash
python -m sparsekv train --out runs/x --steps 1,0,0,0 \\
    --seed 0 && python -m sparsekv eval loss runs/x --seq-len 64
OMP_NUM_THREADS=1 sparsekv serve --port 8392   # a comment
sparsekv bench decode|prefill|modes
sparsekv bench serve [--num-prompts 100]
    [--output-len 128]
```

```python
from sparsekv import LLM
```
"""


def test_extraction_rule(tmp_path):
    (tmp_path / "x.md").write_text(SAMPLE)
    got = [(c.line, c.text, c.synopsis) for c in doc_commands(["x.md"], tmp_path)]
    assert got == [
        (1, "bench prefill --contexts 16K --threads 1 --decode-steps 4", False),
        (2, "bench serve --url ...", True),
        (3, "bench decode --contexts 4K --threads T", False),
        (5, "plan glm-5.2 --context 1M", False),
        (8, "train --out runs/x --steps 1,0,0,0      --seed 0", False),
        (8, "eval loss runs/x --seq-len 64", False),
        (10, "serve --port 8392   # a comment", False),
        (11, "bench decode|prefill|modes", True),
        (12, "bench serve [--num-prompts 100]     [--output-len 128]", True),
    ]
    for c in doc_commands(["x.md"], tmp_path):
        check(c)


@pytest.mark.parametrize("text, synopsis, message", [
    ("bench prefill --contexts 16K --transformers-max-context 0K", False,
     "argument --transformers-max-context: context '0K' must be at least 1 token"),
    ("bench decode --contxts 4K", False, "unrecognized arguments: --contxts 4K"),
    ("bench decode --context 4K", False, "--context: abbreviated, write the option in full"),
    ("bench serve --num-prompts many", False, "argument --num-prompts: invalid int value: 'many'"),
    ("bench serv --num-prompts 8", False, "'serv' is not one of decode, prefill, modes"),
    ("plan glm-5.2 --tiering --miss-rate", False, "argument --miss-rate: expected one argument"),
    ("eval needle MODEL --lengths L --no-such-flag", False, "unrecognized arguments: --no-such-flag"),
    ("generate [MODEL] --prompt TEXT [--max-token N]", True, "sparsekv generate: no option --max-token"),
    ("bench decode|prefil|modes", True, "'prefil' is not one of decode, prefill, modes"),
    ("benchmark decode", False, "unknown command 'benchmark'"),
])
def test_a_broken_command_fails_with_argparse_message(text, synopsis, message):
    with pytest.raises(DocCommandError, match=re.escape(message)):
        check(DocCommand("x.md", 1, text, synopsis))
