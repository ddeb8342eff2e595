"""The training loop: stages in order, a progress bar, a time budget, resumable checkpoints.

Resuming is exact: batches depend only on (seed, stage, step) and the checkpoint holds the model,
the optimizer, the step counters and the elapsed time (which the budget counts across restarts).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from ..error_text import first_line
from .stages import STAGES, heldout_metrics, probe_metrics, set_trainable, stage_loss


class UnusableState(ValueError):
    """The work directory's state file cannot resume this run."""


STATE_FILE = "train_state.pt"
TIME_SHARE = {"pretrain": 0.5, "warmup": 0.1, "sparse": 0.3, "mtp": 0.1, "far": 0.0}   # far: outside the budget


@dataclass
class TrainOptions:
    steps: dict[str, int]
    lr: float = 3e-3
    index_lr: float = 1e-3
    mtp_lr: float = 2e-3
    weight_decay: float = 0.1
    time_budget_s: float | None = None
    checkpoint_every: int = 50
    bias_update_rate: float = 1e-3
    warmup_steps: int = 20
    log_every: int = 10
    stop_after_steps: int | None = None   # pause: save and return after this many steps in this run
    copy_warmup_steps: int = 0            # first pretrain steps: short copy rows (the budget counts their time;
                                          # the per-step estimate of the stage uses only the normal steps)
    copy_warmup_lr: float = 1e-3          # constant (after `warmup_steps`) during the copy warm-up; the main
                                          # cosine schedule starts after it
    copy_warmup_freeze_mlp: bool = False  # MLPs and experts do not train during the copy warm-up
    far_lr: float = 2e-3                  # peak learning rate of the `far` stage (its layers' indexers)
    far_layers: tuple[int, ...] = (0,)    # full layers whose indexers the `far` stage trains
    far_smoothing: float = 0.3            # its target's share of the uniform distribution over the row


