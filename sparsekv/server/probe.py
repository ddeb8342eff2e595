"""SGLang's GET /health_generate: whether the engine still generates, not only whether its thread is
alive (/health). A Kubernetes liveness probe or a router's health check calls it.

A server that is stepping (a step ended within the timeout while requests are in flight) is healthy
without generating anything: a probe must never queue behind the load it checks, nor count it against
a full queue. An idle server, or one whose requests made no step within the timeout (a stuck engine),
generates one greedy token from a one-token prompt. Probes that arrive together share one generation,
so the public endpoint cannot be used to load the engine. The probe's request is left out of the
latency and finish metrics.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from ..request import SamplingParams
from .loop import EngineDead, EngineLoop, QueueFull, RequestGroup, ShuttingDown, Submission

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
PROBE_TENANT = "default"


class GenerateProbe:
    def __init__(self, loop: EngineLoop, timeout_s: float = HEALTH_GENERATE_TIMEOUT_S):
        self.loop, self.timeout_s = loop, timeout_s
        self.generations = 0  # probes that generated (the others found the engine stepping)
        self._running: asyncio.Future | None = None

    async def failure(self) -> str | None:
        """None when the engine generates (or is stepping), else why not."""
        if self._stepping():
            return None
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._one_token())
        try:
            await asyncio.wait_for(asyncio.shield(self._running), self.timeout_s)
        except asyncio.TimeoutError:
            return f"the engine generated no token within {self.timeout_s:g} s"
        except (EngineDead, ShuttingDown, QueueFull) as e:
            return str(e)
        return None

    def _stepping(self) -> bool:
        last = self.loop.last_step_end
        return self.loop.num_active > 0 and last is not None and time.monotonic() - last < self.timeout_s

    async def _one_token(self) -> None:
        group = RequestGroup(f"health-{uuid.uuid4().hex}", 1)
        group.observed = False
        self.generations += 1
        try:
            await self.loop.submit(group, [Submission([0], SamplingParams(max_tokens=1, temperature=0.0))],
                                   PROBE_TENANT, None)
            while True:
                index, item = await group.queue.get()
                if index is None:
                    raise item
                if item.finished:
                    return
        finally:
            self.loop.abort(group)
