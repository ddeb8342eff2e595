"""What every `sparsekv bench serve` workload does with a server: name its model, stream completions."""
from __future__ import annotations

import json
import time

import httpx


class StreamError(Exception):
    """A streamed completion the server refused (non-200) or ended with an error chunk."""


async def server_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int]:
    """(the model to request: `model`, else the server's first; its vocabulary size, for random prompts)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    first = r.json()["data"][0]
    return model or first["id"], int(first.get("vocab_size") or 256)


async def stream_chunks(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                        key: str | None = None):
    """The chunks of one streamed greedy completion of `max_tokens` (ignore_eos, usage included), each
    as (its arrival time, the parsed chunk); StreamError for a refusal or an error chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(chunk["error"].get("message", "error"))
            yield now, chunk
