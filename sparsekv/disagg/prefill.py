"""The prefill worker: computes a request's prompts, then hands their KV to the decode worker that
claims the room.

It runs each prompt once (n choices share it) for one token, or three with MTP drafting: a page is
named once the MTP layer's entries for it exist, which the MTP pass after the first token writes.
It answers with that short completion, plus the transfer's figures in the `sparsekv` extension.
"""
from __future__ import annotations

import json
import logging
import time

from fastapi.responses import JSONResponse

from ..request import SamplingParams
from ..server.errors import APIError, bad_request
from ..server.loop import RequestGroup, Submission
from ..server.serving import Job, run
from .transfer import PREFILL_RANK, Room, connect, host_bootstrap, send_tensors, transfer_backend, transfer_device
from .weights_stamp import check_same_weights, loaded_weights
from .wire import (TransferError, as_bytes, pages_to_tensors, prompt_digest, sign, tensor_specs, verify)
from .worker import Worker

log = logging.getLogger("sparsekv.disagg")


class PrefillWorker(Worker):
    def __init__(self, state, settings):
        super().__init__(state, settings)
        try:
            self.store = host_bootstrap(settings.bootstrap_host, settings.bootstrap_port, settings.timeout_s)
        except Exception as e:  # the port is taken, or the host is not this machine's
            raise ValueError(f"--disaggregation-bootstrap-port {settings.bootstrap_port}: cannot listen on "
                             f"{settings.bootstrap_host}: {str(e).strip().splitlines()[0]}") from None

    @property
    def bootstrap_port(self) -> int:
        return self.store.port

    async def serve(self, request, job: Job, field, prompts: list[list[int]]):
        if field.bootstrap_port != self.bootstrap_port:
            raise bad_request(f"disaggregation.bootstrap_port {field.bootstrap_port} is not this prefill worker's "
                              f"({self.bootstrap_port})", "disaggregation")
        room = self.open_room(field)
        try:
            try:
                response, group = await self._prefill(request, job, prompts)
            except APIError as e:  # refused (bad input, queue full): the decode worker learns it at once
                await self.blocking(self._refuse, room, e.message)
                raise
            times = _times(group, time.monotonic())
            if response.status_code != 200:  # the decode worker learns it at once instead of at its timeout
                await self.blocking(self._refuse, room, "the prefill worker could not compute the prompt")
                return response
            figures = await self._transfer(request, room, job, prompts, times)
        except TransferError as e:
            raise self.failed(room, e) from None
        finally:
            self.close_room(room)
        body = json.loads(response.body)
        body["sparsekv"]["disaggregation"] = figures
        return JSONResponse(body)

    async def _prefill(self, request, job: Job, prompts: list[list[int]]):
        """Each prompt once, greedily, for the tokens that name all its full pages."""
        tokens = 3 if self.state.engine.config.num_speculative_tokens else 1
        subs = [Submission(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for p in prompts]
        group = RequestGroup(job.group.request_ids[0].rsplit("-", 1)[0], len(subs))
        job.builder.n = 1
        prefill = Job(group, subs, job.tenant, job.cache_salt, job.builder, False, False)
        return await run(request, self.state.loop, prefill, self.state.metrics), group

    async def _transfer(self, request, room: str, job: Job, prompts: list[list[int]], times: dict) -> dict:
        started = time.monotonic()
        self.rooms[room] = "claim"
        link = await self.blocking(self._link, room)
        waiting = None  # a decode worker waits for the metadata once its claim was read
        try:
            raw = await self.take(link, "claim", "claim from a decode worker", request)
            waiting = True
            claim = self._check_claim(raw, room, job, prompts)
            await self._check_weights(claim)
            self.rooms[room] = "export"
            pages, per_prompt, loaded = await self._export(job, prompts, claim["held"])
            self.rooms[room] = "send"
            meta = {"room": room, "nonce": claim["nonce"], "names": [name.hex() for name, _ in pages],
                    "pages": per_prompt, "skipped": claim["held"], **times,
                    "weights": await self.blocking(self.weights.stamp, loaded),
                    "backend": transfer_backend(self.device.type, claim.get("device"))}
            waiting = False
            nbytes = await self.blocking(self._send, link, meta, pages)
            _check_verdict(await self.take(link, "done", "verdict from the decode worker", request), meta,
                           self.settings.secret)
        except TransferError as e:
            if waiting:  # NOTE: the decode worker reads the error and cleans the room up itself
                await self.blocking(_tell_error, link, self.settings.secret, room, str(e))
            raise
        finally:
            if not waiting:
                await self.blocking(link.forget)
        figures = {"role": "prefill", "room": room, **times, "transfer_s": time.monotonic() - started,
                   "backend": meta["backend"], "bytes": nbytes, "pages_sent": len(pages),
                   "pages_skipped": sum(claim["held"])}
        self.metrics.bytes.inc(nbytes)
        self.metrics.pages_skipped.inc(figures["pages_skipped"])
        self.metrics.seconds.observe(figures["transfer_s"])
        log.info("disaggregation room %s sent: %s", room, figures)
        return figures

    def _check_claim(self, raw: bytes, room: str, job: Job, prompts: list[list[int]]) -> dict:
        """The decode worker's signed claim on the room, checked against this request."""
        claim = verify(self.settings.secret, raw, "decode worker's claim")
        if claim.get("room") != room:
            raise TransferError(f"the claim names room {claim.get('room')!r}")
        if claim.get("tenant") != job.tenant or claim.get("cache_salt") != job.cache_salt:
            raise TransferError("the two workers see another tenant or cache_salt for this request (are their "
                                "--api-key settings the same?)")
        if claim.get("prompts") != [prompt_digest(p) for p in prompts]:
            raise TransferError("the two workers tokenized the prompt differently (another tokenizer or chat "
                                "template?)")
        held = claim.get("held")
        if not (isinstance(held, list) and len(held) == len(prompts) and all(isinstance(n, int) and n >= 0 for n in held)):
            raise TransferError(f"the claim's held page counts are malformed: {held!r}")
        return claim

    async def _check_weights(self, claim: dict) -> None:
        """Refuse a decode worker of other weights before exporting or sending anything (it checks
        the metadata's stamp again on import: either side may load new weights in between)."""
        theirs = claim.get("weights")
        if isinstance(theirs, dict) and "weights_version" in theirs and "checkpoint" in theirs:
            engine = self.state.engine
            mine = await self.blocking(self.weights.stamp, await self.state.loop.call(lambda: loaded_weights(engine)))
            check_same_weights(mine, theirs)

    async def _export(self, job: Job, prompts: list[list[int]], held: list[int]):
        """The pages of each prompt after those the decode worker holds, and the weights that computed
        them (read together on the engine loop: a weight update forgets every cached page)."""
        engine = self.state.engine

        def export():
            pages = [engine.kv.export_prefix(p, job.tenant, job.cache_salt, skip=n) for p, n in zip(prompts, held)]
            return pages, loaded_weights(engine)
        try:
            per_prompt, loaded = await self.state.loop.call(export)
        except Exception as e:  # the engine going away (ShuttingDown, EngineDead)
            raise TransferError(f"exporting the prompt's pages failed: {e}") from None
        return [page for pages in per_prompt for page in pages], [len(pages) for pages in per_prompt], loaded

    def _link(self, room: str) -> Room:
        return Room(connect(self.settings.bootstrap_host, self.bootstrap_port, self.settings.timeout_s), room)

    def _send(self, link: Room, meta: dict, pages: list) -> int:
        """Publish the signed metadata and send the tensors; returns their bytes."""
        secret, timeout = self.settings.secret, self.settings.timeout_s
        stacked = pages_to_tensors(pages)
        meta["tensors"] = tensor_specs(secret, stacked)
        tensors = [as_bytes(t) for t in stacked]
        link.put("meta", sign(secret, meta))
        if tensors:
            backend = meta["backend"]
            group = link.pair_group(PREFILL_RANK, self.settings.bootstrap_host, timeout, backend)
            try:
                send_tensors(group, tensors, transfer_device(backend, self.device))
            finally:
                del group
        return sum(t.numel() for t in tensors)

    def _refuse(self, room: str, reason: str) -> None:
        try:
            link = self._link(room)
        except TransferError:
            return
        _tell_error(link, self.settings.secret, room, reason)

    def close(self) -> None:
        super().close()
        del self.store


def _check_verdict(raw: bytes, meta: dict, secret: bytes) -> None:
    verdict = verify(secret, raw, "decode worker's verdict")
    if verdict.get("nonce") != meta["nonce"] or not verdict.get("ok"):
        raise TransferError(f"the decode worker refused the KV: {verdict.get('error', 'no reason given')}")


def _tell_error(link: Room, secret: bytes, room: str, reason: str) -> None:
    """Let a decode worker waiting on the room fail now rather than at its timeout."""
    try:
        link.put("meta", sign(secret, {"room": room, "error": reason}))
    except TransferError:
        pass


def _times(group: RequestGroup, finished: float) -> dict:
    """The prefill's share of the time to first token: queue (arrival to first step) and prefill."""
    scheduled = group.first_scheduled or finished
    return {"queue_s": scheduled - group.arrival, "prefill_s": finished - scheduled}
