"""The prefix cache's disk tier: pages pushed out of host memory kept as files, so a later hit (or a
later engine on the same model, after a restart) reads them back instead of recomputing them. The
third tier of SGLang's HiCache and LMCache's local disk, for the prefix cache.

Each page is one safetensors file, `<dir>/<namespace>/<page name in hex>.safetensors`, holding the
page's rows of every slot-indexed tensor (prefix_host.PageRows). The page name is the prefix cache's
hash chain, rooted at (tenant, cache_salt), so a tenant's files are found only by the same tenant and
salt; the namespace (`namespace()`) is a hash of everything that decides a page's bytes: the
checkpoint (config.json, shard names, sizes and sampled contents), dtype, device type, page size,
attention mode, selector, indexer key dtype, drafting and the tensor layout. Another model, or the
same one run another way, never reads these files. Files are written 0600 in a 0700 directory.

Writes, deletions and touches run in order on one background thread, so an eviction costs the engine
step a host copy, not a disk write. A page being written is read from memory. Reads run ahead of
admission on another thread (`prefetch`): a request whose prefix is on disk waits in the queue while
its pages are read, and the requests running meanwhile keep stepping. Budgeted by
`capacity_bytes` (tensor bytes), least recently saved or hit first out, and that order survives a
restart (file mtimes). A file that cannot be read back, or does not match the layout, is a miss: the
page is computed instead and the file removed. One engine per directory: a lock file refuses a second.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
from safetensors.torch import load as load_page
from safetensors.torch import save_file

from .page_cipher import PageCipher
from .pages import TenantLRU
from .prefix_host import PageRows

logger = logging.getLogger(__name__)
FORMAT = "sparsekv-prefix-page-v1"
SUFFIX = ".safetensors"
SAMPLES_PER_FILE, SAMPLE_BYTES = 256, 4096


def checkpoint_identity(path: str) -> list:
    """config.json, and each safetensors file's name, size and 256 sampled 4 KiB blocks (its header
    and last bytes included): what tells two checkpoints apart without reading all their weights."""
    with open(os.path.join(path, "config.json"), "rb") as f:
        identity: list = [hashlib.sha256(f.read()).hexdigest()]
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        size, digest = os.path.getsize(file), hashlib.sha256()
        with open(file, "rb") as f:
            for i in range(SAMPLES_PER_FILE):
                f.seek(max(0, (size - SAMPLE_BYTES) * i // (SAMPLES_PER_FILE - 1)))
                digest.update(f.read(SAMPLE_BYTES))
        identity.append((name, size, digest.hexdigest()))
    return identity


def _page_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors file's bytes (an 8-byte header length, then JSON)."""
    return _header_metadata(data[8:8 + int.from_bytes(data[:8], "little")])


def _header_metadata(header: bytes) -> dict:
    return json.loads(header).get("__metadata__") or {}


def tenant_digest(tenant: str) -> str:
    """What a page file records of its tenant: enough to remove a tenant's pages, not its name."""
    return hashlib.sha256(b"sparsekv-tenant\0" + tenant.encode()).hexdigest()[:32]


