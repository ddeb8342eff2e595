"""`sparsekv bench serve --workload interference`: running streams while long prompts arrive at a steady rate.

`--streams N` requests of `--input-len` tokens, each generating `--output-len` tokens, start together:
the running streams. In the loaded phase `--num-long-prompts K` prompts of `--long-prompt-len` tokens
(each generating `--long-output-len` tokens) arrive one every 1/`--long-prompt-rate` seconds, the first
once every stream has its first token. The same streams first run alone (the quiet phase), so that
the report sets the streams' inter-token latency under the prefill load against its value without it,
measured in the same run. In the loaded phase only the gaps that end while the long prompts are being
served count (from the first one's arrival, once every stream has its first token, to the last one's
end): the streams must outlast them, and the report says when they did not. The quiet phase counts
the gaps from the same moment on (every stream has its first token) to the streams' end.

Against a colocated server every long prompt's prefill shares the engine's steps with the streams;
against `sparsekv router` it runs on the prefill worker. `--long-prompt-url URL` sends the long prompts
to another server instead: the streams then see that server's load on its cores (shared caches, memory
bandwidth, a host's other tenants) without anything reaching their own server, which separates what
the transfer costs them from what a busy neighbour does.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from .serve_client import StreamError, server_model, stream_chunks


@dataclass
class Stream:
    """One request's chunk arrival times (monotonic seconds) and outcome."""

    sent: float
    times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    split: dict = field(default_factory=dict)  # a decode worker's `sparsekv.disaggregation` figures

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Inter-token gaps that end within [start, end]."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= b <= end]


async def consume(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, key: str | None,
                  on_first=None) -> Stream:
    out = Stream(time.perf_counter())
    try:
        async for now, chunk in stream_chunks(client, model, prompt, max_tokens, key):
            if chunk.get("choices"):
                out.times.append(now)
                if len(out.times) == 1 and on_first is not None:
                    on_first()
            if chunk.get("usage"):
                out.output_tokens = chunk["usage"]["completion_tokens"]
            out.split = (chunk.get("sparsekv") or {}).get("disaggregation") or out.split
    except StreamError as e:
        out.error = str(e)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    if not out.times and on_first is not None:  # NOTE: ended with no token: nobody waits for its first
        on_first()
    return out


async def run_phase(client, model: str, args, vocab: int, loaded: bool, longs_to=None) -> dict:
    """One phase; `longs_to`: (client, model) the long prompts go to (default: the streams' server)."""
    rng = random.Random(args.seed + (7 if loaded else 0))
    key = args.api_key[0] if args.api_key else None
    all_first, firsts, all_first_at = asyncio.Event(), [0], [float("inf")]

    def first():
        firsts[0] += 1
        if firsts[0] == args.streams:
            all_first_at[0] = time.perf_counter()
            all_first.set()

    t0 = time.perf_counter()
    streams = [asyncio.create_task(consume(client, model, [rng.randrange(vocab) for _ in range(args.input_len)],
                                           args.output_len, key, first)) for _ in range(args.streams)]
    longs = []
    long_client, long_model = longs_to or (client, model)
    if loaded:
        await all_first.wait()
        start = time.perf_counter()
        for i in range(args.num_long_prompts):
            prompt = [rng.randrange(vocab) for _ in range(args.long_prompt_len)]
            longs.append(asyncio.create_task(consume(long_client, long_model, prompt, args.long_output_len, key)))
            if i + 1 < args.num_long_prompts:
                await asyncio.sleep(1.0 / args.long_prompt_rate)
        longs = list(await asyncio.gather(*longs))
        end = time.perf_counter()
    streams = list(await asyncio.gather(*streams))
    # both phases count from when every stream has its first token: the quiet phase's start-up gaps
    # (streams still prefilling one another) have no counterpart in the loaded window
    window = (start, end) if loaded else (all_first_at[0], float("inf"))
    return summarize_phase(streams, longs, window, time.perf_counter() - t0)


