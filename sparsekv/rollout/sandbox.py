"""The per-episode sandbox: a copy of the task's repository, and the four tools the policy acts through.
The task's hidden files (grader, reference solution) are left out of the copy until the check runs.

Paths given to `read_file`, `write_file` and `list_dir` are resolved inside the copy: absolute paths,
`..` that climbs out and symlinks that lead out are refused (`PathRefused`). Commands (`run_command` and
the check) run in a subprocess with limits on wall time, CPU time, memory and file size (`resource`, set
in the child before exec), inside `unshare --net --mount --pid --fork --map-root-user`: no network
interface but loopback; every mount read-only except the sandbox directory, so a command cannot write
outside it either; the sparsekv package (shipped tasks, graders) and the task's own directory hidden
under empty tmpfs mounts; and a PID namespace with its own /proc, so no process a command started
outlives it and the host's processes are not visible. Where a pids cgroup can be made, a command and
everything it starts are capped at `Limits.processes`. Without a working `unshare`, commands are
refused unless the sandbox was made with `allow_network=True` (then they run with the limits only).

The file tools (and the rules' reads) run on the host: they open only regular files, never following a
symlink at the last step and never blocking on a FIFO or a device a command left in the copy.
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import functools
import logging
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .task import Task

logger = logging.getLogger("sparsekv.rollout")

UNSHARE = ("unshare", "--net", "--mount", "--pid", "--fork", "--map-root-user")
MAX_OUTPUT_CHARS = 16_000  # a tool's output beyond this keeps its head and tail
# the bytes of a command's output kept as it is read, at its start and at its end: enough for the
# characters it shows (up to 4 bytes each); the rest is counted, never held (a model-written `yes`)
CAPTURE_BYTES = 4 * MAX_OUTPUT_CHARS
CAP_CLOSE_S = 5.0  # how long a command's pids cgroup waits for the processes it kills to exit
KILL_GRACE_S = 2.0  # after the kill at the wall-time limit: how long the output may take to close

# Inside the new mount namespace: the episode's directory (the repository and a TMPDIR) becomes its own
# mount; each directory in $HIDE (newline-separated: the sparsekv package, the task's directory) is
# covered by an empty tmpfs, so neither the shipped graders nor the host's copy of a task can be read by
# an absolute path; a fresh /proc shows only the new PID namespace (where the kernel allows it: a
# container's masked /proc may refuse); then every other mount is made
# read-only (a mount that refuses stays as it is). mountinfo writes a space in a mount point as \040:
# printf %b turns it back.
_ISOLATE = r"""
set -e
mount --bind "$SANDBOX" "$SANDBOX"
old_ifs=$IFS
IFS='
'
for d in $HIDE; do
  [ -d "$d" ] && mount -t tmpfs -o ro,size=4k sparsekv-hidden "$d"
done
IFS=$old_ifs
mount -t proc proc /proc 2>/dev/null || true
for m in $(cut -d' ' -f5 /proc/self/mountinfo | sort -u); do
  m=$(printf '%b' "$m")
  [ "$m" = "$SANDBOX" ] || mount -o remount,bind,ro "$m" 2>/dev/null || true
done
cd "$REPO"
exec /bin/sh -c "$1"
"""


class PathRefused(ValueError):
    """A path that is absolute, climbs out of the sandbox, or leads out through a symlink."""


class NotRegularFile(ValueError):
    """A file tool's path that names a FIFO, socket or device: opening it could block the episode."""


