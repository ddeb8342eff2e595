"""`--sweep`: concurrency against context length, with and without tiering, and the `--plot` PNG.

Each cell says what limits that (context, concurrency) point: it does not fit (device or host
capacity), or which resource binds the decode step. Reading a row left to right shows where
tiering moves the capacity limit and where the host link starts to dominate.
"""
from __future__ import annotations

import dataclasses

from sparsekv.config import ModelConfig
from sparsekv.tools.plan_capacity import capacity, capacity_limit
from sparsekv.tools.plan_decode import EngineProfile, estimate_step
from sparsekv.tools.plan_workload import Deployment, Workload, format_tokens

SWEEP_CONTEXTS = (8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
SWEEP_CONCURRENCY = tuple(2 ** i for i in range(11))  # 1 .. 1024 per capacity unit
CODES = {"HBM capacity": "H", "host capacity": "D", "compute": "C", "HBM bandwidth": "M",
         "link bandwidth": "L", "dispatch overhead": "O"}
LEGEND = ("H: does not fit in device memory   D: does not fit in host DRAM   "
          "M: HBM-bandwidth bound   C: compute bound   L: host-link bound   O: dispatch overhead")


def sweep_point(cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile) -> dict:
    """Fit check and decode roofline of one (context, concurrency, tiering) point."""
    cap = capacity(cfg, dep, wl)
    policy = "tiering" if wl.tiering else "no_tiering"
    step = estimate_step(cfg, dep, wl, profile)
    over = capacity_limit(cap, dep, wl)
    limit, fits = over or step.binding, over is None
    device_limit = dep.per_unit(cap.per_gpu[policy])
    return {"context": wl.contexts[0][0], "concurrency": wl.concurrency, "tiering": wl.tiering,
            "fits": fits, "limit": limit, "step_ms": step.step_s * 1e3,
            "tok_s_aggregate": wl.concurrency / step.step_s,
            "link_share": step.times["link"] / step.step_s, "max_per_node": cap.per_unit[policy],
            "max_limited_by": "host" if cap.per_unit[policy] < device_limit else "device",
            "unit": dep.capacity_unit} | ({"host_limit": cap.host_limit} if wl.tiering else {})


def link_bound_miss_rate(cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile) -> float | None:
    """Miss rate above which host-link time exceeds every other resource's, for this workload.

    Link time is linear in the miss rate and nothing else depends on it, so two evaluations
    give the crossing. None when the link never binds (not even with every selection missing).
    """
    at = lambda m: estimate_step(cfg, dep, dataclasses.replace(wl, tiering=True, miss_rate=m), profile).times
    zero, one = at(0.0), at(1.0)
    rest = max(v for k, v in zero.items() if k != "link")
    slope = one["link"] - zero["link"]
    if slope <= 0 or zero["link"] + slope < rest:
        return None
    return max((rest - zero["link"]) / slope, 0.0)


def run_sweep(cfg: ModelConfig, dep: Deployment, wl: Workload, profile: EngineProfile,
              contexts=SWEEP_CONTEXTS, concurrencies=SWEEP_CONCURRENCY) -> list[dict]:
    points = []
    policies = (False,) if wl.attention_mode == "dense" else (False, True)  # dense: nothing to tier
    for T in contexts:
        for tiering in policies:
            for n in concurrencies:
                point_wl = dataclasses.replace(wl, contexts=((T, 1.0),), concurrency=n, tiering=tiering)
                points.append(sweep_point(cfg, dep, point_wl, profile))
            if tiering:
                _add_link_crossing(points, cfg, dep, dataclasses.replace(wl, contexts=((T, 1.0),)), profile)
    return points


def _add_link_crossing(points: list[dict], cfg, dep, wl: Workload, profile) -> None:
    """Annotate a context's tiering row with the link-bound miss rate at its largest fitting load."""
    row = [p for p in points if p["context"] == wl.contexts[0][0] and p["tiering"]]
    fitting = [p["concurrency"] for p in row if p["fits"]]
    crossing = (link_bound_miss_rate(cfg, dep, dataclasses.replace(wl, concurrency=max(fitting)), profile)
                if fitting else None)
    for p in row:
        p["link_bound_above_miss_rate"] = crossing


def sweep_table(points: list[dict], tiering: bool, title: str):
    from rich.table import Table
    concurrencies = sorted({p["concurrency"] for p in points})
    table = Table(title=title)
    table.add_column("context")
    table.add_column(f"max/{points[0]['unit']}", justify="right")
    for n in concurrencies:
        table.add_column(str(n), justify="center")
    if tiering:
        table.add_column("link-bound above\nmiss rate", justify="right")
    for T in sorted({p["context"] for p in points}):
        row = sorted((p for p in points if p["context"] == T and p["tiering"] == tiering),
                     key=lambda p: p["concurrency"])
        limit = row[0]["max_per_node"]
        cells = [f"{limit} (host)" if row[0]["max_limited_by"] == "host" else str(limit)]
        cells += [_cell(p) for p in row]
        if tiering:
            crossing = row[0].get("link_bound_above_miss_rate")
            cells.append("never" if crossing is None else f"{crossing:.0%}")
        table.add_row(format_tokens(T), *cells)
    return table


def _cell(point: dict) -> str:
    code = CODES[point["limit"]]
    return f"[red]{code}[/red]" if not point["fits"] else code


def plot_sweep(points: list[dict], path: str, title: str) -> None:
    """Left: max requests per capacity unit against context. Right: aggregate tok/s against concurrency
    with tiering (without, for dense attention), one line per context, drawn only where the point fits;
    x marks link-bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    contexts = sorted({p["context"] for p in points})
    tiered = any(p["tiering"] for p in points)  # none with dense attention (run_sweep)
    for tiering, style in ((False, "o--"), (True, "s-"))[:1 + tiered]:
        first = [next(p for p in points if p["context"] == T and p["tiering"] == tiering) for T in contexts]
        left.plot(contexts, [p["max_per_node"] or float("nan") for p in first], style,
                  label="tiering" if tiering else "no tiering (gap: none fit)")
    if tiered:
        left.plot(contexts, [p["host_limit"] for p in first], ":", color="gray", label="host DRAM limit")
    unit = points[0]["unit"]
    _axes(left, "context (tokens)", f"max concurrent requests per {unit}", contexts)
    for T in contexts:
        row = sorted((p for p in points if p["context"] == T and p["tiering"] == tiered and p["fits"]),
                     key=lambda p: p["concurrency"])
        if row:
            line, = right.plot([p["concurrency"] for p in row], [p["tok_s_aggregate"] for p in row],
                               "-", label=format_tokens(T))
            linked = [p for p in row if p["limit"] == "link bandwidth"]
            right.plot([p["concurrency"] for p in linked], [p["tok_s_aggregate"] for p in linked], "x",
                       color=line.get_color(), markersize=9)
    _axes(right, f"concurrent requests per {unit} (tiering {'on' if tiered else 'off'})",
          f"decode tokens/s per {unit} (x: link-bound)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _axes(ax, xlabel: str, ylabel: str, xticks=None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticks:
        ax.set_xticks(xticks, [format_tokens(t) for t in xticks])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
