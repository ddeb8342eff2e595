"""Weights and generation control for RL trainers (docs/rl.md): `LLMEngine`'s weight updates (drain or
abort, checked whole first, never mixing weights within a request), pause/continue and flush_cache.

A part of `LLMEngine` kept in its own module so that engine.py stays the request API and the one-way
step; it works on the engine's scheduler, cache manager, executor and output processor, and on the
state the engine sets up (`weights_version`, `paused`, `_pending_update`, `_held`).
"""
from __future__ import annotations

import logging

from .parallel.launch import RankFailure
from .request import Request, RequestOutput, RequestStatus

logger = logging.getLogger("sparsekv.engine")


class WeightControl:
    def update_weights(self, named_tensors, policy: str = "drain") -> list[RequestOutput]:
        """Load (Hugging Face name, tensor) pairs (FP8 weights with their `weight_scale_inv`), checked
        whole first (weights.WeightUpdateError: nothing changed). `policy` "drain": requests already
        started finish under the old weights while the others wait, and the update loads after them
        (within the step that finishes the last; at once if none runs); "abort": started requests are
        aborted now, and their final outputs (finish_reason "abort") returned. No request ever mixes
        weights; no prefix-cache page of the old weights is served after (cache.manager.new_weights)."""
        from .weights import check_tensor_update, model_weight_shapes
        return self._update(check_tensor_update(model_weight_shapes(self.model), named_tensors), None, policy)

    def update_weights_from_group(self, group: str, ticket: int, named_tensors, policy: str = "drain"
                                  ) -> list[RequestOutput]:
        """`update_weights` with the tensors this process received over a trainer's group (weight_sync.py);
        every other rank of the engine loads the copy it received itself (`weight_groups`)."""
        from .weights import ReceivedUpdate, check_tensor_update, model_weight_shapes
        checked = check_tensor_update(model_weight_shapes(self.model), named_tensors)
        return self._update(ReceivedUpdate(checked.tensors, group, ticket), None, policy)

    def weight_groups(self, op: str, *args) -> list:
        """Every other rank's answer to `weight_sync.WORKER_GROUPS.call(op, args)` (none for one process)."""
        return self.executor.weight_groups(op, args)

    def update_weights_from_disk(self, path: str, policy: str = "drain") -> list[RequestOutput]:
        """`update_weights` from a checkpoint directory of the same architecture (every tensor)."""
        from .weights import check_disk_update, model_weight_shapes
        update = check_disk_update(path, self.model_config, self.config.hf_overrides, model_weight_shapes(self.model))
        return self._update(update, path, policy)

    def _update(self, update, checkpoint: str | None, policy: str) -> list[RequestOutput]:
        from .weights import WEIGHT_UPDATE_POLICIES, TensorUpdate, WeightLoadError, WeightUpdateConflict
        if policy not in WEIGHT_UPDATE_POLICIES:
            raise ValueError(f"weight update policy must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}")
        if self._pending_update is not None:
            raise WeightUpdateConflict("another weight update is waiting for the running requests to finish")
        self.executor.check_weight_update(update)
        started = self.started_requests()
        if started and policy == "drain" and self.paused:
            raise WeightUpdateConflict(f"generation is paused with {len(started)} started request(s), which must "
                                       f"finish under the old weights (drain): continue generation first, or abort them")
        aborted = self.abort_started_requests() if policy == "abort" else []
        self.weight_updates.accept()
        self._pending_update, self.weight_update_error = (update, checkpoint), None
        self.hold_unstarted_requests()
        self._apply_pending_update()
        if self._pending_update is not None and isinstance(update, TensorUpdate):  # a drain: it loads later
            self._pending_update = (update.kept_for_later(), checkpoint)
        if self.weight_update_error is not None:  # the requests it aborted still get their final outputs
            raise WeightLoadError(f"the weight update failed to load; the previous weights keep serving: "
                                  f"{self.weight_update_error!r}", aborted) from self.weight_update_error
        return aborted

    def started_requests(self) -> list[Request]:
        """Running, or preempted after running: some of their KV or tokens come from the current weights."""
        return [r for r in [*self.scheduler.running, *self.scheduler.waiting] if r.first_scheduled_time is not None]

    def abort_started_requests(self) -> list[RequestOutput]:
        """Abort every started request; their final outputs (finish_reason "abort")."""
        return [self._abort_started(r) for r in self.started_requests()]

    def _abort_started(self, req: Request) -> RequestOutput:
        req.finish_reason = "abort"
        out = self.outputs.final_output(req)
        self.scheduler.finish(req, RequestStatus.ABORTED, "abort")
        self._release_idle_buffers()
        return out

    def hold_unstarted_requests(self) -> None:
        """Move the requests never scheduled out of the scheduler's queue until `release_held_requests`,
        so that the scheduler admits none of them under the old weights (a preempted one stays: it has
        started). A data-parallel lane is told to before each step of a drain."""
        fresh = [r for r in self.scheduler.waiting if r.first_scheduled_time is None]
        for req in fresh:
            self.scheduler.waiting.remove(req)
        self._held.extend(fresh)

    def release_held_requests(self) -> None:
        self.scheduler.waiting.extend(self._held)
        self._held.clear()

    def _apply_pending_update(self) -> None:
        """Load the waiting update once no started request is left; then the held requests queue again."""
        if self._pending_update is None or self.started_requests():
            return
        from .weights import WeightRestoreError
        update, checkpoint = self._pending_update
        try:
            self.executor.update_weights(update)
        except Exception as e:  # the old weights still serve, unless the ranks failed (below)
            self.weight_updates.settle(None, e)
            if isinstance(e, RankFailure):  # some ranks may have loaded it: their weights differ, none serves again
                logger.error("weight update failed across the ranks; the engine serves no more: %s", e)
                if isinstance(e, WeightRestoreError):  # this engine's own model holds two versions
                    self.weights_lost = e
                raise
            logger.error("weight update failed; the previous weights keep serving: %r", e)
            self.weight_update_error = e
        else:
            self.weights_version += 1
            self.kv.new_weights(checkpoint)
            self.weight_updates.settle(self.weights_version, None)
        finally:
            self._pending_update = None
            self.release_held_requests()

    @property
    def weight_update_pending(self) -> bool:
        return self._pending_update is not None

    def pause_generation(self) -> None:
        """Stop stepping: running and waiting requests keep their KV pages and state (SGLang's
        pause_generation); requests may still be added. `step` returns nothing until continue.
        WeightUpdateConflict while a drain update waits for started requests: paused, they would never finish."""
        from .weights import WeightUpdateConflict
        if self._pending_update is not None and self.started_requests():
            raise WeightUpdateConflict("a drain weight update waits for the started requests to finish; pausing "
                                       "would hold it: pause once it has loaded")
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    def flush_cache(self) -> int:
        """Forget every tenant's prefix-cache pages in every tier (SGLang's flush_cache); pages running
        requests hold stay. Returns how many were forgotten."""
        return self.kv.reset(None)