def _ms(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return {"count": 0, "p50": 0.0, "p99": 0.0}
    pick = lambda q: ms[min(len(ms) - 1, int(round(q * (len(ms) - 1))))]  # noqa: E731
    return {"count": len(ms), "p50": pick(0.5), "p99": pick(0.99)}


def summarize_phase(streams: list[Stream], longs: list[Stream], window: tuple[float, float], duration: float) -> dict:
    done = [s for s in streams if not s.error]
    return {"duration_s": duration, "streams_ok": len(done), "long_prompts_ok": sum(not s.error for s in longs),
            "itl_ms": _ms([g for s in done for g in s.gaps(*window)]),
            "stream_ttft_ms": _ms([s.ttft for s in done if s.ttft is not None]),
            "long_ttft_ms": _ms([s.ttft for s in longs if s.ttft is not None]),
            "stream_output_throughput": sum(s.output_tokens for s in done) / duration,
            "streams_outlasted_load": (all(s.times and s.times[-1] >= window[1] for s in done)
                                       if window[1] < float("inf") else None),   # None: no load to outlast
            "streams_started_before_load": all(s.times and s.times[0] <= window[0] for s in done),
            "long_ttft_split_s": _split(longs),
            "errors": sorted({s.error for s in streams + longs if s.error})[:5]}


SPLIT = ("queue_s", "prefill_s", "transfer_s", "decode_queue_s", "first_decode_s")


def _split(longs: list[Stream]) -> dict:
    """The median of each part of the long prompts' TTFT, as the decode worker reports it (behind a router)."""
    splits = [s.split for s in longs if all(k in s.split for k in SPLIT)]
    if not splits:
        return {}
    return {k: sorted(x[k] for x in splits)[len(splits) // 2] for k in SPLIT}


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.streams + args.num_long_prompts + 4)
    long_url = args.long_prompt_url or args.url
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client, \
            httpx.AsyncClient(base_url=long_url, timeout=args.timeout, limits=limits) as long_client:
        model, vocab = await server_model(client, args.model)
        longs_to = (long_client, (await server_model(long_client, args.model))[0]) if args.long_prompt_url else None
        quiet = await run_phase(client, model, args, vocab, loaded=False)
        loaded = await run_phase(client, model, args, vocab, loaded=True, longs_to=longs_to)
    p99 = quiet["itl_ms"]["p99"]
    return {"workload": "interference", "url": args.url, "long_prompt_url": long_url, "model": model,
            "streams": args.streams,
            "input_len": args.input_len, "output_len": args.output_len, "long_prompt_len": args.long_prompt_len,
            "long_prompt_rate": args.long_prompt_rate, "num_long_prompts": args.num_long_prompts,
            "quiet": quiet, "loaded": loaded, "itl_p99_ratio": loaded["itl_ms"]["p99"] / p99 if p99 else None}


def format_report(rep: dict) -> str:
    lines = ["{s:{c}^64}".format(s=" Running streams under prefill load ", c="="),
             f"{rep['url']}  model {rep['model']}: {rep['streams']} streams of {rep['input_len']} + "
             f"{rep['output_len']} tokens; {rep['num_long_prompts']} prompts of {rep['long_prompt_len']} tokens "
             f"at {rep['long_prompt_rate']:g}/s" + ("" if rep["long_prompt_url"] == rep["url"]
                                                   else f", sent to {rep['long_prompt_url']}"),
             f"{'':<34} {'quiet':>14} {'loaded':>14}"]
    q, l = rep["quiet"], rep["loaded"]
    rows = [("streams' ITL p50 (ms)", q["itl_ms"]["p50"], l["itl_ms"]["p50"]),
            ("streams' ITL p99 (ms)", q["itl_ms"]["p99"], l["itl_ms"]["p99"]),
            ("ITL gaps counted", q["itl_ms"]["count"], l["itl_ms"]["count"]),
            ("streams' TTFT p50 (ms)", q["stream_ttft_ms"]["p50"], l["stream_ttft_ms"]["p50"]),
            ("long prompts' TTFT p50 (ms)", None, l["long_ttft_ms"]["p50"]),
            ("long prompts' TTFT p99 (ms)", None, l["long_ttft_ms"]["p99"]),
            ("streams' output throughput (tok/s)", q["stream_output_throughput"], l["stream_output_throughput"])]
    for label, a, b in rows:
        fmt = "d" if isinstance(b, int) else ".2f"
        lines.append(f"{label:<34} {'-' if a is None else format(a, fmt):>14} {format(b, fmt):>14}")
    split = l["long_ttft_split_s"]
    if split:
        lines.append("long prompts' TTFT split (median s): " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f}"
                                                                          for k, v in split.items()))
    ratio = rep["itl_p99_ratio"]
    lines.append(f"{'ITL p99, loaded / quiet':<34} {'-' if ratio is None else f'{ratio:.2f}x':>29}")
    if not l["streams_outlasted_load"]:
        lines.append("warning: a stream ended before the long prompts did; raise --output-len")
    for err in q["errors"] + l["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 64)
    return "\n".join(lines)
