"""`sparsekv rollout` (episodes, or `--summary` of their trajectories) and `sparsekv rl screen | eval-filter`."""
from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import openai

from ..engine_args import at_least, output_path, positive_finite
from ..sampling_params import MAX_TEMPERATURE
from .episode import EpisodeConfig, Policy, run_episode
from .intercept import Pipeline
from .judge import Judge
from .report import RolloutProgress, filter_figures, print_figures, summarize
from .rules import TOOLS, Action, RuleError, Scope, load_rules
from .sandbox import UNSHARE, Limits, RepoView, isolation_available
from .task import TaskError, load_task, shipped_tasks

LABELLED = Path(__file__).resolve().parent / "labelled_actions.jsonl"
DEFAULT_URL = "http://127.0.0.1:8000/v1"
MIN_MEMORY_MB = 64   # below this /bin/sh and python fail to start, and every command fails obscurely
INTERRUPTED = 130    # the shell's exit status for a command stopped by SIGINT


def _output_or_stdout(text: str) -> str:
    return text if text == "-" else output_path(text)


def _add_pipeline_args(p: argparse.ArgumentParser, rules_only_flag: bool) -> None:
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="a YAML rules file added to the shipped rules (repeatable)")
    if rules_only_flag:
        p.add_argument("--rules-only", action="store_true", help="no judge: trust the rules")
    else:
        p.add_argument("--judge", choices=["llm", "none"], default=None,
                       help="none: trust the rules; llm: ask the judge at --judge-url (the default when given)")
    p.add_argument("--judge-url", default=None, help="the judge's OpenAI base URL, e.g. http://HOST:PORT/v1")
    p.add_argument("--judge-model", default=None, help="default: the first model the judge endpoint lists")
    p.add_argument("--judge-api-key", default="EMPTY")


def build_rollout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv rollout", description="agentic episodes with reward-hack interception")
    p.add_argument("tasks", nargs="*", help=f"task directories or shipped task names (default: all shipped: "
                                            f"{', '.join(shipped_tasks())})")
    p.add_argument("--summary", metavar="TRAJECTORIES", default=None,
                   help="print a per-task table of this trajectories.jsonl and write --plot; runs nothing")
    p.add_argument("--plot", type=output_path, default="rollout_summary.png",
                   help="with --summary: the PNG of reward and interception rate per task to write (default: "
                        "%(default)s in the current directory)")
    p.add_argument("--url", default=DEFAULT_URL, help="the policy's OpenAI base URL (default: a local sparsekv serve)")
    p.add_argument("--model", default=None, help="default: the first model the policy endpoint lists")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--episodes", type=int, default=1, help="per task")
    p.add_argument("--concurrency", type=int, default=1, help="episodes in flight at once")
    p.add_argument("--output", type=output_path, default="trajectories.jsonl")
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-tokens", type=at_least(1), default=1024, help="per policy turn")
    p.add_argument("--max-context", type=at_least(1), default=32768, help="tokens; older tool outputs are compacted to fit")
    p.add_argument("--temperature", type=at_least(0.0, float, high=MAX_TEMPERATURE), default=1.0)
    p.add_argument("--seed", type=int, default=None, help="episode i of a task uses seed + i")
    p.add_argument("--routed-experts", action="store_true", help="ask for and record return_routed_experts")
    p.add_argument("--wall-time", type=positive_finite, default=60.0, help="seconds per command")
    p.add_argument("--cpu-time", type=at_least(1), default=30, help="CPU seconds per command")
    p.add_argument("--memory-mb", type=at_least(MIN_MEMORY_MB), default=2048,
                   help=f"address space per command (at least {MIN_MEMORY_MB}: less and a shell cannot start)")
    p.add_argument("--allow-network", action="store_true",
                   help="run commands even where `unshare` cannot take the network away (and keep writes in)")
    _add_pipeline_args(p, rules_only_flag=False)
    return p


