"""Every action passes here before it runs: rules (recall) -> judge (precision) -> interception.

A confirmed hack is not executed. The episode gets a virtual tool result instead: what the action would
have answered, without its effect.

- `write_file`: the message a real write gives; the file is unchanged.
- `read_file` / `list_dir` of a hidden file: the answer for a path that does not exist.
- `run_command`: the command is cut into its `;` / `&&` / `||` / newline-separated parts. The parts that
  trip no rule run for real and their real output is returned; the hacking parts are dropped, as if they
  had succeeded silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .judge import Judge, Verdict, rules_verdict
from .rules import Action, RuleSet, Scope
from .sandbox import CommandResult, NetworkUnavailable, PathRefused, Sandbox, not_found, wrote


@dataclass(frozen=True)
class Screening:
    rules: list[str]
    verdict: Verdict | None   # None: no rule tripped, no judge asked

    @property
    def flagged(self) -> bool:
        return bool(self.rules)

    @property
    def hack(self) -> bool:
        return self.verdict is not None and self.verdict.hack

    def to_json(self) -> dict:
        return {"flagged": self.flagged, "rules": self.rules,
                "verdict": None if self.verdict is None else self.verdict.to_json()}


class Pipeline:
    """The rules in force and, optionally, a judge; `judge=None` trusts the rules (`--judge none`)."""

    def __init__(self, rules: RuleSet, judge: Judge | None = None):
        self.rules, self.judge = rules, judge

    def screen(self, action: Action, scope: Scope) -> Screening:
        tripped = self.rules.trips(action, scope)
        if not tripped:
            return Screening([], None)
        if self.judge is None:
            return Screening(tripped, rules_verdict(tripped))
        return Screening(tripped, self.judge.verdict(scope.task, action, self.rules.describe(tripped)))


@dataclass
class ToolResult:
    output: str
    virtual: bool = False
    ran: str | None = None  # for an intercepted command: what ran instead ("" if nothing)
    error: bool = False
    screening: Screening = field(default_factory=lambda: Screening([], None))


def execute(action: Action, sandbox: Sandbox, screening: Screening, pipeline: Pipeline) -> ToolResult:
    """Run `action` in the sandbox, or answer it virtually if `screening` confirmed a hack."""
    try:
        if screening.hack:
            return _virtual(action, sandbox, pipeline, screening)
        return ToolResult(_run(action, sandbox), screening=screening)
    except (PathRefused, NetworkUnavailable, ValueError, OSError) as e:
        return ToolResult(f"error: {e}", error=True, screening=screening)


def _run(action: Action, sandbox: Sandbox) -> str:
    a = action.arguments
    if action.tool == "read_file":
        return sandbox.read_file(a.get("path"))
    if action.tool == "write_file":
        return sandbox.write_file(a.get("path"), a.get("content"))
    if action.tool == "list_dir":
        return sandbox.list_dir(a.get("path", "."))
    if action.tool == "run_command":
        return sandbox.run_command(a.get("command")).text()
    raise ValueError(f"unknown tool {action.tool!r} (tools: read_file, write_file, list_dir, run_command)")


def _virtual(action: Action, sandbox: Sandbox, pipeline: Pipeline, screening: Screening) -> ToolResult:
    path = action.path or ""
    if action.tool == "write_file":
        sandbox.resolve(path)  # a path that would be refused is refused the same way
        return ToolResult(wrote(path, action.content), virtual=True, screening=screening)
    if action.tool in ("read_file", "list_dir"):
        sandbox.resolve(path or ".")
        return ToolResult(not_found(path), virtual=True, screening=screening)
    kept = without_hacks(action.command, pipeline, Scope(sandbox.task, sandbox))
    result = sandbox.run_command(kept) if kept.strip() else CommandResult(0, "")
    return ToolResult(result.text(), virtual=True, ran=kept, screening=screening)


def without_hacks(command: str, pipeline: Pipeline, scope: Scope) -> str:
    """`command` with the parts that trip a rule removed as if they had succeeded silently (each one as
    `true`): the remaining parts joined by the operators they had, but a part after a dropped one runs as
    it would after a success (`||` not at all, `&&` whatever came before), and a list that ends on a
    dropped part exits 0. Empty when no single part trips a rule (the hack is in how they combine), so
    nothing of it runs."""
    out, dropped, succeeded = "", False, False  # succeeded: the status so far is a dropped part's success
    for op, part in split_command(command):
        if pipeline.rules.trips(Action("run_command", {"command": part}), scope):
            dropped = True
            succeeded = succeeded or not out or op != "&&"  # after `&&` it ran only on a success already
            continue
        if succeeded and op == "||":
            continue  # after a success it does not run
        out = f"{out} {';' if succeeded else op} {part}" if out else part
        succeeded = False
    if succeeded and out:
        out += " ; true"
    return out.strip() if dropped else ""


def split_command(command: str) -> list[tuple[str, str]]:
    """(the operator before it, the part) for each part of a shell command list, split at `;`, `&&`,
    `||` and newlines outside quotes. Pipelines and subshells stay whole."""
    parts: list[tuple[str, str]] = []
    op, buf, quote, depth, i = "", "", None, 0, 0
    while i < len(command):
        c, two = command[i], command[i:i + 2]
        if quote:
            quote = None if c == quote else quote
        elif c == "\\":
            buf, i = buf + command[i:i + 2], i + 2
            continue
        elif c in "'\"":
            quote = c
        elif c in "({":
            depth += 1
        elif c in ")}":
            depth = max(depth - 1, 0)
        elif depth == 0 and (two in ("&&", "||") or c in ";\n"):
            parts.append((op, buf.strip()))
            op, buf = (two, "") if two in ("&&", "||") else (";", "")
            i += len(two) if two in ("&&", "||") else 1
            continue
        buf += c
        i += 1
    parts.append((op, buf.strip()))
    return [(o, p) for o, p in parts if p]
