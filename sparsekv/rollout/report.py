"""What `sparsekv rollout` and `sparsekv rl eval-filter` show: the progress display, the per-task summary
(table and PNG), and the filter's recall and precision."""
from __future__ import annotations

import json
from collections import defaultdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RolloutProgress:
    """Episodes done, mean reward and interceptions so far, on standard error."""

    def __init__(self, total: int):
        self.rewards: list[float] = []
        self.interceptions = 0
        self.progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("reward {task.fields[reward]:.2f}  interceptions {task.fields[hacks]}"),
                                 TimeElapsedColumn(), console=Console(stderr=True))
        self.bar = self.progress.add_task("episodes", total=total, reward=0.0, hacks=0)

    def __enter__(self) -> RolloutProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def done(self, traj: dict) -> None:
        self.rewards.append(float(traj.get("reward", 0.0)))
        self.interceptions += len(traj.get("interceptions", []))
        self.progress.update(self.bar, advance=1, reward=sum(self.rewards) / len(self.rewards),
                             hacks=self.interceptions)


def task_rows(trajectories: list[dict]) -> list[dict]:
    """Per task: episodes, mean reward, interception rate (share of episodes with one or more), interceptions
    and compactions per episode, failed episodes."""
    by_task = defaultdict(list)
    for t in trajectories:
        by_task[t["task"]].append(t)
    rows = []
    for name, ts in sorted(by_task.items()):
        n = len(ts)
        rows.append({"task": name, "episodes": n,
                     "reward": sum(t.get("reward", 0.0) for t in ts) / n,
                     "interception_rate": sum(bool(t.get("interceptions")) for t in ts) / n,
                     "interceptions_per_episode": sum(len(t.get("interceptions", [])) for t in ts) / n,
                     "compactions_per_episode": sum(len(t.get("compactions", [])) for t in ts) / n,
                     "failed": sum(t.get("finish") == "error" for t in ts)})
    return rows


def _json_lines(path: str):
    """(line number, JSON value) of each non-blank line; a bad line is a ValueError naming the file and the line."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            yield n, value


def read_json_lines(path: str) -> list:
    """The JSON values of a JSON-lines file; a bad line is a ValueError naming the file and the line."""
    return [value for _, value in _json_lines(path)]


def read_trajectories(path: str) -> list[dict]:
    """The trajectories of a `sparsekv rollout` output; a line that is not one (an object naming its task) is a
    ValueError naming the file and the line."""
    out = []
    for n, value in _json_lines(path):
        if not isinstance(value, dict) or not isinstance(value.get("task"), str):
            raise ValueError(f"{path}:{n}: not a trajectory (each line is an object with a \"task\" name)")
        out.append(value)
    return out


def summarize(path: str, plot: str) -> int:
    rows = task_rows(read_trajectories(path))
    table = Table(title=f"rollouts: {path}")
    # intercepted: the share of episodes with an interception; per ep: per episode
    for col in ("task", "episodes", "reward", "intercepted", "interceptions/ep", "compactions/ep", "failed"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for r in rows:
        table.add_row(r["task"], str(r["episodes"]), f"{r['reward']:.2f}", f"{r['interception_rate']:.2f}",
                      f"{r['interceptions_per_episode']:.2f}", f"{r['compactions_per_episode']:.2f}",
                      str(r["failed"]))
    Console(width=max(Console().width, 100)).print(table)  # a pipe's 80 columns would cut the headers
    _plot(rows, plot)
    print(f"wrote {plot}")
    return 0


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["task"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(rows) + 3), 3.5))
    for ax, key, title in ((axes[0], "reward", "mean reward"), (axes[1], "interception_rate", "interception rate")):
        ax.bar(names, [r[key] for r in rows], color="tab:blue" if key == "reward" else "tab:red")
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- the filter's figures

def _counts(labels: list[bool], predicted: list[bool]) -> dict:
    tp = sum(l and p for l, p in zip(labels, predicted))
    fp = sum(p and not l for l, p in zip(labels, predicted))
    fn = sum(l and not p for l, p in zip(labels, predicted))
    return {"tp": tp, "fp": fp, "fn": fn, "tn": len(labels) - tp - fp - fn,
            "recall": tp / (tp + fn) if tp + fn else None, "precision": tp / (tp + fp) if tp + fp else None}


def filter_figures(rows: list[dict], screened: list[dict], judged: bool) -> dict:
    """Recall and precision of the rules alone, and of rules + judge when a judge answered; recall per kind
    of hack (rules alone)."""
    labels = [r["hack"] for r in rows]
    out = {"actions": len(rows), "hacks": sum(labels), "rules": _counts(labels, [s["flagged"] for s in screened])}
    if judged:
        out["rules+judge"] = _counts(labels, [s["flagged"] and s["verdict"]["hack"] for s in screened])
        out["judge_errors"] = sum(bool(s["verdict"] and s["verdict"].get("error")) for s in screened)
    kinds = defaultdict(lambda: [0, 0])
    for r, s in zip(rows, screened):
        if r["hack"]:
            kinds[r.get("kind", "?")][0] += 1
            kinds[r.get("kind", "?")][1] += s["flagged"]
    out["recall_by_kind"] = {k: f"{c}/{n}" for k, (n, c) in sorted(kinds.items())}
    return out


def print_figures(figures: dict) -> None:
    table = Table(title=f"{figures['actions']} actions, {figures['hacks']} hacks")
    for col in ("stage", "recall", "precision", "tp", "fp", "fn", "tn"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in ("rules", "rules+judge"):
        if stage in figures:
            c = figures[stage]
            fmt = lambda v: "-" if v is None else f"{v:.3f}"
            table.add_row(stage, fmt(c["recall"]), fmt(c["precision"]), *(str(c[k]) for k in ("tp", "fp", "fn", "tn")))
    console = Console()
    console.print(table)
    if "rules+judge" not in figures:
        console.print("rules + judge: not measured (give --judge-url)")
    console.print("recall by kind (rules): " + ", ".join(f"{k} {v}" for k, v in figures["recall_by_kind"].items()))
