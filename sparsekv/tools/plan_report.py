"""Rich tables for `sparsekv plan`: reads the dict `build_plan` returns, computes nothing new."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sparsekv.tools.plan_workload import format_tokens

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB" if x >= 1e7 else f"{x / 1e6:,.2f} MB"


def header(plan: dict) -> str:
    m, d, w, hw = plan["model"], plan["deployment"], plan["workload"], plan["hardware"]
    ctx = ", ".join(f"{format_tokens(t)} x{p:.2f}" if len(w["contexts"]) > 1 else format_tokens(t)
                    for t, p in w["contexts"])
    return (f"[bold]{m['name']}[/bold] ({m['model_type']}, {m['layers']} layers, {m['indexer_layers']} with an "
            f"indexer, {m['params_total'] / 1e9:.0f}B params, {m['params_active'] / 1e9:.1f}B active)\n"
            f"{_nodes(d)}{d['gpus_per_node']}x {hw['description']}; TP {d['tp']} x DP {d['dp']}, EP "
            f"{'on' if d['ep'] else 'off'}; weights {d['weights']}, latent {d['latent_cache']}, "
            f"indexer {d['indexer_cache']}\n"
            f"context {ctx}, {w['concurrency']} concurrent per {d['capacity_unit']}, top-k {w['topk']}, attention {w['attention']}, "
            f"tiering {_tiering(w)}")


def _tiering(w: dict) -> str:
    if not w["tiering"]:
        return "off"
    return f"on (buffer {w['device_buffer_tokens']}, miss rate {w['miss_rate']:.0%})"


def _tiers(plan: dict) -> bool:
    """Whether the tiered figures apply: tiering selects from the indexer's top-k, so dense attention
    (which `--tiering` refuses) has none to show."""
    return plan["workload"]["attention"] != "dense"


def _nodes(d: dict) -> str:
    return f"{d['nodes']} nodes x " if d["nodes"] > 1 else ""


def _unit(plan: dict) -> str:
    return plan["deployment"]["capacity_unit"]


def cache_table(plan: dict) -> Table:
    mem, w = plan["memory"], plan["workload"]
    t = Table(title="KV cache per token")
    for col in ("cache kind", "format", "B/token/layer", "layers", "B/token", "per request (mean ctx)"):
        t.add_column(col, justify="left" if col in ("cache kind", "format") else "right")
    for kind, fmt in (("latent (MLA)", plan["deployment"]["latent_cache"]),
                      ("indexer keys", plan["deployment"]["indexer_cache"])):
        key = "latent" if kind.startswith("latent") else "indexer"
        per_token = mem["bytes_per_token"][key]
        t.add_row(kind, fmt, f"{mem['bytes_per_token_per_layer'][key]:,}", str(mem["layers"][key]),
                  f"{per_token:,}", _gb(per_token * w["mean_context"]))
    return t


def capacity_table(plan: dict) -> Table:
    mem = plan["memory"]
    t = Table(title=f"Device memory: weights {_gb(mem['weights_per_gpu'])}/GPU, "
                    f"cache budget {_gb(mem['cache_budget_per_gpu'])}/GPU")
    for col in ("policy", "device/request", "max/GPU", f"max/{_unit(plan)}", "host/request/node", "host needed/node"):
        t.add_column(col, justify="right")
    t.add_row("no tiering", _gb(mem["device_per_request"]["no_tiering"]),
              str(mem["max_requests_per_gpu"]["no_tiering"]), str(mem["max_requests_per_node"]["no_tiering"]),
              "-", "-")
    if not _tiers(plan):
        return t
    host_limit = f" (host allows {mem['host_limit_requests']})"
    t.add_row("tiering", _gb(mem["device_per_request"]["tiering"]), str(mem["max_requests_per_gpu"]["tiering"]),
              str(mem["max_requests_per_node"]["tiering"]) + host_limit, _gb(mem["host_per_request"]),
              f"{_gb(mem['host_needed'])} of {_gb(mem['host_available'])}")
    return t


def decode_table(plan: dict) -> Table:
    dec = plan["decode"]
    t = Table(title=f"Decode roofline per GPU ({dec['requests_per_gpu']} requests/GPU, profile {dec['profile']})")
    for col in ("stage", "GFLOP", "device bytes", "link bytes", "fixed ms"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for s in dec["stages"]:
        t.add_row(s["name"], f"{s['flops'] / 1e9:,.2f}", _gb(s["bytes"]), _gb(s["link_bytes"]),
                  f"{s['fixed_s'] * 1e3:.3f}")
    times = ", ".join(f"{k} {v:.2f} ms" for k, v in dec["times_ms"].items())
    t.caption = (f"step {dec['step_ms']:.2f} ms ({times}); {dec['tok_s_per_request']:,.1f} tok/s per request, "
                 f"{dec['tok_s_aggregate']:,.0f} tok/s per {_unit(plan)}; binding: {dec['binding']}")
    return t


def flops_table(plan: dict) -> Table:
    t = Table(title="FLOPs per token (GFLOP), ratio = DSA every layer / variant")
    for col in ("phase", "context", "variant", "weights", "attention", "indexer", "total", "ratio"):
        t.add_column(col, justify="left" if col in ("phase", "variant") else "right")
    for r in plan["flops_per_token"]:
        t.add_row(r["phase"], format_tokens(r["context"]), r["variant"], f"{r['weights'] / 1e9:.1f}",
                  f"{r['attention'] / 1e9:.1f}", f"{r['indexer'] / 1e9:.1f}", f"{r['total'] / 1e9:.1f}",
                  f"{r['vs_dsa_every_layer']:.2f}x")
    return t


def published_table(plan: dict) -> Table:
    t = Table(title="Against published figures (see docs/plan.md)")
    for col in ("claim", "published", "planner", "source", "what the planner counts"):
        t.add_column(col, justify="right" if col in ("published", "planner") else "left")
    for r in plan["published"]:
        t.add_row(r["claim"], f"{r['published']:.2f}x", f"{r['planner']:.2f}x", r["source"], r["note"])
    return t


def prefix_table(plan: dict) -> Table:
    pc = plan["prefix_cache"]
    t = Table(title=f"Prefix cache tiers: contexts of {format_tokens(int(pc['context']))} tokens "
                    f"({_gb(pc['bytes_per_context'])} each) kept warm, and bringing one back")
    for col in ("tier", "capacity", "contexts", "read bandwidth", "restore one", "vs recompute"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name, tier in pc["tiers"].items():
        t.add_row(f"{name} ({'host link' if name == 'host' else 'disk'})", _gb(tier["capacity_bytes"]),
                  f"{tier['contexts']:,}", f"{tier['bandwidth'] / GB:,.1f} GB/s", f"{tier['restore_s']:.2f} s",
                  f"{tier['speedup_vs_recompute']:,.1f}x faster")
    t.add_row("recompute (prefill, ideal)", "-", "-", "-", f"{pc['recompute_s']:.2f} s", "1.0x")
    return t


def parallel_weights_table(plan: dict) -> Table:
    par, w = plan["parallel"], plan["parallel"]["weights_per_gpu"]
    experts = (f"{w['experts_per_gpu']} whole experts per GPU (EP over {par['world']})" if par["ep"]
               else f"1/{par['tp']} of every expert (TP)")
    t = Table(title=f"Weights per GPU ({plan['deployment']['weights']}): TP {par['tp']} x DP {par['dp']} = "
                    f"{par['world']} ranks, EP {'on' if par['ep'] else 'off'}")
    for col in ("part", "how it is split", "bytes/GPU"):
        t.add_column(col, justify="right" if col == "bytes/GPU" else "left")
    t.add_row("replicated", "MLA down-projections, norms, router, indexer", _gb(w["replicated"]))
    t.add_row("tensor-parallel", f"1/{par['tp']}: q_b/kv_b/o_proj, dense MLPs, shared experts, vocab",
              _gb(w["sharded"]))
    t.add_row("routed experts", experts, _gb(w["routed_experts"]))
    t.add_row("[bold]total[/bold]", "", f"[bold]{_gb(w['total'])}[/bold]")
    t.add_row("+ MTP layer", "sharded like a decoder layer; eh_proj and norms replicated", _gb(w["mtp_layer"]))
    return t


def parallel_kv_table(plan: dict) -> Table:
    par = plan["parallel"]
    t = Table(title=f"KV cache per GPU and requests (latent and indexer keys whole on each of the "
                    f"{par['tp']} TP rank(s) of a DP rank; {par['dp']} DP ranks)")
    unit, tiers = _unit(plan), _tiers(plan)
    columns = ["context", "KV/request/GPU", "max/DP rank", f"max/{unit}"]
    if tiers:
        columns[2:2] = ["tiered: device/request"]
        columns += ["tiered max/DP rank", f"tiered max/{unit}"]
    for col in columns:
        t.add_column(col, justify="right")
    for r in par["kv_per_gpu"]:
        note = " *" if r["beyond_model"] else ""
        untiered = (str(r["per_gpu"]["no_tiering"]), str(r["per_node"]["no_tiering"]))
        if tiers:
            t.add_row(format_tokens(r["context"]) + note, _gb(r["kv_per_request"]), _gb(r["kv_per_request_tiering"]),
                      *untiered, str(r["per_gpu"]["tiering"]), f"{r['per_node']['tiering']} (host {r['host_limit']})")
        else:
            t.add_row(format_tokens(r["context"]) + note, _gb(r["kv_per_request"]), *untiered)
    if any(r["beyond_model"] for r in par["kv_per_gpu"]):
        t.caption = "* beyond the model's max_position_embeddings: a what-if"
    return t


def collectives_table(plan: dict) -> Table:
    par = plan["parallel"]
    t = Table(title=f"Collectives: bytes one rank sends per token ({par['activation_format']} hidden states)")
    for col in ("collective", "op", "ranks", "formula", "B/token/call", "calls/token", "B/token",
                "per decode step/rank"):
        t.add_column(col, justify="left" if col in ("collective", "op", "formula") else "right")
    for c in par["collectives"]:
        t.add_row(c["name"], c["op"], str(c["ranks"]), c["formula"], f"{c['per_token']:,.0f}", str(c["times"]),
                  f"{c['per_token_all']:,.0f}", _gb(c["per_step"]))
    if not par["collectives"]:
        t.add_row("none", "-", "1", "one rank per replica", "0", "0", "0", "0")
    meet = par["moe_meeting"]
    if meet:
        t.caption = (f"DP attention + EP: the {par['dp']} DP ranks' tokens meet at the MoE. A rank holds "
                     f"{meet['tokens_per_rank']} tokens per decode step; its experts compute "
                     f"{meet['expert_rows_per_rank']:,.0f} rows per MoE layer from all {meet['tokens_all_ranks']}. "
                     f"all-gather + reduce-scatter instead of all_to_all: "
                     f"{meet['gather_scatter_per_token']:,.0f} B/token/layer")
    elif par["ep"] and par["world"] > 1:
        t.caption = ("EP with DP 1: every rank has every token; each runs its own experts and the FFN "
                     "all-reduce sums them")
    return t


def print_footer(plan: dict, con: Console) -> None:
    """Notes, warnings and the verdict, which the exit status reports."""
    for note in plan.get("notes", []):
        con.print(f"[cyan]note: {note}[/]", soft_wrap=True)
    for warning in plan.get("warnings", []):
        con.print(f"[yellow]warning: {warning}[/]", soft_wrap=True)
    v = plan["verdict"]
    con.print(f"[bold {'green' if v['fits'] else 'red'}]{v['message']}[/]", soft_wrap=True)


def print_parallel(plan: dict, console: Console | None = None) -> None:
    con = console or Console(width=140)
    con.print(header(plan))
    for table in (parallel_weights_table(plan), parallel_kv_table(plan), collectives_table(plan)):
        con.print(table)
    print_footer(plan, con)


def print_plan(plan: dict, sweep_points: list[dict] | None = None, console: Console | None = None) -> None:
    from sparsekv.tools.plan_sweep import LEGEND, sweep_table
    con = console or Console(width=140)
    con.print(header(plan))
    for table in (cache_table(plan), capacity_table(plan), parallel_weights_table(plan), parallel_kv_table(plan),
                  collectives_table(plan), decode_table(plan), flops_table(plan), published_table(plan)):
        con.print(table)
    if "prefix_cache" in plan:
        con.print(prefix_table(plan))
    if sweep_points:
        unit = _unit(plan)
        con.print(sweep_table(sweep_points, False, f"Sweep, no tiering: limit per (context, requests per {unit})"))
        if _tiers(plan):
            con.print(sweep_table(sweep_points, True, f"Sweep, tiering: limit per (context, requests per {unit})"))
        con.print(LEGEND)
    print_footer(plan, con)
