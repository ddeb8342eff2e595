"""Size parsing shared by the engine options (`engine_args.py`) and the benchmarks: a bottom-layer module,
no sparsekv imports (tests/test_imports.py)."""
from __future__ import annotations

import argparse


MAX_TIMEOUT_S = 10 ** 7  # a timeout's bound (about 115 days): torch's and the stores' take whole milliseconds


def parse_bytes(text: str) -> int:
    """'123', '64K', '8M', '2G', '1T' (binary multiples) -> bytes. An argparse `type=`: a bad size is an
    ArgumentTypeError, which argparse reports as a usage error."""
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):  # the last: inf
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 4096, 64K, 8G)") from None
