"""The per-episode sandbox: a copy of the task's repository, and the four tools the policy acts through.
The task's hidden files (grader, reference solution) are left out of the copy until the check runs.

Paths given to `read_file`, `write_file` and `list_dir` are resolved inside the copy: absolute paths,
`..` that climbs out and symlinks that lead out are refused (`PathRefused`). Commands (`run_command` and
the check) run in a subprocess with limits on wall time, CPU time, memory and file size (`resource`, set
in the child before exec), inside `unshare --net --mount --pid --fork --map-root-user`: no network
interface but loopback; every mount read-only except the sandbox directory, so a command cannot write
outside it either; and a PID namespace, so no process a command started outlives it. Without a working
`unshare`, commands are refused unless the sandbox was made with `allow_network=True` (then they run
with the limits only).
"""
from __future__ import annotations

import fnmatch
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .task import Task

UNSHARE = ("unshare", "--net", "--mount", "--pid", "--fork", "--map-root-user")
MAX_OUTPUT_CHARS = 16_000  # a tool's output beyond this keeps its head and tail

# Inside the new mount namespace: the episode's directory (the repository and a TMPDIR) becomes its own
# mount, then every other mount is made read-only (a mount that refuses, e.g. /proc, stays as it is).
# mountinfo writes a space in a mount point as \040: printf %b turns it back.
_ISOLATE = r"""
set -e
mount --bind "$SANDBOX" "$SANDBOX"
for m in $(cut -d' ' -f5 /proc/self/mountinfo | sort -u); do
  m=$(printf '%b' "$m")
  [ "$m" = "$SANDBOX" ] || mount -o remount,bind,ro "$m" 2>/dev/null || true
done
cd "$REPO"
exec /bin/sh -c "$1"
"""


class PathRefused(ValueError):
    """A path that is absolute, climbs out of the sandbox, or leads out through a symlink."""


class NetworkUnavailable(RuntimeError):
    """run_command without a network-less namespace, and the network not explicitly allowed."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 60.0
    cpu_s: int = 30
    memory_mb: int = 2048
    file_mb: int = 64

    def apply(self) -> None:  # runs in the child between fork and exec
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_mb * mb, self.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_mb * mb, self.file_mb * mb))


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    output: str
    timed_out: bool = False

    def text(self) -> str:
        head = f"exit code: {self.exit_code}" + (" (killed: wall-time limit)" if self.timed_out else "")
        return f"{head}\n{clip(self.output)}"


def clip(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


@functools.cache
def isolation_available() -> bool:
    """Whether `unshare` can give a command no network, a read-only view outside the sandbox and its own
    PID namespace here."""
    if shutil.which("unshare") is None:
        return False
    where = tempfile.mkdtemp(prefix="sparsekv-probe-")  # as a sandbox's: an empty directory of its own
    try:
        probe = subprocess.run([*UNSHARE, "/bin/sh", "-c", _ISOLATE, "probe", "true"],
                               env={**os.environ, "SANDBOX": where, "REPO": where}, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        os.rmdir(where)
    return probe.returncode == 0


class RepoView:
    """A repository seen through paths its tools may use: what the rules read, with or without a sandbox."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def resolve(self, path: str) -> Path:
        """`path` inside the root, symlinks followed; PathRefused if it is, or leads, outside."""
        if not isinstance(path, str) or not path.strip():
            raise PathRefused("a path is required")
        if os.path.isabs(path) or path.startswith("~"):
            raise PathRefused(f"{path}: absolute paths are refused; give a path relative to the repository")
        resolved = (self.root / path).resolve()
        if resolved != self.root and not resolved.is_relative_to(self.root):
            raise PathRefused(f"{path}: outside the repository (refused)")
        return resolved

    def relative(self, path: str) -> str:
        """The repository-relative form of `path` (for rules); the path as given if it is refused."""
        try:
            return self.resolve(path).relative_to(self.root).as_posix() or "."
        except PathRefused:
            return os.path.normpath(path)

    def text(self, path: str) -> str | None:
        """A file's current text, None if it does not exist or cannot be read."""
        try:
            return self.resolve(path).read_text(errors="replace")
        except (OSError, PathRefused):
            return None

    def files(self) -> list[str]:
        """Every regular file under the root, repository-relative (symlinks not followed)."""
        return sorted(f.relative_to(self.root).as_posix() for f in self.root.rglob("*")
                      if f.is_file() and not f.is_symlink())


