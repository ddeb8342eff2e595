"""Hardware profiles for the planner: datasheet presets for machines we do not have, and a
micro-benchmark (`this-cpu`) for the one we do.

A profile holds only rates and capacities. Datasheet rates are peaks, so predictions for the
GPU presets are ideal rooflines; the `this-cpu` rates are measured with torch, which is what the
engine runs on here, so its predictions can be checked against `sparsekv bench decode`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU socket) and the node it sits in.

    `mem_bw` is the bandwidth of the memory the cache and weights live in (HBM, or DRAM for a
    CPU); `link_bw` is the host-to-device path a tiered cache misses over (PCIe, NVLink-C2C,
    or a plain memcpy on a CPU). `op_overhead_s` and `topk_s_per_key` are only non-zero where
    measured: datasheets do not state dispatch latency or top-k throughput.
    """

    name: str
    description: str
    device_mem_bytes: float
    mem_bw: float
    link_bw: float
    link_name: str
    flops_bf16: float
    flops_fp8: float
    gpus_per_node: int
    host_dram_bytes: float
    op_overhead_s: float = 0.0
    topk_s_per_key: float = 0.0
    parallel_op_s: float = 0.0
    threads: int = 0
    measured: bool = False

    def matmul_flops(self, weight_format: str) -> float:
        """Peak matmul rate for weights stored in `weight_format` (FP8 tensor cores where they exist)."""
        return self.flops_fp8 if weight_format == "fp8" else self.flops_bf16

    def with_node(self, gpus_per_node: int | None = None, host_dram_gb: float | None = None) -> "Hardware":
        changes = {}
        if gpus_per_node is not None:
            changes["gpus_per_node"] = gpus_per_node
        if host_dram_gb is not None:
            changes["host_dram_bytes"] = host_dram_gb * GB
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Datasheet figures (dense, no structured sparsity). PCIe Gen5 x16 is 64 GB/s per direction on
# paper; 55 GB/s is what pinned-memory copies reach. GH200's NVLink-C2C is 900 GB/s both ways,
# 450 GB/s host-to-device. Host DRAM: 2 TB for an 8-GPU HGX node, 480 GB LPDDR5X on a GH200.
PRESETS: dict[str, Hardware] = {
    "h100": Hardware("h100", "H100 SXM, 80 GB HBM3, PCIe Gen5 host link", 80 * GB, 3.35 * TB,
                     55 * GB, "PCIe Gen5", 989 * TB, 1979 * TB, 8, 2048 * GB),
    "h200": Hardware("h200", "H200 SXM, 141 GB HBM3e 4.8 TB/s, PCIe Gen5 host link", 141 * GB, 4.8 * TB,
                     55 * GB, "PCIe Gen5", 989 * TB, 1979 * TB, 8, 2048 * GB),
    "b200": Hardware("b200", "B200, 180 GB HBM3e 8 TB/s, PCIe Gen5 host link", 180 * GB, 8.0 * TB,
                     55 * GB, "PCIe Gen5", 2250 * TB, 4500 * TB, 8, 2048 * GB),
    "gh200": Hardware("gh200", "GH200, 144 GB HBM3e, NVLink-C2C to 480 GB LPDDR5X", 144 * GB, 4.9 * TB,
                      450 * GB, "NVLink-C2C", 989 * TB, 1979 * TB, 1, 480 * GB),
}


