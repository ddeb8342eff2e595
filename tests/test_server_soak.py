"""Random concurrent clients against one server: streams cut after a few chunks, requests whose client
gives up before the answer, several choices, chat and text completions, /abort_request by id, and
requests that run to their end, all at once on a small KV pool (optimistic admission: running requests
are preempted in most runs, though timing decides it) with the prefix cache on. Afterwards the
engine holds no request and no page, every pool's integrity holds, every request that ran to its end
was answered whole and counted so, and a client that left ended its request early: the tokens
generated are those answered, plus at most a few per client that left (a request its client left
and the engine kept running would add its whole max_tokens)."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from test_server_util import ThreadServer, pages_all_free, scrape, scrape_labelled, tiny_checkpoint, wait_until

KEY = "sk-soak"
LONG, CUT_TOKENS = 120, 60  # a leaving client's max_tokens, and a bound on what it gets before it leaves
PROMPTS = ["hello world, the rain in spain", "def f(x):\n    return", "one two three four five six seven",
           "the rain in spain falls mainly"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with ThreadServer(model, api_keys=[f"{KEY}:alice"], max_num_seqs=4, num_kv_pages=12,
                      kv_admission="optimistic") as srv:
        yield srv
    torch.set_num_threads(threads)


def _body(rng: random.Random, rid: str) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS) + " " + " ".join(rng.choice(["a", "b", "spain", "x = 1"]) for _ in range(rng.randint(0, 12)))
    common = {"model": "tiny", "max_tokens": rng.randint(1, 24), "ignore_eos": True, "n": rng.choice([1, 1, 2]),
              "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(100), "rid": rid}
    if rng.random() < 0.3:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt, "logprobs": rng.choice([None, 2])}


def _ended_whole(url: str) -> float:
    """Requests (choices) the server counted as finished at their max_tokens."""
    return scrape_labelled(url, "finished_reason").get("sparsekv:request_success_total", {}).get("length", 0.0)


async def _client(url: str, headers: dict, rng: random.Random, i: int, outcomes: list) -> None:
    """One random client: what it did, and for a request that ran to its end, the answer."""
    path, body = _body(rng, f"soak-{i}")
    action = rng.choice(["whole", "whole", "stream", "cut stream", "give up", "abort"])
    if action in ("cut stream", "give up"):  # longer than the client waits: only an abort ends it early
        body["max_tokens"] = LONG
    await asyncio.sleep(rng.random() * 0.5)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        if action == "whole":
            r = await client.post(path, json=body)
            outcomes.append((action, body, r.status_code, r.json()))
        elif action in ("stream", "cut stream"):
            chunks = 0
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    chunks += line.startswith("data:")
                    if action == "cut stream" and chunks >= rng.randint(1, 3):
                        break
            outcomes.append((action, body, r.status_code, chunks))
        elif action == "give up":
            try:
                await client.post(path, json=body, timeout=rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                pass
            outcomes.append((action, body, None, None))
        else:  # another client's /abort_request of this one's id, while it runs or waits
            sent = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            aborted = await client.post("/abort_request", json={"rid": body["rid"]})
            r = await sent
            outcomes.append((action, body, r.status_code, (aborted.status_code, r.json())))


def run_clients(url: str, seed: int, clients: int, headers: dict | None = None) -> list:
    """`clients` random clients (`_client`) at once against `url`: what each did, and its answer."""
    rng, outcomes = random.Random(seed), []

    async def everyone():
        await asyncio.gather(*(_client(url, headers or {}, random.Random(rng.random()), i, outcomes)
                               for i in range(clients)))
    asyncio.run(everyone())
    assert len(outcomes) == clients
    return outcomes


def answered_whole(outcomes: list) -> tuple[int, int, int]:
    """(choices that ran to their max_tokens, the tokens answered, choices whose client left)."""
    whole = tokens = left = 0
    for action, body, status, answer in outcomes:
        if action in ("whole", "stream"):
            whole, tokens = whole + body["n"], tokens + body["n"] * body["max_tokens"]
        elif action == "abort":
            whole += sum(c["finish_reason"] == "length" for c in answer[1]["choices"])
            tokens += answer[1]["usage"]["completion_tokens"]
        else:
            left += body["n"]
    return whole, tokens, left


def check_answers(outcomes: list) -> None:
    """A request that ran to its end was answered whole; a stream got its chunks; an aborted one ended
    with what it had (or had ended before its abort came)."""
    for action, body, status, answer in outcomes:
        if action == "whole":
            assert status == 200, answer
            choices = answer["choices"]
            assert len(choices) == body["n"] and all(c["finish_reason"] == "length" for c in choices)
            assert answer["usage"]["completion_tokens"] == body["n"] * body["max_tokens"]
        elif action == "stream":
            assert status == 200 and answer >= 2  # its chunks, and the last one
        elif action == "cut stream":
            assert status == 200 and answer >= 1
        elif action == "abort":
            (abort_status, answer) = answer
            assert status == abort_status == 200, answer
            choices = answer["choices"]
            assert len(choices) == body["n"] and {c["finish_reason"] for c in choices} <= {"abort", "length"}
            if all(c["finish_reason"] == "length" for c in choices):
                assert answer["usage"]["completion_tokens"] == body["n"] * body["max_tokens"]
            else:
                assert answer["usage"]["completion_tokens"] < body["n"] * body["max_tokens"]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_concurrent_clients_leave_no_request_and_no_page(server, seed):
    server.delay[0] = 0.005  # a step takes a little longer: cuts and aborts land mid-request
    ended, generated = _ended_whole(server.url), scrape(server.url)["sparsekv:generation_tokens_total"]
    try:
        outcomes = run_clients(server.url, seed, 24, {"Authorization": f"Bearer {KEY}"})
    finally:
        server.delay[0] = 0.0
    assert wait_until(lambda: pages_all_free(server.url), 30)
    assert scrape(server.url)["sparsekv:num_requests_waiting"] == 0
    server.engine.check_integrity()
    # a client that left ended its request early (the abort its disconnect made): of its LONG tokens at
    # most CUT_TOKENS were generated
    whole, tokens, left = answered_whole(outcomes)
    assert _ended_whole(server.url) - ended == whole
    assert tokens <= scrape(server.url)["sparsekv:generation_tokens_total"] - generated <= tokens + CUT_TOKENS * left
    check_answers(outcomes)