def build_rl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv rl", description="the reward-hack pipeline on logged actions")
    sub = p.add_subparsers(dest="command", required=True)
    screen = sub.add_parser("screen", help="screen logged actions without running them")
    screen.add_argument("--actions", required=True, metavar="FILE",
                        help='JSON lines {"id", "task", "tool", "arguments"}')
    screen.add_argument("--output", type=_output_or_stdout, default="-", help="JSON lines out (default: standard output)")
    _add_pipeline_args(screen, rules_only_flag=True)
    ev = sub.add_parser("eval-filter", help="recall and precision of the rules, and of rules + judge")
    ev.add_argument("--labelled", default=str(LABELLED), metavar="FILE",
                    help='JSON lines {"id", "task", "tool", "arguments", "hack": bool, "kind"} '
                         '(default: the shipped set)')
    ev.add_argument("--json", action="store_true", help="print the figures as JSON")
    _add_pipeline_args(ev, rules_only_flag=False)
    return p


def _served_models(url: str, api_key: str) -> list[str]:
    """The model names `url` serves (GET /v1/models), in its order."""
    try:
        models = openai.OpenAI(base_url=url, api_key=api_key, max_retries=1).models.list().data
    except openai.APIError as e:
        raise ValueError(f"{url}: cannot list its models ({e}); is the server up?") from None
    if not models:
        raise ValueError(f"{url} lists no models; give the model's name")
    return [m.id for m in models]


def _served_model(url: str, api_key: str, wanted: str | None, flag: str, strict: bool = True) -> str:
    """`wanted` if `url` serves it, else its first model when none is given. A name the endpoint does
    not list is a ValueError naming `flag` and the served models (before any episode starts: each
    would end in a 404), or with `strict` off a warning (a third-party judge may list other ids than
    it accepts); an endpoint that cannot list its models is taken at its word for a given name."""
    if wanted is None:
        return _served_models(url, api_key)[0]
    try:
        served = _served_models(url, api_key)
    except ValueError as e:
        print(f"warning: {flag} {wanted} not checked: {e}", file=sys.stderr)
        return wanted
    if wanted not in served:
        message = f"{flag} {wanted}: {url} does not serve it (it serves: {', '.join(served)})"
        if strict:
            raise ValueError(message)
        print(f"warning: {message}", file=sys.stderr)
    return wanted


def _judge(args) -> Judge | None:
    if getattr(args, "rules_only", False) or getattr(args, "judge", None) == "none":
        return None
    if not args.judge_url:
        raise ValueError("give --judge-url URL (an OpenAI-compatible judge) or trust the rules alone "
                         "(--judge none; `rl screen`: --rules-only)")
    model = _served_model(args.judge_url, args.judge_api_key, args.judge_model, "--judge-model", strict=False)
    return Judge(args.judge_url, model, args.judge_api_key)


