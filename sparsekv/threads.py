"""How many torch intra-op threads an engine uses when none is asked for (`num_threads=None`).

`LLM(path)`, `sparsekv generate` and `sparsekv serve` all leave `num_threads` at None, so all three
resolve it here, from the checkpoint's config.json, and agree.

The rule: one thread per `BYTES_PER_THREAD` of weights a decode token reads, at least one, at most
the cores this process may run on; on an accelerator, up to `ACCELERATOR_THREADS` cores: the model
runs on the device, and so do a step's plain rows, but the rows sampled one at a time (penalties,
bias, grammars, drafts to verify) and prompt logprobs are decided on the host, and at a real
vocabulary that is large work: 64 rows of GLM-5's 154,880 logits take 81 ms to filter by top-p and 27
ms to draw from on one thread, 44 and 18 ms on two (`sparsekv bench sampling --rows 64`, BENCHMARKS.md).

Why: a decode step is a chain of small ops (norms, RoPE, routing, selection on a few rows) plus
matrix-vector products that stream the weights once. Extra threads only shorten the streaming
part, and every parallel op pays a fork/join across the threads; on a shared CPU an op split onto a
busy core waits for that core. So threads pay only when a step streams enough bytes that splitting
the streaming outweighs those costs: the bundled model, tiny-bench and glm5-geometry decode fastest
with one thread on a shared two-core machine, and so does glm5.2-proportions (~1.2 GB of weights a
token) while the other core is busy; a decode at 1M tokens of context (its indexer scan streaming
~128 MB of keys) ran faster on two with that core free. BENCHMARKS.md (`sparsekv bench decode`) has
the figures.
"""
from __future__ import annotations

import os

from .cache.sizing import Parallelism, params_per_rank
from .config import EngineConfig, ModelConfig, auto_dtype

BYTES_PER_THREAD = 2 ** 30
ACCELERATOR_THREADS = 8  # host threads for the step's decisions when the model runs on an accelerator
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def decode_weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of weights one decode token reads: every weight but the embedding table (one row of it)
    and the routed experts the router does not pick (num_experts_per_tok of n_routed_experts)."""
    params = params_per_rank(cfg, Parallelism())
    unpicked = params.experts * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) if cfg.n_routed_experts else 0
    return int((params.total - unpicked - cfg.vocab_size * cfg.hidden_size) * DTYPE_BYTES[dtype])


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_num_threads(cfg: ModelConfig, dtype: str, device: str, cores: int | None = None) -> int:
    """The rule in the module docstring."""
    cores = available_cores() if cores is None else cores
    if not device.startswith("cpu"):
        return max(1, min(cores, ACCELERATOR_THREADS))
    return max(1, min(cores, decode_weight_bytes(cfg, dtype) // BYTES_PER_THREAD))


def resolve_num_threads(config: EngineConfig, cfg: ModelConfig, cores: int | None = None) -> int | None:
    """The threads an engine sets: `config.num_threads` when given (0: leave torch's default, None
    returned), else the rule's (whose CPU branch needs the dtype, which "auto" is there whatever the
    checkpoint names: `auto_dtype`)."""
    if config.num_threads is None:
        dtype = config.dtype if config.dtype != "auto" else auto_dtype(None, config.device.split(":")[0])
        return auto_num_threads(cfg, dtype, config.device, cores)
    return config.num_threads or None
