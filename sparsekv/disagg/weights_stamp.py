"""Which weights computed a room's KV, so that a decode worker never uses KV of other weights.

An RL trainer updates each worker's weights on its own (`update_weights_from_disk`, docs/rl.md), so
for a while a prefill worker and a decode worker may hold different ones. The prefill worker names
its weights in the room's signed metadata, read on the engine loop together with the export, and the
decode worker refuses the KV unless they are its own:

- `weights_version`: the updates the engine loaded since it started (equal counts on both sides);
- `checkpoint`: a digest of the checkpoint directory the weights were last loaded from (its
  config.json and sampled blocks of each safetensors file, as the prefix cache's disk tier names a
  checkpoint). Compared only where both sides know it: it is unknown (None) once the directory has
  changed on disk since it was loaded, as its files then no longer say what was loaded.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from ..cache.prefix_disk import checkpoint_identity
from ..weights import files_stamp
from .wire import TransferError

MAX_STAMPS = 8  # checkpoint digests kept: the weights loaded last (an RL trainer loads a new checkpoint at each update)


def loaded_weights(engine) -> tuple:
    """(weights_version, checkpoint directory, its files' stat stamp when loaded); on the engine loop.
    The executor (rank 0's, under tensor parallelism) knows where its weights came from."""
    source = engine.executor.weights
    return engine.weights_version, source.path, source.identity


class WeightsStamp:
    """A worker's stamps, each checkpoint digest computed once (it reads the checkpoint's files)."""

    def __init__(self):
        # (path, files stamp when loaded) -> digest, for the MAX_STAMPS loaded last: a worker whose weights an
        # RL trainer updates from a new checkpoint at each step would otherwise keep one per update for its life
        self._digests: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: stamps are taken on the transfer threads, several at once

    def stamp(self, loaded: tuple) -> dict:
        """The signed metadata's `weights` field for `loaded_weights(engine)` (off the engine loop)."""
        version, path, files = loaded
        return {"weights_version": version, "checkpoint": self._digest(path, files)}

    def _digest(self, path: str, files: list) -> str | None:
        key = (path, json.dumps(files))
        with self._lock:
            if key in self._digests:
                self._digests.move_to_end(key)
                return self._digests[key]
        same = _stat_stamp(path) == files  # the directory still holds what was loaded
        digest = _checkpoint_digest(path) if same else None  # NOTE: outside the lock (it reads the files)
        with self._lock:
            self._digests[key] = digest
            while len(self._digests) > MAX_STAMPS:
                self._digests.popitem(last=False)
        return digest


def check_same_weights(theirs, mine: dict) -> None:
    """TransferError unless the prefill worker's stamp (`theirs`, from its metadata) names this
    decode worker's weights."""
    theirs = theirs if isinstance(theirs, dict) else {}
    if theirs.get("weights_version") != mine["weights_version"]:
        raise TransferError(f"the prefill worker computed the KV under weights_version "
                            f"{theirs.get('weights_version')}, this decode worker holds weights_version "
                            f"{mine['weights_version']}: update both workers to the same weights")
    a, b = theirs.get("checkpoint"), mine["checkpoint"]
    if a is not None and b is not None and a != b:
        raise TransferError(f"the prefill worker computed the KV under checkpoint {str(a)[:12]}, this decode "
                            f"worker holds checkpoint {b[:12]} (both at weights_version {mine['weights_version']}): "
                            f"load the same checkpoint on both workers")


def _stat_stamp(path: str) -> list | None:
    try:
        return files_stamp(path)
    except OSError:  # the directory is gone
        return None


def _checkpoint_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(json.dumps(checkpoint_identity(path)).encode()).hexdigest()
    except OSError:
        return None
