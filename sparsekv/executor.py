"""The executor boundary: a scheduled step (plain data) in, the step's logits out.

The engine hands each `SchedulerOutput` to an `Executor` and gets a `ModelOutput` back; nothing below
this line sees a request object or calls back into the scheduler. `InProcessExecutor` runs the model
in this process on one device; a multi-rank executor runs the same step on every rank of a
torch.distributed group and answers the same calls.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ConfigError
from .runner import ModelRunner
from .scheduler import SchedulerOutput
from .speculative import MTPDrafter, MTPPlan

log = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # fp32 on the model's device: 1 + drafts rows per chunk that samples, in chunk order
    hidden: torch.Tensor  # the final hidden state of every row of the step (on the device)
    routed_experts: torch.Tensor | None = None  # [logits rows, MoE layers, top-k] when captured (routing.py)


class Executor(ABC):
    """Runs steps of the model over the KV cache it was built with."""

    @abstractmethod
    def execute(self, step: SchedulerOutput) -> ModelOutput: ...

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (prompt logprobs)."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop a request's per-request state (page tables, selector state)."""

    @abstractmethod
    def release_idle_buffers(self) -> None:
        """With no request left: free scratch memory sized by the longest step so far."""

    @abstractmethod
    def check_integrity(self, running: set[str]) -> None: ...

    @abstractmethod
    def draft_extend(self, plan: MTPPlan) -> torch.Tensor:
        """The MTP layer's extend pass over the last step's final rows; fp32 logits of the drafting rows."""

    @abstractmethod
    def draft_step(self, step: int, tokens: list[int]) -> torch.Tensor:
        """Draft step `step` from the previous drafts; fp32 logits, one row per drafting request."""

    def close(self) -> None:
        """Let go of worker processes, if any."""

    def layer_taps(self, tensors: list):
        """cache/layer_tap.py's `LayerTaps` of the runner that holds the pages (a prefill worker's send)."""
        raise NotImplementedError(f"{type(self).__name__} hands out no rows layer by layer")

    @abstractmethod
    def rank_stats(self) -> list[dict]:
        """Per rank, in rank order: weight bytes, KV pool bytes (latents and indexer keys, every slot),
        peak resident memory, bytes sent by each collective."""

    def decode_graph_stats(self) -> dict:
        """Plain decode steps run as fixed-shape pieces (model/decode_graphs.py), and the buckets
        captured: none where they are not built."""
        return {}

    def update_weights(self, update) -> None:
        """Load a checked weight update (weights.py: TensorUpdate or DiskUpdate) on every rank, each its
        own slices; nothing changes if it fails."""
        raise NotImplementedError(f"{type(self).__name__} does not update weights")

    def check_weight_update(self, update) -> None:
        """WeightUpdateError if a checked update still cannot be applied whole (its source changed)."""

    def weight_groups(self, op: str, args: tuple) -> list:
        """Every other rank's answer to `weight_sync.WORKER_GROUPS.call(op, args)`: none for one process."""
        return []

    def capture_routed_experts(self, on: bool) -> None:
        """Whether the next steps' ModelOutput carries the sampling rows' routed experts."""
        raise NotImplementedError(f"{type(self).__name__} does not capture routed experts")

    def add_observer(self, observer: Callable[[SchedulerOutput, ModelOutput], None]) -> None:
        """Call `observer(step, output)` after every step (benchmarks and tools record through this)."""
        self.observers.append(observer)


