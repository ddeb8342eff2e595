"""`sparsekv bench sampling`: top-p (nucleus) filtering of a batch of logit rows at a real vocabulary.

`--rows` rows of `--vocab` logits (GLM-5's 154,880 by default), drawn as N(0, σ²) for each σ of
`--spreads`: a larger σ is a more peaked distribution, a smaller nucleus. Timed, interleaved, medians
of `--repeats`: sparsekv's `outside_nucleus` (a partial sort of the 1024 most probable tokens, the
whole row only where the nucleus is wider) against the whole-row sort of every row (the code before
it, the baseline). Printed per σ: the median nucleus size, both times, the speed-up, achieved
bandwidth (the logits read once, over the time) against the machine's, and the rows whose kept sets
agree. The others differ by a token or two at the cut: a float32 softmax over 155K logits sums to
1 ± 1e-5, and the two normalise in different orders (sorted, unsorted), which moves the cut by as much
as a tail token's probability.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from .bench import _machine_bandwidth, report_console, run_bench


def whole_row_sort(logits, top_p):
    """The baseline: every row sorted whole, cut by position."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    return drop_sorted.scatter(1, order, drop_sorted)


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return 1000 * (time.perf_counter() - t0), out


def run(args) -> dict:
    import torch
    from sparsekv.sampling import outside_nucleus
    if not 0.0 < args.top_p < 1.0:
        raise ValueError(f"--top-p must be in (0, 1), got {args.top_p}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    top_p = torch.full((args.rows, 1), args.top_p)
    rows = []
    for spread in args.spreads:
        logits = torch.randn(args.rows, args.vocab, generator=g) * spread
        times = {"whole-row sort": [], "sparsekv": []}
        for _ in range(args.repeats):
            ms, base = timed(whole_row_sort, logits, top_p)
            times["whole-row sort"].append(ms)
            ms, ours = timed(outside_nucleus, logits, top_p)
            times["sparsekv"].append(ms)
        rows.append({"spread": spread, "nucleus": statistics.median((~ours).sum(-1).tolist()),
                     "ms": {k: statistics.median(v) for k, v in times.items()},
                     "agree": int((ours == base).all(-1).sum()),
                     "most_apart": int(((~ours).sum(-1) - (~base).sum(-1)).abs().max())})
    return {"rows": args.rows, "vocab": args.vocab, "top_p": args.top_p, "results": rows,
            "machine_gbps": _machine_bandwidth(args.threads)}


def report(result: dict) -> dict:
    n, v = result["rows"], result["vocab"]
    table = Table(title=f"top-p {result['top_p']} over {n} rows of {v:,} logits (medians)")
    for col in ("σ", "nucleus (median tokens)", "whole-row sort", "sparsekv", "speed-up", "achieved bandwidth",
                "rows agreeing"):
        table.add_column(col)
    for r in result["results"]:
        base, ours = r["ms"]["whole-row sort"], r["ms"]["sparsekv"]
        r["speedup"] = base / ours
        gbps = n * v * 4 / (ours / 1000) / 1e9
        table.add_row(f"{r['spread']:g}", f"{r['nucleus']:,.0f}", f"{base:.1f} ms", f"{ours:.1f} ms",
                      f"{r['speedup']:.2f}x", f"{gbps:.2f} GB/s ({100 * gbps / result['machine_gbps']:.0f}%)",
                      f"{r['agree']} of {n} (others ±{r['most_apart']} tokens)")
    report_console().print(table)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparsekv bench sampling", description=__doc__)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--spreads", type=float, nargs="+", default=[8.0, 5.0, 3.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return run_bench(p, argv, ("rows", "vocab", "repeats"), run, report)