def namespace(config, rows: PageRows, lookahead: int, sealed: bool = False) -> str:
    """The directory name for pages this engine computes: equal only for engines whose pages hold the
    same bytes for the same names."""
    key = {"format": FORMAT, "checkpoint": checkpoint_identity(config.model), "dtype": config.dtype,
           "device": torch.device(config.device).type, "page": config.kv_page_size, "attention": config.attention,
           "overrides": config.hf_overrides, "selector": config.selector, "quest": config.quest_page_tokens,
           "index_keys": config.indexer_key_dtype, "latents": config.kv_cache_dtype, "lookahead": lookahead,
           "layout": [(shape, str(dtype)) for shape, dtype in rows.layout], "sealed": sealed}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PrefixDiskStore:
    """`max_pages_per_tenant`: a tenant's files beyond this many are removed, oldest first (None: no
    bound). Over budget, the oldest file of the tenant holding the most goes first (pages.TenantLRU).
    `old_ciphers`: keys being rotated out; files sealed with one are read with it, and re-sealed with
    `cipher` in the background from the start (`rekeyed`), each keeping its place in the LRU order."""

    def __init__(self, rows: PageRows, root: str, space: str, capacity_bytes: int, cipher: PageCipher | None = None,
                 max_pages_per_tenant: int | None = None, old_ciphers: list[PageCipher] = ()):
        self.rows, self.page_bytes, self.capacity_bytes, self.cipher = rows, rows.page_bytes, capacity_bytes, cipher
        self._ciphers = {c.key_id: c for c in [*old_ciphers, *([cipher] if cipher is not None else [])]}
        self.max_pages_per_tenant = max_pages_per_tenant
        self.dir = os.path.join(root, space)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._lock_file = open(os.path.join(self.dir, ".lock"), "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ValueError(f"prefix cache disk tier {self.dir} is in use by another engine") from None
        # pages on disk or being written, by tenant_digest() of the tenant that computed them, with the
        # time each was last saved or hit (clock())
        self._files = TenantLRU()
        self.clock = time.time
        self._pending: dict[bytes, tuple[int, list[torch.Tensor]]] = {}  # being written: (ticket, rows)
        self._lock = threading.Lock()  # _files and _pending, shared with the writer thread
        self._tickets = itertools.count()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sparsekv-prefix-disk")
        # Reads ahead of admission (`prefetch`): page -> its rows being read (None if unreadable)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sparsekv-prefix-disk-read")
        self._prefetched: dict[bytes, Future] = {}
        self.saved = self.loaded = self.dropped = self.failed = self.rekeyed = 0
        self._last_ns = 0  # file times, strictly increasing: the filesystem clock is too coarse to order
        self._scan()

    def _path(self, name: bytes) -> str:
        return os.path.join(self.dir, name.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index the pages an earlier engine left, oldest first; remove half-written files and what
        exceeds the budget."""
        found = []
        for entry in os.scandir(self.dir):
            stem = entry.name[:-len(SUFFIX)]
            if entry.name.endswith(SUFFIX) and len(stem) == 64 and all(c in "0123456789abcdef" for c in stem):
                found.append((entry.stat().st_mtime_ns, bytes.fromhex(stem)))
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)
        for mtime, name in sorted(found):
            metadata = self._stored_metadata(name)
            self._files.add(name, metadata.get("tenant", ""), mtime / 1e9)
            self._last_ns = max(self._last_ns, mtime)
            if self.cipher is not None and metadata.get("key") != self.cipher.key_id:
                self._writer.submit(self._rekey, name)  # sealed with an old key (or unreadable: left alone)
        with self._lock:
            for tenant in self._files.counts():
                self._hold_quota(tenant, 0)
        self._make_room(0)

    @property
    def num_pages(self) -> int:
        return len(self._files)

    @property
    def bytes_used(self) -> int:
        return len(self._files) * self.page_bytes

    def has(self, name: bytes) -> bool:
        return name in self._files

    def touch(self, name: bytes) -> None:
        with self._lock:
            if name not in self._files:
                return
            self._files.touch(name, self.clock())
        self._writer.submit(self._utime, name)

    def _make_room(self, page_bytes: int, adding: str | None = None) -> None:
        with self._lock:
            while len(self._files) and self.bytes_used + page_bytes > self.capacity_bytes:
                self._drop(self._files.victim(adding))
                self.dropped += 1

    def _hold_quota(self, digest: str, room: int) -> None:
        """Remove the tenant's oldest files beyond its quota less `room` (the lock held)."""
        quota = self.max_pages_per_tenant
        for name in self._files.over(digest, None if quota is None else max(0, quota - room)):
            self._drop(name)
            self.dropped += 1

    def _drop(self, name: bytes) -> None:
        self._files.remove(name)
        self._pending.pop(name, None)
        self._prefetched.pop(name, None)
        self._writer.submit(self._unlink, name)

    def drop(self, tenant: str | None = None) -> int:
        """Remove a tenant's pages (every tenant's with None); returns how many."""
        digest = None if tenant is None else tenant_digest(tenant)
        with self._lock:
            names = self._files.keys(digest)
            for name in names:
                self._drop(name)
        return len(names)

    def _digest_of(self, name: bytes) -> str:
        with self._lock:
            return self._files.tenant(name) if name in self._files else ""

    def _stored_metadata(self, name: bytes) -> dict:
        try:
            with open(self._path(name), "rb") as f:  # the header only
                return _header_metadata(f.read(int.from_bytes(f.read(8), "little")))
        except Exception:  # noqa: BLE001 - unreadable: a miss when looked up, removed then
            return {}

    def expire(self, cutoff: float) -> int:
        """Remove the pages last used before `cutoff`; returns how many."""
        with self._lock:
            names = self._files.unused_since(cutoff)
            for name in names:
                self._drop(name)
        return len(names)

    def save(self, name: bytes, page: int, tenant: str) -> None:
        """Keep pool page `page`'s rows under `name`."""
        if name in self._files:
            self.touch(name)
        elif self.page_bytes <= self.capacity_bytes:
            self.save_rows(name, self.rows.copy_out(page), tenant)

    def save_rows(self, name: bytes, rows: list[torch.Tensor], tenant: str) -> None:
        """Keep `rows` (host copies, not changed afterwards) under `name`: written in the background."""
        if name in self._files:
            self.touch(name)
            return
        digest = tenant_digest(tenant)
        if self.page_bytes > self.capacity_bytes or self.max_pages_per_tenant == 0:
            return
        with self._lock:
            self._hold_quota(digest, 1)
        self._make_room(self.page_bytes, digest)
        with self._lock:
            ticket = next(self._tickets)
            self._files.add(name, digest, self.clock())
            self._pending[name] = (ticket, rows)
        self.saved += 1
        self._writer.submit(self._write, name, ticket, rows, digest)

    def _write_file(self, name: bytes, rows: list[torch.Tensor], tenant: str, tag: str, mtime_ns: int | None = None):
        """Write the page file (sealed with the current key, if any) under a temporary name, then rename
        it into place (atomic: a reader sees the whole file or none); stamped now, or `mtime_ns`."""
        path = self._path(name)
        tmp = f"{path}.{tag}.tmp"
        try:
            tensors, extra = (self.cipher.seal(rows, name, tenant) if self.cipher is not None else
                              ({str(i): r.contiguous() for i, r in enumerate(rows)}, {}))
            save_file(tensors, tmp, metadata={"format": FORMAT, "tenant": tenant, **extra})
            os.chmod(tmp, 0o600)
            if mtime_ns is None:
                self._stamp(tmp)
            else:
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _write(self, name: bytes, ticket: int, rows: list[torch.Tensor], tenant: str) -> None:
        try:
            self._write_file(name, rows, tenant, str(ticket))
        except Exception as e:  # noqa: BLE001 - disk full, permissions: the page is only lost
            logger.warning("prefix cache disk tier: writing %s failed (%s); the page is dropped", self._path(name), e)
            with self._lock:
                self.failed += 1
                if self._pending.get(name, (None,))[0] == ticket and name in self._files:
                    self._files.remove(name)
        with self._lock:
            if self._pending.get(name, (None,))[0] == ticket:
                del self._pending[name]

    def _unlink(self, name: bytes) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def _utime(self, name: bytes) -> None:
        try:
            self._stamp(self._path(name))
        except FileNotFoundError:
            pass

    def _stamp(self, path: str) -> None:
        """Mark the file used now, after every file marked before (the writer thread's order)."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        os.utime(path, ns=(self._last_ns, self._last_ns))

    def _read(self, name: bytes) -> list[torch.Tensor] | None:
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            return pending[1]
        try:
            with open(self._path(name), "rb") as f:  # one read, the GIL released: reads ahead run beside steps
                rows = self._decode(f.read(), name, self._digest_of(name))
        except Exception as e:  # noqa: BLE001 - a page that cannot be read is recomputed
            logger.warning("prefix cache disk tier: %s is unreadable (%s); recomputing it", self._path(name), e)
            return None
        return rows if self.rows.fits(rows) else None

    def _decode(self, data: bytes, name: bytes, tenant: str) -> list[torch.Tensor]:
        """A page file's rows; raises if it is not one of ours, or does not authenticate under the key
        it names (a file without a key name, from before key rotation: under any key held)."""
        metadata, tensors = _page_metadata(data), load_page(data)
        if metadata.get("format") != FORMAT:
            raise ValueError("not a sparsekv prefix page")
        if self.cipher is None:
            return [tensors[str(i)] for i in range(len(self.rows.layout))]
        key = metadata.get("key")
        if key is not None and key not in self._ciphers:
            raise ValueError("sealed with a key this engine does not hold")
        ciphers = [self._ciphers[key]] if key is not None else list(self._ciphers.values())[::-1]  # current first
        for cipher in ciphers[:-1]:
            try:
                return cipher.open(metadata, tensors["sealed"], self.rows.layout, name, tenant)
            except Exception:  # noqa: BLE001 - InvalidTag: another key may open it
                pass
        return ciphers[-1].open(metadata, tensors["sealed"], self.rows.layout, name, tenant)

    def _rekey(self, name: bytes) -> None:
        """Re-seal a file sealed with an old key under the current one, keeping its file time (its
        place in the LRU order after a restart). On the writer thread; a file that no held key opens
        is left as it is (a miss when looked up)."""
        with self._lock:
            if name not in self._files or name in self._pending:
                return
            tenant = self._files.tenant(name)
        path = self._path(name)
        try:
            mtime_ns = os.stat(path).st_mtime_ns
            with open(path, "rb") as f:
                rows = self._decode(f.read(), name, tenant)
            self._write_file(name, rows, tenant, "rekey", mtime_ns)
        except Exception as e:  # noqa: BLE001 - unreadable or unwritable: left as it is
            logger.warning("prefix cache disk tier: re-sealing %s failed (%s)", path, e)
            return
        with self._lock:
            self.rekeyed += 1

    def prefetch(self, names: list[bytes]) -> bool:
        """Read these pages in the background, ahead of the admission that will load them, so the
        engine step never waits on the disk; True once all are in memory (read, or being written)."""
        ready = True
        for name in names:
            if name in self._pending or name not in self._files:
                continue
            future = self._prefetched.get(name)
            if future is None:
                future = self._prefetched[name] = self._reader.submit(self._read, name)
            ready = ready and future.done()
        return ready

    def discard(self, names: list[bytes]) -> None:
        """Forget read-ahead rows no admission will load (its request was aborted)."""
        for name in names:
            future = self._prefetched.pop(name, None)
            if future is not None:
                future.cancel()

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a read ahead finishes, at most `timeout` s (an engine with nothing else to do)."""
        running = [f for f in list(self._prefetched.values()) if not f.done()]
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    def take(self, name: bytes) -> list[torch.Tensor] | None:
        """The rows of the page saved under `name` (read ahead, or now), for `PageRows.copy_in`; None
        (and the file is removed) if it cannot be read back."""
        future = self._prefetched.pop(name, None)
        rows = future.result() if future is not None and not future.cancelled() else self._read(name)
        if rows is None:
            with self._lock:
                self.failed += 1
                if name in self._files:
                    self._drop(name)
            return None
        self.touch(name)
        self.loaded += 1
        return rows

    def flush(self) -> None:
        """Wait for every queued write and deletion."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._prefetched.clear()
        self._writer.shutdown(wait=True)
        self._lock_file.close()  # releases the lock

    def pages_by_tenant(self) -> dict[str, int]:
        """Pages per tenant_digest()."""
        with self._lock:
            return self._files.counts()

    def stats(self) -> dict:
        return {"prefix_disk_pages": self.num_pages, "prefix_disk_bytes": self.bytes_used,
                "prefix_disk_budget_bytes": self.capacity_bytes, "prefix_disk_writes": self.saved,
                "prefix_disk_reads": self.loaded, "prefix_disk_evictions": self.dropped,
                "prefix_disk_failures": self.failed, "prefix_disk_rekeyed": self.rekeyed}

    def check_integrity(self) -> None:
        with self._lock:
            assert self.bytes_used <= self.capacity_bytes, "the prefix disk tier is over its budget"
            assert all(name in self._files for name in self._pending), "a page being written is not indexed"
            self._files.check_integrity()
            quota = self.max_pages_per_tenant
            assert quota is None or all(n <= quota for n in self._files.counts().values()), "a tenant is over its quota"
