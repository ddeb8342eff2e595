"""The disk tier's policies at their edges (cache/prefix_disk.py), on the store alone: a budget of
exactly N files holds N, a hit keeps its page and its place after a restart, a page's time of last use
never moves back and survives a restart and a key rotation (what the TTL measures), other namespaces'
files go oldest first, and a namespace another engine holds is neither counted nor touched."""
from __future__ import annotations

import os
import time

import pytest

from test_prefix_disk import _files, _rows, files_that


def _name(i: int) -> bytes:
    return bytes([i + 1]) * 32


def _store(rows, root, pages, cipher=None, old=(), **kw):
    """A store whose budget is exactly `pages` page files."""
    from sparsekv.cache.prefix_disk import PrefixDiskStore, page_file_bytes
    return PrefixDiskStore(rows, str(root), "space", pages * page_file_bytes(rows, cipher), cipher,
                           old_ciphers=list(old), **kw)


def test_a_budget_of_exactly_n_files_holds_n_pages(tmp_path):
    """The budget is a bound, not a strict one: N files fit a budget of N files' bytes (a budget of one
    file holds one page)."""
    rows = _rows()
    disk = _store(rows, tmp_path / "four", 4)
    for i in range(4):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    assert all(disk.has(_name(i)) for i in range(4)) and disk.dropped == 0
    assert disk.tier_bytes_used == disk.capacity_bytes and len(_files(tmp_path / "four")) == 4
    disk.check_integrity()
    disk.close()

    one = _store(rows, tmp_path / "one", 1)
    one.save_rows(_name(0), rows.copy_out(0), "alice")
    one.flush()
    assert one.has(_name(0)) and len(_files(tmp_path / "one")) == 1
    one.save_rows(_name(1), rows.copy_out(1), "alice")  # the older one makes room
    one.flush()
    assert one.has(_name(1)) and not one.has(_name(0)) and len(_files(tmp_path / "one")) == 1
    one.close()


def test_a_hit_keeps_its_page_over_older_ones_also_after_a_restart(tmp_path):
    """A page read back (`take`) is used now: the eviction takes the page saved after it but not hit,
    and its file time records the hit, so a restart within a smaller budget keeps it."""
    rows = _rows()
    disk = _store(rows, tmp_path, 3)
    for i in range(3):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    assert torch_equal(disk.take(_name(0)), rows.copy_out(0))
    disk.save_rows(_name(3), rows.copy_out(3), "alice")  # over budget: page 1, the least recently used, goes
    disk.flush()
    assert disk.has(_name(0)) and not disk.has(_name(1)) and disk.has(_name(2)) and disk.has(_name(3))
    assert torch_equal(disk.take(_name(2)), rows.copy_out(2))
    disk.close()

    smaller = _store(rows, tmp_path, 2)  # the two most recently used: 3 (saved), then 2 (hit)
    assert smaller.has(_name(2)) and smaller.has(_name(3)) and not smaller.has(_name(0))
    smaller.close()
    smallest = _store(rows, tmp_path, 1)
    assert smallest.has(_name(2)) and smallest.num_pages == 1  # the page hit last
    smallest.close()


def torch_equal(a, b) -> bool:
    import torch
    return a is not None and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_pages_time_of_last_use_never_moves_back(tmp_path):
    """A touch with an earlier time than the page's last use (a copy spilled late from the host tier)
    leaves it: the TTL measures from the latest use."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    now = time.time()
    disk.save_rows(_name(0), rows.copy_out(0), "alice", used_at=now)
    disk.touch(_name(0), now - 1000)
    assert disk.expire(now - 500) == 0 and disk.has(_name(0))
    disk.close()


def test_a_restart_expires_by_each_pages_own_last_use_saved_out_of_order(tmp_path):
    """Pages saved with their last use (as at close) in any order: each file's time is its own last
    use, so after a restart the TTL removes the old page and keeps the recent one."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    now = time.time()
    disk.save_rows(_name(0), rows.copy_out(0), "alice", used_at=now)
    disk.save_rows(_name(1), rows.copy_out(1), "alice", used_at=now - 1000)
    disk.close()
    restarted = _store(rows, tmp_path, 4)
    assert restarted.expire(now - 500) == 1
    assert restarted.has(_name(0)) and not restarted.has(_name(1))
    restarted.flush()
    assert len(_files(tmp_path)) == 1
    restarted.close()


