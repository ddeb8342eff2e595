"""The memory a KV store could take at most where it lives, checked before anything is allocated: a
cache sized past it fails with a ConfigError naming what sized it, rather than deep in an allocation or
by the out-of-memory killer."""
from __future__ import annotations

import os
import shutil

import torch

from ..config import ConfigError

GiB = 2 ** 30


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory a pool on `device` could take at most: the machine's RAM, or the GPU's free memory.
    NOTE: on CUDA the driver's free memory (`mem_get_info`) leaves out what torch's caching allocator
    holds reserved but unused (an earlier engine's pool, freed in this process): an allocation takes
    it (the allocator releases its cached blocks and retries before it fails), so it is counted."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(cached, 0)
    if device.type == "cpu":
        return host_memory_bytes()
    return None


def host_memory_bytes() -> int | None:
    if hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_tiered_fits(host_bytes: int, device_bytes: int, device: torch.device, store_path: str | None,
                      sized_by: str) -> None:
    """A tiered cache's host store (`host_bytes`, in RAM, or in a file at `store_path`) and its device
    part (indexer keys and working sets) against the machine's RAM, the GPU's memory and the disk."""
    in_ram = (0 if store_path else host_bytes) + (device_bytes if device.type == "cpu" else 0)
    places = [("RAM", in_ram, host_memory_bytes())]
    if device.type == "cuda":
        places.append((f"{device} memory", device_bytes, device_memory_bytes(device)))
    if store_path:
        places.append((f"free disk space at {store_path}", host_bytes, _free_disk_bytes(store_path)))
    for where, need, have in places:
        if have is not None and need > have:
            raise ConfigError(f"the tiered KV cache needs {need / GiB:.1f} GiB of {where} (host store "
                              f"{host_bytes / GiB:.1f} GiB, device part {device_bytes / GiB:.1f} GiB; sized by "
                              f"{sized_by}) and there are {have / GiB:.1f} GiB; lower max_model_len, max_num_seqs "
                              f"or host_kv_budget_bytes")


def _free_disk_bytes(path: str) -> int | None:
    """Free bytes where the store's file would be made; None where that directory does not exist (the
    store itself then refuses the path, naming it)."""
    try:
        return shutil.disk_usage(_existing_dir(path)).free
    except OSError:
        return None


def _existing_dir(path: str) -> str:
    """`path` if it is a directory, else the directory a new file of that name would be made in."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
