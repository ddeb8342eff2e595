"""A scripted OpenAI-compatible endpoint for the rollout tests: a FastAPI app run by uvicorn in a thread.

Chat requests with a `response_format` go to the judge function; the others take the next scripted policy
turn (a list of (tool, arguments) calls, a string: the final answer without calls, a dict {"content",
"finish_reason"}: an answer ending as given, or an int: an HTTP error status). Every request body is
kept in `requests`, so a test sees what the policy and the judge were sent."""
from __future__ import annotations

import json
import threading
import time

ROUTED = [[[0, 1], [2, 3]]]  # what the fake answers under sparsekv.choices[i].routed_experts when asked


class FakeOpenAI:
    def __init__(self, script: list, judge=None, model: str = "fake-policy"):
        from fastapi import FastAPI
        self.script, self.judge, self.model = list(script), judge, model
        self.requests: list[dict] = []
        app = FastAPI()
        app.get("/v1/models")(self._models)
        app.post("/v1/chat/completions")(self._chat)
        self.app = app

    def _models(self):
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "test"}]}

    async def _chat(self, body: dict):
        self.requests.append(body)
        if body.get("response_format") is not None:
            return _completion(json.dumps(self.judge(body)), [], body)
        turn = self.script.pop(0) if self.script else "done"
        if isinstance(turn, int):  # an HTTP error status
            from fastapi.responses import JSONResponse
            return JSONResponse({"error": {"message": "scripted failure", "type": "invalid_request_error"}}, turn)
        if isinstance(turn, str):
            return _completion(turn, [], body)
        if isinstance(turn, dict):
            return _completion(turn["content"], [], body, turn["finish_reason"])
        calls = [{"id": f"call_{len(self.requests)}_{i}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(turn)]
        return _completion(None, calls, body)

    def __enter__(self) -> FakeOpenAI:
        import socket

        import uvicorn
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def policy_requests(self) -> list[dict]:
        return [r for r in self.requests if r.get("response_format") is None]

    def judge_requests(self) -> list[dict]:
        return [r for r in self.requests if r.get("response_format") is not None]


def _completion(content, calls: list, body: dict, finish_reason: str | None = None) -> dict:
    tokens = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
              for t in (content or "call").split()]
    choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": calls or None},
              "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
              "logprobs": {"content": tokens} if body.get("logprobs") else None}
    ext = {"index": 0, "token_ids": list(range(len(tokens))), "weights_version": 3}  # as sparsekv serve adds them
    if body.get("return_routed_experts"):
        ext["routed_experts"] = ROUTED
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body.get("model", "fake"),
            "choices": [choice], "sparsekv": {"choices": [ext]},
            "usage": {"prompt_tokens": 10, "completion_tokens": len(tokens), "total_tokens": 10 + len(tokens)}}