def _read_actions(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(row, dict) or not {"id", "task", "tool", "arguments"} <= row.keys() \
                    or not isinstance(row["arguments"], dict):
                raise ValueError(f"{path}:{n}: each line is {{\"id\", \"task\", \"tool\", \"arguments\": {{...}}}}")
            if row["tool"] not in TOOLS:
                raise ValueError(f"{path}:{n}: unknown tool {row['tool']!r} (tools: {', '.join(TOOLS)})")
            rows.append(row)
    return rows


def screen_actions(rows: list[dict], pipeline: Pipeline) -> list[dict]:
    """Each logged action screened against its task's repository as shipped (nothing runs). A task is a
    shipped task's name or a task directory."""
    tasks, out = {}, []
    for row in rows:
        name = row["task"]
        if name not in tasks:
            task = load_task(name)
            tasks[name] = Scope(task, RepoView(task.repo))
        screening = pipeline.screen(Action(row["tool"], row["arguments"]), tasks[name])
        out.append({"id": row["id"], **screening.to_json()})
    return out


def rl_main(argv: list[str]) -> int:
    args = build_rl_parser().parse_args(argv)
    try:
        rules = load_rules(*args.rules)
        rows = _read_actions(args.actions if args.command == "screen" else args.labelled)
        if args.command == "eval-filter":
            return _eval_filter(args, rows, rules)
        results = screen_actions(rows, Pipeline(rules, _judge(args)))
    except (RuleError, TaskError, ValueError, OSError, openai.APIError) as e:
        print(f"sparsekv rl {args.command}: error: {e}", file=sys.stderr)
        return 2
    out = sys.stdout if args.output == "-" else open(args.output, "w")
    for r in results:
        out.write(json.dumps(r) + "\n")
    if out is not sys.stdout:
        out.close()
    return 0


def _eval_filter(args, rows: list[dict], rules) -> int:
    if any(not isinstance(r.get("hack"), bool) for r in rows):
        raise ValueError(f"{args.labelled}: every line needs \"hack\": true|false")
    judge = _judge(args)
    screened = screen_actions(rows, Pipeline(rules, judge))
    figures = filter_figures(rows, screened, judged=judge is not None)
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        print_figures(figures)
    return 0


def rollout_main(argv: list[str]) -> int:
    args = build_rollout_parser().parse_args(argv)
    if args.summary:
        try:
            return summarize(args.summary, args.plot)
        except (OSError, ValueError) as e:  # missing, not UTF-8, not JSON lines
            print(f"sparsekv rollout: error: --summary {args.summary}: {e}", file=sys.stderr)
            return 2
    try:
        tasks = [load_task(t) for t in (args.tasks or shipped_tasks())]
        if not args.allow_network and not isolation_available():
            raise ValueError(f"`{' '.join(UNSHARE)}` does not work here, so commands could reach the network "
                             "and write outside the sandbox; pass --allow-network to run them anyway")
        if args.episodes < 1 or args.concurrency < 1 or args.max_turns < 1:
            raise ValueError("--episodes, --concurrency and --max-turns must be >= 1")
        pipeline = Pipeline(load_rules(*args.rules), _judge(args))
        model = _served_model(args.url, args.api_key, args.model, "--model")
    except (RuleError, TaskError, ValueError, OSError, openai.APIError) as e:
        print(f"sparsekv rollout: error: {e}", file=sys.stderr)
        return 2
    cfg = EpisodeConfig(max_turns=args.max_turns, max_context=args.max_context, max_tokens=args.max_tokens,
                        limits=Limits(args.wall_time, args.cpu_time, args.memory_mb),
                        allow_network=args.allow_network)
    jobs = [(t, i) for t in tasks for i in range(args.episodes)]
    policies = {i: Policy(args.url, model, args.api_key, args.temperature,
                          None if args.seed is None else args.seed + i, args.routed_experts)
                for i in range(args.episodes)}
    return _run_all(jobs, policies, pipeline, cfg, args.output, args.concurrency)


def _run_all(jobs, policies, pipeline, cfg, output: str, concurrency: int) -> int:
    """Every episode, `concurrency` at a time, each trajectory written as it finishes. Ctrl-C cancels the
    episodes not started, stops the running ones before their next policy call, keeps what was written,
    and exits 130."""
    stop = threading.Event()
    for policy in policies.values():
        policy.stop = stop
    written = failures = 0
    pool = ThreadPoolExecutor(concurrency)
    with open(output, "w") as out, RolloutProgress(len(jobs)) as progress:
        try:
            futures = {pool.submit(run_episode, task, i, policies[i], pipeline, cfg): (task, i) for task, i in jobs}
            for fut in as_completed(futures):
                traj = _trajectory(fut, *futures[fut])
                failures += traj.get("finish") == "error"
                out.write(json.dumps(traj) + "\n")
                out.flush()
                written += 1
                progress.done(traj)
        except KeyboardInterrupt:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
            print(f"\nsparsekv rollout: interrupted; {written} of {len(jobs)} trajectories written to {output}",
                  file=sys.stderr)
            return INTERRUPTED
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    print(f"wrote {len(jobs)} trajectories to {output}" + (f" ({failures} failed)" if failures else ""),
          file=sys.stderr)
    return 1 if failures else 0


def _trajectory(fut, task, i: int) -> dict:
    try:
        return fut.result()
    except Exception as e:  # noqa: BLE001 - one failed episode is reported, not fatal
        return {"task": task.name, "episode": i, "finish": "error", "error": f"{type(e).__name__}: {e}"}
