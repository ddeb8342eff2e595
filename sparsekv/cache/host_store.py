"""The host tier of the tiered KV cache: every request's full latent history.

Layer-first layout, as SGLang's host pool: layer l's rows are one contiguous [num_slots, latent_dim]
array, indexed by the same logical slot (page_id * page_size + offset) as the device indexer keys,
so one page table covers both tiers. Two real implementations, differing only in their backing:

  * `RamHostStore`: a tensor in host RAM (pinned when the device is CUDA, so H2D copies can run
    asynchronously on a side stream);
  * `MmapHostStore`: a memory-mapped file (`host_store_path`), so the histories of many long
    sessions can exceed RAM; the OS pages rows in and out (the "third tier").

Both count the bytes they hold; the page allocator decides which slots are in use.
"""
from __future__ import annotations

import os
import weakref

import torch


class HostStore:
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
        return self.dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.row_bytes * len(self.layers)

    @property
    def capacity_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._rows[layer].index_copy_(0, slots.cpu(), values.to("cpu", self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the given slots, a new host tensor [len(slots), dim]."""
        return self._rows[layer].index_select(0, slots.cpu())

    def close(self) -> None:
        self._rows = {}


class RamHostStore(HostStore):
    kind = "ram"

    def __init__(self, layers, num_slots, dim, dtype, pin: bool = False):
        self.pin = pin
        super().__init__(layers, num_slots, dim, dtype)

    def _allocate(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, pin_memory=self.pin)


class MmapHostStore(HostStore):
    """Backed by a sparse file: disk blocks are used only for rows actually written."""

    kind = "mmap"

    def __init__(self, layers, num_slots, dim, dtype, path: str):
        self.path = path
        super().__init__(layers, num_slots, dim, dtype)

    def _allocate(self, numel: int) -> torch.Tensor:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"host_store_path {self.path!r}: directory {directory} does not exist")
        if os.path.exists(self.path):
            os.remove(self.path)  # never read a previous run's rows
        backing = torch.from_file(self.path, shared=True, size=numel, dtype=self.dtype)
        self._remove = weakref.finalize(self, _remove_file, self.path)  # the file goes with the store
        return backing

    def close(self) -> None:
        super().close()
        self._remove()


def _remove_file(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def make_host_store(layers: list[int], num_slots: int, dim: int, dtype: torch.dtype, path: str | None,
                    pin: bool = False) -> HostStore:
    if path:
        return MmapHostStore(layers, num_slots, dim, dtype, path)
    return RamHostStore(layers, num_slots, dim, dtype, pin)
