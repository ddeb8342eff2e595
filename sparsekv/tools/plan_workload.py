"""What the planner is asked about: a deployment (hardware, parallelism, precisions) and a
workload (context lengths, concurrency, cache policy). Plain data plus input parsing."""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from sparsekv.tools.hardware import Hardware
from sparsekv.cache.sizing import ELEMENT_BYTES, Parallelism


class PlanError(ValueError):
    """Bad planner input; the message is shown to the user as one line."""


@dataclass(frozen=True)
class Deployment:
    """One model replica on `nodes` nodes of `hardware.gpus_per_node` GPUs: `tp x dp` ranks, one per GPU.

    `dp` (default: every GPU / tp) attention ranks each serve their own requests; MLA caches a single
    latent per token shared by all heads, so the tp ranks of one attention rank each hold its whole
    cache (replicated, not split). A TP group fits in a node or spans whole nodes; requests are
    counted per node, or per replica where a TP group spans nodes (`capacity_unit`). Routed experts
    are split over every rank with `ep`, else over tp
    like the other sharded weights (cache/sizing.py says which). `mem_fraction` of device memory is
    usable (the rest is activations, graphs and fragmentation, as SGLang's mem_fraction_static);
    `host_fraction` of host DRAM.
    """

    hardware: Hardware
    tp: int = 1
    dp: int | None = None
    ep: bool = True
    nodes: int = 1
    weight_format: str = "fp8"
    latent_format: str = "bf16"
    indexer_format: str = "bf16"
    mem_fraction: float = 0.9
    host_fraction: float = 0.9
    page_size: int = 64

    def __post_init__(self):
        if self.dp is None:  # resolved once, at construction
            object.__setattr__(self, "dp", max(self.gpus // max(self.tp, 1), 1))

    @property
    def gpus_per_node(self) -> int:
        return self.hardware.gpus_per_node

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(self.tp, self.dp, self.ep)

    @property
    def attention_ranks(self) -> int:
        """Ranks with their own requests and KV cache, over all nodes."""
        return self.dp

    @property
    def tp_spans_nodes(self) -> bool:
        """Whether one TP group (one attention rank) is spread over several nodes."""
        return self.tp > self.gpus_per_node

    @property
    def capacity_unit(self) -> str:
        """What `--concurrency` and the capacity figures count requests per: a node, or the whole
        replica where a TP group spans nodes (no node then holds a request of its own)."""
        return "replica" if self.tp_spans_nodes else "node"

    @property
    def nodes_per_unit(self) -> int:
        return self.nodes if self.tp_spans_nodes else 1

    def replica_requests(self, per_unit: int) -> int:
        """Requests the whole replica serves when every capacity unit serves `per_unit`."""
        return per_unit * self.nodes // self.nodes_per_unit

    def requests_per_rank(self, per_unit: int) -> int:
        """Requests each attention rank serves when every capacity unit serves `per_unit`."""
        return -(-self.replica_requests(per_unit) // self.dp)

    def per_unit(self, per_rank: int) -> int:
        """Requests per capacity unit when every attention rank serves `per_rank`."""
        return per_rank * self.dp * self.nodes_per_unit // self.nodes

    def requests_on_node(self, per_unit: int) -> int:
        """Requests whose cache a node's GPUs hold: the node's own, or where a TP group spans nodes,
        every request of the one attention rank the node's GPUs belong to."""
        return self.requests_per_rank(per_unit) if self.tp_spans_nodes else per_unit

    def per_unit_from_node(self, on_node: int) -> int:
        """Requests per capacity unit when a node can hold the cache of `on_node` requests."""
        return self.per_unit(on_node) if self.tp_spans_nodes else on_node

    @property
    def host_copies(self) -> int:
        """Copies of one request's host history a node holds: one per TP rank of its attention rank there."""
        return min(self.tp, self.gpus_per_node)

    @property
    def engine_runs_layout(self) -> bool:
        """sparsekv's engine runs data-parallel attention only with TP 1 (docs/parallel.md)."""
        return self.dp == 1 or self.tp == 1

    @property
    def expert_shards(self) -> int:
        """Ranks the routed experts are split over."""
        return self.tp * self.dp if self.ep else self.tp

    @property
    def activation_format(self) -> str:
        """What the hidden states travel in: the engine dtype (bf16 on a GPU, fp32 when weights are)."""
        return "fp32" if self.weight_format == "fp32" else "bf16"

    def validate(self) -> None:
        for name in ("weight_format", "latent_format", "indexer_format"):
            if getattr(self, name) not in ELEMENT_BYTES:
                raise PlanError(f"{name.replace('_', '-')} {getattr(self, name)!r} is not one of fp8, bf16, fp32")
        if self.tp < 1 or self.dp < 1 or self.nodes < 1 or self.gpus_per_node < 1:
            raise PlanError("--tp, --dp, --nodes and --gpus-per-node must be >= 1")
        if not 0 < self.mem_fraction <= 1:
            raise PlanError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if not (math.isfinite(self.hardware.host_dram_bytes) and self.hardware.host_dram_bytes >= 0):
            raise PlanError("--host-dram-gb must be a finite number >= 0")
        if self.gpus % self.tp:
            raise PlanError(f"--tp {self.tp} must divide the {self.gpus} GPUs (--nodes {self.nodes} x "
                            f"--gpus-per-node {self.gpus_per_node})")
        if self.gpus_per_node % self.tp and self.tp % self.gpus_per_node:
            raise PlanError(f"--tp {self.tp} must divide --gpus-per-node {self.gpus_per_node} or be a multiple of "
                            "it: a TP group fits in one node or spans whole nodes")
        if self.tp * self.dp != self.gpus:
            raise PlanError(f"--tp {self.tp} x --dp {self.dp} = {self.tp * self.dp} ranks, but --nodes {self.nodes} "
                            f"x --gpus-per-node {self.gpus_per_node} = {self.gpus} GPUs (one rank per GPU)")


@dataclass(frozen=True)
class Workload:
    """Concurrent decoding requests per capacity unit (a node, or the replica where a TP group spans
    nodes), their context lengths, and the cache policy.

    `contexts` is a distribution [(tokens, probability)]: per-request costs are linear in the
    context, so the planner works with their expectation. With `tiering`, each request keeps a
    device hot buffer of `device_buffer_tokens` (+ one page) latent slots per layer and its full
    latent history in host DRAM; indexer keys stay on the device (SGLang HiSparse v1).
    """

    contexts: tuple[tuple[int, float], ...]
    concurrency: int = 1
    topk: int | None = None
    tiering: bool = False
    device_buffer_tokens: int | None = None
    miss_rate: float = 0.1
    attention_mode: str = "sparse"

    @property
    def mean_context(self) -> float:
        return sum(t * p for t, p in self.contexts)

    def validate(self) -> None:
        if self.concurrency < 1:
            raise PlanError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not 0.0 <= self.miss_rate <= 1.0:
            raise PlanError(f"--miss-rate must be in [0, 1], got {self.miss_rate}")
        if self.topk is not None and self.topk < 1:
            raise PlanError(f"--topk must be >= 1, got {self.topk}")
        if self.attention_mode not in ("sparse", "dense"):
            raise PlanError(f"attention mode {self.attention_mode!r}: use sparse or dense")
        if self.tiering and self.attention_mode == "dense":
            raise PlanError("--tiering needs --attention sparse: dense attention reads every key each step, "
                            "which a bounded device buffer cannot hold (the engine refuses it too)")


_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def parse_tokens(text: str) -> int:
    """'131072', '128K', '1M', '1.5M' -> tokens (K = 1024, as context lengths are quoted)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise PlanError(f"cannot read {text!r} as a token count (examples: 131072, 128K, 1M)")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value < 1:
        raise PlanError(f"context {text!r} must be at least 1 token")
    if value != int(value):  # 1.9 or 1.1K: a count the plan would silently round down
        raise PlanError(f"context {text!r} is not a whole number of tokens")
    return int(value)


def parse_token_list(text: str) -> list[int]:
    """'8K,32K,1M' -> [8192, 32768, 1048576]."""
    return [parse_tokens(part) for part in text.split(",")]


def token_list_arg(text: str) -> list[int]:
    """`parse_token_list` as an argparse type: a bad list is a usage error naming the flag."""
    try:
        return parse_token_list(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _context_weight(weight: str, text: str) -> float:
    try:
        w = float(weight) if weight else 1.0
    except ValueError:
        raise PlanError(f"cannot read weight {weight!r} in --context {text!r}") from None
    if not (math.isfinite(w) and w > 0):
        raise PlanError(f"weights in --context must be finite numbers > 0, got {weight!r}")
    return w


def parse_contexts(text: str) -> tuple[tuple[int, float], ...]:
    """'128K' or a distribution '64K:0.5,1M:0.5' (weights are normalised to sum to 1)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise PlanError("--context is empty")
    pairs = []
    for part in parts:
        tokens, _, weight = part.partition(":")
        pairs.append((parse_tokens(tokens), _context_weight(weight, text)))
    total = sum(w for _, w in pairs)
    if not math.isfinite(total):
        raise PlanError(f"weights in --context {text!r} are too large to add up")
    return tuple((t, w / total) for t, w in pairs)


def format_tokens(tokens: float) -> str:
    for unit, size in (("M", 1024 ** 2), ("K", 1024)):
        if tokens >= size and tokens % size == 0:
            return f"{int(tokens // size)}{unit}"
    return f"{tokens:,.0f}"