class Sandbox(RepoView):
    """A copy of `task.repo` for one episode; remove it with `close()` (or use it as a context manager)."""

    def __init__(self, task: Task, limits: Limits = Limits(), allow_network: bool = False):
        self.task, self.limits, self.allow_network = task, limits, allow_network
        self._tmp = tempfile.mkdtemp(prefix=f"sparsekv-{task.name}-")
        super().__init__(Path(self._tmp, "repo"))
        shutil.copytree(task.repo, self.root, symlinks=True)
        Path(self._tmp, "tmp").mkdir()
        self.hidden = [f for f in RepoView(task.repo).files()
                       if any(fnmatch.fnmatchcase(f, g) for g in task.hidden)]
        for f in self.hidden:
            (self.root / f).unlink()
            for parent in (self.root / f).parents:  # a directory the hidden files leave empty goes too
                if parent == self.root or any(parent.iterdir()):
                    break
                parent.rmdir()

    def restore_hidden(self) -> None:
        """Put the task's hidden files (grader, reference) back as shipped, over anything written there, for
        the check: the policy never sees them, and cannot change them."""
        for f in self.hidden:
            here = self.root
            for part in Path(f).parts[:-1]:  # a symlink or file in the way is removed, never followed
                here = here / part
                if here.is_symlink() or (here.exists() and not here.is_dir()):
                    here.unlink()
                here.mkdir(exist_ok=True)
            dest = here / Path(f).name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            elif dest.is_symlink() or dest.exists():
                dest.unlink()
            shutil.copy2(self.task.repo / f, dest)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ------------------------------------------------------------------ the tools

    def read_file(self, path: str) -> str:
        p = self.resolve(path)
        if not p.is_file():
            return not_found(path)
        return clip(p.read_text(errors="replace"))

    def write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            raise ValueError("write_file: 'content' must be a string")
        if len(content.encode()) > self.limits.file_mb << 20:
            raise ValueError(f"write_file: content over the file-size limit ({self.limits.file_mb} MB)")
        p = self.resolve(path)
        if p.is_dir():
            return f"error: {path}: is a directory"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return wrote(path, content)

    def list_dir(self, path: str = ".") -> str:
        p = self.resolve(path)
        if not p.is_dir():
            return not_found(path)
        return clip("\n".join(e.name + ("/" if e.is_dir() else "") for e in sorted(p.iterdir())) or "(empty)")

    def run_command(self, command: str) -> CommandResult:
        if not isinstance(command, str) or not command.strip():
            raise ValueError("run_command: 'command' must be a non-empty string")
        return self.run(command)

    def run(self, command: str, limits: Limits | None = None) -> CommandResult:
        """`command` under /bin/sh in the sandbox, under the limits, without network."""
        limits = limits or self.limits
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.root),
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(Path(self._tmp, "tmp")),
               "SANDBOX": str(Path(self._tmp).resolve()), "REPO": str(self.root)}
        if isolation_available():
            argv = [*UNSHARE, "/bin/sh", "-c", _ISOLATE, "sandbox", command]
        elif self.allow_network:
            argv = ["/bin/sh", "-c", command]
        else:
            raise NetworkUnavailable(f"run_command refused: `{' '.join(UNSHARE)}` does not work "
                                     "here, so the command could reach the network and write outside the "
                                     "sandbox (allow it explicitly with --allow-network)")
        return _run(argv, self.root, env, limits)


def _run(argv: list[str], cwd: Path, env: dict, limits: Limits) -> CommandResult:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=limits.apply, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limits.wall_s)
        return CommandResult(proc.returncode, out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return CommandResult(proc.returncode, out.decode(errors="replace"), timed_out=True)


def not_found(path: str) -> str:
    return f"error: {path}: no such file or directory"


def wrote(path: str, content: str) -> str:
    return f"wrote {len(content.encode())} bytes to {path}"