def test_a_key_rotation_keeps_each_pages_time_of_last_use(tmp_path):
    """Re-sealing a file under the new key keeps its time: a page last used long ago still expires
    after the rotation, and a recent one stays."""
    from sparsekv.cache.page_cipher import PageCipher
    rows = _rows()
    k1, k2 = PageCipher(b"1" * 32, "space"), PageCipher(b"2" * 32, "space")
    disk = _store(rows, tmp_path, 4, k1)
    now = time.time()
    disk.save_rows(_name(0), rows.copy_out(0), "alice", used_at=now - 1000)
    disk.save_rows(_name(1), rows.copy_out(1), "alice", used_at=now)
    disk.close()
    rotating = _store(rows, tmp_path, 4, k2, old=[k1])
    rotating.flush()
    assert rotating.rekeyed == 2
    rotating.close()
    after = _store(rows, tmp_path, 4, k2)
    assert after.expire(now - 500) == 1 and after.has(_name(1)) and not after.has(_name(0))
    assert torch_equal(after.take(_name(1)), rows.copy_out(1))
    after.close()


def _plant_other_namespace(root, space, file_bytes, mtimes):
    """Page-named files of `file_bytes` bytes with these times in another namespace directory."""
    path = root / space
    path.mkdir(parents=True, mode=0o700)
    for i, mtime in enumerate(mtimes):
        file = path / (f"{i:064x}" + ".safetensors")
        file.write_bytes(b"\0" * file_bytes)
        os.utime(file, ns=(mtime, mtime))
    return path


def test_other_namespaces_files_go_oldest_first(tmp_path):
    """Another namespace no engine holds, over the budget: its oldest files are removed first, before
    any of this namespace's, and the newest stays while room remains."""
    from sparsekv.cache.prefix_disk import page_file_bytes
    rows = _rows()
    fb = page_file_bytes(rows, None)
    other = _plant_other_namespace(tmp_path, "a" * 32, fb, [3_000_000_000, 1_000_000_000, 4_000_000_000, 2_000_000_000])
    disk = _store(rows, tmp_path, 3)
    disk.flush()  # the removals queued at start
    assert sorted(p.name for p in other.iterdir() if p.name.endswith(".safetensors")) == [
        f"{0:064x}.safetensors", f"{2:064x}.safetensors", f"{3:064x}.safetensors"]  # the file of time 1 went
    disk.save_rows(_name(0), rows.copy_out(0), "alice")
    disk.flush()
    assert sorted(p.name for p in other.iterdir() if p.name.endswith(".safetensors")) == [
        f"{0:064x}.safetensors", f"{2:064x}.safetensors"]  # then the file of time 2
    disk.save_rows(_name(1), rows.copy_out(1), "alice")  # room left in the budget only with the other's files out
    disk.flush()
    assert sorted(p.name for p in other.iterdir() if p.name.endswith(".safetensors")) == [f"{2:064x}.safetensors"]
    assert disk.has(_name(0)) and disk.has(_name(1)) and disk.tier_bytes_used <= disk.capacity_bytes
    disk.close()


def _namespace_with_pages(beside, space: str, pages: int):
    """A store of namespace `space` beside the store `beside` (its rows, root and budget), holding
    `pages` of bob's pages, saved."""
    store = type(beside)(beside.rows, beside.root, space, beside.capacity_bytes)
    for i in range(pages):
        store.save_rows(_name(i), beside.rows.copy_out(i), "bob")
    store.flush()
    return store


