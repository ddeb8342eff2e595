"""Files and directories of the prefix cache's disk tier (prefix_disk.py): a private directory, page
files read only when they are regular files, atomic private writes that never follow a planted link,
and the namespace directories other engines may hold."""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat

SUFFIX = ".safetensors"
TENANT_KEY_FILE = ".tenant-key"          # in each namespace directory
HEX = frozenset("0123456789abcdef")
FILE_NAME_CHARS = 64


def make_private_dir(path: str) -> None:
    """Create `path` (with its missing parents) if needed, the directory itself 0700: only the
    engine's user may list or read the tier. An existing directory keeps its mode (the operator's)."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # whatever the umask


def is_hex_name(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= HEX


def is_page_file_name(name: str) -> bool:
    return name.endswith(SUFFIX) and is_hex_name(name[:-len(SUFFIX)], FILE_NAME_CHARS)


def open_regular(path: str):
    """`path` opened for reading if it is a regular file (not followed if a symlink): a FIFO planted
    under a page's name would block an open or a read forever, a device or directory would not be a
    page. Raises OSError (ELOOP for a symlink) or ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return os.fdopen(fd, "rb")


def temporary_path(directory: str) -> str:
    """A fresh, unguessable temporary name in `directory` (swept at the next start: `.tmp`)."""
    return os.path.join(directory, f".{secrets.token_hex(16)}.tmp")


def write_private_file(path: str, data: bytes, mtime_ns: int | None = None) -> None:
    """Write `data` to `path` (0600), atomically: a reader sees the whole file or none. The temporary
    file is created O_EXCL|O_NOFOLLOW, so a symlink or file planted at its name fails the write rather
    than redirecting it to the planted target."""
    tmp = temporary_path(os.path.dirname(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def namespace_if_free(path: str):
    """Yields whether no engine holds the namespace at `path` (its lock file taken meanwhile, so none
    starts on it while its files are counted or removed)."""
    try:
        fd = os.open(os.path.join(path, ".lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def page_files(directory: str) -> list[tuple[int, str, int]]:
    """(mtime_ns, path, size) of the regular page files in `directory`."""
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if is_page_file_name(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.path, st.st_size))
    return found


def remove_namespace_if_empty(path: str) -> bool:
    """Remove a namespace directory left with no page files (its lock, tenant key and temporaries
    too); whether it is gone. Anything else found in it keeps it."""
    if page_files(path):
        return False
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            if entry.name in (".lock", TENANT_KEY_FILE) or entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True
