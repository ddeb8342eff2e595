"""Encryption at rest for the prefix cache's disk tier (prefix_disk.py): AES-256-GCM, a key per
namespace derived with HKDF-SHA256 from the operator's secret, a fresh nonce per file, and a key name
in each file so keys can be rotated (`PrefixDiskStore(old_ciphers=...)`)."""
from __future__ import annotations

import math
import os
import threading

import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32


def create_key_file(path: str) -> bool:
    """Write a fresh secret of KEY_BYTES random bytes to `path`, mode 0600, unless the file exists;
    True if this call made it. Written under a temporary name and linked into place, so an engine
    starting beside this one on the same directory reads the whole key or finds none, and a key that
    exists (pages sealed with it) is never replaced."""
    if os.path.exists(path):
        return False
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another engine made it first: use theirs
            return False
        return True
    finally:
        os.unlink(tmp)


class PageCipher:
    """Encryption at rest for page files: AES-256-GCM under a key derived (HKDF-SHA256) from the
    operator's secret and the namespace. A page's name and tenant digest are authenticated with its
    bytes, so a file altered, renamed or written under another key reads back as a miss, never as
    wrong KV entries."""

    def __init__(self, secret: bytes, space: str):
        if len(secret) < KEY_BYTES:
            raise ValueError(f"the key file holds {len(secret)} bytes; it needs at least {KEY_BYTES} of secret")
        info = b"sparsekv-prefix-disk-v1\0" + space.encode()
        self._aead = AESGCM(HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(secret))
        # names the key in each file (a one-way derivation: it tells keys apart, reveals nothing of them)
        self.key_id = HKDF(hashes.SHA256(), 8, salt=None, info=info + b"\0key-id").derive(secret).hex()

    def seal(self, rows: list[torch.Tensor], name: bytes, tenant: str) -> tuple[dict, dict]:
        """(tensors, metadata) of the encrypted page."""
        plain = b"".join(r.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for r in rows)
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, plain, name + tenant.encode())
        return {"sealed": torch.frombuffer(bytearray(sealed), dtype=torch.uint8)}, {"nonce": nonce.hex(), "key": self.key_id}

    def open(self, metadata: dict, sealed: torch.Tensor, layout: list, name: bytes, tenant: str) -> list[torch.Tensor]:
        """The rows of a page file (its metadata and sealed bytes); raises if it does not authenticate."""
        plain = self._aead.decrypt(bytes.fromhex(metadata["nonce"]), sealed.numpy().tobytes(), name + tenant.encode())
        rows, start = [], 0
        for shape, dtype in layout:
            size = math.prod(shape) * dtype.itemsize
            rows.append(torch.frombuffer(bytearray(plain[start:start + size]), dtype=torch.uint8).view(dtype).view(shape))
            start += size
        return rows

    def seal_bytes(self, data: bytes, purpose: bytes) -> dict:
        """A small secret sealed for storage beside the pages (the tier's tenant key): a JSON-able
        record naming the key, so a rotation can re-seal it. `purpose` is authenticated with it."""
        nonce = os.urandom(12)
        return {"key": self.key_id, "nonce": nonce.hex(), "sealed": self._aead.encrypt(nonce, data, purpose).hex()}

    def open_bytes(self, record: dict, purpose: bytes) -> bytes:
        """What `seal_bytes` sealed; raises if it does not authenticate under this key."""
        return self._aead.decrypt(bytes.fromhex(record["nonce"]), bytes.fromhex(record["sealed"]), purpose)
