"""The prefix cache's disk tier: pages pushed out of host memory kept as files, so a later hit (or a
later engine on the same model, after a restart) reads them back instead of recomputing them. The
third tier of SGLang's HiCache and LMCache's local disk, for the prefix cache.

Each page is one safetensors file, `<dir>/<namespace>/<file name>.safetensors`, holding the page's
rows of every slot-indexed tensor (prefix_host.PageRows). The page's own name is the prefix cache's
hash chain, rooted at (tenant, cache_salt), which anyone can compute from a guessed tenant and prompt;
so the file is named by an HMAC of it under the namespace's secret (`TENANT_KEY_FILE`, sealed with the
tier's key when the tier is encrypted), and a listing of the directory cannot be tested against
guesses. The namespace (`namespace()`) is a hash of everything that decides a page's bytes: the
checkpoint (config.json, shard names, sizes and sampled contents), dtype, device type, page size,
attention mode, selector, indexer key dtype, drafting and the tensor layout. Another model, or the
same one run another way, never reads these files. Files are written 0600 in a 0700 directory, each
under a fresh temporary name opened O_EXCL|O_NOFOLLOW and renamed into place; page files are opened
O_NOFOLLOW|O_NONBLOCK and read only if they are regular files.

Pages are encrypted at rest unless the engine is told otherwise (page_cipher.py; the engine passes
a cipher from its key file, or from one generated in the tier's directory, `default_key_file`). A
file records its tenant as an HMAC of the tenant's name under the same secret, so the files do not
say whose they are to a reader who can guess tenant names. A file is served only under the file name
and tenant digest it was written with, with the bytes it was written with: sealed files authenticate
all three with AES-GCM, plain ones carry an HMAC of them (tensor dtypes, shapes and bytes included),
so a file renamed, with its tenant field rewritten or a byte of its rows changed is a miss.

Writes, deletions and touches run in order on one background thread, so an eviction costs the engine
step a host copy, not a disk write. A page being written is read from memory. Reads run ahead of
admission on another thread (`prefetch`): a request whose prefix is on disk waits in the queue while
its pages are read, and the requests running meanwhile keep stepping. Budgeted by `capacity_bytes`,
counted in whole file sizes over the whole tier directory: the namespaces of other settings or
checkpoints that no engine holds are counted too and evicted first, oldest file first, and removed
once empty. Least recently saved or hit first out, and that order survives a restart (file mtimes,
which are each page's time of last use). A file that cannot be read back, or does not match the
layout, is a miss: the page is computed instead and the file removed; files sealed with a key the
engine no longer holds are removed at start. A full disk evicts the oldest pages and retries the
write once. One engine per namespace: a lock file refuses a second.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import itertools
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
from safetensors.torch import load as load_page
from safetensors.torch import save as encode_safetensors

from .page_cipher import KEY_BYTES, PageCipher, create_key_file
from .cached_pages import TenantLRU
from .prefix_disk_files import (SUFFIX, TENANT_KEY_FILE, is_hex_name, is_page_file_name, make_private_dir,
                                namespace_if_free, open_regular, page_files, remove_namespace_if_empty,
                                write_private_file)
from .prefix_host import PageRows

logger = logging.getLogger(__name__)
# v3: files named by a keyed HMAC of the page name, plain files' MAC covering their rows; files of
# earlier formats sit in other namespaces, never read, and count against the budget until evicted
FORMAT = "sparsekv-prefix-page-v3"
DEFAULT_KEY_FILE = ".prefix-cache.key"   # in the tier's directory, beside the namespaces
TENANT_KEY_PURPOSE = b"sparsekv-prefix-disk-tenant-key"
SAMPLES_PER_FILE, SAMPLE_BYTES = 256, 4096
NAMESPACE_CHARS = 32


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


def page_mac(secret: bytes, file_id: bytes, tenant: str, rows: list[torch.Tensor]) -> str:
    """A plain file's binding of its rows (dtype, shape and bytes of each) to its file name and tenant
    digest (sealed files authenticate all of it with AES-GCM instead)."""
    mac = hmac.new(secret, b"sparsekv-page\0" + file_id + b"\0" + tenant.encode() + b"\0", hashlib.sha256)
    for row in rows:
        mac.update(json.dumps([str(row.dtype), list(row.shape)]).encode() + b"\0")
        mac.update(row.contiguous().view(-1).view(torch.uint8).numpy())
    return mac.hexdigest()


def encode_page(rows: list[torch.Tensor], file_id: bytes, tenant: str, cipher: PageCipher | None,
                mac_secret: bytes) -> bytes:
    """A page file's bytes: sealed with `cipher`, or plain with a MAC under `mac_secret`."""
    if cipher is not None:
        tensors, extra = cipher.seal(rows, file_id, tenant)
    else:
        tensors = {str(i): r.contiguous() for i, r in enumerate(rows)}
        extra = {"mac": page_mac(mac_secret, file_id, tenant, rows)}
    return encode_safetensors(tensors, metadata={"format": FORMAT, "tenant": tenant, **extra})


