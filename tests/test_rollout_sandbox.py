"""The rollout sandbox: escapes refused (`..`, absolute paths, symlinks out, network, writes outside by a
command) and the limits enforced (wall time, CPU time, memory)."""
from __future__ import annotations

import json
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



def test_an_absolute_path_is_refused_also_where_it_names_the_copy(sandbox):
    """Paths are relative to the repository: an absolute one is refused by every file tool, even when it
    names a file or directory inside the episode's copy."""
    inside, root = str(sandbox.root / "fizzbuzz.py"), str(sandbox.root)
    for call in (lambda: sandbox.read_file(inside), lambda: sandbox.write_file(inside, "x"),
                 lambda: sandbox.list_dir(root)):
        with pytest.raises(PathRefused, match="absolute paths are refused"):
            call()
    assert (sandbox.root / "fizzbuzz.py").read_text() == (sandbox.task.repo / "fizzbuzz.py").read_text()

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
        with pytest.raises(ValueError, match="file-size limit"):  # the limit is on bytes, not characters
            sb.write_file("big.txt", "\u00e9" * ((1 << 19) + 1))


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


def test_the_wall_time_limit_holds_when_a_process_leaves_the_group(sandbox, monkeypatch):
    """Without isolation, a process started in a session of its own (setsid) escapes the kill at the
    wall-time limit and keeps the output open: the command still ends at the limit, with its output so
    far, instead of waiting for that process to end (for ever, for `sleep infinity`)."""
    import signal
    import threading
    monkeypatch.setattr(sandbox_mod, "isolation_available", lambda: False)
    sandbox.allow_network = True
    box = {}
    command = "setsid sh -c 'echo $$ > bg.pid; exec sleep 600' & echo started; sleep 600"
    worker = threading.Thread(target=lambda: box.update(out=sandbox.run(command, Limits(wall_s=1))), daemon=True)
    worker.start()
    worker.join(30)
    hung = worker.is_alive()
    try:
        os.kill(int((sandbox.root / "bg.pid").read_text()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    worker.join(10)
    assert not hung, "the command outlived its wall-time limit"
    assert box["out"].timed_out and box["out"].output == "started\n"


def test_a_sandbox_that_cannot_be_made_leaves_no_directory_behind(tmp_path, monkeypatch):
    """A failure while the episode's copy is made (the task's repository gone) removes what was made."""
    import tempfile

    from sparsekv.rollout.task import Task
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(FileNotFoundError):
        Sandbox(Task("gone", "x", "true", tmp_path / "missing"))
    assert list((tmp_path / "tmp").iterdir()) == []


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


def test_the_check_restores_the_shipped_tests_and_keeps_only_the_requested_new_one(tmp_path):
    """Before the check: a changed test file is back as shipped, an added test file and a symlinked
    directory among the tests (a way to a conftest.py elsewhere) are removed, the link not followed, and a
    new test file the task asks for (`editable`) is kept."""
    import shutil

    from sparsekv.rollout.check import restore_tests
    shutil.copytree(load_task("fizzbuzz").repo.parent, tmp_path / "fizzbuzz")
    spec = tmp_path / "fizzbuzz" / "task.yaml"
    spec.write_text(spec.read_text() + 'editable: ["tests/test_edge_cases.py"]\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "conftest.py").write_text("def pytest_pyfunc_call(pyfuncitem):\n    return True\n")
    with Sandbox(load_task(tmp_path / "fizzbuzz")) as sb:
        shipped = sb.read_file("tests/test_fizzbuzz.py")
        sb.write_file("tests/test_edge_cases.py", "def test_zero():\n    pass\n")
        sb.write_file("tests/test_extra.py", "def test_ok():\n    pass\n")
        sb.write_file("tests/test_fizzbuzz.py", "def test_nothing():\n    pass\n")
        (sb.root / "tests" / "linked").symlink_to(elsewhere, target_is_directory=True)
        restore_tests(sb)
        assert sb.read_file("tests/test_fizzbuzz.py") == shipped
        assert sb.read_file("tests/test_edge_cases.py") == "def test_zero():\n    pass\n"
        assert not (sb.root / "tests" / "test_extra.py").exists()
        assert not (sb.root / "tests" / "linked").is_symlink() and not (sb.root / "tests" / "linked").exists()
    assert (elsewhere / "conftest.py").is_file()


def test_the_check_expects_every_test_function_of_the_shipped_test_files(tmp_path):
    """What the check requires to be called and passed: the test functions of every shipped test file
    (test_*.py and *_test.py), methods of Test* classes included, not helpers, nested functions or
    conftest.py's."""
    import shutil

    from sparsekv.rollout.check import expected_tests
    shutil.copytree(load_task("fizzbuzz").repo.parent, tmp_path / "fizzbuzz")
    tests = tmp_path / "fizzbuzz" / "repo" / "tests"
    (tests / "edge_test.py").write_text("def helper():\n    pass\n\n\ndef test_zero():\n    def test_inner():\n"
                                        "        pass\n\n\nclass TestLarge:\n    def test_big(self):\n        pass\n\n"
                                        "    def setup_method(self):\n        pass\n\n\nclass Helper:\n"
                                        "    def test_not_collected(self):\n        pass\n")
    (tests / "conftest.py").write_text("def test_in_conftest():\n    pass\n")
    task = load_task(tmp_path / "fizzbuzz")
    with Sandbox(task) as sb:
        assert expected_tests(task.repo, sb) == {
            ("tests/test_fizzbuzz.py", None, "test_numbers"), ("tests/test_fizzbuzz.py", None, "test_fizz_and_buzz"),
            ("tests/test_fizzbuzz.py", None, "test_fizzbuzz"), ("tests/edge_test.py", None, "test_zero"),
            ("tests/edge_test.py", "TestLarge", "test_big")}


def test_the_checks_files_are_those_inside_the_repository_it_names(tmp_path):
    """check_paths: the check command's words that name files or directories of the repository (a
    directory as everything under it); options, missing files and paths that climb out are not."""
    from sparsekv.rollout.task import Task
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    (tmp_path / "repo" / "check.py").write_text("")
    (tmp_path / "outside.py").write_text("")
    task = Task("t", "x", "python check.py --strict tests/ ../outside.py missing.py && pytest -q tests", tmp_path / "repo")
    assert task.check_paths == ("check.py", "tests/*", "tests/*")


def test_the_check_fails_a_test_that_failed_in_any_of_its_runs(tmp_path):
    """A test function pytest ran more than once (parametrized, or by two pytest runs of the check) passes
    only if no run failed: one passing case does not cover a failing one."""
    from sparsekv.rollout.check import judge_results
    key = ("tests/test_a.py", None, "test_x")
    results = tmp_path / "results.jsonl"
    run = lambda outcome: {"path": str(tmp_path / key[0]), "cls": None, "name": key[2], "called": True,
                           "outcome": outcome}
    results.write_text(json.dumps({"exitstatus": 1, "tests": [run("passed"), run("failed")]}) + "\n")
    assert judge_results(results, {key}, tmp_path) == (1, ["tests/test_a.py::test_x: failed"])
    results.write_text(json.dumps({"exitstatus": 0, "tests": [run("passed")]}) + "\n")
    assert judge_results(results, {key}, tmp_path) == (1, [])


def test_a_directory_that_holds_the_sandbox_is_not_hidden_from_its_commands(tmp_path):
    """Commands must not see the package or the task's repository by an absolute path, but covering a
    directory the sandbox itself lies in would hide the sandbox: such a directory stays visible."""
    from sparsekv.rollout.sandbox import hidden_dirs
    task = load_task("fizzbuzz")
    package = Path(sandbox_mod.__file__).resolve().parent.parent
    assert {package, task.repo.resolve()} <= set(hidden_dirs(task, tmp_path))
    inside = hidden_dirs(task, package / "rollout" / "sandbox-1")
    assert package not in inside and task.repo.resolve() in inside


def test_bad_task_specs(tmp_path):
    with pytest.raises(TaskError, match="no task at"):
        load_task(tmp_path / "missing")
    (tmp_path / "task.yaml").write_text("instruction: x\ncheck: true\ncolour: red\n")
    with pytest.raises(TaskError, match="unknown keys"):
        load_task(tmp_path)
    (tmp_path / "task.yaml").write_text("instruction: x\n")
    with pytest.raises(TaskError, match="'check' is required"):
        load_task(tmp_path)
    (tmp_path / "task.yaml").write_text("instruction: '  '\ncheck: 'true'\n")
    with pytest.raises(TaskError, match="'instruction' is required"):
        load_task(tmp_path)
    (tmp_path / "task.yaml").write_text("instruction: x\ncheck: 'true'\n")
    with pytest.raises(TaskError, match="repository directory"):
        load_task(tmp_path)
    (tmp_path / "repo").mkdir()
    assert load_task(tmp_path).check == "true"


@pytest.mark.parametrize("text, says", [
    ("instruction: x\ncheck: 'true'\nhidden: [a\n", "not valid YAML"),
    ("instruction: x\ncheck: 'true'\nrepo: 3\n", "'repo' must be"),
    ("instruction: x\ncheck: 'true'\nrepo:\n", "'repo' must be"),
], ids=["bad-yaml", "repo-number", "repo-empty"])
def test_a_task_spec_that_is_not_yaml_or_names_no_repository_path_is_a_task_error(tmp_path, text, says):
    """`sparsekv rollout` reports a TaskError as one line; a YAML syntax error or a `repo` that is not a path
    (a number, or empty) must be one, not a yaml or TypeError traceback."""
    (tmp_path / "task.yaml").write_text(text)
    (tmp_path / "repo").mkdir()
    with pytest.raises(TaskError, match=says) as e:
        load_task(tmp_path)
    assert "\n" not in str(e.value)


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


def test_a_directory_in_the_way_of_a_hidden_file_is_replaced_for_the_check(sandbox):
    """A directory a command made where a hidden file belongs is removed, and the shipped file put back
    (not copied inside the directory, where the check would not find it)."""
    (sandbox.root / ".grader" / "reference.py").mkdir(parents=True)
    (sandbox.root / ".grader" / "reference.py" / "planted.py").write_text("x = 1\n")
    sandbox.restore_hidden()
    restored = sandbox.root / ".grader" / "reference.py"
    assert restored.is_file() and restored.read_text() == (sandbox.task.repo / ".grader/reference.py").read_text()


def test_file_tools_on_a_directory_answer_with_an_error(sandbox):
    """read_file and write_file on a directory answer with the tools' usual error; list_dir marks
    directories with a trailing `/` and says when one is empty."""
    assert sandbox.write_file("tests", "x") == "error: tests: is a directory"
    assert sandbox.read_file("tests") == "error: tests: is a directory"
    assert sandbox.list_dir(".").splitlines() == ["conftest.py", "fizzbuzz.py", "tests/"]
    (sandbox.root / "empty").mkdir()
    assert sandbox.list_dir("empty") == "(empty)"


def test_an_empty_command_is_refused(sandbox):
    for command in ("", "  \n", None):
        with pytest.raises(ValueError, match="non-empty string"):
            sandbox.run_command(command)


def test_file_size_limit_for_commands(sandbox):
    """A command cannot write a file over `Limits.file_mb` (RLIMIT_FSIZE): the write stops at the limit
    and the command fails."""
    sandbox.allow_network = True
    result = sandbox.run("head -c 2097152 /dev/zero > big.bin", Limits(file_mb=1))
    assert result.exit_code != 0 and (sandbox.root / "big.bin").stat().st_size <= 1 << 20


def _alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie waiting to be reaped has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("pids_cgroup", [True, False], ids=["cgroup-if-any", "no-cgroup"])
def test_a_command_past_its_wall_time_is_killed_with_everything_it_started(sandbox, monkeypatch, pids_cgroup):
    """At the wall-time limit the whole process group goes, a background child that closed its output
    included (it would otherwise outlive the tool call and change the sandbox later); also where no pids
    cgroup can be made (most containers), where nothing else would end the child."""
    import signal
    import time
    monkeypatch.setattr(sandbox_mod, "isolation_available", lambda: False)
    if not pids_cgroup:
        monkeypatch.setattr(sandbox_mod.ProcessCap, "ROOTS", ())
    sandbox.allow_network = True
    result = sandbox.run("sleep 30 >/dev/null 2>&1 & echo $! > bg.pid; wait", Limits(wall_s=1))
    assert result.timed_out
    pid = int((sandbox.root / "bg.pid").read_text())
    try:
        deadline = time.monotonic() + 10  # SIGKILL is sent at the limit; the exit itself is not instant
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_output_is_kept_as_it_is_read_its_head_and_tail_only():
    """A command's output is read as it comes: its first and last CAPTURE_BYTES are held, the rest only
    counted (a model-written `yes` cannot fill the rollout process's memory); what the model sees is
    the first and last MAX_OUTPUT_CHARS / 2 characters around the exact count of bytes left out."""
    from sparsekv.rollout.sandbox import Capture
    capture = Capture(keep=10)
    for chunk in (b"abc", b"defghijkl", b"m" * 25, b"nopq"):
        capture.add(chunk)
        assert len(capture.head) <= 10 and len(capture.tail) <= 10
    assert (bytes(capture.head), bytes(capture.tail), capture.total) == (b"abcdefghij", b"mmmmmmnopq", 41)
    small = Capture(keep=10)
    small.add(b"0123456789abcdefghij")  # all of it held: whole, and clipped by characters as before
    assert small.result(0).output == "0123456789abcdefghij" and not small.result(0).clipped


def test_a_huge_output_shows_its_head_and_tail_and_the_bytes_left_out(sandbox):
    from sparsekv.rollout.sandbox import CAPTURE_BYTES, MAX_OUTPUT_CHARS
    half = MAX_OUTPUT_CHARS // 2
    size = CAPTURE_BYTES * 40  # 2.56 MB of digits
    result = sandbox.run_command(f"python3 -c \"import sys; sys.stdout.write(('0123456789' * {size // 10}))\"")
    text = result.text()
    assert result.exit_code == 0 and result.clipped
    assert text == (f"exit code: 0\n{('0123456789' * half)[:half]}\n[... {size - 2 * half} bytes omitted ...]\n"
                    f"{('0123456789' * half)[-half:]}")


def test_clip_keeps_an_output_of_exactly_the_limit_whole():
    from sparsekv.rollout.sandbox import clip
    assert clip("x" * 10, limit=10) == "x" * 10
    assert clip("x" * 5 + "y" * 6, limit=10) == "xxxxx\n[... 1 characters omitted ...]\nyyyyy"


@pytest.mark.skipif(not sandbox_mod.process_cap_available(), reason="no pids cgroup can be made here")
def test_a_commands_process_cap_is_removed_after_it(sandbox):
    """The pids cgroup made for a command is removed when the command ends: none is left per tool call."""
    sandbox.allow_network = True
    mine = lambda: sorted(p for root in sandbox_mod.ProcessCap.ROOTS if root.is_dir()
                          for p in root.glob(f"sparsekv-{os.getpid()}-*"))
    before = mine()
    assert sandbox.run("echo hi", Limits(processes=16)).output == "hi\n"
    assert mine() == before


@pytest.mark.skipif(not sandbox_mod.process_cap_available(), reason="no pids cgroup can be made here")
def test_what_a_command_leaves_running_ends_with_it_and_its_cgroup_goes(sandbox, monkeypatch):
    """Without isolation (no pid namespace to take them down), a background job a command left behind,
    its output closed, is killed through the command's pids cgroup when the command ends, and the
    cgroup is removed (an empty cgroup stays until it is: one was left behind per such call)."""
    import signal
    monkeypatch.setattr(sandbox_mod, "isolation_available", lambda: False)
    sandbox.allow_network = True
    mine = lambda: sorted(p for root in sandbox_mod.ProcessCap.ROOTS if root.is_dir()
                          for p in root.glob(f"sparsekv-{os.getpid()}-*"))
    before = mine()
    result = sandbox.run("setsid sleep 30 >/dev/null 2>&1 & echo $! > bg.pid; echo left", Limits(processes=16))
    assert result.output == "left\n" and not result.timed_out
    pid = int((sandbox.root / "bg.pid").read_text())
    try:
        assert not _alive(pid)  # gone before the call returned
        assert mine() == before
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_judgement_counts_only_the_expected_tests(tmp_path):
    """tests_passed counts the shipped test functions that passed, not other tests pytest ran (a test file
    the task let the policy add); a task without test files needs no record at all."""
    from sparsekv.rollout.check import judge_results
    key, extra = ("tests/test_a.py", None, "test_x"), ("tests/test_new.py", None, "test_y")
    results = tmp_path / "results.jsonl"
    run = lambda k: {"path": str(tmp_path / k[0]), "cls": None, "name": k[2], "called": True, "outcome": "passed"}
    results.write_text(json.dumps({"exitstatus": 0, "tests": [run(key), run(extra)]}) + "\n")
    assert judge_results(results, {key}, tmp_path) == (1, [])
    assert judge_results(tmp_path / "missing.jsonl", set(), tmp_path) == (0, [])


def test_the_check_counts_a_test_whose_teardown_failed_as_failed(tmp_path):
    """A test whose call passed but whose fixture teardown failed is failed, not passed; the check's
    working directory (its plugin and records) is removed after it."""
    from sparsekv.rollout.check import run_check
    repo = tmp_path / "t" / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_t.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef res():\n    yield 1\n    raise RuntimeError('teardown')\n\n\n"
        "def test_uses(res):\n    assert res == 1\n\n\ndef test_plain():\n    pass\n")
    (tmp_path / "t" / "task.yaml").write_text("instruction: x\ncheck: python -m pytest -q tests\n")
    with Sandbox(load_task(tmp_path / "t"), allow_network=not isolation_available()) as sb:
        check = run_check(sb)
        assert not check.ok and (check.expected, check.passed) == (2, 1)
        assert check.problems == ["tests/test_t.py::test_uses: failed",
                                  "tests/test_t.py::test_uses: not called and passed"]
        assert list(sb.scratch.glob("check-*")) == []


def test_the_repository_view_lists_regular_files_not_symlinks(sandbox, tmp_path):
    """RepoView.files(): every regular file, repository-relative and sorted; a symlink (to a file inside
    or outside) is not listed, nor followed into a directory."""
    (tmp_path / "outside.py").write_text("x = 1\n")
    (sandbox.root / "out.py").symlink_to(tmp_path / "outside.py")
    (sandbox.root / "alias.py").symlink_to(sandbox.root / "fizzbuzz.py")
    (sandbox.root / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    assert sandbox.files() == ["conftest.py", "fizzbuzz.py", "tests/test_fizzbuzz.py"]


def test_a_check_that_runs_pytest_twice_is_judged_on_both_runs(tmp_path):
    """Each pytest the check starts adds its record: the tests of the first run still count after a second
    run of other files."""
    from sparsekv.rollout.check import run_check
    repo = tmp_path / "t" / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    (repo / "tests" / "test_b.py").write_text("def test_b():\n    pass\n")
    (tmp_path / "t" / "task.yaml").write_text(
        "instruction: x\ncheck: python -m pytest -q tests/test_a.py && python -m pytest -q tests/test_b.py\n")
    with Sandbox(load_task(tmp_path / "t"), allow_network=not isolation_available()) as sb:
        check = run_check(sb)
    assert check.ok and (check.expected, check.passed, check.problems) == (2, 2, [])


def _spec(tmp_path, text: str):
    """A task directory holding `text` as its task.yaml and an empty repository."""
    (tmp_path / "task.yaml").write_text(text)
    (tmp_path / "repo").mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("text, says", [
    ("- instruction: x\n- check: 'true'\n", "a task spec is a mapping"),
    ("instruction: x\ncheck: 'true'\nhidden: .grader/*\n", "'hidden' must be a list of strings"),
    ("instruction: x\ncheck: 'true'\ntests: [checks/*, 3]\n", "'tests' must be a list of strings"),
    ("instruction: x\ncheck: 'true'\neditable: {a: b}\n", "'editable' must be a list of strings"),
], ids=["list", "string", "number", "mapping"])
def test_a_task_spec_of_the_wrong_shape_is_a_task_error(tmp_path, text, says):
    with pytest.raises(TaskError, match=says):
        load_task(_spec(tmp_path, text))


def test_a_task_is_named_after_its_directory_also_when_given_its_task_yaml(tmp_path):
    (tmp_path / "mytask").mkdir()
    spec = _spec(tmp_path / "mytask", "instruction: x\ncheck: 'true'\n")
    assert load_task(spec).name == load_task(spec / "task.yaml").name == "mytask"
    assert load_task(spec / "task.yaml").repo == (spec / "repo").resolve()


def test_a_task_directory_that_exists_wins_over_a_shipped_task_of_the_same_name(tmp_path, monkeypatch):
    """A bare name is a shipped task only where no such path exists: a copy of fizzbuzz in the working
    directory (to change it) is the one loaded."""
    (tmp_path / "fizzbuzz").mkdir()
    _spec(tmp_path / "fizzbuzz", "instruction: the local copy\ncheck: 'true'\n")
    monkeypatch.chdir(tmp_path)
    task = load_task("fizzbuzz")
    assert task.instruction == "the local copy" and task.repo == (tmp_path / "fizzbuzz" / "repo").resolve()


def test_an_option_of_the_check_command_is_not_a_path_even_where_a_file_has_its_name(tmp_path):
    """`pytest -v tests`: -v is pytest's option, also in a repository that holds a file called -v."""
    from sparsekv.rollout.task import Task
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    (tmp_path / "repo" / "-v").write_text("")
    assert Task("t", "x", "pytest -v tests", tmp_path / "repo").check_paths == ("tests/*",)


def test_the_check_fails_when_its_command_fails_though_every_test_passed(tmp_path):
    """The reward needs both: every shipped test called and passed, and the check command's exit status 0
    (a check that runs more than pytest fails when the rest of it fails)."""
    from sparsekv.rollout.check import run_check
    repo = tmp_path / "t" / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "t" / "task.yaml").write_text("instruction: x\ncheck: python -m pytest -q tests && exit 3\n")
    with Sandbox(load_task(tmp_path / "t"), allow_network=not isolation_available()) as sb:
        check = run_check(sb)
    assert (check.command.exit_code, check.expected, check.passed, check.problems) == (3, 1, 1, [])
    assert not check.ok


def test_a_dangling_symlink_where_a_hidden_file_belongs_is_replaced_not_written_through(sandbox, tmp_path):
    """A symlink a command left where a hidden file goes, pointing at a file that does not exist (outside
    the sandbox), is removed before the shipped file is put back: the host must not create its target."""
    target = tmp_path / "planted.py"
    (sandbox.root / ".grader").mkdir(exist_ok=True)
    (sandbox.root / ".grader" / "reference.py").symlink_to(target)
    sandbox.restore_hidden()
    restored = sandbox.root / ".grader" / "reference.py"
    assert not target.exists()
    assert not restored.is_symlink() and restored.read_text() == (sandbox.task.repo / ".grader/reference.py").read_text()


@needs_isolation
def test_commands_cannot_read_the_directory_of_the_tasks_spec(tmp_path):
    """Beside the task's repository, the directory holding its task.yaml (where notes or a reference may
    sit outside the repository) is covered too: a command cannot read it by an absolute path."""
    (tmp_path / "t" / "repo").mkdir(parents=True)
    (tmp_path / "t" / "task.yaml").write_text("instruction: x\ncheck: 'true'\n")
    (tmp_path / "t" / "notes.txt").write_text("the answer\n")
    with Sandbox(load_task(tmp_path / "t")) as sb:
        result = sb.run_command(f"cat {tmp_path / 't' / 'notes.txt'}; ls {tmp_path / 't'}")
    assert "the answer" not in result.output and "task.yaml" not in result.output
