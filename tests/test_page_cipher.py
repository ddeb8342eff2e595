"""The prefix disk tier's page cipher (cache/page_cipher.py) on its own: what a sealed page file and a
sealed secret reveal, and what they authenticate."""
from __future__ import annotations

import os

import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sparsekv.cache import page_cipher
from sparsekv.cache.page_cipher import KEY_BYTES, PageCipher, create_key_file

SECRET = bytes(range(KEY_BYTES))
NAME = bytes(32)  # file ids are 32-byte digests


def _rows():
    return [torch.arange(12, dtype=torch.float32).view(3, 4), torch.arange(6, dtype=torch.uint8)]


def test_every_seal_takes_a_fresh_nonce():
    """AES-GCM under one key must never reuse a nonce: two seals of the same page (a page saved again,
    a rotation re-sealing it) and of the same secret differ in nonce and ciphertext, and each opens."""
    cipher = PageCipher(SECRET, "space")
    (a, meta_a), (b, meta_b) = (cipher.seal(_rows(), NAME, "tenant") for _ in range(2))
    assert meta_a["nonce"] != meta_b["nonce"] and not torch.equal(a["sealed"], b["sealed"])
    layout = [((3, 4), torch.float32), ((6,), torch.uint8)]
    for sealed, meta in ((a, meta_a), (b, meta_b)):
        opened = cipher.open(meta, sealed["sealed"], layout, NAME, "tenant")
        assert all(torch.equal(x, y) for x, y in zip(opened, _rows(), strict=True))
    first, second = (cipher.seal_bytes(b"tenant secret", b"purpose") for _ in range(2))
    assert first["nonce"] != second["nonce"] and first["sealed"] != second["sealed"]
    assert cipher.open_bytes(first, b"purpose") == cipher.open_bytes(second, b"purpose") == b"tenant secret"


def test_the_key_id_reveals_no_bytes_of_the_key():
    """The key name written in every file is derived one-way with its own HKDF info: HKDF's output
    for one info is a prefix of its longer output, so a name derived like the key would publish
    the key's first bytes. It tells secrets and namespaces apart."""
    cipher = PageCipher(SECRET, "space")
    info = b"sparsekv-prefix-disk-v1\0" + b"space"
    key = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(SECRET)
    assert len(cipher.key_id) == 16 and bytes.fromhex(cipher.key_id) not in key
    assert cipher.key_id != PageCipher(SECRET, "other").key_id != PageCipher(bytes(KEY_BYTES), "other").key_id


def test_the_tenant_and_name_are_authenticated_and_short_secrets_refused():
    cipher = PageCipher(SECRET, "space")
    sealed, meta = cipher.seal(_rows(), NAME, "tenant")
    layout = [((3, 4), torch.float32), ((6,), torch.uint8)]
    for name, tenant in ((NAME, "other"), (bytes([1]) + NAME[1:], "tenant")):
        with pytest.raises(InvalidTag):
            cipher.open(meta, sealed["sealed"], layout, name, tenant)
    with pytest.raises(InvalidTag):  # another namespace's key
        PageCipher(SECRET, "other").open(meta, sealed["sealed"], layout, NAME, "tenant")
    with pytest.raises(ValueError, match="at least 32"):
        PageCipher(SECRET[:-1], "space")


def test_a_key_file_is_made_once_private_and_leaves_no_temporary(tmp_path, monkeypatch):
    """`create_key_file`: the secret lands 0600 under its own name with no temporary copy of it left
    beside it (a stray copy of the key would outlive a rotation or removal of the key file); a key
    already there, also one another engine links into place first, is kept as it is."""
    path = tmp_path / "key"
    assert create_key_file(str(path)) is True
    key = path.read_bytes()
    assert len(key) == KEY_BYTES and os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["key"]
    assert create_key_file(str(path)) is False
    with monkeypatch.context() as m:  # the file appears between the check and the link: another engine's
        m.setattr(page_cipher.os.path, "exists", lambda p: False)
        assert create_key_file(str(path)) is False
    assert path.read_bytes() == key and os.listdir(tmp_path) == ["key"]


def test_a_sealed_secret_opens_only_for_its_purpose_and_key():
    """`seal_bytes` authenticates its purpose: a record sealed for one use (the tier's tenant key) never
    opens as another's, nor under another key, nor with its bytes changed."""
    cipher = PageCipher(SECRET, "space")
    record = cipher.seal_bytes(b"tenant secret", b"purpose")
    assert record["key"] == cipher.key_id
    with pytest.raises(InvalidTag):
        cipher.open_bytes(record, b"another purpose")
    with pytest.raises(InvalidTag):
        PageCipher(SECRET, "other").open_bytes(record, b"purpose")
    flipped = dict(record, sealed=f"{int(record['sealed'][:2], 16) ^ 1:02x}" + record["sealed"][2:])
    with pytest.raises(InvalidTag):
        cipher.open_bytes(flipped, b"purpose")
    assert cipher.open_bytes(record, b"purpose") == b"tenant secret"
