"""The admin endpoints an RL trainer drives (SGLang's names; docs/rl.md), open only to admin keys
(auth.ADMIN_PATHS): POST /update_weights_from_disk, /pause_generation, /continue_generation,
/flush_cache. Each runs on the engine loop's thread, between steps.

/update_weights_from_disk answers once the update has loaded: at once with the "abort" policy or when
nothing runs, else after the requests already started have finished under the old weights ("drain").
A refused update (another architecture, a missing tensor) is a 400 and the old weights keep serving.
"""
from __future__ import annotations

import asyncio

from fastapi import Request

from ..parallel.launch import RankFailure
from ..weights import WeightLoadError, WeightUpdateConflict, WeightUpdateError
from .errors import APIError
from .loop import EngineDead, ShuttingDown
from .protocol import _Body, parse_body

POLL_S = 0.05  # how often a drain's progress is read (on the loop thread)


class UpdateWeightsFromDisk(_Body):
    model_path: str


async def call_engine(state, fn, *args):
    try:
        return await state.loop.call(fn, *args)
    except (ShuttingDown, EngineDead) as e:
        raise APIError(503, str(e)) from None


async def update_weights_from_disk(request: Request):
    state = request.app.state.server
    body = parse_body(await request.body(), UpdateWeightsFromDisk)
    policy = state.settings.weight_update_policy
    version = await run_weight_update(state, lambda: state.engine.update_weights_from_disk(body.model_path, policy),
                                      "model_path")
    return {"success": True, "message": f"loaded {body.model_path}", "weights_version": version}


async def run_weight_update(state, load, param: str) -> int:
    """Run a weight update (`load()`, on the loop thread: the engine's update call, which returns the
    outputs of the requests it aborted) and wait for its own outcome: the version it loaded as."""
    engine = state.engine

    def start() -> int:
        """The update started (or loaded); its ticket, read in the same command (UpdateOutcomes)."""
        try:
            aborted = load()
        except WeightLoadError as e:
            state.loop.deliver_outputs(e.aborted)  # the aborted requests' clients get their final chunks
            raise
        state.loop.deliver_outputs(aborted)
        return engine.weight_updates.accepted
    try:
        ticket = await call_engine(state, start)
    except WeightUpdateError as e:
        raise APIError(400, str(e), param) from None
    except WeightUpdateConflict as e:
        raise APIError(409, str(e)) from None
    except WeightLoadError as e:
        raise APIError(500, str(e)) from None
    except RankFailure as e:  # the ranks' weights differ, or a failed load could not put them back: no more serving
        raise APIError(503, str(e)) from None
    # NOTE: this update's own result: another update may load (or fail) before this answer is read
    while (outcome := await call_engine(state, lambda: engine.weight_updates.outcome(ticket))) is None:
        await asyncio.sleep(POLL_S)
    version, error = outcome
    if error is not None:
        raise APIError(500, f"the weight update failed to load; the previous weights keep serving: {error}")
    return version


async def pause_generation(request: Request):
    state = request.app.state.server
    try:
        await call_engine(state, state.engine.pause_generation)
    except WeightUpdateConflict as e:
        raise APIError(409, str(e)) from None
    return {"success": True, "paused": True}


async def continue_generation(request: Request):
    state = request.app.state.server
    await call_engine(state, state.engine.continue_generation)
    return {"success": True, "paused": False}


async def flush_cache(request: Request):
    """Every tenant's prefix-cache pages in every tier (/reset_prefix_cache is one tenant's)."""
    state = request.app.state.server
    return {"success": True, "pages_removed": await call_engine(state, state.engine.flush_cache)}


ADMIN_ROUTES = [("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
                ("/pause_generation", pause_generation, ["POST"]),
                ("/continue_generation", continue_generation, ["POST"]),
                ("/flush_cache", flush_cache, ["POST"])]