def _best_seconds(fn, reps: int) -> float:
    """Fastest of `reps` runs after one warm-up (page faults, thread-pool start): the machine is
    shared, so the minimum is the least disturbed."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_bandwidths(torch, numel: int, reps: int) -> tuple[float, float]:
    """(read bandwidth from a streaming sum, memcpy bandwidth counting read + write), bytes/s.

    Decode mostly reads (weights, selected cache rows), so the read rate is the roofline's memory
    bandwidth; a tiered cache's miss is a copy, so memcpy is its link bandwidth on a CPU.
    """
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    read = nbytes / _best_seconds(lambda: src.sum(), reps)
    copy = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), reps)
    return read, copy


def _measure_matmul_flops(torch, n: int, reps: int) -> float:
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    return 2 * n ** 3 / _best_seconds(lambda: a @ b, reps)


def _measure_op_overhead(torch, ops: int) -> float:
    """Seconds per small eager torch call from Python: the fixed cost each op of an unfused engine pays.

    A mix like the engine's (a GEMV-sized linear, a slice, a view, a cat, a softmax, an in-place
    add), since a bare `add(out=)` (~1 us) underestimates ops that allocate their output.
    """
    import torch.nn.functional as F
    x, w = torch.randn(1, 16), torch.randn(16, 16)

    def run():
        for _ in range(ops // 6):
            y = F.linear(x, w)
            y = y[:, :8].reshape(-1)
            y = torch.cat([y, y])
            y = torch.softmax(y, -1)
            y.add_(1.0)
    return _best_seconds(run, 3) / (ops // 6 * 6)


def _measure_parallel_op(torch) -> float:
    x = torch.zeros(1 << 17)
    return _best_seconds(lambda: torch.add(x, 1.0, out=x), 5)


def _measure_topk(torch, numel: int, k: int, reps: int) -> float:
    scores = torch.randn(numel)
    return _best_seconds(lambda: scores.topk(k), reps) / numel


def _memory_total_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GB


def device_read_bandwidth(device, threads: int, quick: bool = False) -> float:
    """Bytes/s a streaming read reaches on `device` (a torch.device): this CPU's measured figure, or
    the best of 5 sums of 1 GiB on an accelerator (timed as the CPU's are). The roofline every
    bench prints its achieved bandwidth against."""
    import torch
    if device.type == "cpu":
        return measure_this_cpu(quick=quick, threads=threads).mem_bw
    x = torch.ones(1 << 28, device=device)
    return x.numel() * x.element_size() / _best_seconds(lambda: (x.sum(), torch.cuda.synchronize(device)), 5)


def measure_this_cpu(quick: bool = False, threads: int | None = None) -> Hardware:
    """Measure this machine with torch in well under 3 s (about 0.2 s with `quick`).

    Measure with the thread count the engine will run with (`threads`, default torch's current
    setting): on a shared 2-core machine one thread can be faster than two. On a CPU the
    "device" and the "host" are the same DRAM, so both capacities are MemTotal and the link is a
    memcpy. Matmul rate is fp32 (what the engine runs on CPU) for every format.
    """
    import torch
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure(torch, quick)
    finally:
        torch.set_num_threads(previous)


def _measure(torch, quick: bool) -> Hardware:
    numel = (1 << 23) if quick else (1 << 25)  # 32 MB / 128 MB of fp32: larger than any L3 here
    read_bw, copy_bw = _measure_bandwidths(torch, numel, 2 if quick else 3)
    flops = _measure_matmul_flops(torch, 256 if quick else 768, 2 if quick else 3)
    op_s = _measure_op_overhead(torch, 200 if quick else 1000)
    topk_s = _measure_topk(torch, 1 << 18, 2048, 2 if quick else 3)
    parallel_s = _measure_parallel_op(torch)
    mem = _memory_total_bytes()
    threads = torch.get_num_threads()
    desc = (f"this CPU ({threads} torch threads): read {read_bw / GB:.1f} GB/s, memcpy {copy_bw / GB:.1f} GB/s, "
            f"fp32 matmul {flops / 1e9:.0f} GFLOP/s, op {op_s * 1e6:.1f} us, parallel op {parallel_s * 1e3:.2f} ms")
    return Hardware("this-cpu", desc, mem, read_bw, copy_bw, "memcpy", flops, flops, 1, mem,
                    op_overhead_s=op_s, topk_s_per_key=topk_s, parallel_op_s=parallel_s, threads=threads,
                    measured=True)


def load_hardware(spec: str) -> Hardware:
    """A preset name, `this-cpu` or `this-cpu:THREADS` (measured now), or a JSON file saved from
    `Hardware.to_dict()`."""
    key = spec.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key == "this-cpu" or key.startswith("this-cpu:"):
        threads = key.partition(":")[2]
        if threads and not (threads.isdigit() and int(threads) >= 1):
            raise ValueError(f"hardware {spec!r}: the thread count after 'this-cpu:' must be a number >= 1")
        return measure_this_cpu(threads=int(threads) if threads else None)
    if os.path.isfile(spec):
        return _load_profile(spec)
    raise ValueError(f"unknown hardware {spec!r}; use one of {', '.join([*PRESETS, 'this-cpu'])} "
                     "or a JSON profile file")


# Numeric fields of a profile: (lowest value, whether the lowest is excluded, whether it must be an int).
_PROFILE_NUMBERS = {"device_mem_bytes": (0, True, False), "mem_bw": (0, True, False), "link_bw": (0, True, False),
                    "flops_bf16": (0, True, False), "flops_fp8": (0, True, False), "gpus_per_node": (1, False, True),
                    "host_dram_bytes": (0, False, False), "op_overhead_s": (0, False, False),
                    "topk_s_per_key": (0, False, False), "parallel_op_s": (0, False, False),
                    "threads": (0, False, True)}
_PROFILE_STRINGS = ("name", "description", "link_name")


def _load_profile(path: str) -> Hardware:
    try:
        with open(path) as f:
            raw = json.load(f)
        hw = Hardware(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a hardware profile ({e})") from None
    _check_profile(path, raw)
    return hw


def _check_profile(path: str, raw: dict) -> None:
    """ValueError naming the file and the field unless every field has a usable type and value."""
    for field, (low, low_open, integer) in _PROFILE_NUMBERS.items():
        if field in raw:
            _check_number(path, field, raw[field], low, low_open, integer)
    for field in _PROFILE_STRINGS:
        if not isinstance(raw[field], str):
            raise ValueError(f"{path}: field {field!r} must be a string, got {raw[field]!r}")
    if not isinstance(raw.get("measured", False), bool):
        raise ValueError(f"{path}: field 'measured' must be true or false, got {raw['measured']!r}")


def _check_number(path: str, field: str, value, low: float, low_open: bool, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{path}: field {field!r} must be {kind}, got {value!r}")
    if not (math.isfinite(value) and (value > low if low_open else value >= low)):
        raise ValueError(f"{path}: field {field!r} must be a finite number {'>' if low_open else '>='} {low}, "
                         f"got {value!r}")
