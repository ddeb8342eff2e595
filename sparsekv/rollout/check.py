"""The check that gives the reward, made to measure the task's own tests rather than whatever the policy
left behind.

Before the check command runs, the sandbox gets back the task's hidden files and its test files and test
configuration as shipped (`conftest.py`, `pytest.ini`, ...): changed ones are overwritten, added ones
removed (test files the instruction asks to change, `editable`, are kept). Every pytest the check starts
loads a small plugin (through `PYTEST_ADDOPTS`) that records, per test, whether pytest's own call of the
test function happened and how the test ended, and writes that when the session finishes. The check
passes only if the command exits 0 and, when the task has test files, every test function of the shipped
test files was called and passed and none failed: an early `os._exit(0)`, a patched `runtest` or a hook
that skips the call leaves tests uncalled or no record at all.

Code the policy wrote still runs inside that pytest process, so a hack aimed at this plugin by name is not
ruled out; the rules screen for the general patterns (early exits, framework patches) before they run.
"""
from __future__ import annotations

import ast
import fnmatch
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from .sandbox import CommandResult, RepoView, Sandbox

PLUGIN = "sparsekv_check_plugin"
TEST_FILES = ("test_*.py", "*/test_*.py", "*_test.py", "tests/*", "*/tests/*", "test/*", "*/test/*")
CONFIG_FILES = ("conftest.py", "*/conftest.py", "pytest.ini", "*/pytest.ini", "tox.ini", "setup.cfg",
                "pyproject.toml", ".pytest.ini")

_PLUGIN_SOURCE = '''"""Records which tests pytest really called and how each ended (sparsekv rollout's check)."""
import json
import os

import pytest

_called, _outcomes = set(), {}


def _key(item):
    return str(item.path), item.cls.__name__ if item.cls is not None else None, item.originalname


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    result = yield
    _called.add(pyfuncitem.nodeid)
    return result


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus):
    items = {i.nodeid: _key(i) for i in session.items}
    tests = [{"path": path, "cls": cls, "name": name, "called": nodeid in _called,
              "outcome": _outcomes.get(nodeid, "not run")} for nodeid, (path, cls, name) in items.items()]
    with open(os.environ["SPARSEKV_CHECK_RESULTS"], "a") as f:
        f.write(json.dumps({"exitstatus": int(exitstatus), "tests": tests}) + "\\n")
'''


@dataclass(frozen=True)
class CheckResult:
    command: CommandResult
    expected: int               # test functions in the shipped test files
    passed: int                 # of those: called by pytest and passed
    problems: list[str]         # why the check failed despite the command's exit status

    @property
    def ok(self) -> bool:
        return self.command.exit_code == 0 and not self.problems

    def to_json(self, check: str) -> dict:
        return {"command": check, "exit_code": self.command.exit_code, "timed_out": self.command.timed_out,
                "output": self.command.text(), "tests_expected": self.expected, "tests_passed": self.passed,
                "problems": self.problems}


def run_check(sandbox: Sandbox) -> CheckResult:
    """Restore what the check depends on, run the task's check command, and judge it by pytest's record."""
    sandbox.restore_hidden()
    restore_tests(sandbox)
    where = Path(sandbox.scratch, f"check-{uuid.uuid4().hex}")
    where.mkdir()
    (where / f"{PLUGIN}.py").write_text(_PLUGIN_SOURCE)
    results = where / "results.jsonl"
    env = {"PYTHONPATH": str(where), "PYTEST_ADDOPTS": f"-p {PLUGIN} -p no:cacheprovider",
           "SPARSEKV_CHECK_RESULTS": str(results)}
    command = sandbox.run(sandbox.task.check, env=env)
    expected = expected_tests(sandbox.task.repo, sandbox)
    passed, problems = judge_results(results, expected, sandbox.root)
    shutil.rmtree(where, ignore_errors=True)
    return CheckResult(command, len(expected), passed, problems)


def _matches(path: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


def _protected(sandbox: Sandbox) -> tuple[str, ...]:
    """Globs of the files the check needs as shipped: tests, the task's extra tests and configuration."""
    return TEST_FILES + sandbox.task.tests + CONFIG_FILES


def restore_tests(sandbox: Sandbox) -> None:
    """Test files and test configuration back as shipped: changed ones overwritten, added ones removed,
    except the files the instruction asks the policy to change."""
    task, globs = sandbox.task, _protected(sandbox)
    shipped = {f for f in RepoView(task.repo).files() if _matches(f, globs)}
    editable = lambda f: _matches(f, task.editable)
    for f in _entries(sandbox.root):
        if _matches(f, globs) and f not in shipped and not editable(f) and f not in sandbox.hidden:
            (sandbox.root / f).unlink()
    for f in sorted(shipped - set(sandbox.hidden)):
        if not editable(f):
            sandbox.restore_file(f)


def _entries(root: Path) -> list[str]:
    """Every file and symlink under `root` (symlinks listed, not followed: pytest would follow them)."""
    out = []
    for top, dirs, files in os.walk(root):
        out += [Path(top, n).relative_to(root).as_posix() for n in files]
        out += [Path(top, n).relative_to(root).as_posix() for n in dirs if Path(top, n).is_symlink()]
    return sorted(out)


def expected_tests(repo: Path, sandbox: Sandbox) -> set[tuple[str, str | None, str]]:
    """(file, class or None, function) of every test function in the shipped test files."""
    out = set()
    for f in RepoView(repo).files():
        name = Path(f).name
        if not f.endswith(".py") or not _matches(f, _protected(sandbox)) or name == "conftest.py":
            continue
        if not (name.startswith("test_") or name.endswith("_test.py")):
            continue
        out |= {(f, cls, fn) for cls, fn in _test_functions((repo / f).read_text(errors="replace"))}
    return out


def _test_functions(code: str) -> set[tuple[str | None, str]]:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set()
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found.add((None, node.name))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found |= {(node.name, n.name) for n in node.body
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}
    return found


def judge_results(results: Path, expected: set, root: Path) -> tuple[int, list[str]]:
    """(how many expected tests were called and passed, the problems) from the plugin's records."""
    if not expected:
        return 0, []
    if not results.is_file():
        return 0, ["pytest wrote no record of its tests (it did not run, or the process exited early)"]
    records = _records(results, root)
    passed = {k for k, called, outcome in records if called and outcome == "passed"}
    failed = sorted({k for k, _, outcome in records if outcome == "failed"})
    problems = [f"{_name(k)}: failed" for k in failed]
    problems += [f"{_name(k)}: not called and passed" for k in sorted(expected - passed, key=str)]
    return len(expected & passed), problems


def _records(results: Path, root: Path) -> list[tuple[tuple, bool, str]]:
    out = []
    for line in results.read_text(errors="replace").splitlines():
        try:
            tests = json.loads(line)["tests"]
        except (ValueError, KeyError, TypeError):
            continue
        for t in tests:
            try:
                path = Path(t["path"]).resolve().relative_to(root).as_posix()
            except (ValueError, KeyError, TypeError):
                continue
            out.append(((path, t.get("cls"), t.get("name")), t.get("called") is True, t.get("outcome")))
    return out


def _name(key: tuple) -> str:
    path, cls, fn = key
    return f"{path}::{cls}::{fn}" if cls else f"{path}::{fn}"