def page_file_bytes(rows: PageRows, cipher: PageCipher | None) -> int:
    """The size of one page file, metadata included: the same for every page of a namespace (its
    digests, nonce and MAC have fixed lengths). What the byte budget counts per page."""
    zeros = [torch.zeros(shape, dtype=dtype) for shape, dtype in rows.layout]
    return len(encode_page(zeros, bytes(32), "0" * 32, cipher, bytes(32)))


class PrefixDiskStore:
    """`max_pages_per_tenant`: a tenant's files beyond this many are removed, oldest first (None: no
    bound). Over budget, the other namespaces' files go first, oldest first, then the oldest file of
    the tenant holding the most (cached_pages.TenantLRU). `old_ciphers`: keys being rotated out; files
    sealed with one are read with it, and re-sealed with `cipher` in the background from the start
    (`rekeyed`), each keeping its name and its place in the LRU order.

    Pages are named by the prefix cache's names; the index and the files by `_file_id(name)`."""

    def __init__(self, rows: PageRows, root: str, space: str, capacity_bytes: int, cipher: PageCipher | None = None,
                 max_pages_per_tenant: int | None = None, old_ciphers: list[PageCipher] = ()):
        self.rows, self.page_bytes, self.capacity_bytes, self.cipher = rows, rows.page_bytes, capacity_bytes, cipher
        self._ciphers = {c.key_id: c for c in [*old_ciphers, *([cipher] if cipher is not None else [])]}
        self.max_pages_per_tenant = max_pages_per_tenant
        self.root, self.space, self.dir = root, space, os.path.join(root, space)
        make_private_dir(root)
        make_private_dir(self.dir)
        self._warn_if_others_may_write()
        self._lock_file = self._take_lock()
        self._tenant_secret, self._secret_is_new = self._load_tenant_secret()
        self.file_bytes = page_file_bytes(rows, cipher)
        # pages on disk or being written, by file id, grouped by tenant_digest() of the tenant that
        # computed them, with the time each was last saved or hit (clock())
        self._files = TenantLRU()
        self._sizes: dict[bytes, int] = {}  # file id -> its file's size, what the budget counts
        self._indexings = 0
        self._indexing: dict[bytes, int] = {}  # file id -> which indexing of it this is (a read tells a page
        # that left the tier, or left and came back, while it read from one that is unreadable)
        self._bytes = 0
        # other namespaces' files no engine holds, oldest first: [mtime_ns, path, size]
        self._others: list[tuple[int, str, int]] = []
        self._others_bytes = 0
        self.clock = time.time
        self._pending: dict[bytes, tuple[int, list[torch.Tensor]]] = {}  # being written: (ticket, rows)
        self._lock = threading.Lock()  # the index, sizes and _pending, shared with the writer thread
        self._tickets = itertools.count()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sparsekv-prefix-disk")
        # Reads ahead of admission (`prefetch`): file id -> its rows being read (None if unreadable)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sparsekv-prefix-disk-read")
        self._prefetched: dict[bytes, Future] = {}
        self.saved = self.loaded = self.dropped = self.failed = self.rekeyed = self.discarded = 0
        self._last_ns = 0  # file times, strictly increasing: the filesystem clock is too coarse to order
        self._scan()
        self._scan_other_namespaces()
        self._make_room(0)

    # -- names ---------------------------------------------------------------------------------
    def _file_id(self, name: bytes) -> bytes:
        """The id a page's file is named by: an HMAC of the page's name under the namespace's secret, so
        a listing of the directory tells nothing to one who can compute names from guessed prompts."""
        return hmac.new(self._tenant_secret, b"sparsekv-file\0" + name, hashlib.sha256).digest()

    def _file(self, file_id: bytes) -> str:
        return os.path.join(self.dir, file_id.hex() + SUFFIX)

    def path_of(self, name: bytes) -> str:
        """Where the page named `name` is (or would be) kept."""
        return self._file(self._file_id(name))

    def tenant_digest(self, tenant: str) -> str:
        return tenant_hmac(self._tenant_secret, tenant)

    # -- start ---------------------------------------------------------------------------------
    def _warn_if_others_may_write(self) -> None:
        """A tier directory others may write is served from all the same (a file they plant fails its
        MAC or AES-GCM tag and is a miss; FIFOs and symlinks are never followed), with a warning: they
        may still remove pages or fill the disk."""
        for path in (self.root, self.dir):
            if os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                logger.warning("prefix cache disk tier: %s may be written by group or others; `chmod 700 %s` "
                               "so they cannot remove its pages or fill its disk", path, path)

    def _take_lock(self):
        """The namespace's lock file (0600, even one an earlier version made 0644), held for this
        engine's life; raises if another engine holds it."""
        fd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        lock_file = os.fdopen(fd, "w")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise ValueError(f"prefix cache disk tier {self.dir} is in use by another engine") from None
        os.fchmod(fd, 0o600)
        return lock_file

    def _load_tenant_secret(self) -> tuple[bytes, bool]:
        """The namespace's secret (made on first use; the lock held), and whether it was made now: it
        keys tenant digests, file names and plain files' MACs. Sealed with the current key when the
        tier is encrypted, so neither can be tested against guesses without the key; one sealed with
        a key being rotated out is re-sealed with the current one (file names stay). One no held key
        opens is replaced: the files it named are then unreadable anyway (removed by `_scan`)."""
        path = os.path.join(self.dir, TENANT_KEY_FILE)
        record, secret = None, None
        try:
            with open_regular(path) as f:
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
        return secret, fresh

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
        write_private_file(path, json.dumps(record).encode())

    def _scan(self) -> None:
        """Index the pages an earlier engine left, oldest first; remove temporaries, and files that no
        key held opens or that were named under a secret since lost (they only take room)."""
        found, odd = [], []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif is_page_file_name(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        odd.append(entry.name)
                        continue
                    found.append((st.st_mtime_ns, bytes.fromhex(entry.name[:-len(SUFFIX)]), st.st_size))
        if odd:
            logger.warning("prefix cache disk tier: ignoring %d entries of %s that are not regular files (%s...)",
                           len(odd), self.dir, odd[0])
        unopenable = []
        for mtime, file_id, size in sorted(found):
            metadata = self._stored_metadata(file_id)
            if self._secret_is_new or ("key" in metadata and metadata["key"] not in self._ciphers):
                unopenable.append(file_id)
                continue
            self._index(file_id, metadata.get("tenant", ""), mtime / 1e9, size)
            self._last_ns = max(self._last_ns, mtime)
            if self.cipher is not None and metadata.get("key") != self.cipher.key_id:
                self._on_writer(self._rekey, file_id)  # sealed with an old key (or unreadable: left alone)
        self._remove_unopenable(unopenable)
        with self._lock:
            for tenant in self._files.counts():
                self._hold_quota(tenant, 0)

    def _remove_unopenable(self, file_ids: list[bytes]) -> None:
        for file_id in file_ids:
            with contextlib.suppress(OSError):
                os.unlink(self._file(file_id))
        self.discarded += len(file_ids)
        if file_ids:
            logger.warning("prefix cache disk tier: removed %d files of %s that no key this engine holds opens "
                           "(sealed with a retired key, or named under a lost secret)", len(file_ids), self.dir)

    def _scan_other_namespaces(self) -> None:
        """Count the page files of the tier's other namespaces that no engine holds (other checkpoints,
        settings, formats): the budget covers the whole directory. Empty ones are removed."""
        with os.scandir(self.root) as entries:
            spaces = [e.path for e in entries if e.name != self.space and is_hex_name(e.name, NAMESPACE_CHARS)
                      and e.is_dir(follow_symlinks=False)]
        for path in spaces:
            with namespace_if_free(path) as free:
                if free and not remove_namespace_if_empty(path):
                    self._others.extend(page_files(path))
        self._others.sort()
        self._others_bytes = sum(size for _, _, size in self._others)

    def _index(self, file_id: bytes, tenant: str, when: float, size: int) -> None:
        """(the lock held, or at start)"""
        self._files.add(file_id, tenant, when)
        self._sizes[file_id] = size
        self._bytes += size
        self._indexings += 1
        self._indexing[file_id] = self._indexings

    # -- figures -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._files)

    @property
    def bytes_used(self) -> int:
        """This namespace's files' sizes."""
        return self._bytes

    @property
    def tier_bytes_used(self) -> int:
        """With the other namespaces' files still counted: what the budget bounds."""
        return self._bytes + self._others_bytes

    def has(self, name: bytes) -> bool:
        return self._file_id(name) in self._files

    def touch(self, name: bytes, when: float | None = None) -> None:
        """Mark the page used now (or at `when`, if later than its last use)."""
        self._touch(self._file_id(name), when)

    def _touch(self, file_id: bytes, when: float | None = None) -> None:
        with self._lock:
            if file_id not in self._files:
                return
            when = self.clock() if when is None else max(when, self._files.last_used(file_id))
            self._files.touch(file_id, when)
        self._on_writer(self._utime, file_id, when)

    # -- eviction ------------------------------------------------------------------------------
    def _make_room(self, room: int, adding: str | None = None) -> None:
        """Evict until `room` more bytes fit the budget: other namespaces' files first, then ours."""
        with self._lock:
            while self._others and self.tier_bytes_used + room > self.capacity_bytes:
                self._drop_other()
            while len(self._files) and self.tier_bytes_used + room > self.capacity_bytes:
                self._drop(self._files.victim(adding))
                self.dropped += 1

    def _drop_other(self) -> None:
        """Forget another namespace's oldest file and remove it (the lock held)."""
        _, path, size = self._others.pop(0)
        self._others_bytes -= size
        self.dropped += 1
        self._on_writer(self._unlink_other, path)

    def _unlink_other(self, path: str) -> None:
        """On the writer thread: remove another namespace's file, unless an engine has taken that
        namespace since; its directory too once empty."""
        space = os.path.dirname(path)
        with namespace_if_free(space) as free:
            if free:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                remove_namespace_if_empty(space)

    def _hold_quota(self, digest: str, room: int) -> None:
        """Remove the tenant's oldest files beyond its quota less `room` (the lock held)."""
        quota = self.max_pages_per_tenant
        for file_id in self._files.over(digest, None if quota is None else max(0, quota - room)):
            self._drop(file_id)
            self.dropped += 1

    def _forget(self, file_id: bytes) -> None:
        """Drop a file from the index (the lock held); its file is the caller's to remove."""
        self._files.remove(file_id)
        self._bytes -= self._sizes.pop(file_id)
        del self._indexing[file_id]
        self._pending.pop(file_id, None)
        self._prefetched.pop(file_id, None)

    def _drop(self, file_id: bytes) -> None:
        self._forget(file_id)
        self._on_writer(self._unlink, file_id)

    def drop_page(self, name: bytes) -> bool:
        """Remove one page's file; whether there was one."""
        file_id = self._file_id(name)
        with self._lock:
            if file_id not in self._files:
                return False
            self._drop(file_id)
        return True

    def drop(self, tenant: str | None = None) -> int:
        """Remove a tenant's pages (every tenant's with None); returns how many."""
        digest = None if tenant is None else self.tenant_digest(tenant)
        with self._lock:
            file_ids = self._files.keys(digest)
            for file_id in file_ids:
                self._drop(file_id)
        return len(file_ids)

    def _stored_metadata(self, file_id: bytes) -> dict:
        try:
            with open_regular(self._file(file_id)) as f:  # the header only
                return _header_metadata(f.read(int.from_bytes(f.read(8), "little")))
        except Exception:  # noqa: BLE001 - unreadable: a miss when looked up, removed then
            return {}

    def expire(self, cutoff: float) -> int:
        """Remove the pages last used before `cutoff`; returns how many."""
        with self._lock:
            file_ids = self._files.unused_since(cutoff)
            for file_id in file_ids:
                self._drop(file_id)
        return len(file_ids)

    # -- writes --------------------------------------------------------------------------------
    def save(self, name: bytes, page: int, tenant: str, used_at: float | None = None) -> None:
        """Keep pool page `page`'s rows under `name`, last used now (or at `used_at`)."""
        if self.has(name):
            self.touch(name, used_at)
        elif self._takes_pages():
            self.save_rows(name, self.rows.copy_out(page), tenant, used_at)

    def _takes_pages(self) -> bool:
        """Whether a page fits at all (the tier's capacity, a tenant's quota)."""
        return self.file_bytes <= self.capacity_bytes and self.max_pages_per_tenant != 0

    def save_rows(self, name: bytes, rows: list[torch.Tensor], tenant: str, used_at: float | None = None) -> None:
        """Keep `rows` (host copies, not changed afterwards) under `name`: written in the background,
        the file's time the page's last use (now, or `used_at`: what the TTL measures after a restart)."""
        file_id = self._file_id(name)
        if file_id in self._files:
            self._touch(file_id, used_at)
            return
        digest = self.tenant_digest(tenant)
        if not self._takes_pages():
            return
        with self._lock:
            self._hold_quota(digest, 1)
        self._make_room(self.file_bytes, digest)
        when = self.clock() if used_at is None else used_at
        with self._lock:
            ticket = next(self._tickets)
            self._index(file_id, digest, when, self.file_bytes)
            self._pending[file_id] = (ticket, rows)
        self.saved += 1
        self._on_writer(self._write, file_id, ticket, rows, digest, when, used_at is not None)

    def _encode(self, file_id: bytes, rows: list[torch.Tensor], tenant: str) -> bytes:
        return encode_page(rows, file_id, tenant, self.cipher, self._tenant_secret)

    def _write(self, file_id: bytes, ticket: int, rows: list[torch.Tensor], tenant: str, when: float,
               exact_time: bool) -> None:
        """On the writer thread. A full disk: the oldest pages are removed and the write tried once more."""
        try:
            data = self._encode(file_id, rows, tenant)
            mtime_ns = int(when * 1e9) if exact_time else self._next_stamp(when)
            try:
                write_private_file(self._file(file_id), data, mtime_ns)
            except OSError as e:
                if e.errno != errno.ENOSPC or not self._free_now(len(data), keep=file_id):
                    raise
                write_private_file(self._file(file_id), data, mtime_ns)
        except Exception as e:  # noqa: BLE001 - disk full, permissions: the page is only lost
            logger.warning("prefix cache disk tier: writing %s failed (%s); the page is dropped",
                           self._file(file_id), e)
            with self._lock:
                self.failed += 1
                if self._pending.get(file_id, (None,))[0] == ticket and file_id in self._files:
                    self._forget(file_id)
        with self._lock:
            if self._pending.get(file_id, (None,))[0] == ticket:
                del self._pending[file_id]

    def _free_now(self, room: int, keep: bytes) -> bool:
        """On the writer thread, the disk full below the budget: remove the oldest files (other
        namespaces' first, never `keep` or a page being written) until `room` bytes are freed;
        whether any was."""
        freed = 0
        while freed < room:
            victim = self._forget_oldest(keep)
            if victim is None:
                break
            path, size, ours = victim
            if ours:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                self._unlink_other(path)
            freed += size
        return freed > 0

    def _forget_oldest(self, keep: bytes) -> tuple[str, int, bool] | None:
        """Forget the oldest file, another namespace's first, never `keep` or a page being written:
        (its path, size, whether it is this namespace's), or None if there is none."""
        with self._lock:
            if self._others:
                _, path, size = self._others.pop(0)
                self._others_bytes -= size
                ours = False
            else:
                file_id = next((f for f in self._files.oldest_first() if f != keep and f not in self._pending), None)
                if file_id is None:
                    return None
                path, size, ours = self._file(file_id), self._sizes[file_id], True
                self._forget(file_id)
            self.dropped += 1
            return path, size, ours

    def _on_writer(self, fn, *args) -> None:
        """`fn(*args)` on the writer thread; an error it did not handle is logged, not kept in a future
        nobody reads."""
        self._writer.submit(fn, *args).add_done_callback(_report_writer_failure)

    def _unlink(self, file_id: bytes) -> None:
        """On the writer thread: remove a dropped page's file. One that cannot be removed is reported with
        what that leaves: the file on disk, outside the tier's count, until the next start counts it again."""
        path = self._file(file_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("prefix cache disk tier: removing %s failed (%s); it stays on disk", path, e)

    def _utime(self, file_id: bytes, when: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            ns = self._next_stamp(when)
            os.utime(self._file(file_id), ns=(ns, ns), follow_symlinks=False)

    def _next_stamp(self, when: float) -> int:
        """A file time for a use at `when`, after every one given before (the writer thread's order:
        the filesystem clock is too coarse to order them)."""
        self._last_ns = max(int(when * 1e9), self._last_ns + 1)
        return self._last_ns

    # -- reads ---------------------------------------------------------------------------------
    def _read(self, file_id: bytes) -> list[torch.Tensor] | None:
        """The page's rows, or None: gone from the tier (before or while it was read), or unreadable
        (then counted and its file removed, so that the page, once recomputed, is saved anew)."""
        with self._lock:
            pending, indexing = self._pending.get(file_id), self._indexing.get(file_id)
            tenant = self._files.tenant(file_id) if indexing is not None else ""
        if pending is not None:
            return pending[1]
        if indexing is None:
            return None
        try:
            with open_regular(self._file(file_id)) as f:  # one read, the GIL released: reads ahead run beside steps
                rows = self._decode(f.read(), file_id, tenant)
            if not self.rows.fits(rows):
                raise ValueError("its rows do not fit this cache's layout")
        except Exception as e:  # noqa: BLE001 - a page that cannot be read is recomputed
            self._forget_unreadable(file_id, indexing, e)
            return None
        with self._lock:  # NOTE: a page that left the tier while it was read (a reset among them) is not served
            return rows if self._indexing.get(file_id) == indexing else None

    def _forget_unreadable(self, file_id: bytes, indexing: int, error: Exception) -> None:
        """A read failed: the file is counted and removed, unless the page left the tier while it was
        read (evicted, reset, expired: its file removed or replaced under the read), which is no
        failure. NOTE: on the reader thread for a read ahead, where each page of a chain is read, also
        those after the first that fails, which no admission then takes."""
        with self._lock:
            if self._indexing.get(file_id) != indexing:
                return
            logger.warning("prefix cache disk tier: %s is unreadable (%s); recomputing it", self._file(file_id), error)
            self.failed += 1
            self._drop(file_id)

    def _decode(self, data: bytes, file_id: bytes, tenant: str) -> list[torch.Tensor]:
        """A page file's rows; raises if it is not one of ours, was not written under `file_id` for
        `tenant` (the digest it was indexed with), holds other tensors than a page file's or other rows
        than it was written with, or does not authenticate under the key it names (a file without a key
        name: under any key held)."""
        metadata, tensors = _page_metadata(data), load_page(data)
        if metadata.get("format") != FORMAT:
            raise ValueError("not a sparsekv prefix page")
        if metadata.get("tenant") != tenant:
            raise ValueError("the file's tenant field was changed")
        if set(tensors) != self._tensor_names():
            raise ValueError("the file holds other tensors than a page's")
        if self.cipher is None:
            rows = [tensors[str(i)] for i in range(len(self.rows.layout))]
            if not hmac.compare_digest(metadata.get("mac", ""), page_mac(self._tenant_secret, file_id, tenant, rows)):
                raise ValueError("the file was altered, or written for another page or tenant")
            return rows
        key = metadata.get("key")
        if key is not None and key not in self._ciphers:
            raise ValueError("sealed with a key this engine does not hold")
        ciphers = [self._ciphers[key]] if key is not None else list(self._ciphers.values())[::-1]  # current first
        for cipher in ciphers[:-1]:
            try:
                return cipher.open(metadata, tensors["sealed"], self.rows.layout, file_id, tenant)
            except Exception:  # noqa: BLE001 - InvalidTag: another key may open it
                pass
        return ciphers[-1].open(metadata, tensors["sealed"], self.rows.layout, file_id, tenant)

    def _tensor_names(self) -> set[str]:
        """The tensors a page file of this tier holds, no more (encode_page): its sealed bytes, or one
        tensor per row. A file padded with others is refused, though its page's own would authenticate."""
        return {"sealed"} if self.cipher is not None else {str(i) for i in range(len(self.rows.layout))}

    def _rekey(self, file_id: bytes) -> None:
        """Re-seal a file sealed with an old key under the current one, keeping its name (the
        namespace's secret survives a rotation) and its file time (its place in the LRU order after a
        restart). On the writer thread; a file that no held key opens is left as it is (a miss when
        looked up)."""
        with self._lock:
            if file_id not in self._files or file_id in self._pending:
                return
            tenant = self._files.tenant(file_id)
        path = self._file(file_id)
        try:
            with open_regular(path) as f:
                mtime_ns = os.fstat(f.fileno()).st_mtime_ns
                rows = self._decode(f.read(), file_id, tenant)
            write_private_file(path, self._encode(file_id, rows, tenant), mtime_ns)
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
            file_id = self._file_id(name)
            if file_id in self._pending or file_id not in self._files:
                continue
            future = self._prefetched.get(file_id)
            if future is None:
                future = self._prefetched[file_id] = self._reader.submit(self._read, file_id)
            ready = ready and future.done()
        return ready

    def discard(self, names: list[bytes]) -> None:
        """Forget read-ahead rows no admission will load (its request was aborted)."""
        for name in names:
            future = self._prefetched.pop(self._file_id(name), None)
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
        file_id = self._file_id(name)
        future = self._prefetched.pop(file_id, None)
        rows = future.result() if future is not None and not future.cancelled() else self._read(file_id)
        if rows is None:
            return None
        self._touch(file_id)
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

    COUNTS = ("saved", "loaded", "dropped", "failed", "rekeyed", "discarded")

    def carry_counts(self, old: "PrefixDiskStore") -> None:
        """The counts of the tier this one replaces (reopened for new weights), added to its own."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(old, name))

    def pages_by_tenant(self) -> dict[str, int]:
        """Pages per tenant_digest()."""
        with self._lock:
            return self._files.counts()

    def stats(self) -> dict:
        return {"prefix_disk_pages": self.num_pages, "prefix_disk_bytes": self.bytes_used,
                "prefix_disk_other_bytes": self._others_bytes, "prefix_disk_budget_bytes": self.capacity_bytes,
                "prefix_disk_writes": self.saved, "prefix_disk_reads": self.loaded,
                "prefix_disk_evictions": self.dropped, "prefix_disk_failures": self.failed,
                "prefix_disk_rekeyed": self.rekeyed, "prefix_disk_discarded": self.discarded,
                "prefix_disk_encrypted": int(self.cipher is not None)}

    def check_integrity(self) -> None:
        with self._lock:
            assert self.tier_bytes_used <= self.capacity_bytes, "the prefix disk tier is over its budget"
            assert all(f in self._files for f in self._pending), "a page being written is not indexed"
            assert self._bytes == sum(self._sizes.values()) and self._sizes.keys() == set(self._files.keys()) \
                == self._indexing.keys(), "file sizes and the index disagree"
            self._files.check_integrity()
            quota = self.max_pages_per_tenant
            assert quota is None or all(n <= quota for n in self._files.counts().values()), "a tenant is over its quota"


def _report_writer_failure(job: Future) -> None:
    if not job.cancelled() and job.exception() is not None:
        logger.warning("prefix cache disk tier: a background job failed (%r)", job.exception())

