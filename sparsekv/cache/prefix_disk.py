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

Pages are encrypted at rest unless the engine is told otherwise (page_cipher.py; the engine passes
a cipher from its key file, or from one generated in the tier's directory, `default_key_file`). A
file records its tenant as an HMAC of the tenant's name under a secret kept with the tier
(`TENANT_KEY_FILE`, itself sealed when the tier is), so the files do not say whose they are to a
reader who can guess tenant names. A file is served only under the page name and tenant digest it
was written with: sealed files authenticate both with their bytes, and plain ones carry an HMAC of
both, so a file renamed to another page's name or with its tenant field rewritten is a miss.

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
import hmac
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

from .page_cipher import KEY_BYTES, PageCipher, create_key_file
from .cached_pages import TenantLRU
from .prefix_host import PageRows

logger = logging.getLogger(__name__)
# v2: tenant digests are keyed HMACs and plain files carry a MAC of their name and tenant; v1 files
# (plain SHA-256 tenant digests) sit in other namespaces and are never read
FORMAT = "sparsekv-prefix-page-v2"
SUFFIX = ".safetensors"
DEFAULT_KEY_FILE = ".prefix-cache.key"   # in the tier's directory, beside the namespaces
TENANT_KEY_FILE = ".tenant-key"          # in each namespace directory
TENANT_KEY_PURPOSE = b"sparsekv-prefix-disk-tenant-key"
SAMPLES_PER_FILE, SAMPLE_BYTES = 256, 4096


def checkpoint_identity(path: str, with_times: bool = False) -> list:
    """config.json, and each safetensors file's name, size and 256 sampled 4 KiB blocks (its header
    and last bytes included): what tells two checkpoints apart without reading all their weights, the
    same for a copy on another machine. `with_times`: each file's modification time too, so that a file
    rewritten in place between the sampled blocks (a partial update) is another checkpoint; a copy that
    does not keep the times then is one too."""
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
        identity.append((name, size, digest.hexdigest(), *([os.stat(file).st_mtime_ns] if with_times else [])))
    return identity


def _page_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors file's bytes (an 8-byte header length, then JSON)."""
    return _header_metadata(data[8:8 + int.from_bytes(data[:8], "little")])


def _header_metadata(header: bytes) -> dict:
    return json.loads(header).get("__metadata__") or {}


def default_key_file(root: str) -> tuple[str, bool]:
    """The key file an encrypted tier uses when the operator names none: `root/DEFAULT_KEY_FILE`,
    made (0600, in `root` made 0700) if missing; (path, whether it was made now).

    Kept in the tier's own directory because it must live exactly as long as the pages it opens: a
    restart, another container mounting the same volume, or the directory moved elsewhere finds it
    with them, and removing the tier removes it. A key kept elsewhere (the user's home) is lost where
    that is not persistent, and every page then becomes a miss; beside the directory needs write
    access to its parent, which a dedicated cache mount often does not give. What it protects: page
    files read or copied without this one (a namespace directory copied, a file attached to a
    report). What it does not: a reader of the whole directory; an operator who needs that keeps the
    key elsewhere (`prefix_cache_disk_key_file`)."""
    make_private_dir(root)
    path = os.path.join(root, DEFAULT_KEY_FILE)
    return path, create_key_file(path)


def make_private_dir(path: str) -> None:
    """Create `path` (with its missing parents) if needed, the directory itself 0700: only the
    engine's user may list or read the tier. An existing directory keeps its mode (the operator's)."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # whatever the umask


def tenant_hmac(secret: bytes, tenant: str) -> str:
    """What a page file records of its tenant: enough to remove a tenant's pages, neither its name nor
    a hash anyone can compute from a guessed name (keyed with the tier's tenant secret)."""
    return hmac.new(secret, b"sparsekv-tenant\0" + tenant.encode(), hashlib.sha256).hexdigest()[:32]


def namespace(config, rows: PageRows, lookahead: int, sealed: bool = False) -> str:
    """The directory name for pages this engine computes: equal only for engines whose pages hold the
    same bytes for the same names (the checkpoint's files with their times: a page never outlives a
    file rewritten in place, whatever bytes changed)."""
    key = {"format": FORMAT, "checkpoint": checkpoint_identity(config.model, with_times=True), "dtype": config.dtype,
           "device": torch.device(config.device).type, "page": config.kv_page_size, "attention": config.attention,
           "overrides": config.hf_overrides, "selector": config.selector, "quest": config.quest_page_tokens,
           "index_keys": config.indexer_key_dtype, "latents": config.kv_cache_dtype, "lookahead": lookahead,
           "layout": [(shape, str(dtype)) for shape, dtype in rows.layout], "sealed": sealed}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PrefixDiskStore:
    """`max_pages_per_tenant`: a tenant's files beyond this many are removed, oldest first (None: no
    bound). Over budget, the oldest file of the tenant holding the most goes first (cached_pages.TenantLRU).
    `old_ciphers`: keys being rotated out; files sealed with one are read with it, and re-sealed with
    `cipher` in the background from the start (`rekeyed`), each keeping its place in the LRU order."""

    def __init__(self, rows: PageRows, root: str, space: str, capacity_bytes: int, cipher: PageCipher | None = None,
                 max_pages_per_tenant: int | None = None, old_ciphers: list[PageCipher] = ()):
        self.rows, self.page_bytes, self.capacity_bytes, self.cipher = rows, rows.page_bytes, capacity_bytes, cipher
        self._ciphers = {c.key_id: c for c in [*old_ciphers, *([cipher] if cipher is not None else [])]}
        self.max_pages_per_tenant = max_pages_per_tenant
        self.dir = os.path.join(root, space)
        make_private_dir(root)
        make_private_dir(self.dir)
        self._lock_file = self._take_lock()
        self._tenant_secret = self._load_tenant_secret()
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

    def _take_lock(self):
        """The namespace's lock file (0600, even one an earlier version made 0644), held for this
        engine's life; raises if another engine holds it."""
        fd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        lock_file = os.fdopen(fd, "w")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise ValueError(f"prefix cache disk tier {self.dir} is in use by another engine") from None
        os.fchmod(fd, 0o600)
        return lock_file

    def tenant_digest(self, tenant: str) -> str:
        return tenant_hmac(self._tenant_secret, tenant)

    def _load_tenant_secret(self) -> bytes:
        """The namespace's tenant secret (made on first use; the lock held). Sealed with the current
        key when the tier is encrypted, so the digests cannot be tested against guessed names without
        the key; one sealed with a key being rotated out is re-sealed with the current one. One no
        held key opens is replaced: the files it named are then unreadable anyway."""
        path = os.path.join(self.dir, TENANT_KEY_FILE)
        record, secret = None, None
        try:
            with open(path) as f:
                record = json.load(f)
            secret = self._open_tenant_secret(record)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - corrupt, or under a key no longer held
            logger.warning("prefix cache disk tier: the tenant key %s cannot be read (%s); making a new one", path, e)
        fresh = secret is None
        if fresh:
            secret = os.urandom(KEY_BYTES)
        if fresh or record.get("key") != (self.cipher.key_id if self.cipher is not None else None):
            self._write_tenant_secret(path, secret)
        return secret

    def _open_tenant_secret(self, record: dict) -> bytes:
        if self.cipher is None:
            return bytes.fromhex(record["secret"])
        cipher = self._ciphers.get(record.get("key"))
        if cipher is None:
            raise ValueError("sealed with a key this engine does not hold")
        return cipher.open_bytes(record, TENANT_KEY_PURPOSE)

    def _write_tenant_secret(self, path: str, secret: bytes) -> None:
        record = ({"secret": secret.hex()} if self.cipher is None
                  else self.cipher.seal_bytes(secret, TENANT_KEY_PURPOSE))
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _page_mac(self, name: bytes, tenant: str) -> str:
        """A plain file's binding of its bytes to its page name and tenant digest (sealed files
        authenticate both with their bytes instead)."""
        return hmac.new(self._tenant_secret, b"sparsekv-page\0" + name + tenant.encode(), hashlib.sha256).hexdigest()

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

    def drop_page(self, name: bytes) -> bool:
        """Remove one page's file; whether there was one."""
        with self._lock:
            if name not in self._files:
                return False
            self._drop(name)
        return True

    def drop(self, tenant: str | None = None) -> int:
        """Remove a tenant's pages (every tenant's with None); returns how many."""
        digest = None if tenant is None else self.tenant_digest(tenant)
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
        digest = self.tenant_digest(tenant)
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
            if self.cipher is not None:
                tensors, extra = self.cipher.seal(rows, name, tenant)
            else:
                tensors = {str(i): r.contiguous() for i, r in enumerate(rows)}
                extra = {"mac": self._page_mac(name, tenant)}
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
        """The page's rows, or None: gone from the tier, or unreadable (then counted and its file removed,
        so that the page, once recomputed, is saved anew)."""
        with self._lock:
            pending, indexed = self._pending.get(name), name in self._files
        if pending is not None:
            return pending[1]
        if not indexed:
            return None
        try:
            with open(self._path(name), "rb") as f:  # one read, the GIL released: reads ahead run beside steps
                rows = self._decode(f.read(), name, self._digest_of(name))
            if not self.rows.fits(rows):
                raise ValueError("its rows do not fit this cache's layout")
        except Exception as e:  # noqa: BLE001 - a page that cannot be read is recomputed
            logger.warning("prefix cache disk tier: %s is unreadable (%s); recomputing it", self._path(name), e)
            self._forget_unreadable(name)
            return None
        return rows

    def _forget_unreadable(self, name: bytes) -> None:
        """NOTE: on the reader thread for a read ahead, where each page of a chain is read, also those
        after the first that fails, which no admission then takes."""
        with self._lock:
            self.failed += 1
            if name in self._files:
                self._drop(name)

    def _decode(self, data: bytes, name: bytes, tenant: str) -> list[torch.Tensor]:
        """A page file's rows; raises if it is not one of ours, was not written under `name` for
        `tenant` (the digest it was indexed with), or does not authenticate under the key it names (a
        file without a key name, from before key rotation: under any key held)."""
        metadata, tensors = _page_metadata(data), load_page(data)
        if metadata.get("format") != FORMAT:
            raise ValueError("not a sparsekv prefix page")
        if metadata.get("tenant") != tenant:
            raise ValueError("the file's tenant field was changed")
        if self.cipher is None:
            if not hmac.compare_digest(metadata.get("mac", ""), self._page_mac(name, tenant)):
                raise ValueError("the file was written for another page name or tenant")
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