def test_a_namespace_another_engine_holds_is_neither_counted_nor_removed(tmp_path):
    """Another engine's namespace (its lock held) is not this engine's to evict: none of its files is
    counted against this budget or removed, whatever this engine saves."""
    rows = _rows()
    other = _store(rows, tmp_path, 4)
    held = _namespace_with_pages(other, "b" * 32, 3)
    other.close()
    os.rename(tmp_path / "space", tmp_path / "unused")  # only the held namespace beside the next one
    disk = _store(rows, tmp_path, 2)
    assert disk.tier_bytes_used == 0
    for i in range(4):
        disk.save_rows(_name(10 + i), rows.copy_out(i % 4), "alice")
    disk.flush()
    assert all(held.has(_name(i)) for i in range(3)) and len(_files(tmp_path / ("b" * 32))) == 3
    assert all(torch_equal(held.take(_name(i)), rows.copy_out(i)) for i in range(3))
    disk.close()
    held.close()


def test_files_named_under_a_lost_tenant_secret_are_removed_at_start(tmp_path):
    """The namespace's secret lost (its file removed): the files it named can never be looked up
    again, so a restart removes them instead of letting them hold the budget."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    for i in range(2):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.close()
    os.unlink(tmp_path / "space" / ".tenant-key")
    restarted = _store(rows, tmp_path, 4)
    assert restarted.num_pages == 0 and restarted.tier_bytes_used == 0 and restarted.discarded == 2
    assert _files(tmp_path) == []
    restarted.close()


def test_files_still_sealed_with_a_retired_key_are_removed_at_start(tmp_path, monkeypatch):
    """A rotation stopped before it re-sealed the files (the tenant key re-sealed already): an engine
    with the new key alone removes the files it cannot open at start, not counting them as pages."""
    from sparsekv.cache.page_cipher import PageCipher
    from sparsekv.cache.prefix_disk import PrefixDiskStore
    rows = _rows()
    k1, k2 = PageCipher(b"1" * 32, "space"), PageCipher(b"2" * 32, "space")
    disk = _store(rows, tmp_path, 4, k1)
    for i in range(2):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.close()
    with monkeypatch.context() as m:
        m.setattr(PrefixDiskStore, "_rekey", lambda self, file_id: None)
        _store(rows, tmp_path, 4, k2, old=[k1]).close()
    after = _store(rows, tmp_path, 4, k2)
    assert after.num_pages == 0 and after.discarded == 2 and after.tier_bytes_used == 0
    assert _files(tmp_path) == [] and after.failed == 0
    after.close()


def test_resetting_a_tenant_removes_its_files_only_and_a_zero_quota_keeps_none(tmp_path):
    """`drop(tenant)` removes that tenant's files and no other's; a tenant quota of 0 pages (a small
    tenant share of a small tier) writes nothing."""
    rows = _rows()
    disk = _store(rows, tmp_path / "a", 4)
    disk.save_rows(_name(0), rows.copy_out(0), "alice")
    disk.save_rows(_name(1), rows.copy_out(1), "bob")
    assert disk.drop("alice") == 1
    disk.flush()
    assert not disk.has(_name(0)) and disk.has(_name(1)) and len(_files(tmp_path / "a")) == 1
    disk.close()
    none = _store(rows, tmp_path / "b", 4, max_pages_per_tenant=0)
    none.save_rows(_name(0), rows.copy_out(0), "alice")
    copied = []
    rows.copy_out = lambda page: copied.append(page)
    none.save(_name(1), 1, "alice")  # and the pool page is not even read
    none.flush()
    assert none.num_pages == 0 and _files(tmp_path / "b") == [] and copied == []
    none.check_integrity()
    none.close()


def test_a_file_the_writer_cannot_remove_or_touch_is_reported_and_counted_again_at_the_next_start(tmp_path, monkeypatch, caplog):
    """A dropped page whose file the writer cannot remove (permissions changed under the engine) is
    logged, not lost in a future nobody reads; the file stays, and the next start counts it again. Any
    other writer job's unhandled error is logged as well."""
    import sparsekv.cache.prefix_disk as prefix_disk
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    disk.save_rows(_name(0), rows.copy_out(0), "alice")
    disk.flush()

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)
    with monkeypatch.context() as m:
        m.setattr(prefix_disk.os, "unlink", refuse)
        assert disk.drop("alice") == 1
        disk.flush()
    assert not disk.has(_name(0)) and disk.num_pages == 0 and len(_files(tmp_path)) == 1
    assert any("removing" in r.getMessage() and "Permission denied" in r.getMessage() for r in caplog.records)
    disk.close()
    again = _store(rows, tmp_path, 4)
    assert again.has(_name(0)) and again.num_pages == 1
    again.check_integrity()
    with monkeypatch.context() as m:  # any other job's unhandled error is logged too (here a file's time)
        m.setattr(prefix_disk.os, "utime", refuse)
        again.touch(_name(0))
        again.flush()
    assert any("background job failed" in r.getMessage() and "Permission denied" in r.getMessage()
               for r in caplog.records)
    again.close()


