"""The rollout sandbox: escapes refused (`..`, absolute paths, symlinks out, network, writes outside by a
command) and the limits enforced (wall time, CPU time, memory)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from sparsekv.rollout import sandbox as sandbox_mod
from sparsekv.rollout.sandbox import Limits, NetworkUnavailable, PathRefused, Sandbox, isolation_available
from sparsekv.rollout.task import TaskError, load_task

needs_isolation = pytest.mark.skipif(not isolation_available(), reason="unshare cannot isolate commands here")


@pytest.fixture
def sandbox():
    with Sandbox(load_task("fizzbuzz")) as sb:
        yield sb


def test_the_copy_is_per_episode(sandbox):
    task = sandbox.task
    sandbox.write_file("fizzbuzz.py", "changed\n")
    assert (task.repo / "fizzbuzz.py").read_text() != "changed\n"
    with Sandbox(task) as other:
        assert other.read_file("fizzbuzz.py") == (task.repo / "fizzbuzz.py").read_text()
    root = sandbox.root
    sandbox.close()
    assert not root.exists()


@pytest.mark.parametrize("path", ["../outside.txt", "tests/../../outside.txt", "/etc/passwd", "/tmp/x", "~/x"])
def test_paths_out_of_the_repository_are_refused(sandbox, path):
    for call in (lambda: sandbox.read_file(path), lambda: sandbox.write_file(path, "x"),
                 lambda: sandbox.list_dir(path)):
        with pytest.raises(PathRefused):
            call()
    assert not (sandbox.root.parent.parent / "outside.txt").exists()


def test_symlinks_out_are_refused(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    (sandbox.root / "link.txt").symlink_to(secret)
    (sandbox.root / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(PathRefused):
        sandbox.read_file("link.txt")
    with pytest.raises(PathRefused):
        sandbox.write_file("link.txt", "overwritten")
    with pytest.raises(PathRefused):
        sandbox.write_file("linkdir/new.txt", "x")
    with pytest.raises(PathRefused):
        sandbox.list_dir("linkdir")
    assert secret.read_text() == "secret" and not (tmp_path / "new.txt").exists()


def test_writes_over_the_file_size_limit_are_refused(tmp_path):
    with Sandbox(load_task("fizzbuzz"), Limits(file_mb=1)) as sb:
        with pytest.raises(ValueError, match="file-size limit"):
            sb.write_file("big.txt", "x" * ((1 << 20) + 1))
        assert sb.write_file("ok.txt", "x" * (1 << 20)) == f"wrote {1 << 20} bytes to ok.txt"


def test_paths_inside_work(sandbox):
    assert sandbox.write_file("pkg/../notes.txt", "hello") == "wrote 5 bytes to pkg/../notes.txt"
    assert sandbox.read_file("./notes.txt") == "hello"
    (sandbox.root / "alias.txt").symlink_to(sandbox.root / "notes.txt")
    assert sandbox.read_file("alias.txt") == "hello"
    assert "fizzbuzz.py" in sandbox.list_dir(".").splitlines()


@needs_isolation
def test_commands_have_no_network(sandbox):
    result = sandbox.run_command("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"")
    assert result.exit_code != 0 and "unreachable" in result.output.lower()
    inside = sandbox.run_command("readlink /proc/self/ns/net").output.strip()
    assert inside.startswith("net:[") and inside != os.readlink("/proc/self/ns/net")  # a namespace of its own


@needs_isolation
def test_commands_cannot_write_outside(sandbox):
    name = f"sparsekv-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"{sandbox.root.parent.parent}/{name}", f"/dev/shm/{name}", f"{Path.home()}/{name}"]
    result = sandbox.run_command("; ".join(f"touch {t}" for t in targets) + "; touch inside.txt && echo made")
    assert result.output.count("Read-only file system") == len(targets)
    assert "made" in result.output and (sandbox.root / "inside.txt").exists()
    assert not any(os.path.exists(t) for t in targets)


@needs_isolation
def test_commands_leave_no_process_behind(sandbox):
    """A background process (even in a session of its own) dies with its command, so nothing changes the
    sandbox between tool calls."""
    started = sandbox.run_command("(sleep 1; touch late1) >/dev/null 2>&1 & "
                                  "setsid sh -c 'sleep 1; touch late2' >/dev/null 2>&1 & echo started")
    assert started.output == "started\n"
    assert sandbox.run_command("sleep 2; ls late1 late2 2>&1").output.count("No such file") == 2


def test_wall_time_limit(sandbox, monkeypatch):
    monkeypatch.setattr(sandbox_mod, "isolation_available", lambda: False)
    sandbox.allow_network = True
    result = sandbox.run("sleep 30; echo not reached", Limits(wall_s=0.5))
    assert result.timed_out and "not reached" not in result.output
    assert "killed: wall-time limit" in result.text()


def test_cpu_time_limit(sandbox):
    sandbox.allow_network = True
    result = sandbox.run("python -c 'while True: pass'", Limits(cpu_s=1, wall_s=60))
    assert not result.timed_out and result.exit_code != 0  # SIGXCPU, well before the wall limit
    assert "killed: CPU-time limit" in result.text()


def test_memory_limit(sandbox):
    sandbox.allow_network = True
    code = "python -c 'x = bytearray(512 << 20); print(\"allocated\")'"
    small = sandbox.run(code, Limits(memory_mb=256))
    assert small.exit_code != 0 and "MemoryError" in small.output
    assert "allocated" in sandbox.run(code, Limits(memory_mb=2048)).output


def test_without_isolation_commands_are_refused_unless_allowed(sandbox, monkeypatch):
    monkeypatch.setattr(sandbox_mod, "isolation_available", lambda: False)
    with pytest.raises(NetworkUnavailable, match="--allow-network"):
        sandbox.run_command("echo hi")
    sandbox.allow_network = True
    assert sandbox.run_command("echo hi").output == "hi\n"


def test_the_check_runs_in_the_sandbox(sandbox):
    sandbox.allow_network = True
    assert sandbox.run(sandbox.task.check).exit_code != 0  # the stub raises NotImplementedError
    sandbox.write_file("fizzbuzz.py", 'def fizzbuzz(n):\n    return "Fizz" * (n % 3 == 0) + "Buzz" * (n % 5 == 0) or str(n)\n')
    assert sandbox.run(sandbox.task.check).exit_code == 0


def test_hidden_files_only_for_the_check(sandbox, tmp_path):
    assert sandbox.hidden == [".grader/reference.py"]
    assert sandbox.read_file(".grader/reference.py") == "error: .grader/reference.py: no such file or directory"
    assert ".grader/" not in sandbox.list_dir(".").splitlines()  # not even its directory
    sandbox.write_file(".grader/reference.py", "tampered")
    sandbox.restore_hidden()
    assert sandbox.read_file(".grader/reference.py") == (sandbox.task.repo / ".grader/reference.py").read_text()
    (sandbox.root / ".grader/reference.py").unlink()
    (sandbox.root / ".grader").rmdir()
    (sandbox.root / ".grader").symlink_to(tmp_path, target_is_directory=True)  # a way out, left by a command
    sandbox.restore_hidden()
    assert list(tmp_path.iterdir()) == [] and not (sandbox.root / ".grader").is_symlink()
    assert (sandbox.root / ".grader/reference.py").is_file()


def test_bad_task_specs(tmp_path):
    with pytest.raises(TaskError, match="no task at"):
        load_task(tmp_path / "missing")
    (tmp_path / "task.yaml").write_text("instruction: x\ncheck: true\ncolour: red\n")
    with pytest.raises(TaskError, match="unknown keys"):
        load_task(tmp_path)
    (tmp_path / "task.yaml").write_text("instruction: x\n")
    with pytest.raises(TaskError, match="'check' is required"):
        load_task(tmp_path)
    (tmp_path / "task.yaml").write_text("instruction: x\ncheck: 'true'\n")
    with pytest.raises(TaskError, match="repository directory"):
        load_task(tmp_path)
    (tmp_path / "repo").mkdir()
    assert load_task(tmp_path).check == "true"


def _returns_promptly(call, fifo: Path) -> object:
    """`call()`'s result or exception, failing if it blocks; a blocked opener of `fifo` is released."""
    import threading
    box = {}
    worker = threading.Thread(target=lambda: box.update(out=_outcome(call)), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # a reader and a writer: the blocked open returns
        worker.join(5)
        pytest.fail("a file tool blocked on a FIFO")
    return box["out"]


def _outcome(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the test looks at which
        return e


def test_file_tools_refuse_a_fifo(sandbox):
    """A FIFO a command left in the copy is refused by the file tools and the rules' reads, never opened
    in a way that blocks the host."""
    from sparsekv.rollout.sandbox import NotRegularFile
    fifo = sandbox.root / "p"
    os.mkfifo(fifo)
    assert isinstance(_returns_promptly(lambda: sandbox.write_file("p", "x"), fifo), NotRegularFile)
    assert isinstance(_returns_promptly(lambda: sandbox.read_file("p"), fifo), NotRegularFile)
    assert _returns_promptly(lambda: sandbox.text("p"), fifo) is None
    assert sandbox.write_file("fizzbuzz.py", "x = 1\n") and sandbox.read_file("fizzbuzz.py") == "x = 1\n"


def _kernel_mounts_a_fresh_proc() -> bool:
    import subprocess
    probe = subprocess.run([*sandbox_mod.UNSHARE, "/bin/sh", "-c", "mount -t proc proc /proc"], capture_output=True,
                           timeout=30)
    return probe.returncode == 0


@needs_isolation
def test_commands_cannot_read_the_shipped_tasks_or_see_host_processes():
    """The host's copy of the task (its grader) and the sparsekv package are covered, and /proc shows only
    the command's own PID namespace."""
    task = load_task("stack")
    with Sandbox(task) as sb:
        grader = sb.run_command(f"cat {task.repo}/.grader/check_tests.py; ls {task.repo.parent.parent}")
        assert "EmptyStackError" not in grader.output and "fizzbuzz" not in grader.output
        found = sb.run_command("cat $(python -c 'import sparsekv.rollout.task as t; print(t.SHIPPED)')"
                               "/stack/repo/.g?ader/*")
        assert "EmptyStackError" not in found.output
        if _kernel_mounts_a_fresh_proc():  # a container's masked /proc may refuse (the sandbox then keeps the host's)
            pids = sb.run_command("ls /proc | grep -c '^[0-9]'").output.split()
            assert int(pids[-1]) < 10 and str(os.getpid()) not in sb.run_command("ls /proc").output.split()
        assert "1 passed" in sb.run_command("python -m pytest -q tests").output  # the tools still work


@pytest.mark.skipif(not sandbox_mod.process_cap_available(), reason="no pids cgroup can be made here")
def test_a_command_cannot_start_more_than_the_process_cap(sandbox):
    sandbox.allow_network = True
    result = sandbox.run("n=0; for i in $(seq 200); do sleep 3 & n=$((n+1)); done; "
                         "echo running $(ps -e 2>/dev/null | grep -c sleep || ls /proc | grep -c '^[0-9]')",
                         Limits(processes=32, wall_s=30))
    assert "fork" in result.output.lower()  # the shell's "Cannot fork" once the cap is reached