@dataclass
class TrainState:
    stage: int = 0
    step: int = 0
    planned: dict[str, int] = field(default_factory=dict)
    elapsed: dict[str, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    heldout: dict[str, dict] = field(default_factory=dict)
    done: bool = False


def cosine(progress: float, warm: float) -> float:
    """Linear warm-up over `warm` (fraction), then cosine from 1 down to 0.1."""
    if progress < warm:
        return (progress + 1e-3) / warm
    t = min((progress - warm) / max(1 - warm, 1e-9), 1.0)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


class Trainer:
    def __init__(self, model, source, heldout_rows: torch.Tensor, opts: TrainOptions, work_dir: str, probe=None):
        self.model, self.source, self.heldout_rows, self.opts, self.work_dir = model, source, heldout_rows, opts, work_dir
        self.probe = probe   # (ids, answer mask) of fixed retrieval prompts, or None
        self.state = TrainState(planned=dict(opts.steps))
        self.optimizer = None
        self.steps_this_run = 0

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> None:
        path = os.path.join(self.work_dir, STATE_FILE)
        blob = {"model": self.model.state_dict(), "state": self.state.__dict__,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None}
        torch.save(blob, path + ".tmp")
        os.replace(path + ".tmp", path)

    def try_resume(self) -> bool:
        path = os.path.join(self.work_dir, STATE_FILE)
        if not os.path.exists(path):
            return False
        try:
            blob = torch.load(path, weights_only=False, map_location=next(self.model.parameters()).device)
            self.model.load_state_dict(blob["model"])
            state = TrainState(**blob["state"])
        except Exception as e:  # truncated, another model's (other flags), or not a state at all
            raise UnusableState(f"{path} does not resume this run ({first_line(e)}); pass --fresh to start over, "
                                f"or another --work-dir") from None
        self.state = state
        for stage, n in self.opts.steps.items():   # a state saved before a stage existed (the far stage)
            self.state.planned.setdefault(stage, n)
        self._pending_optimizer = blob["optimizer"]
        return True

    # -- schedules -----------------------------------------------------------------------------
    def _lr(self, stage: str, step: int) -> dict[str, float]:
        st, o = self.state.planned, self.opts
        local = cosine(step / max(st[stage], 1), min(o.warmup_steps / max(st[stage], 1), 0.3))
        rates = {"index": (o.far_lr if stage == "far" else o.index_lr) * local, "mtp": o.mtp_lr * local}
        if stage == "pretrain" and step < o.copy_warmup_steps:
            copy = o.copy_warmup_lr * min(1.0, (step + 1) / o.warmup_steps)
            return {**rates, "main": copy, "mlp": 0.0 if o.copy_warmup_freeze_mlp else copy}
        pretrain = st["pretrain"] - o.copy_warmup_steps
        main_total = pretrain + st["sparse"]
        main_done = step - o.copy_warmup_steps if stage == "pretrain" else step + pretrain
        main = o.lr * cosine(main_done / max(main_total, 1), o.warmup_steps / max(main_total, 1))
        return {**rates, "main": main, "mlp": main}

    def _make_optimizer(self, stage: str) -> torch.optim.Optimizer:
        params = set_trainable(self.model, stage, self.opts.far_layers)
        ids = {id(p) for p in params}
        groups: dict[str, list] = {"main": [], "mlp": [], "index": [], "mtp": []}
        for name, p in self.model.named_parameters():
            if id(p) not in ids:
                continue
            kind = "mtp" if stage == "mtp" else ("index" if ".indexer." in name else "main")
            if kind == "main" and self.opts.copy_warmup_freeze_mlp and ".mlp." in name:
                kind = "mlp"
            groups[kind].append(p)
        param_groups = [{"params": ps, "name": k, "weight_decay": self.opts.weight_decay}
                        for k, ps in groups.items() if ps]
        return torch.optim.AdamW(param_groups, betas=(0.9, 0.95))

    # -- the loop ------------------------------------------------------------------------------
    def _budget_left(self, stage: str) -> float:
        if self.opts.time_budget_s is None:
            return float("inf")
        spent_before = sum(self.state.elapsed.get(s, 0.0) for s in STAGES[:STAGES.index(stage)])
        share_until = sum(TIME_SHARE[s] for s in STAGES[:STAGES.index(stage) + 1])
        return self.opts.time_budget_s * share_until - spent_before - self.state.elapsed.get(stage, 0.0)

    def _replan(self, stage: str, step: int, seconds_per_step: float) -> None:
        """Fit the stage's step count to the time left (never above the requested count)."""
        if self.opts.time_budget_s is None or not TIME_SHARE[stage]:
            return
        fits = step + int(self._budget_left(stage) / max(seconds_per_step, 1e-6))
        self.state.planned[stage] = min(max(fits, step + 1), self.opts.steps[stage])

    def run_stage(self, stage: str, log) -> bool:
        """Runs the stage to its end (True) or until the pause point (False)."""
        from tqdm import tqdm
        st = self.state
        self.optimizer = self._make_optimizer(stage)
        pending = getattr(self, "_pending_optimizer", None)
        if pending is not None:
            self.optimizer.load_state_dict(pending)
            self._pending_optimizer = None
        bar = tqdm(total=st.planned[stage], initial=st.step, desc=f"{STAGES.index(stage) + 1}/{len(STAGES)} {stage}",
                   file=sys.stderr, mininterval=1.0 if sys.stderr.isatty() else 20.0, dynamic_ncols=True)
        self.model.train()
        t_stage, steps_here = time.perf_counter(), 0
        while st.step < st.planned[stage]:
            t0 = time.perf_counter()
            metrics = self.train_step(stage)
            st.step += 1
            steps_here += 1
            dt = time.perf_counter() - t0
            st.elapsed[stage] = st.elapsed.get(stage, 0.0) + dt
            if stage == "pretrain" and st.step <= self.opts.copy_warmup_steps:
                # copy warm-up steps are shorter rows: time the stage's normal steps only
                t_stage, steps_here = time.perf_counter(), 0
            elif steps_here == 5 or steps_here % 25 == 0:
                self._replan(stage, st.step, (time.perf_counter() - t_stage) / steps_here)
                bar.total = st.planned[stage]
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items()}, refresh=False)
            bar.update(1)
            self.steps_this_run += 1
            if st.step % self.opts.log_every == 0:
                st.history.append({"stage": stage, "step": st.step, **metrics})
                log(f"{stage} step {st.step}/{st.planned[stage]} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if st.step % self.opts.checkpoint_every == 0:
                self.save()
            if self.opts.stop_after_steps is not None and self.steps_this_run >= self.opts.stop_after_steps:
                self.save()
                bar.close()
                return False
        bar.close()
        return True

    def train_step(self, stage: str) -> dict:
        st = self.state
        lrs = self._lr(stage, st.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lrs[g["name"]]
        batch = self.source.batch(STAGES.index(stage), st.step).to(next(self.model.parameters()).device)
        loss, metrics = stage_loss(self.model, stage, batch, st.step / max(st.planned[stage], 1),
                                   far_smoothing=self.opts.far_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.optimizer.step()
        self._balance(stage)
        return metrics

    def _balance(self, stage: str) -> None:
        mtp = self.model.mtp
        mtp_moes = set(id(m) for m in mtp.modules()) if mtp is not None else set()
        for moe in self.model.moe_layers():
            trains = (id(moe) in mtp_moes) == (stage == "mtp") and stage not in ("warmup", "far")
            moe.balance(self.opts.bias_update_rate) if trains else moe.gate.load.zero_()

    def run(self, log=print) -> TrainState:
        st = self.state
        while st.stage < len(STAGES):
            stage = STAGES[st.stage]
            if not st.planned[stage]:   # a stage given 0 steps is skipped (no held-out figures either)
                st.stage, st.step = st.stage + 1, 0
                continue
            if not self.run_stage(stage, log):
                log(f"paused at stage {st.stage + 1} step {st.step}; state saved in {self.work_dir}")
                return st
            st.heldout[stage] = heldout_metrics(self.model, self.heldout_rows)
            if self.probe is not None:
                st.heldout[stage].update(probe_metrics(self.model, *self.probe))
            log(f"after {stage}: held-out " + " ".join(f"{k}={v:.4f}" for k, v in st.heldout[stage].items()))
            st.stage, st.step = st.stage + 1, 0
            self.optimizer = None
            self.save()
        st.done = True
        return st
