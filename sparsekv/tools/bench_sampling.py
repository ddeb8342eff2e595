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

Then drawing one token per row from the softmax of the σ = 5 rows, each row with its own seeded
generator: `torch.multinomial` row by row (the code before, the baseline) against `draw_rows` (one
uniform per row, one batched search of the cumulative sums). Different algorithms, so the tokens
differ; both draw from the rows' distributions (tests/test_sampling.py checks `draw_rows`'s).
"""
from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from ..engine_args import at_least, output_path
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
            "draws": time_draws(args, g), "machine_gbps": _machine_bandwidth(args.threads)}


def multinomial_rows(probs, generators):
    """The baseline: one torch.multinomial per row."""
    import torch
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def time_draws(args, g) -> dict:
    import torch
    from sparsekv.sampling import draw_rows, make_generator
    probs = (torch.randn(args.rows, args.vocab, generator=g) * 5).softmax(-1)
    times = {"multinomial per row": [], "sparsekv": []}
    for repeat in range(args.repeats):
        generators = [make_generator(repeat * args.rows + i) for i in range(args.rows)]
        times["multinomial per row"].append(timed(multinomial_rows, probs, generators)[0])
        times["sparsekv"].append(timed(draw_rows, probs, generators)[0])
    return {k: statistics.median(v) for k, v in times.items()}


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
    draws = result["draws"]
    base, ours = draws["multinomial per row"], draws["sparsekv"]
    table = Table(title=f"one token drawn per row, {n} rows of {v:,} probabilities, a seeded generator each (medians)")
    for col in ("multinomial per row", "sparsekv (draw_rows)", "speed-up", "achieved bandwidth"):
        table.add_column(col)
    gbps = n * v * 4 / (ours / 1000) / 1e9
    table.add_row(f"{base:.1f} ms", f"{ours:.1f} ms", f"{base / ours:.2f}x",
                  f"{gbps:.2f} GB/s ({100 * gbps / result['machine_gbps']:.0f}%)")
    report_console().print(table)
    draws["speedup"] = base / ours
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv bench sampling", description=__doc__)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--spreads", type=float, nargs="+", default=[8.0, 5.0, 3.0])
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", type=output_path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser(), argv, ("rows", "vocab", "repeats"), run, report)
