"""A rollout task: a small repository, an instruction for the policy, and a check command whose exit status
is the reward.

A task is a directory holding `task.yaml` and the repository (`repo/` unless the spec says otherwise)::

    name: fizzbuzz
    instruction: Implement fizzbuzz(n) in fizzbuzz.py so that the tests pass.
    check: python -m pytest -q tests
    hidden: [".grader/*"]             # files the agent must not read (grader, reference solution)
    tests: ["checks/*"]               # more test files, beside the usual test_*.py / tests/ / conftest.py
    editable: []                      # test files the instruction asks the agent to change
    repo: repo                        # the repository, relative to task.yaml

Globs are fnmatch patterns on paths relative to the repository, `*` crossing directories.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

SHIPPED = Path(__file__).resolve().parent / "tasks"
TASK_FILE = "task.yaml"
KEYS = {"name", "instruction", "check", "hidden", "tests", "editable", "repo"}


class TaskError(ValueError):
    """A task spec that cannot be used (missing file, unknown key, wrong type)."""


@dataclass(frozen=True)
class Task:
    name: str
    instruction: str
    check: str
    repo: Path
    hidden: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    editable: tuple[str, ...] = ()

    @property
    def check_paths(self) -> tuple[str, ...]:
        """Globs for the files the check command names (a directory stands for everything under it)."""
        out = []
        for word in shlex.split(self.check):
            path = self.repo / word
            if word.startswith("-") or ".." in Path(word).parts or not path.exists():
                continue
            out.append(f"{word.rstrip('/')}/*" if path.is_dir() else word)
        return tuple(out)


def _strings(spec: dict, key: str, where: Path) -> tuple[str, ...]:
    value = spec.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"{where}: {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def load_task(path: str | Path) -> Task:
    """A task from its directory or its task.yaml; a bare name is a shipped task (`shipped_tasks()`)."""
    path = Path(path)
    if not path.exists() and (SHIPPED / str(path)).is_dir():
        path = SHIPPED / str(path)
    spec_file = path / TASK_FILE if path.is_dir() else path
    if not spec_file.is_file():
        raise TaskError(f"no task at {path} (a directory with {TASK_FILE}, its {TASK_FILE}, or one of the "
                        f"shipped tasks: {', '.join(shipped_tasks())})")
    try:
        spec = yaml.safe_load(spec_file.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{spec_file}:{mark.line + 1}" if mark else str(spec_file)
        raise TaskError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(spec, dict):
        raise TaskError(f"{spec_file}: a task spec is a mapping")
    if unknown := set(spec) - KEYS:
        raise TaskError(f"{spec_file}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
    for key in ("instruction", "check"):
        if not isinstance(spec.get(key), str) or not spec[key].strip():
            raise TaskError(f"{spec_file}: {key!r} is required (a non-empty string)")
    repo_path = spec.get("repo", "repo")
    if not isinstance(repo_path, str) or not repo_path.strip():
        raise TaskError(f"{spec_file}: 'repo' must be a directory path (a non-empty string), got {repo_path!r}")
    repo = (spec_file.parent / repo_path).resolve()
    if not repo.is_dir():
        raise TaskError(f"{spec_file}: repository directory {repo} does not exist")
    return Task(name=str(spec.get("name", spec_file.parent.name)), instruction=spec["instruction"].strip(),
                check=spec["check"], repo=repo, hidden=_strings(spec, "hidden", spec_file),
                tests=_strings(spec, "tests", spec_file), editable=_strings(spec, "editable", spec_file))


def shipped_tasks() -> list[str]:
    return sorted(p.parent.name for p in SHIPPED.glob(f"*/{TASK_FILE}"))