def test_a_namespace_an_engine_takes_after_it_was_counted_is_not_removed(tmp_path):
    """Another namespace counted free at start, then taken by an engine before this one runs out of
    room: its files are no longer this engine's to remove (the lock is checked again at removal)."""
    rows = _rows()
    first = _store(rows, tmp_path, 3)
    _namespace_with_pages(first, "c" * 32, 2).close()
    first.close()
    disk = _store(rows, tmp_path, 3)  # room for the other's two files and one page of its own
    disk.flush()
    assert len(_files(tmp_path / ("c" * 32))) == 2  # counted, nothing removed yet
    taken = type(disk)(rows, str(tmp_path), "c" * 32, disk.capacity_bytes)  # an engine starts on it
    for i in range(3):
        disk.save_rows(_name(10 + i), rows.copy_out(i), "alice")
    disk.flush()
    assert all(taken.has(_name(i)) for i in range(2)) and len(_files(tmp_path / ("c" * 32))) == 2
    assert disk.has(_name(12))
    taken.close()
    disk.close()


def test_a_namespace_with_page_files_keeps_its_lock_and_tenant_key_and_an_emptied_one_goes(tmp_path):
    """`remove_namespace_if_empty`: a namespace still holding a page file is left whole (its lock and
    tenant key too: its pages stay readable under their names); once none is left it goes with its
    lock, tenant key and temporaries."""
    from sparsekv.cache.prefix_disk_files import SUFFIX, TENANT_KEY_FILE, remove_namespace_if_empty
    space = tmp_path / "space"
    space.mkdir()
    page = space / ("a" * 64 + SUFFIX)
    for path in (page, space / ".lock", space / TENANT_KEY_FILE, space / ".0123.tmp"):
        path.write_bytes(b"x")
    assert not remove_namespace_if_empty(str(space))
    assert sorted(os.listdir(space)) == sorted([page.name, ".lock", TENANT_KEY_FILE, ".0123.tmp"])
    page.unlink()
    assert remove_namespace_if_empty(str(space)) and not space.exists()


def test_only_regular_files_of_a_page_files_name_are_counted(tmp_path):
    """`page_files`: a name of 64 hex characters and the suffix, a regular file: a longer or shorter
    name, or a symlink named like a page (to a file elsewhere), is not a page of the tier."""
    from sparsekv.cache.prefix_disk_files import SUFFIX, page_files
    (tmp_path / ("b" * 64 + SUFFIX)).write_bytes(b"xy")
    for name in ("c" * 63 + SUFFIX, "d" * 65 + SUFFIX):
        (tmp_path / name).write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.write_bytes(b"xyz")
    os.symlink(outside, tmp_path / ("e" * 64 + SUFFIX))
    assert [(os.path.basename(path), size) for _, path, size in page_files(str(tmp_path))] == [("b" * 64 + SUFFIX, 2)]


def test_a_private_file_is_synced_before_it_replaces_the_page_and_keeps_its_stamp(tmp_path, monkeypatch):
    """`write_private_file`: the data reaches the disk (fsync) before the rename that makes it the page
    (a crash leaves the old page or the new, never an empty one), 0600, stamped with the given time,
    no temporary left."""
    from sparsekv.cache import prefix_disk_files
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or replace(a, b))
    path = tmp_path / "page"
    prefix_disk_files.write_private_file(str(path), b"rows", mtime_ns=123_000_000_000)
    assert events == ["fsync", "replace"] and path.read_bytes() == b"rows" and os.listdir(tmp_path) == ["page"]
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(path).st_mtime_ns == 123_000_000_000