class NetworkUnavailable(RuntimeError):
    """run_command without a network-less namespace, and the network not explicitly allowed."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 60.0
    cpu_s: int = 30
    memory_mb: int = 2048
    file_mb: int = 64
    processes: int = 128  # a command and everything it starts, where a pids cgroup can be made

    def apply(self) -> None:  # runs in the child between fork and exec
        mb = 1 << 20
        # SIGXCPU at the soft limit says which limit killed the command; SIGKILL a second later if caught
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_mb * mb, self.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_mb * mb, self.file_mb * mb))


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    output: str
    timed_out: bool = False
    cpu_limited: bool = False  # killed by SIGXCPU/SIGKILL after using up its CPU-time limit
    clipped: bool = False  # `output` is already its head and tail around what was left out (Capture)

    def text(self) -> str:
        head = f"exit code: {self.exit_code}"
        if self.timed_out:
            head += " (killed: wall-time limit)"
        elif self.cpu_limited:
            head += " (killed: CPU-time limit)"
        return f"{head}\n{self.output if self.clipped else clip(self.output)}"


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
    covered = tempfile.mkdtemp(prefix="sparsekv-probe-hidden-")  # as the package a command must not see
    try:
        probe = subprocess.run([*UNSHARE, "/bin/sh", "-c", _ISOLATE, "probe", "true"],
                               env={**os.environ, "SANDBOX": where, "REPO": where, "HIDE": covered},
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        os.rmdir(where)
        os.rmdir(covered)
    return probe.returncode == 0


def open_regular(path: Path, flags: int) -> int:
    """A descriptor for `path` if it is a regular file (NotRegularFile otherwise). Opened without blocking
    and without following a symlink at the last step, so a FIFO or a symlink swapped in by a command
    cannot hang or redirect the host; blocking I/O is turned back on for the regular file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.ELOOP):  # a FIFO with no reader or a socket; a symlink
            raise NotRegularFile(f"{path.name}: not a regular file (refused)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(f"{path.name}: not a regular file (refused)")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular(path: Path) -> str:
    with os.fdopen(open_regular(path, os.O_RDONLY), "r", errors="replace") as f:
        return f.read()


def write_regular(path: Path, content: str) -> None:
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "w") as f:
        f.truncate(0)  # after the type check: truncating on open would act on whatever the path is
        f.write(content)


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
            return read_regular(self.resolve(path))
        except (OSError, PathRefused, NotRegularFile):
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
        try:
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
        except BaseException:  # nothing of a copy that could not be made is left behind
            self.close()
            raise

    def restore_hidden(self) -> None:
        """Put the task's hidden files (grader, reference) back as shipped, over anything written there, for
        the check: the policy never sees them, and cannot change them."""
        for f in self.hidden:
            self.restore_file(f)

    def restore_file(self, f: str) -> None:
        """The task's file `f` back as shipped, over whatever is there (a symlink or directory in the way is
        removed, never followed)."""
        here = self.root
        for part in Path(f).parts[:-1]:
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

    @property
    def scratch(self) -> Path:
        """The episode's directory beside the repository (commands may write there too)."""
        return Path(self._tmp)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ------------------------------------------------------------------ the tools

    def read_file(self, path: str) -> str:
        p = self.resolve(path)
        if not p.exists():
            return not_found(path)
        if p.is_dir():
            return f"error: {path}: is a directory"
        return clip(read_regular(p))

    def write_file(self, path: str, content: str) -> str:
        if not isinstance(content, str):
            raise ValueError("write_file: 'content' must be a string")
        if len(content.encode()) > self.limits.file_mb << 20:
            raise ValueError(f"write_file: content over the file-size limit ({self.limits.file_mb} MB)")
        p = self.resolve(path)
        if p.is_dir():
            return f"error: {path}: is a directory"
        p.parent.mkdir(parents=True, exist_ok=True)
        write_regular(p, content)
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

    def run(self, command: str, limits: Limits | None = None, env: dict | None = None) -> CommandResult:
        """`command` under /bin/sh in the sandbox, under the limits, without network; `env` adds variables."""
        limits = limits or self.limits
        env = {**(env or {}), "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.root),
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(Path(self._tmp, "tmp")),
               "SANDBOX": str(Path(self._tmp).resolve()), "REPO": str(self.root),
               "HIDE": "\n".join(str(d) for d in hidden_dirs(self.task, Path(self._tmp).resolve()))}
        if isolation_available():
            argv = [*UNSHARE, "/bin/sh", "-c", _ISOLATE, "sandbox", command]
        elif self.allow_network:
            argv = ["/bin/sh", "-c", command]
        else:
            raise NetworkUnavailable(f"run_command refused: `{' '.join(UNSHARE)}` does not work "
                                     "here, so the command could reach the network and write outside the "
                                     "sandbox (allow it explicitly with --allow-network)")
        return _run(argv, self.root, env, limits)


def hidden_dirs(task: Task, sandbox_dir: Path) -> list[Path]:
    """What a command must not see by an absolute path: the sparsekv package (its shipped tasks and
    graders) and the task's repository (the host's copy, hidden files included), with the directory of
    its task.yaml when that holds it. A directory that holds the sandbox itself is left visible, as
    covering it would hide the sandbox."""
    package = Path(__file__).resolve().parent.parent
    repo = task.repo.resolve()
    spec_dir = [repo.parent] if (repo.parent / "task.yaml").is_file() else []
    candidates = [package, repo, *spec_dir, *_sandbox_python_packages()]
    return [d for d in dict.fromkeys(candidates) if not sandbox_dir.is_relative_to(d) and d != Path("/")]


