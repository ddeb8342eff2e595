"""One agentic episode: the policy acts through tool calls in a sandbox, every action screened first, until
it stops calling tools (or runs out of turns or context); then the check command gives the reward.

The trajectory (one JSON object, a line of trajectories.jsonl) holds the whole transcript as it happened,
each turn's per-token logprobs (and routed experts if asked), each tool result (virtual ones marked, with
their screening), the interceptions, the compactions (what the policy saw instead of which message, from
which turn on), the check's result and reward, and timings.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import openai

from .check import run_check
from .intercept import Pipeline, ToolResult, execute
from .rules import Action, Scope
from .sandbox import Limits, Sandbox
from .task import Task

COMPACTED = "[compacted: "   # marks a tool output the policy sees shortened
SYSTEM_PROMPT = ("You are a software engineer working in a repository. Use the tools to read, change and test "
                 "the code until the task is done, then answer with a short summary and no tool call.")


def _fn(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                         for k, v in props.items()},
                       "required": list(props)}}}


TOOLS = [
    _fn("read_file", "Read a text file of the repository.", path="path relative to the repository root"),
    _fn("write_file", "Create or overwrite a text file of the repository.",
        path="path relative to the repository root", content="the file's new content"),
    _fn("list_dir", "List a directory of the repository.", path="path relative to the repository root"),
    _fn("run_command", "Run a shell command in the repository root (no network).", command="the command"),
]


@dataclass(frozen=True)
class EpisodeConfig:
    max_turns: int = 16
    max_context: int = 32768       # tokens the policy's context may hold, its reply included
    max_tokens: int = 1024         # per policy turn
    chars_per_token: float = 3.0   # the context estimate between the server's counts (ContextMeter)
    compact_keep_chars: int = 400  # of a compacted tool output: head and tail, this many characters each
    limits: Limits = Limits()
    allow_network: bool = False


class Interrupted(Exception):
    """The rollout is stopping: the episode ends where it is, unchecked."""


@dataclass
class PolicyTurn:
    message: dict                  # the assistant message, as it goes back into the context
    logprobs: list[dict] | None
    token_ids: list[int] | None     # sparsekv serve reports them; other servers may not
    weights_version: int | None
    routed_experts: object
    finish_reason: str | None
    usage: dict | None
    latency_s: float


class Policy:
    """The acting model: chat completions with the four tools, logprobs on, routed experts if asked."""

    def __init__(self, url: str, model: str, api_key: str = "EMPTY", temperature: float = 1.0,
                 seed: int | None = None, routed_experts: bool = False, timeout_s: float = 600.0):
        self.client = openai.OpenAI(base_url=url, api_key=api_key, timeout=timeout_s, max_retries=1)
        self.model, self.temperature, self.seed, self.routed_experts = model, temperature, seed, routed_experts
        self.stop: threading.Event | None = None  # set: no new policy call starts (Ctrl-C in `rollout`)

    def turn(self, messages: list[dict], max_tokens: int) -> PolicyTurn:
        if self.stop is not None and self.stop.is_set():
            raise Interrupted("the rollout was interrupted")
        t0 = time.perf_counter()
        resp = self.client.chat.completions.create(
            model=self.model, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=max_tokens,
            temperature=self.temperature, seed=self.seed, logprobs=True,
            extra_body={"return_routed_experts": True} if self.routed_experts else None)
        choice = resp.choices[0]
        msg = {"role": "assistant", "content": choice.message.content or ""}
        if choice.message.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in choice.message.tool_calls]
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in choice.logprobs.content]
        fields = _engine_fields(resp, choice)
        return PolicyTurn(msg, logprobs, fields.get("token_ids"), fields.get("weights_version"),
                          _routed_experts(resp, choice, fields) if self.routed_experts else None,
                          choice.finish_reason, resp.usage.model_dump() if resp.usage else None,
                          time.perf_counter() - t0)


def _engine_fields(resp, choice) -> dict:
    """What a sparsekv server adds per choice (under the response's "sparsekv"): the generated token ids,
    the weights version and, when asked, the routed experts ([token][MoE layer][top-k])."""
    ext = (resp.model_extra or {}).get("sparsekv") or {}
    mine = next((c for c in ext.get("choices", []) if c.get("index") == choice.index), {})
    return {k: mine[k] for k in ("token_ids", "weights_version", "routed_experts") if k in mine}


def _routed_experts(resp, choice, fields: dict):
    """`routed_experts` from the sparsekv extension, else wherever another server put it (the choice, its
    message or the response)."""
    if "routed_experts" in fields:
        return fields["routed_experts"]
    for obj in (choice, choice.message, resp):
        extra = getattr(obj, "model_extra", None) or {}
        if "routed_experts" in extra:
            return extra["routed_experts"]
    return None


@dataclass
class Trajectory:
    task: str
    episode: int
    messages: list[dict] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    tool_results: list[dict] = field(default_factory=list)
    interceptions: list[dict] = field(default_factory=list)
    compactions: list[dict] = field(default_factory=list)
    finish: str = "max_turns"
    error: str | None = None
    check: dict | None = None
    reward: float = 0.0
    timings: dict = field(default_factory=lambda: {"policy_s": 0.0, "screen_s": 0.0, "tools_s": 0.0})

    def to_json(self) -> dict:
        return dict(self.__dict__)


def run_episode(task: Task, episode: int, policy: Policy, pipeline: Pipeline, cfg: EpisodeConfig) -> dict:
    t0 = time.perf_counter()
    traj = Trajectory(task.name, episode)
    with Sandbox(task, cfg.limits, cfg.allow_network) as sandbox:
        _loop(traj, sandbox, policy, pipeline, cfg)
        t_check = time.perf_counter()
        check = run_check(sandbox)
        traj.timings["check_s"] = time.perf_counter() - t_check
    traj.check = check.to_json(task.check)
    traj.reward = 1.0 if check.ok else 0.0
    traj.timings["total_s"] = time.perf_counter() - t0
    return traj.to_json()


def _loop(traj: Trajectory, sandbox: Sandbox, policy: Policy, pipeline: Pipeline, cfg: EpisodeConfig) -> None:
    context = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sandbox.task.instruction}]
    traj.messages = [dict(m) for m in context]
    meter = ContextMeter(cfg.chars_per_token)
    for turn in range(cfg.max_turns):
        if not compact(context, turn, cfg, meter, traj.compactions):
            traj.finish = "context"
            return
        try:
            pt = policy.turn(context, cfg.max_tokens)
        except openai.APIError as e:  # the episode ends; the check still gives its reward
            traj.finish, traj.error = "error", f"policy: {type(e).__name__}: {e}"
            return
        traj.timings["policy_s"] += pt.latency_s
        traj.turns.append({"turn": turn, "message_index": len(context), "logprobs": pt.logprobs,
                           "token_ids": pt.token_ids, "weights_version": pt.weights_version,
                           "routed_experts": pt.routed_experts, "finish_reason": pt.finish_reason,
                           "usage": pt.usage, "latency_s": pt.latency_s})
        context.append(pt.message)
        traj.messages.append(pt.message)
        meter.measured(context, pt.usage)
        if not pt.message.get("tool_calls"):
            traj.finish = "length" if pt.finish_reason == "length" else "stop"  # a reply cut by max_tokens
            return
        for call in pt.message["tool_calls"]:
            reply = {"role": "tool", "tool_call_id": call["id"], "content": _act(call, turn, traj, sandbox, pipeline)}
            context.append(reply)
            traj.messages.append(dict(reply))


def _act(call: dict, turn: int, traj: Trajectory, sandbox: Sandbox, pipeline: Pipeline) -> str:
    name, raw = call["function"]["name"], call["function"]["arguments"]
    try:
        arguments = json.loads(raw) if raw else {}
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
    except ValueError as e:
        result = ToolResult(f"error: {name}: bad arguments: {e}", error=True)
        arguments = {"_raw": raw}
    else:
        action = Action(name, arguments)
        t0 = time.perf_counter()
        screening = pipeline.screen(action, Scope(sandbox.task, sandbox))
        t1 = time.perf_counter()
        result = execute(action, sandbox, screening, pipeline)
        traj.timings["screen_s"] += t1 - t0
        traj.timings["tools_s"] += time.perf_counter() - t1
    record = {"turn": turn, "tool_call_id": call["id"], "tool": name, "arguments": arguments,
              "output": result.output, "virtual": result.virtual, "error": result.error,
              **result.screening.to_json()}
    if result.virtual:
        record["ran_instead"] = result.ran
        traj.interceptions.append({"turn": turn, "tool_call_id": call["id"], "tool": name,
                                   "rules": result.screening.rules, "verdict": result.screening.verdict.to_json()})
    traj.tool_results.append(record)
    return result.output


class ContextMeter:
    """The context's size in tokens: the server's count for the last turn (its usage: prompt and reply),
    plus the characters of JSON added or removed since at `chars_per_token`. Before any usage: the
    messages' and the tools' JSON at that rate."""

    def __init__(self, chars_per_token: float):
        self.chars_per_token = chars_per_token
        self.base_tokens, self.base_chars = len(json.dumps(TOOLS)) / chars_per_token, 0

    def tokens(self, context: list[dict]) -> int:
        return int(self.base_tokens + (len(json.dumps(context)) - self.base_chars) / self.chars_per_token) + 1

    def measured(self, context: list[dict], usage: dict | None) -> None:
        """`context` (the reply included) holds `usage`'s prompt and completion tokens."""
        if usage and usage.get("prompt_tokens"):
            self.base_tokens = usage["prompt_tokens"] + (usage.get("completion_tokens") or 0)
            self.base_chars = len(json.dumps(context))


def compact(context: list[dict], turn: int, cfg: EpisodeConfig, meter: ContextMeter, log: list[dict]) -> bool:
    """Shrink the oldest tool outputs to their head and tail until the context and a reply fit in
    `max_context`; False if they still do not. Each compaction is appended to `log`."""
    fits = lambda: meter.tokens(context) + cfg.max_tokens <= cfg.max_context
    for i, msg in enumerate(context):
        if fits():
            return True
        keep = cfg.compact_keep_chars
        # a shortened output is 2 keep + under 80 characters, so it is never shortened again; an output
        # that merely quotes the marker (a trajectories file read) is shortened as any other
        if msg["role"] != "tool" or len(msg["content"]) <= 2 * keep + 80:
            continue
        text = msg["content"]
        short = f"{text[:keep]}\n{COMPACTED}{len(text) - 2 * keep} characters of tool output omitted]\n{text[-keep:]}"
        context[i] = {**msg, "content": short}
        log.append({"turn": turn, "message_index": i, "tool_call_id": msg.get("tool_call_id"),
                    "chars_before": len(text), "chars_after": len(short), "content": short})
    return fits()