def test_a_failed_private_write_leaves_no_temporary_and_a_new_directory_is_private_whatever_the_umask(
        tmp_path, monkeypatch):
    """`write_private_file` failing (here its rename) removes its temporary; `make_private_dir` makes a
    new directory 0700 even under a umask that would take the owner's write bit."""
    from sparsekv.cache import prefix_disk_files

    def refused(a, b):
        raise OSError("refused")
    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="refused"):
        prefix_disk_files.write_private_file(str(tmp_path / "page"), b"rows")
    assert os.listdir(tmp_path) == []
    old = os.umask(0o277)  # would make the directory 0500: the tier could not write into it
    try:
        prefix_disk_files.make_private_dir(str(tmp_path / "tier"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "tier").st_mode & 0o777 == 0o700


def test_a_regular_file_planted_at_the_temporary_name_fails_the_write(tmp_path, monkeypatch):
    """`write_private_file`: a regular file planted at its temporary name (another user's, readable by
    all) is neither written through nor renamed into place as the page, which would keep its owner and
    mode: the write fails, no page appears, and the planted file is left as it was."""
    from sparsekv.cache import prefix_disk_files
    planted = tmp_path / ".planted.tmp"
    planted.write_bytes(b"planted")
    os.chmod(planted, 0o644)
    monkeypatch.setattr(prefix_disk_files, "temporary_path", lambda directory: str(planted))
    with pytest.raises(FileExistsError):
        prefix_disk_files.write_private_file(str(tmp_path / "page"), b"rows")
    assert sorted(os.listdir(tmp_path)) == [".planted.tmp"] and planted.read_bytes() == b"planted"

def test_only_a_regular_file_is_opened_for_reading_never_a_fifo_or_a_symlink(tmp_path):
    """`open_regular`: a regular file opens; a FIFO (a read of it could block) is refused with
    ValueError, and a symlink, even to a regular file, with OSError (it is not followed)."""
    from sparsekv.cache.prefix_disk_files import open_regular
    page = tmp_path / "page"
    page.write_bytes(b"rows")
    with open_regular(str(page)) as f:
        assert f.read() == b"rows"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        open_regular(str(tmp_path / "fifo"))
    os.symlink(page, tmp_path / "link")
    with pytest.raises(OSError):
        open_regular(str(tmp_path / "link"))


def test_every_eviction_and_read_back_is_counted(tmp_path):
    """`prefix_disk_evictions` counts every file the budget removes, another namespace's as well as
    this one's, and `prefix_disk_reads` every page read back."""
    from sparsekv.cache.prefix_disk import page_file_bytes
    rows = _rows()
    _plant_other_namespace(tmp_path, "a" * 32, page_file_bytes(rows, None), [1_000_000_000, 2_000_000_000])
    disk = _store(rows, tmp_path, 2)
    assert disk.dropped == 0 and disk.tier_bytes_used == disk.capacity_bytes  # exactly full: nothing removed
    for i in range(3):  # the other's two files go, then this namespace's oldest page
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    assert disk.dropped == 3 and not disk.has(_name(0)) and _files(tmp_path) == _files(tmp_path / "space")
    for i in (1, 2, 1):
        assert torch_equal(disk.take(_name(i)), rows.copy_out(i))
    assert disk.take(_name(0)) is None
    stats = disk.stats()
    assert (stats["prefix_disk_evictions"], stats["prefix_disk_reads"], stats["prefix_disk_writes"]) == (3, 3, 3)
    disk.close()


def _read_ahead(disk, names) -> None:
    """Read `names` ahead and wait until they are in memory."""
    while not disk.prefetch(names):
        disk.wait_for_reads(1.0)


def test_a_page_read_ahead_then_reset_is_not_served(tmp_path):
    """A page read ahead of its admission and then removed from the tier (a reset of its tenant) is a
    miss: its rows read ahead are forgotten with it, not served nor counted as a read."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    for i in range(2):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    _read_ahead(disk, [_name(0), _name(1)])
    assert disk.drop("alice") == 2
    assert disk.take(_name(0)) is None and disk.take(_name(1)) is None and disk.loaded == 0
    disk.flush()
    assert _files(tmp_path) == [] and disk.num_pages == 0
    disk.check_integrity()
    disk.close()


def test_a_read_ahead_is_ready_only_once_every_page_is_read(tmp_path, monkeypatch):
    """`prefetch` is True only when all the pages asked for are in memory: one read earlier does not
    make a chain ready while a page before it is still being read."""
    import threading

    from sparsekv.cache import prefix_disk
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    for i in range(2):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    _read_ahead(disk, [_name(1)])
    gate, real = threading.Event(), prefix_disk.open_regular

    def held_back(path):
        gate.wait()
        return real(path)
    monkeypatch.setattr(prefix_disk, "open_regular", held_back)
    try:
        ready = disk.prefetch([_name(0), _name(1)])  # page 0's read is held back, page 1 is in memory
    finally:
        gate.set()
    assert not ready
    _read_ahead(disk, [_name(0), _name(1)])
    assert all(torch_equal(disk.take(_name(i)), rows.copy_out(i)) for i in range(2)) and disk.loaded == 2
    disk.close()


def test_a_page_that_left_and_came_back_while_it_was_read_is_kept(tmp_path, monkeypatch):
    """A read that fails because its page was removed and saved again meanwhile (a reset, then the
    page recomputed) is no failure of the new file: nothing counted, the page saved anew stays."""
    from sparsekv.cache import prefix_disk
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    disk.save_rows(_name(0), rows.copy_out(0), "alice")
    disk.flush()
    real = prefix_disk.open_regular

    def replaced_while_read(data: bytes) -> bytes:
        disk.drop("alice")
        disk.save_rows(_name(0), rows.copy_out(1), "alice")  # the page back, under a new write
        return data[:len(data) // 2]  # the old file cut short under the read
    monkeypatch.setattr(prefix_disk, "open_regular", files_that(real, replaced_while_read))
    assert disk.take(_name(0)) is None
    monkeypatch.setattr(prefix_disk, "open_regular", real)
    disk.flush()
    assert disk.failed == 0 and disk.has(_name(0)) and len(_files(tmp_path)) == 1
    assert torch_equal(disk.take(_name(0)), rows.copy_out(1))
    disk.check_integrity()
    disk.close()


def test_a_discarded_read_ahead_that_has_not_started_never_reads_its_file(tmp_path, monkeypatch):
    """`discard` (the request aborted): the pages whose reads are still queued are not read at all."""
    import threading

    from sparsekv.cache import prefix_disk
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    for i in range(3):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    gate, real, opened = threading.Event(), prefix_disk.open_regular, []

    def counted(path):
        gate.wait()
        opened.append(path)
        return real(path)
    monkeypatch.setattr(prefix_disk, "open_regular", counted)
    try:
        disk.prefetch([_name(i) for i in range(3)])  # page 0's read held back, 1 and 2 queued behind it
        disk.discard([_name(1), _name(2)])
    finally:
        gate.set()
    _read_ahead(disk, [_name(0)])
    disk.flush()
    assert opened == [disk.path_of(_name(0))] and disk.failed == 0 and disk.num_pages == 3
    disk.close()


def test_pages_removed_for_a_tenant_quota_are_counted_as_evictions(tmp_path):
    """A tenant's files beyond its quota, removed when it saves another or at a restart with a smaller
    quota, count in `prefix_disk_evictions` like those the byte budget removes."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4, max_pages_per_tenant=2)
    for i in range(3):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.save_rows(_name(3), rows.copy_out(3), "bob")
    disk.flush()
    assert disk.dropped == 1 and not disk.has(_name(0)) and disk.stats()["prefix_disk_evictions"] == 1
    disk.close()
    restarted = _store(rows, tmp_path, 4, max_pages_per_tenant=1)
    assert restarted.dropped == 1 and restarted.num_pages == 2 and restarted.has(_name(2))
    restarted.flush()
    assert len(_files(tmp_path)) == 2
    restarted.close()


def test_a_namespace_whose_lock_cannot_be_opened_is_left_alone(tmp_path):
    """Another namespace's lock that cannot be opened (here a symlink, never followed) may be held:
    its files are neither counted against this budget nor removed."""
    from sparsekv.cache.prefix_disk import page_file_bytes
    rows = _rows()
    other = _plant_other_namespace(tmp_path, "a" * 32, page_file_bytes(rows, None), [1_000_000_000, 2_000_000_000])
    (tmp_path / "lock-target").write_bytes(b"")
    os.symlink(tmp_path / "lock-target", other / ".lock")
    disk = _store(rows, tmp_path, 2)
    for i in range(3):
        disk.save_rows(_name(i), rows.copy_out(i), "alice")
    disk.flush()
    assert disk.tier_bytes_used == disk.bytes_used == disk.capacity_bytes and len(_files(other)) == 2
    disk.close()


def test_a_checkpoints_first_and_last_bytes_are_part_of_its_identity(tmp_path):
    """`checkpoint_identity` samples a weights file's header and its very last bytes: a change of
    either alone is another checkpoint, without the files' times."""
    from sparsekv.cache.prefix_disk import SAMPLE_BYTES, SAMPLES_PER_FILE, checkpoint_identity
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    data = bytearray(SAMPLE_BYTES + SAMPLES_PER_FILE * 16)  # the samples overlap: every byte is read
    weights.write_bytes(bytes(data))
    before = checkpoint_identity(str(tmp_path))
    for at in (0, len(data) - 1):
        changed = bytearray(data)
        changed[at] = 1
        weights.write_bytes(bytes(changed))
        assert checkpoint_identity(str(tmp_path)) != before, at
    weights.write_bytes(bytes(data))
    assert checkpoint_identity(str(tmp_path)) == before


def test_a_full_disk_with_nothing_to_evict_fails_the_write_without_retrying_it(tmp_path, monkeypatch):
    """ENOSPC with no other file in the tier to remove: the write is tried once, counted as failed,
    and the page is not indexed."""
    import errno

    import sparsekv.cache.prefix_disk as prefix_disk
    rows, tries = _rows(), []

    def full(*args, **kwargs):
        tries.append(args[0])
        raise OSError(errno.ENOSPC, "No space left on device")
    disk = _store(rows, tmp_path, 4)
    monkeypatch.setattr(prefix_disk, "write_private_file", full)
    disk.save_rows(_name(0), rows.copy_out(0), "alice")
    disk.flush()
    assert tries == [disk.path_of(_name(0))] and disk.failed == 1 and disk.dropped == 0 and disk.num_pages == 0
    disk.check_integrity()
    disk.close()


def test_pages_saved_within_one_clock_tick_keep_their_order_after_a_restart(tmp_path):
    """File times are strictly increasing even when the clock does not move between saves (a coarse
    clock): a restart within a smaller budget keeps the pages saved last, whatever their file names.
    Here the pages are saved in descending file name order, so an order by name alone keeps the wrong
    ones."""
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    now = time.time()
    disk.clock = lambda: now
    names = sorted((_name(i) for i in range(4)), key=disk.path_of, reverse=True)
    for i, name in enumerate(names):
        disk.save_rows(name, rows.copy_out(i), "alice")
    disk.close()
    smaller = _store(rows, tmp_path, 2)
    assert [smaller.has(name) for name in names] == [False, False, True, True]
    smaller.close()


def test_a_lock_file_others_may_read_is_made_private_when_the_namespace_is_taken(tmp_path):
    """A namespace's lock file left 0644 (by an earlier version) is 0600 once an engine takes it."""
    space = tmp_path / "space"
    space.mkdir(mode=0o700)
    (space / ".lock").write_bytes(b"")
    os.chmod(space / ".lock", 0o644)
    disk = _store(_rows(), tmp_path, 1)
    assert os.stat(space / ".lock").st_mode & 0o777 == 0o600
    disk.close()


def test_a_page_still_being_written_is_served_from_memory(tmp_path, monkeypatch):
    """A hit on a page whose file is not written yet (the writer busy) gets the rows kept for the write:
    served exactly, no failure counted, and the file written afterwards."""
    import threading

    from sparsekv.cache import prefix_disk
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    gate, write = threading.Event(), prefix_disk.write_private_file

    def held_back(*args, **kwargs):
        gate.wait()
        return write(*args, **kwargs)
    monkeypatch.setattr(prefix_disk, "write_private_file", held_back)
    try:
        disk.save_rows(_name(0), rows.copy_out(0), "alice")
        assert disk.prefetch([_name(0)])  # nothing to read ahead: the rows are in memory
        served = disk.take(_name(0))
    finally:
        gate.set()
    disk.flush()
    assert torch_equal(served, rows.copy_out(0)) and disk.failed == 0 and disk.loaded == 1
    assert disk.has(_name(0)) and len(_files(tmp_path)) == 1
    disk.close()


def test_closing_with_more_cached_pages_than_the_budget_keeps_the_most_recently_used(tmp_path):
    """`persist` saves the pool's cached pages least recently used first, so a disk budget smaller than
    the cache keeps the newest (each saved page makes room by removing an older one)."""
    from sparsekv import SamplingParams
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    from sparsekv.request import Request
    from test_prefix_disk import PAGE
    rows = _rows()
    allocator, disk = PageAllocator(4, PAGE), _store(rows, tmp_path, 2)
    cache = PrefixCache(allocator, tiers={"disk": disk}, rows=rows)
    now = [time.time()]
    cache.set_clock(lambda: now[0])
    owner = Request("a", list(range(1, 3 * PAGE + 2)), SamplingParams(max_tokens=1))
    owner.page_ids, owner.num_computed_tokens = allocator.allocate("a", 4), 3 * PAGE + 1
    cache.register(owner)
    names = [cache._name_of[p] for p in owner.page_ids[:3]]
    cache.forget_request("a")
    for page in owner.page_ids:                       # released a second apart: page 0 the least recent
        allocator.free("a", [page])
        now[0] += 1
    cache.persist()
    assert [disk.has(name) for name in names] == [False, True, True]
    disk.check_integrity()
    disk.close()


def test_after_new_weights_the_host_tier_spills_to_the_new_disk_tier_only(tmp_path):
    """`new_weights(disk)` replaces the disk tier: a copy the host tier pushes out afterwards goes to the
    new one (never to the old tier, closed, whose files are named for the old weights); with no new disk
    tier it is dropped."""
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    from sparsekv.cache.prefix_host import PrefixHostStore
    from test_prefix_disk import PAGE
    rows = _rows()
    old, new = _store(rows, tmp_path / "old", 4), _store(rows, tmp_path / "new", 4)
    host = PrefixHostStore(rows, rows.page_bytes, spill=old.save_rows)  # room for one copy
    cache = PrefixCache(PageAllocator(4, PAGE), tiers={"host": host, "disk": old}, rows=rows)
    cache.new_weights(new)
    host.save(_name(0), 0, "alice")
    host.save(_name(1), 1, "alice")                     # pushes copy 0 out
    new.flush()
    assert new.has(_name(0)) and _files(tmp_path / "old") == []
    cache.new_weights(None)
    host.save(_name(2), 2, "alice")                     # pushes copy 1 out: no disk tier to take it
    assert "disk" not in cache.tiers and not new.has(_name(1)) and _files(tmp_path / "old") == []
    host.check_integrity()
    new.close()


def test_a_request_waiting_for_a_read_ahead_across_new_weights_leaves_nothing_behind(tmp_path, monkeypatch):
    """A request waiting for its disk pages to be read when the weights change (and the disk tier goes):
    the read is forgotten with the old tier, so the request, aborted, leaves as one that waits for nothing."""
    from sparsekv import SamplingParams
    from sparsekv.cache.pages import PageAllocator
    from sparsekv.cache.prefix import PrefixCache
    from sparsekv.request import Request
    from test_prefix_disk import PAGE
    rows = _rows()
    disk = _store(rows, tmp_path, 4)
    cache = PrefixCache(PageAllocator(4, PAGE), tiers={"disk": disk}, rows=rows)
    prompt = list(range(1, 2 * PAGE + 2))
    disk.save_rows(cache.prompt_names(prompt, "default", None)[0], rows.copy_out(0), "default")
    disk.flush()
    monkeypatch.setattr(disk, "prefetch", lambda names: False)  # the read not done yet
    assert cache.match(Request("r", prompt, SamplingParams(max_tokens=1))) is None
    cache.new_weights(None)
    cache.forget_request("r")                                  # aborted while it waited
    cache.check_integrity(set())
