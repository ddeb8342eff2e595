"""What a prefill worker and a decode worker say to each other, and the pages as tensors.

Messages are JSON bodies signed with the workers' shared secret (HMAC-SHA256): a worker acts on no
message whose MAC does not check, so a peer without the secret can neither claim a room nor feed a
decode worker KV. The tensor bytes travel over torch.distributed (transfer.py); the signed metadata
names each tensor's shape, dtype and a keyed digest of its bytes (HMAC-SHA256 under a key derived
from the secret: SHA-256 because CPUs with SHA extensions digest it faster than BLAKE2b, and the
decode worker digests every byte it receives), so a corrupted or forged tensor fails its request.

A room's pages (`engine.kv.export_prefix`: `(name, rows)` pairs, one row tensor per slot-indexed
tensor of the cache) go as one tensor per kind of row, the pages stacked along a new first axis::

    pages  [(name_0, [lat_0, idx_0, ...]), (name_1, [lat_1, idx_1, ...]), ...]
    wire   [stack(lat_0, lat_1, ...), stack(idx_0, idx_1, ...), ...]   each sent as flat bytes

A batch's metadata names the kinds its tensors hold (`kinds`, positions in a page's rows; None: all):
a layer batch holds some layers' kinds for pages of one prompt, not yet named (`layer_rows`), and the
named batch of those pages the other kinds (prefill.py, decode.py); a tail batch (`layer_rows.tail`: n)
the first n rows of the page after a prompt's cacheable ones, which is never named.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat

import torch

SECRET_MIN_BYTES = 16
OTHERS_MAY_ACCESS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH


class TransferError(RuntimeError):
    """One room's transfer failed (peer gone, timeout, bad MAC, corrupted bytes): its request fails
    with a 503, the worker goes on."""


class PrefillRefused(TransferError):
    """The prefill worker refused the request itself (bad input): the decode worker answers with the
    prefill worker's status, message and param, as one server would, and counts no failed transfer."""

    def __init__(self, status: int, message: str, param: str | None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RoomAborted(TransferError):
    """/abort_request ended the room's request during its transfer (on the decode worker, which holds
    the client's request and tells the prefill worker in its verdict): both workers end the room, its
    client gets finish_reason "abort", and neither counts a failed transfer."""


def load_secret(path: str) -> bytes:
    """The shared secret of a --disaggregation-secret-file: its bytes, surrounding whitespace removed.
    Refused if other users may read or write it, or if it is shorter than SECRET_MIN_BYTES."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & OTHERS_MAY_ACCESS:
                raise ValueError(f"--disaggregation-secret-file {path}: other users may read or write it (mode "
                                 f"{stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}")
            secret = f.read().strip()
    except OSError as e:  # missing, a directory, unreadable
        raise ValueError(f"--disaggregation-secret-file {path}: {e.strerror}") from None
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(f"--disaggregation-secret-file {path}: the secret has {len(secret)} bytes, fewer than "
                         f"{SECRET_MIN_BYTES} (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(secret: bytes, body: dict) -> bytes:
    mac = hmac.new(secret, _canonical(body), hashlib.sha256).hexdigest()
    return json.dumps({"body": body, "mac": mac}).encode()


def verify(secret: bytes, raw: bytes, what: str) -> dict:
    """The body of a signed message; TransferError if it is not one, or its MAC does not check (the
    other worker has another secret, or the message was altered)."""
    try:
        message = json.loads(raw)
        body, mac = message["body"], message["mac"]
        ok = hmac.compare_digest(hmac.new(secret, _canonical(body), hashlib.sha256).hexdigest(), mac)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise TransferError(f"the {what} failed authentication: the two workers' --disaggregation-secret-file "
                            f"differ, or the message was altered")
    return body


def digest(secret: bytes, data: torch.Tensor) -> str:
    """A keyed digest of a flat uint8 tensor's bytes."""
    key = hashlib.sha256(b"sparsekv-disagg-tensor" + secret).digest()
    return hmac.digest(key, data.numpy(), "sha256").hex()


def pages_to_tensors(pages: list) -> list[torch.Tensor]:
    """One tensor per kind of row, the pages stacked on a new first axis (nothing for no pages)."""
    if not pages:
        return []
    kinds = len(pages[0][1])
    return [torch.stack([rows[j] for _, rows in pages]).contiguous() for j in range(kinds)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (FP8 and bf16 rows go as their bytes)."""
    return t.reshape(-1).view(torch.uint8)


def tensor_specs(secret: bytes, tensors: list[torch.Tensor]) -> list[dict]:
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "nbytes": t.numel() * t.element_size(),
             "digest": digest(secret, as_bytes(t))} for t in tensors]


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"the prefill worker named an unknown dtype {name!r}")
    return dtype


def check_received(secret: bytes, spec: dict, data: torch.Tensor, index: int) -> torch.Tensor:
    """The tensor `spec` describes, from the bytes received; TransferError on a size or digest mismatch,
    or a spec whose digest, dtype or shape does not describe them."""
    if data.numel() != spec["nbytes"]:
        raise TransferError(f"tensor {index}: {data.numel()} bytes received, {spec['nbytes']} announced")
    announced = spec.get("digest")
    if not (isinstance(announced, str) and hmac.compare_digest(digest(secret, data).encode(), announced.encode())):
        raise TransferError(f"tensor {index}: its bytes do not match their digest (corrupted in transfer)")
    dtype, shape = parse_dtype(spec.get("dtype")), spec.get("shape")
    try:
        if not shape:  # every tensor a transfer sends has rows: a 0-dim one is nothing the decode side reads
            raise TypeError(shape)
        return data.view(dtype).reshape(shape)
    except (RuntimeError, TypeError):
        raise TransferError(f"tensor {index}: its {data.numel()} bytes hold no {spec.get('dtype')} tensor of shape "
                            f"{shape!r}") from None


def tensors_to_pages(names: list[bytes], tensors: list[torch.Tensor]) -> list:
    """`pages_to_tensors` undone: (name, rows) pairs for `engine.kv.import_prefix`, each row a view into
    its received tensor."""
    if any(t.shape[0] != len(names) for t in tensors):
        raise TransferError(f"{len(names)} pages named but tensors of {[t.shape[0] for t in tensors]} pages received")
    return [(name, [t[i] for t in tensors]) for i, name in enumerate(names)]


def prompt_digest(token_ids: list[int]) -> str:
    """Names a prompt's token ids, so the two workers can check they hold the same prompt."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


def at_once(fn):
    """Run `fn` now: the pace of work nobody spreads out (decode.Pacer spreads it)."""
    return fn()