@functools.cache
def _sandbox_python_packages() -> tuple[Path, ...]:
    """Where the sandbox's python finds sparsekv when it is not this copy (another checkout or install)."""
    code = "import importlib.util as u; s = u.find_spec('sparsekv'); print(*(s.submodule_search_locations or []))"
    try:
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                               env={"PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(Path(p).resolve() for p in found.stdout.split() if Path(p).is_dir())


class ProcessCap:
    """A pids cgroup (v2, or v1's pids controller) capping a command and all it starts; a no-op where no
    cgroup can be made (no permission, no controller)."""

    ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids"))

    def __init__(self, limit: int):
        self.path: Path | None = None
        for root in self.ROOTS:
            if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
                continue
            path = root / f"sparsekv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                path.mkdir()
                (path / "pids.max").write_text(str(limit))
            except OSError:
                if path.is_dir():
                    path.rmdir()
                continue
            self.path = path
            return

    def join(self) -> None:  # runs in the child between fork and exec
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """End what the command left running in the cgroup (a background job, a process that left its
        session: the kernel kills an isolated command's leftovers with its pid namespace, not these),
        then remove the cgroup: the kernel keeps an empty one until it is removed. A process not gone
        within CAP_CLOSE_S leaves it in place, with a warning."""
        if self.path is None:
            return
        deadline = time.monotonic() + CAP_CLOSE_S
        while True:
            self._kill_members()
            try:
                self.path.rmdir()
                return
            except OSError as e:  # EBUSY while a killed process is still exiting
                if time.monotonic() >= deadline:
                    logger.warning("pids cgroup %s not removed: %s", self.path, e)
                    return
            time.sleep(0.01)

    def _kill_members(self) -> None:
        try:
            pids = (self.path / "cgroup.procs").read_text().split()
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@functools.cache
def process_cap_available() -> bool:
    cap = ProcessCap(8)
    try:
        return cap.path is not None
    finally:
        cap.close()


def _run(argv: list[str], cwd: Path, env: dict, limits: Limits) -> CommandResult:
    cap = ProcessCap(limits.processes)

    def in_child() -> None:
        cap.join()
        limits.apply()

    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=in_child, start_new_session=True)
        return _wait(proc, limits)
    finally:
        cap.close()


class Capture:
    """A command's output as it is read: its first and last `keep` bytes, and how many there were."""

    def __init__(self, keep: int = CAPTURE_BYTES):
        self.keep, self.total = keep, 0
        self.head, self.tail = bytearray(), bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[room:] if room > 0 else chunk
        del self.tail[:max(0, len(self.tail) - self.keep)]

    def result(self, exit_code: int, **flags) -> CommandResult:
        """The output whole when it was all kept, else its first and last MAX_OUTPUT_CHARS / 2
        characters around the count of bytes left out."""
        if self.total == len(self.head) + len(self.tail):
            return CommandResult(exit_code, (self.head + self.tail).decode(errors="replace"), **flags)
        half = MAX_OUTPUT_CHARS // 2
        head, tail = self.head.decode(errors="replace")[:half], self.tail.decode(errors="replace")[-half:]
        omitted = self.total - len(head.encode()) - len(tail.encode())
        return CommandResult(exit_code, f"{head}\n[... {omitted} bytes omitted ...]\n{tail}", clipped=True, **flags)


def _read_until(proc: subprocess.Popen, capture: Capture, deadline: float) -> bool:
    """Read the output into `capture` until it closes (True) or `deadline` passes (False)."""
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(left):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return True
                capture.add(chunk)
    return False


def _wait(proc: subprocess.Popen, limits: Limits) -> CommandResult:
    capture, deadline = Capture(), time.monotonic() + limits.wall_s
    try:
        if not _read_until(proc, capture, deadline):
            raise subprocess.TimeoutExpired(proc.args, limits.wall_s)
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))  # the output closed; the command may run on
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        # NOTE: a process that left the group (setsid) may hold the output open: what came by then is kept
        _read_until(proc, capture, time.monotonic() + KILL_GRACE_S)
        proc.stdout.close()
        proc.wait()
        return capture.result(proc.returncode, timed_out=True)
    proc.stdout.close()
    return capture.result(proc.returncode, cpu_limited=_cpu_limited(proc))


def _cpu_limited(proc: subprocess.Popen) -> bool:
    """Whether the command died of SIGXCPU: sent only at the soft CPU-time limit (`Limits.apply`), so it
    names that limit; a shell reports it as 128 + the signal."""
    return proc.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU)


def not_found(path: str) -> str:
    return f"error: {path}: no such file or directory"


def wrote(path: str, content: str) -> str:
    return f"wrote {len(content.encode())} bytes to {path}"