class InProcessExecutor(Executor):
    """The model and its cache in this process, on one device."""

    def __init__(self, model, pool, config):
        from .routing import RoutedExpertsRecorder
        from .weights import WeightSource
        self.model, self.pool = model, pool
        self.weights = WeightSource(config.model, config.hf_overrides, model.dtype, _layout(config),
                                    model.loaded_stamp, keep_host_copy=config.weight_update_host_copy)
        self.routing, self.capture_routing = RoutedExpertsRecorder(model), False
        self.runner = ModelRunner(model, pool, config.kv_page_size, config.attention,
                                  decode_rows=1 + config.num_speculative_tokens,
                                  batch_dense_decodes=config.batch_dense_decodes)
        mode = config.decode_graph_mode()
        if mode != "off" and self._decode_pieces_read(pool, config):
            from .model.decode_graphs import DecodeGraphs
            self.runner.graphs = DecodeGraphs(self.runner, config.cuda_graph_max_bs, capture=mode == "capture")
        drafting = config.num_speculative_tokens and model.mtp is not None
        self.drafter = MTPDrafter(model, self.runner, pool, config.num_speculative_tokens) if drafting else None
        self.observers: list[Callable[[SchedulerOutput, ModelOutput], None]] = []
        self._hidden: torch.Tensor | None = None  # the last step's final hidden states (the MTP pass reads them)

    @staticmethod
    def _decode_pieces_read(pool, config) -> bool:
        """Whether the decode pieces can read `pool` (a tiered pool's working sets must hold whatever a
        decode with its drafts selects); `decode_graphs="eager"` asked for them: ConfigError if not."""
        unbuilt = pool.decode_pieces_unbuilt()
        if unbuilt is None:
            return True
        if config.decode_graphs == "eager":
            raise ConfigError(f"decode_graphs 'eager': the decode pieces are not built for {unbuilt}")
        log.warning("decode graphs off: the decode pieces are not built for %s", unbuilt)
        return False

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        self.pool.begin_step(step.chunks)
        self.routing.begin(self.capture_routing)
        logits, hidden = self.runner.execute(step.chunks, graphs=not self.capture_routing)
        self._hidden = hidden if self.drafter is not None else None
        out = ModelOutput(logits, hidden, self.routing.take(step.chunks))
        for observe in self.observers:
            observe(step, out)
        return out

    def draft_extend(self, plan: MTPPlan) -> torch.Tensor:
        logits = self.drafter.extend(self._hidden, plan)
        if self.runner.taps:  # a tail's MTP layer rows, written by this pass
            self.runner.taps.after_mtp()
        return logits

    def rank_stats(self) -> list[dict]:
        return [self.local_stats()]

    def decode_graph_stats(self) -> dict:
        return {} if self.runner.graphs is None else self.runner.graphs.stats()

    def local_stats(self) -> dict:
        """This process's figures (one rank's)."""
        import resource

        import torch.distributed as dist
        comm = self.model.comm
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "weight_bytes": self.model.weight_bytes,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "kv_pool_bytes": sum(t.numel() * t.element_size() for t, _ in self.pool.slot_tensors()),
                "bytes_sent": dict(getattr(comm, "bytes_sent", {}))}

    def draft_step(self, step: int, tokens: list[int]) -> torch.Tensor:
        return self.drafter.step(step, tokens)

    def disable_decode_graphs(self) -> None:
        """Decode steps take the engine's decode path from now on (a prefill worker's, whose layer taps
        observe every layer)."""
        self.runner.graphs = None

    def layer_taps(self, tensors: list):
        """The runner's layer taps (made at the first call), over `tensors`: a page's slot-indexed tensors
        in the order they are exported (the prefix cache's `PageRows.tensors`). The decode graphs go
        with them: a step's layers must reach the taps."""
        self.disable_decode_graphs()
        if self.runner.taps is None:
            from .cache.layer_tap import LayerTaps
            layers = {l: self.pool.layer_slot_tensors(l) for l in range(len(self.model.layers))}
            mtp = {len(self.model.layers): self.pool.layer_slot_tensors(len(self.model.layers))} if self.drafter else {}
            self.runner.taps = LayerTaps(tensors, layers, self.runner.page_size, self.runner.slots_of, self.pool.flush,
                                         frozenset(self.model.cfg.full_layers), mtp)
        return self.runner.taps

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def forget(self, request_id: str) -> None:
        self.runner.forget(request_id)

    def release_idle_buffers(self) -> None:
        # the indexer's prefill score buffer grows with the longest context prefilled
        self.model.index_scratch.release()

    def check_integrity(self, running: set[str]) -> None:
        for selector in self.model.selectors():
            selector.check_integrity(running)

    def update_weights(self, update) -> None:
        """Load a checked weight update (weights.py) into this rank's model, in place."""
        try:
            self.weights.apply(self.model, update)
        finally:
            if self.runner.graphs is not None:  # captured pieces would read tensors an update may replace
                self.runner.graphs.reset()

    def check_weight_update(self, update) -> None:
        """WeightUpdateError if the update cannot be applied whole (here, before any rank starts)."""
        self.weights.check(self.model, update)

    def capture_routed_experts(self, on: bool) -> None:
        """Whether the next steps return their sampling rows' routed experts (on rank 0 only)."""
        self.capture_routing = on


def _layout(config):
    """This process's rank layout (None: one rank holds the whole model)."""
    import torch.distributed as dist

    from .parallel.launch import layout_of
    if config.tensor_parallel_size * config.data_parallel_size == 1:
        return None
    return layout_of(config, dist.get_rank() if dist.is_initialized() else 0)
