"""The host tier of the tiered KV cache: every request's full latent history.

Layer-first layout, as SGLang's host pool: layer l's rows are one contiguous [num_slots, latent_dim]
array, indexed by the same logical slot (page_id * page_size + offset) as the device indexer keys,
so one page table covers both tiers. Two real implementations, differing only in their backing:

  * `RamTieredHostStore`: a tensor in host RAM (pinned when the device is CUDA, so H2D copies can run
    asynchronously on a side stream);
  * `MmapTieredHostStore`: a memory-mapped file (`host_store_path`), so the histories of many long
    sessions can exceed RAM; the OS pages rows in and out (the "third tier").

Both count the bytes they hold; the page allocator decides which slots are in use. `HostLink` moves
rows between the host store and the device: plain copies on a CPU-only machine; on CUDA pinned
staging, shared layers' fetches on a side stream and asynchronous backups (docs/tiers.md).
"""
from __future__ import annotations

import os
import tempfile

import torch

from ..context import index_tensor


class TieredHostStore:
    """rows[layer][slot] = one token's latent (c_KV ++ k_R) in that layer."""

    kind = "abstract"

    def __init__(self, layers: list[int], num_slots: int, dim: int, dtype: torch.dtype):
        self.layers, self.num_slots, self.dim, self.dtype = list(layers), num_slots, dim, dtype
        backing = self._allocate(len(self.layers) * num_slots * dim)
        self._rows = {l: backing[i * num_slots * dim:(i + 1) * num_slots * dim].view(num_slots, dim)
                      for i, l in enumerate(self.layers)}

    def _allocate(self, numel: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's latent in one layer."""
        return self.dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.row_bytes * len(self.layers)

    @property
    def capacity_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return [(self._rows[l], 1) for l in self.layers]

    def layer_slot_tensors(self, layer: int) -> list[torch.Tensor]:
        return [self._rows[layer]] if layer in self._rows else []

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._rows[layer].index_copy_(0, slots.cpu(), values.to("cpu", self.dtype))

    def read(self, layer: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the given slots [len(slots), dim]: a new host tensor, or written into `out`."""
        if out is None:
            return self._rows[layer].index_select(0, slots.cpu())
        return torch.index_select(self._rows[layer], 0, slots.cpu(), out=out)

    def close(self) -> None:
        self._rows = {}

    def check_integrity(self) -> None:
        assert set(self._rows) == set(self.layers), "a layer has no host rows"
        assert all(t.shape == (self.num_slots, self.dim) for t in self._rows.values()), "host rows resized"


class RamTieredHostStore(TieredHostStore):
    kind = "ram"

    def __init__(self, layers, num_slots, dim, dtype, pin: bool = False):
        self.pin, self._locked = pin, None
        super().__init__(layers, num_slots, dim, dtype)

    def _allocate(self, numel: int) -> torch.Tensor:
        """NOTE: `pin_memory=True` would take the store from torch's pinned caching allocator, which rounds
        every request up to a power of two (a 33 GiB store would lock 64 GiB); the store is page-locked
        in place instead (cudaHostRegister), its own size."""
        backing = torch.empty(numel, dtype=self.dtype)
        if self.pin:
            _check_cuda(torch.cuda.cudart().cudaHostRegister(backing.data_ptr(), backing.nbytes, HOST_REGISTER_PORTABLE),
                        "page-locking the host store")
            self._locked = backing
        return backing

    def close(self) -> None:
        locked, self._locked = self._locked, None
        super().close()
        if locked is not None:
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(locked.data_ptr()), "unlocking the host store")


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def _check_cuda(error, what: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"{what} failed: CUDA error {int(error)}")


class MmapTieredHostStore(TieredHostStore):
    """Backed by a sparse file: disk blocks are used only for rows actually written.

    `path` is a directory (a fresh uniquely named file is made in it, so several engines or restarts
    can share one) or the name of a file to create. An existing file is refused, never overwritten:
    it may be anything of the user's. The file is created 0600 and unlinked as soon as it is mapped: the
    mapping keeps its blocks until the store goes away, and then the OS frees them, even if the process
    is killed, so no conversation's KV is ever left on disk behind an engine."""

    kind = "mmap"

    def __init__(self, layers, num_slots, dim, dtype, path: str):
        self.path = _new_store_file(path)
        try:
            super().__init__(layers, num_slots, dim, dtype)
        finally:
            _remove_file(self.path)

    def _allocate(self, numel: int) -> torch.Tensor:
        return torch.from_file(self.path, shared=True, size=numel, dtype=self.dtype)


def _new_store_file(path: str) -> str:
    """Create the store's file, empty, from `host_store_path` (see MmapTieredHostStore); its path."""
    if os.path.isdir(path):
        fd, name = tempfile.mkstemp(prefix="sparsekv-host-", suffix=".kv", dir=path)
        os.close(fd)
        return name
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"host_store_path {path!r}: directory {directory} does not exist")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        raise FileExistsError(f"host_store_path {path!r} exists; sparsekv never overwrites a file: give a "
                              f"new file name, or a directory to create a fresh file in") from None
    return path


def _remove_file(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def make_host_store(layers: list[int], num_slots: int, dim: int, dtype: torch.dtype, path: str | None,
                    pin: bool = False) -> TieredHostStore:
    if path:
        return MmapTieredHostStore(layers, num_slots, dim, dtype, path)
    return RamTieredHostStore(layers, num_slots, dim, dtype, pin)


class HostLink:
    """Copies between a host store and device tensors, ordered so that no host row is read stale.

    backup(): device -> host. On CUDA the copy goes to pinned memory on a backup stream and lands in
    the store at the next `flush()` (the start of the next step, or before any host read), so a
    decode step never waits for it. fetch(): host -> device; the first layer's rows on the current
    stream (needed now), the other layers' on a side stream; `wait(layer)` before reading those.

    On a CPU every copy is done at once, unless `emulate_async` (tests set it): then a CPU link keeps
    CUDA's ordering contract as late as it allows. Backups reach the store only at `flush()`, and a
    shared layer's fetched rows reach its working set only at its `wait(layer)`, in issue order. A
    caller that reads the host before a flush, or a shared layer's rows before its wait, or writes a
    row that a fetch not yet waited on will overwrite, then computes on stale rows, and the exactness
    tests see it, with no GPU (tests/test_tiers.py, "emulated CUDA ordering").
    """

    emulate_async = False

    def __init__(self, host: TieredHostStore, device: torch.device):
        self.host, self.device = host, device
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None
        self._backups = torch.cuda.Stream(device) if cuda else None
        self._events: dict[int, torch.cuda.Event] = {}
        self._pending: list[tuple] = []
        self._landing: dict[int, list[tuple]] = {}  # emulate_async: a layer's fetches not yet waited on
        self._scratch: torch.Tensor | None = None  # CPU fetch staging, grown to the largest fetch

    def index(self, values) -> torch.Tensor:
        return index_tensor(values, self.device)

    def backup(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        if self._backups is None:
            if self.emulate_async:
                self._pending.append((layer, slots.clone(), values.clone(), None))
            else:
                self.host.write(layer, slots, values)
            return
        self._backups.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._backups):
            v = torch.empty(values.shape, dtype=self.host.dtype, pin_memory=True).copy_(values, non_blocking=True)
            s = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True).copy_(slots, non_blocking=True)
        values.record_stream(self._backups)
        slots.record_stream(self._backups)
        done = torch.cuda.Event()
        done.record(self._backups)
        self._pending.append((layer, s, v, done))

    def flush(self) -> None:
        for layer, slots, values, done in self._pending:
            if done is not None:
                done.synchronize()
            self.host.write(layer, slots, values)
        self._pending.clear()

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        self.flush()
        return self.host.read(layer, slots).to(self.device)

    def fetch(self, layers: list[int], src: torch.Tensor, dst: dict[int, torch.Tensor], rows: torch.Tensor) -> None:
        """dst[l][rows] = host rows `src` (a CPU tensor) of layer l, for every l in `layers`."""
        if self._side is None:  # through one reused buffer: a fresh multi-MB tensor per layer and step
            staged = self._staging(src.numel())  # made glibc mmap and page-fault it (2x slower fetches)
            for i, layer in enumerate(layers):
                if self.emulate_async and i:  # a side-stream copy: lands at wait(layer)
                    self._landing.setdefault(layer, []).append((dst[layer], rows, self.host.read(layer, src)))
                else:
                    dst[layer].index_copy_(0, rows, self.host.read(layer, src, out=staged))
            return
        # gathered straight into pinned memory (one copy, where a read, a stack and a pin made three); the
        # caching host allocator hands the block out again only once the copies from it below are done
        staged = torch.empty((len(layers), src.numel(), self.host.dim), dtype=self.host.dtype, pin_memory=True)
        for i, layer in enumerate(layers):
            self.host.read(layer, src, out=staged[i])
        dst[layers[0]].index_copy_(0, rows, staged[0].to(self.device, non_blocking=True))
        if len(layers) == 1:
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            moved = staged[1:].to(self.device, non_blocking=True)
            for i, layer in enumerate(layers[1:]):
                dst[layer].index_copy_(0, rows, moved[i])
        rows.record_stream(self._side)
        done = torch.cuda.Event()
        done.record(self._side)
        self._events.update({layer: done for layer in layers[1:]})

    def _staging(self, rows: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.shape[0] < rows:
            # NOTE: a normal tensor even when a step's forward (inference mode) grows it: a fetch outside
            # it (a tail's warm-up in begin_step) writes it too, which an inference tensor refuses
            with torch.inference_mode(False):
                self._scratch = torch.empty(rows, self.host.dim, dtype=self.host.dtype)
        return self._scratch[:rows]

    def wait(self, layer: int) -> None:
        for dst, rows, values in self._landing.pop(layer, []):
            dst.index_copy_(0, rows, values)
        done = self._events.pop(layer, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
