"""The prefill worker: computes a request's prompts and, while it does, streams their KV to the
decode worker that claims the room.

It runs each of the request's choices for its first token, sampled with the request's own parameters
(its seed, logprobs, grammar, penalties), and sends those tokens with the last batch: the decode worker
starts each choice from its first token (`first_token`). A choice's prompt pages are computed once:
the other choices of a prompt hit them and compute its last page again. With MTP drafting it runs each
prompt once, greedily, for three tokens instead: a page is named once the MTP layer's entries for it
exist, which the MTP pass after the first token writes for the prompt's last page; that run's first
token is sent only when every choice would sample it (`plain_greedy`), with the tail, else the decode
worker samples the first token itself after computing the prompt's last token from a short tail (the
tail less that token's rows, which are every choice's). Pages go in batches as they are named
(`_stream`), the last after the prefill. It answers with that short completion, plus the transfer's
figures in the `sparsekv` extension.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi.responses import JSONResponse

from ..error_text import first_line
from ..parallel.dp_held import drop_held, is_held
from ..request import SamplingParams
from ..server.errors import APIError, bad_request
from ..server.loop import EngineDead, RequestGroup, ShuttingDown, Submission
from ..server.serving import Job, run
from . import dp_send
from .transfer import STORE_CLIENTS, Room, connect, host_bootstrap, pair_backend
from .weights_stamp import check_same_weights, loaded_weights
from .first_token import first_token_of, first_token_params, first_token_wire, plain_greedy
from .layers import LayerFeed, kinds_of, named_parts, short_tail
from .outbox import Batches
from .router_workers import layout_mismatch
from .wire import RoomAborted, TransferError, prompt_digest, verify
from .worker import Worker

log = logging.getLogger("sparsekv.disagg")
STREAM_POLL_S = 0.005  # the longest pause between two looks for pages named since the last batch
COPY_POLL_S = 0.0005  # the pause between two looks at a layer delivery's device -> host copy (CUDA)


class PrefillWorker(Worker):
    def __init__(self, state, settings):
        super().__init__(state, settings)
        self.stream_poll_s: float | None = STREAM_POLL_S  # None: one look, after the prefill (bench transfer)
        self.layer_by_layer = settings.send == "layers"  # else a page's rows go once every layer computed them
        self.direct_send = True  # a data-parallel rank > 0 sends its rooms' tensors itself (else through rank 0)
        # each room's prompts on one data-parallel rank (the first's), not where the router puts each: a baseline
        self.one_rank_rooms = False
        self.rank_gpus: dict[int, str | None] = {}  # each data-parallel rank's GPU, asked at its first room (`_gpu_of`)
        try:
            self.store = host_bootstrap(settings.bootstrap_host, settings.bootstrap_port, settings.timeout_s)
        except Exception as e:  # the port is taken, or the host is not this machine's
            raise ValueError(f"--disaggregation-bootstrap-port {settings.bootstrap_port}: cannot listen on "
                             f"{settings.bootstrap_host}: {first_line(e)}") from None

    @property
    def bootstrap_port(self) -> int:
        return self.store.port

    async def serve(self, request, job: Job, field, prompts: list[list[int]]):
        if field.bootstrap_port != self.bootstrap_port:
            raise bad_request(f"disaggregation.bootstrap_port {field.bootstrap_port} is not this prefill worker's "
                              f"({self.bootstrap_port})", "disaggregation")
        room = self.open_room(field)
        job.builder.echo = None  # its answer is the prefill's own: the decode worker echoes (prompt logprobs too)
        subs, sends_first = self._prefill_subs(job, prompts)
        group = RequestGroup(job.group.request_ids[0].rsplit("-", 1)[0], len(subs))
        group.abortable = False  # NOTE: the decode worker holds the client's request: an abort there ends this room
        tapped = group.request_ids[::len(subs) // len(prompts)]  # each prompt's first choice
        prefill = asyncio.ensure_future(self._prefill(request, job, subs, group, sends_first))
        ended: list[float] = []  # when the prefill ended
        prefill.add_done_callback(lambda _: ended.append(time.monotonic()))
        try:
            figures = await self._transfer(request, room, job, prompts, prefill, ended, tapped, sends_first,
                                           len(subs) > 1)
        except RoomAborted as e:
            log.info("disaggregation room %s: %s", room, e)
            figures = None
            await self._end_aborted(prefill, group)
        except TransferError as e:
            raise self.failed(room, e) from None
        finally:
            if not prefill.done():
                await self._cancel(prefill)
            self.close_room(room)
        response = prefill.result()[0]  # a prefill refused (APIError) is raised here, after the decode worker learnt it
        if figures is None:
            return response
        body = json.loads(response.body)
        body["sparsekv"]["disaggregation"] = figures
        return JSONResponse(body)

    async def _end_aborted(self, prefill, group: RequestGroup) -> None:
        """End the prefill of a request the decode worker's /abort_request ended during its transfer as
        one server ends an aborted request: its engine requests stop, and it answers with what it computed
        so far and finish_reason "abort" (unless it had finished already)."""
        try:
            await self.state.loop.end_aborted(group)
        except (ShuttingDown, EngineDead) as e:  # the engine is going away: the prefill is cancelled (serve)
            raise APIError(503, str(e)) from None
        await asyncio.wait([prefill], timeout=self.settings.timeout_s)  # its outputs are queued by now

    async def _cancel(self, prefill) -> None:
        """End a prefill whose transfer failed, its requests aborted on the engine before this returns
        (serving.collect_replies queues the abort; a command queued after it runs after it)."""
        prefill.cancel()
        await asyncio.wait([prefill])
        try:
            await self.state.loop.call(lambda: None)
        except Exception:  # the engine loop is closing: nothing is left to wait for
            pass

    def _prefill_subs(self, job: Job, prompts: list[list[int]]) -> tuple[list[Submission], bool]:
        """What the engine runs, and whether its first tokens are the choices' (sent): each choice for
        its first token; with MTP drafting, each prompt once, greedily, for the tokens that name all
        its full pages, whose first token is every choice's when each samples greedily from unadjusted
        logits (`plain_greedy`; that run then reports the request's logprobs)."""
        if not self.state.engine.config.num_speculative_tokens:
            return [Submission(s.prompt, first_token_params(s.params)) for s in job.subs], True
        job.builder.n = 1
        greedy = all(plain_greedy(s.params) for s in job.subs)
        logprobs = job.subs[0].params.logprobs if greedy else None
        return [Submission(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=logprobs))
                for p in prompts], greedy

    async def _prefill(self, request, job: Job, subs: list[Submission], group: RequestGroup, sends_first: bool):
        """(response, group, each choice's first token, or None when `sends_first` is not set) of the
        prefill's engine requests (`group.request_ids`: a choice each, or with MTP drafting a prompt each)."""
        prefill = Job(group, subs, job.tenant, job.cache_salt, job.builder, False, False, job.client_params)
        states = []
        response = await run(request, self.state.loop, prefill, self.state.metrics, states)
        if not sends_first:
            return response, group, None
        n = len(job.subs) // len(states)  # choices per engine request
        return response, group, [first_token_of(states[i // n].out, sub.params) for i, sub in enumerate(job.subs)]

    async def _transfer(self, request, room: str, job: Job, prompts: list[list[int]], prefill, ended: list,
                        request_ids: list[str], sends_first: bool, several: bool) -> dict | None:
        """The room's pages to the decode worker that claims it, streamed while the prefill runs
        (`_stream`), with each prompt's tail: whole when the choices' first tokens go too
        (`sends_first`), else short (`layers.short_tail`).
        Returns the transfer's figures, or None when the prefill failed (the decode worker is told;
        the caller answers the prefill's own error)."""
        self.rooms[room] = "claim"
        feed = await self._tap(request_ids, prompts, sends_first)  # NOTE: before the claim: the first step may start before it
        try:
            return await self._claim_and_send(request, room, job, prompts, prefill, ended, feed, request_ids, several)
        finally:
            await self._untap(request_ids, feed)

    async def _claim_and_send(self, request, room: str, job: Job, prompts: list[list[int]], prefill, ended: list,
                              feed: LayerFeed | None, request_ids: list[str], several: bool) -> dict | None:
        out = Batches(await self.blocking(self._link, room), self.settings, self.device, self.nixl)
        try:
            raw = await self._claim_or_failed_prefill(request, out.link, prefill)
            if raw is None:
                await self.blocking(out.error, _prefill_failure(prefill))
                return None
            out.claimed = True
            claim = self._check_claim(raw, room, job, prompts)
            out.rank = await self._sending_rank(request_ids)
            self.rooms[room] = "send"
            return await self._stream(request, room, job, prompts, prefill, ended, claim, out, feed, request_ids,
                                      several)
        except TransferError as e:
            if out.peer_waiting:  # NOTE: the decode worker reads the error and cleans the room up itself
                await self.blocking(out.error_unless_answered, str(e))
            raise
        finally:
            await self.blocking(out.close)  # NOTE: off the event loop (a group's teardown takes ms)
            if out.rank is not None:
                await self._close_on_rank(out)
            if not out.peer_waiting and not out.told_error:
                await self.blocking(out.link.forget, out.index + 1)

    async def _claim_or_failed_prefill(self, request, link: Room, prefill) -> bytes | None:
        """The decode worker's claim, waited for while the prefill runs; None if the prefill failed. A
        prefill that ends without KV (refused: a status below 500, or failed) waits for the claim however
        early it came, so that the decode worker answers with the prefill's error at once: one that
        claimed after the room's keys were deleted would wait for them until its timeout. When no claim
        comes in time, the prefill's own error answers, not the missing claim."""
        try:
            raw = await self.take(link, "claim", "claim from a decode worker", request)
        except TransferError:
            if prefill.done() and _prefill_failure(prefill) is not None:
                return None
            raise
        return None if prefill.done() and _prefill_failure(prefill) is not None else raw

    async def _stream(self, request, room: str, job: Job, prompts: list[list[int]], prefill, ended: list,
                      claim: dict, out: "Batches", feed: LayerFeed | None, request_ids: list[str],
                      several: bool) -> dict | None:
        """While the prefill runs, each look (every STREAM_POLL_S, on the engine loop between two steps)
        sends the prompts' pages named since the last one: a page is named in the step that fills it
        (its MTP entries included), so chunk c's pages travel while chunk c + 1 computes. With a layer
        feed, the rows each layer writes go as it computes them, between the looks (layer i's while
        layer i + 1 computes), and a look sends the rest of those pages' rows with their names. The
        last batch, after the prefill's end, carries the rest and the prefill's timings.

        A look reads the pages (`_Reader`) apart from sending them. The read after the prefill's end
        starts as it ends, even while earlier batches are still being sent: it lets go of the pages the
        engine kept for the room's ended requests (`_tap`), so the hold never waits on the transfer. A
        room whose prefill runs `several` engine requests (choices, prompts) lets go of those ended so far
        at every look: one may end before the others, which may need its pages. A room of one request
        does only then (a data-parallel engine's release calls every rank)."""
        sent, streamed, nbytes = list(claim["held"]), 0, 0
        backend = pair_backend(self.settings.transfer, self.device.type, claim, await self._gpu_of(out.rank))
        base = {"room": room, "nonce": claim["nonce"], "backend": backend}
        reader = _Reader(lambda skip, releasing: self._export(job, prompts, skip, out, releasing), sent)
        prefill.add_done_callback(lambda _: reader.last(request_ids))
        if self.stream_poll_s is None:  # one look, after the prefill
            await asyncio.wait([prefill])
        if feed is not None:
            base["weights"] = feed.weights
            feed.claim()
        while True:
            finished = prefill.done()
            if await self.blocking(out.answered):  # the decode worker failed this room already
                _check_verdict(await self.blocking(out.link.get, "done"), {"nonce": claim["nonce"]}, self.settings.secret)
            failure = _prefill_failure(prefill) if finished else None
            if failure is not None:
                await self.blocking(out.error, failure)
                return None
            look = reader.last(request_ids) if finished else reader.next(request_ids if several else ())
            if feed is not None:
                nbytes += await self._send_layers_until(look, feed, out, base, claim, request, sent)
            pages, per_prompt, loaded = await look
            base["weights"] = await self.blocking(self.weights.stamp, loaded)
            self._check_weights(claim, base["weights"])
            if feed is not None:  # NOTE: the rows of the pages just named were queued before their names
                nbytes += await self._send_layers(feed, out, base, claim, request, sent)
            parts = named_parts(pages, per_prompt, sent, feed) or ([(per_prompt, pages, None)] if finished else [])
            for i, (counts, part, kinds) in enumerate(parts):
                meta = {**base, "names": [name.hex() for name, _ in part], "pages": counts, "kinds": kinds,
                        "num_kinds": None if kinds is None else feed.num_kinds, "last": finished and i == len(parts) - 1}
                if meta["last"]:
                    ended.append(time.monotonic())  # NOTE: its done callback may not have run yet
                    meta.update(skipped=claim["held"], streamed=streamed, **_times(prefill.result()[1], ended[0]))
                    if prefill.result()[2] is not None:
                        meta["first"] = [first_token_wire(f) for f in prefill.result()[2]]
                nbytes += await self._send(out, meta, kinds_of(part, kinds), request)
                streamed += 0 if finished else len(part)
            self._discard([r for _, rows in pages for r in rows])  # kinds that went by layer, kept by the sending rank
            sent = [n + more for n, more in zip(sent, per_prompt)]
            if finished:
                break
            await (feed.wait([prefill], self.stream_poll_s) if feed is not None
                   else asyncio.wait([prefill], timeout=self.stream_poll_s))
        _check_verdict(await self.take(out.link, "done", "verdict from the decode worker", request), meta,
                       self.settings.secret)
        return self._sent(meta, time.monotonic() - ended[0], nbytes, sum(sent) - sum(claim["held"]), streamed, out, feed)

    async def _sending_rank(self, request_ids: list[str]) -> int | None:
        """The data-parallel rank > 0 that publishes and sends the room's tensors itself (dp_send.py: over
        NIXL through an agent of its own): the one rank its prompts run on, whose rows stay there. None
        (rank 0 sends, fetching any rows kept on another rank) for a room whose prompts run on rank 0 or
        on several ranks (the router places each), or with `direct_send` off."""
        engine = self.state.engine
        if not self.direct_send or engine.config.data_parallel_size == 1:
            return None
        # NOTE: read here when every request has its rank (lookups of two dicts the loop writes: atomic;
        # `_tap` opened the calls and watches the requests), without a turn of the engine loop; else on
        # the loop, after the adds the prefill queued there (behind a step, they may not have run yet)
        rank = engine.rank_running(request_ids)
        if rank is None:
            try:
                rank = await self.state.loop.call(engine.rank_running, request_ids)
            except Exception as e:  # the engine going away (ShuttingDown, EngineDead, a rank's failure)
                raise TransferError(f"finding the data-parallel rank of the prompt failed: {first_line(e)}") from None
        return rank or None

    async def _gpu_of(self, rank: int | None) -> str | None:
        """The GPU the room's tensors leave from: this process's, or that of data-parallel rank `rank`,
        which sends them from its own (asked once per rank). A decode worker on that same GPU cannot
        pair with it over NCCL (`pair_backend`)."""
        if rank is None:
            return self.gpu
        if rank not in self.rank_gpus:
            self.rank_gpus[rank] = await self._on_rank(rank, dp_send.gpu_of)
        return self.rank_gpus[rank]

    async def _close_on_rank(self, out: "Batches") -> None:
        """The room ends on the rank that sent it: its group, store connection and rows left go."""
        try:
            await self._on_rank(out.rank, dp_send.close_room, out.link.name)
        except TransferError as e:  # the rank is gone: the engine fails with it
            log.warning("disaggregation room %s: closing it on data-parallel rank %s failed: %s", out.link.name,
                        out.rank, e)

    async def _on_rank(self, rank: int, fn, *args):
        """`fn(side, *args)` on data-parallel rank `rank`, a call that waits for no peer: TransferError if
        it fails there or does not answer within the timeout."""
        calling = self._calling(rank, fn, *args)
        try:
            return await asyncio.wait_for(calling, self.settings.timeout_s)
        except (RuntimeError, asyncio.TimeoutError) as e:  # its failure there arrives as its text
            raise TransferError(f"data-parallel rank {rank}: {first_line(e)}") from None

    def _calling(self, rank: int, fn, *args) -> asyncio.Future:
        """`fn(side, *args)` called on data-parallel rank `rank` (dp_held.RankCalls), as a future of this
        loop; TransferError if the call cannot go."""
        try:
            return asyncio.wrap_future(self.state.engine.call_rank(rank, fn, *args))
        except (RuntimeError, ValueError) as e:  # the ranks' calls failed, or the call does not pickle
            raise TransferError(f"data-parallel rank {rank}: {first_line(e)}") from None

    def _sent(self, meta: dict, transfer_s: float, nbytes: int, pages: int, streamed: int, out: "Batches",
              feed: LayerFeed | None) -> dict:
        """The transfer's figures (the response's and the log's), counted in the metrics."""
        figures = {"role": "prefill", "room": meta["room"], "queue_s": meta["queue_s"], "prefill_s": meta["prefill_s"],
                   "transfer_s": transfer_s, "backend": meta["backend"], "bytes": nbytes, "pages_sent": pages,
                   "pages_streamed": streamed, "pages_skipped": sum(meta["skipped"]), "batches": out.index,
                   "prefill_rank": out.rank or 0,  # the data-parallel rank that sent the tensors
                   # NOTE: the rows of pages the decode worker held were taken, not sent (`_send_layers`)
                   "pages_by_layer": 0 if feed is None else sum(page >= meta["skipped"][prompt]
                                                                for prompt, page in feed.tapped),
                   "layer_batches": 0 if feed is None else feed.batches}
        self.metrics.bytes.inc(nbytes)
        self.metrics.pages_skipped.inc(figures["pages_skipped"])
        self.metrics.seconds.observe(figures["transfer_s"])
        log.info("disaggregation room %s sent: %s", meta["room"], figures)
        return figures

    async def _send_layers_until(self, look, feed: LayerFeed, out: "Batches", base: dict, claim: dict,
                                 request, named: list[int]) -> int:
        """Send the layer rows of the step that runs while the look waits for its end."""
        nbytes = 0
        try:
            while not look.done():
                await feed.wait([look], None)
                nbytes += await self._send_layers(feed, out, base, claim, request, named)
        except BaseException:
            look.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now
            raise
        return nbytes

    async def _send_layers(self, feed: LayerFeed, out: "Batches", base: dict, claim: dict, request,
                           named: list[int]) -> int:
        """The layer rows queued so far, a batch per prompt and step (the layers it computed since the
        last), less each prompt's first `named` pages: those the decode worker holds, and those an
        earlier look named whole, the room's request computing them later (another request computed them
        first, and they were evicted before this one's admission could hit them); a tail's with its full
        layers' selections when the decode worker warms a tiered cache with them (its claim's `warm`)."""
        nbytes, held = 0, claim["held"]
        for prompt, first, count, deliveries in feed.take():
            cut = min(max(0, named[prompt] - first), count)
            if cut == count:
                self._discard_deliveries(deliveries)
                continue
            tail, warm = deliveries[0].tail, claim.get("warm") is True
            # NOTE: on CUDA the rows land when the GPU has run the step up to their layer: polled, so the
            # event loop (every other request's streaming) never blocks in the copies' event
            while not all(d.done() for d in deliveries):
                await asyncio.sleep(COPY_POLL_S)
            rows = [r[cut:] for d in deliveries for r in d.ready()]
            if tail and not feed.first_tokens:  # the decode side computes the last token: no selections
                rows, tail, warm = short_tail(rows, tail), tail - 1, False
            selecting = [d for d in deliveries if d.selected is not None] if warm else []
            meta = {**base, "names": [], "pages": [0] * len(held), "last": False,
                    "layer_rows": {"prompt": prompt, "first": first + cut, "count": count - cut,
                                   "layers": [d.layer for d in deliveries], "tail": tail,
                                   "selected": [d.layer for d in selecting]},
                    "kinds": [k for d in deliveries for k in d.kinds], "num_kinds": feed.num_kinds}
            nbytes += await self._send(out, meta, rows + [t for d in selecting for t in d.selected], request)
            feed.batches += 1
        return nbytes

    async def _send(self, out: "Batches", meta: dict, tensors: list, request) -> int:
        """One batch: its metadata published, the data path connected at the room's first tensors (a
        wait for the decode worker, `Worker.connected`), its tensors sent (another). A send that fails because
        the decode worker refused an earlier batch and left raises its refusal, which says why."""
        if out.rank is not None:
            return await self._send_from_rank(out, meta, tensors, request)
        try:
            if any(is_held(t) for t in tensors):  # a room sent through rank 0: another rank's rows come here first
                tensors = await self.blocking(self._fetch, tensors)
            sent = await self.blocking(out.publish, meta, tensors)
            if not sent:
                return out.push(sent)
            await self.connected(out.path, out.link, request, peer_left=out.refused)
            # NOTE: a send ends when the decode worker receives it: on a transfer thread it could wait for
            # a receive queued behind another room's on the decode worker, while that room's send waits
            # behind it here
            return await self.with_peer(out.link, "the decode worker's receive", request, out.push, sent)
        except TransferError:
            if await self.blocking(out.refused):
                _check_verdict(await self.blocking(out.link.get, "done"), meta, self.settings.secret)
            raise

    async def _send_from_rank(self, out: "Batches", meta: dict, tensors: list, request) -> int:
        """One batch of a room that data-parallel rank `out.rank` sends (dp_send.py): it publishes the
        metadata with its rows' specs, then joins the pair group (at the room's first tensors) and sends
        them, a wait for the decode worker as `_send`'s. A refusal by the decode worker raises it."""
        room = out.link.name
        try:
            nbytes = await self._on_rank(out.rank, dp_send.publish, self.settings, self.bootstrap_port, room, meta,
                                         tensors, out.index, out.tags)
            out.published(meta, tensors)
            if not tensors:
                return out.pushed(0, 0)
            pushing = self._calling(out.rank, dp_send.push, room, out.tags)
            try:
                await self._while_peer_works(pushing, out.link, "the decode worker's receive", request,
                                             peer_left=out.refused)
            except BaseException:  # NOTE: a join still waiting for the decode worker ends now, not at the timeout
                self._submit(self.state.engine.call_rank, out.rank, dp_send.abandon, room)
                raise
            try:
                pushing.result()
            except RuntimeError as e:  # it failed on the rank (its TransferError arrives as its text)
                raise TransferError(f"data-parallel rank {out.rank}: {first_line(e)}") from None
            return out.pushed(len(tensors), nbytes)
        except TransferError:
            if await self.blocking(out.refused):
                _check_verdict(await self.blocking(out.link.get, "done"), meta, self.settings.secret)
            raise

    def _fetch(self, tensors: list) -> list:
        """`tensors` with the rows another data-parallel rank keeps fetched here (a transfer thread)."""
        try:
            return self.state.engine.fetch_held(tensors)
        except Exception as e:  # the rank failed the call, or did not answer in time
            raise TransferError(f"fetching rows from a data-parallel rank failed: {first_line(e)}") from None

    def _discard(self, rows: list) -> None:
        """Rows that will not be sent (or were): those another data-parallel rank keeps go there now, in
        the order of that rank's calls (before the room's end there, say)."""
        handles: dict[int, set[int]] = {}
        for r in rows:
            if is_held(r):
                handles.setdefault(r.rank, set()).add(r.handle)
        for rank, mine in handles.items():
            try:
                self.state.engine.call_rank(rank, drop_held, sorted(mine), in_order=True)
            except RuntimeError:  # the ranks' calls failed: the engine fails with them, and the rows with it
                pass

    def _discard_deliveries(self, deliveries: list) -> None:
        self._discard([r for d in deliveries for r in d.rows])

    async def _tap(self, request_ids: list[str], prompts: list[list[int]], first_tokens: bool) -> LayerFeed | None:
        """Have the engine hand each prompt's pages out layer by layer as its steps compute them, queued
        until the claim says which the decode worker holds (None: chunk-by-chunk or one-look mode). On
        a data-parallel engine, another rank's rows stay on that rank, named here where they are
        (parallel/dp_taps.py, dp_held.py), and the engine remembers which rank each request runs on
        until the room ends, which is the rank that sends the room (`_sending_rank`). Streaming, the
        requests' pages stay held once they end (`CacheManager.keep_pages`) until the room's next look
        has read them (or `_untap`, when the room failed): the look after the prefill's end comes after
        its requests ended, when their pages might be evicted already. (The one-look mode keeps none: a
        choice's kept pages could keep the prompt's other choices out of the pool for good.) One engine
        call, queued before the requests' adds."""
        engine = self.state.engine
        watch = engine.config.data_parallel_size > 1
        feed = None
        if self.layer_by_layer and self.stream_poll_s is not None:
            feed = LayerFeed(asyncio.get_running_loop(), len(engine.kv.page_tensors()), first_tokens=first_tokens,
                             discard=self._discard_deliveries)

        def tap():  # NOTE: with the weights they are computed under (read together, between two steps)
            if self.stream_poll_s is not None:
                engine.kv.keep_pages(request_ids)
            if watch:
                engine.open_rank_calls()  # a room's rank > 0 sends it: `_sending_rank`
                engine.watch_ranks(request_ids, self.one_rank_rooms)
            if feed is not None:
                for i, (request_id, prompt) in enumerate(zip(request_ids, prompts)):
                    feed.tap_kinds = engine.tap_layers(request_id, len(prompt), 0, feed.deliver_for(i))
            return loaded_weights(engine)
        try:
            loaded = await self.state.loop.call(tap)
        except Exception as e:  # the engine going away (ShuttingDown, EngineDead)
            raise TransferError(f"tapping the prompt's layers failed: {e}") from None
        if feed is not None:
            feed.weights = await self.blocking(self.weights.stamp, loaded)
        return feed

    async def _untap(self, request_ids: list[str], feed: LayerFeed | None) -> None:
        engine = self.state.engine
        watched = engine.config.data_parallel_size > 1

        def untap():
            engine.kv.release_pages(request_ids)
            if feed is not None:
                for request_id in request_ids:
                    engine.untap_layers(request_id)
            if watched:
                engine.unwatch_ranks(request_ids)
        try:
            await self.state.loop.call(untap)
        except Exception:  # the engine loop is closing: its taps go with it
            pass

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
        mismatch = layout_mismatch({"this prefill worker": self.layout, "the decode worker": claim.get("layout")})
        if mismatch is not None:
            raise TransferError(mismatch)
        held = claim.get("held")
        if not (isinstance(held, list) and len(held) == len(prompts) and all(isinstance(n, int) and n >= 0 for n in held)):
            raise TransferError(f"the claim's held page counts are malformed: {held!r}")
        return claim

    @staticmethod
    def _check_weights(claim: dict, mine: dict) -> None:
        """Refuse a decode worker of other weights at every look, before sending anything of them (it
        checks each batch's stamp again, and on import: either side may load new weights in between)."""
        theirs = claim.get("weights")
        if isinstance(theirs, dict) and "weights_version" in theirs and "checkpoint" in theirs:
            check_same_weights(mine, theirs)

    async def _export(self, job: Job, prompts: list[list[int]], skip: list[int], out: "Batches",
                      release: list[str] = ()):
        """The pages of each prompt named after its first `skip`, and the weights that computed them
        (read together on the engine loop, once the running step ends: a weight update forgets every
        cached page); from the rank that sends the room, its rows kept there (`out.rank`). The rows are
        copies: the pages the engine kept for those of the requests `release` that ended are let go of
        in the same call."""
        engine = self.state.engine

        def export():
            if out.rank is not None:
                pages = [engine.export_held(out.rank, p, job.tenant, job.cache_salt, n, out.link.name)
                         for p, n in zip(prompts, skip)]
            else:
                pages = [engine.kv.export_prefix(p, job.tenant, job.cache_salt, skip=n) for p, n in zip(prompts, skip)]
            if release:
                engine.kv.release_pages(list(release), ended_only=True)
            return pages, loaded_weights(engine)
        try:
            per_prompt, loaded = await self.state.loop.call(export)
        except Exception as e:  # the engine going away (ShuttingDown, EngineDead)
            raise TransferError(f"exporting the prompt's pages failed: {e}") from None
        return [page for pages in per_prompt for page in pages], [len(pages) for pages in per_prompt], loaded

    def _link(self, room: str) -> Room:
        return Room(connect(self.settings.bootstrap_host, self.bootstrap_port, self.settings.timeout_s), room)

    def close(self) -> None:
        super().close()
        STORE_CLIENTS.drop(self.settings.bootstrap_host, self.bootstrap_port)  # this process's kept connections to it
        del self.store


class _Reader:
    """A room's looks, one at a time, each reading the pages named after those read before
    (`read(skip, releasing)`: `PrefillWorker._export`): so the last one (`last`, started as the prefill
    ends) may run while the batches of the one before it are still being sent."""

    def __init__(self, read, skip: list[int]):
        self.read, self.skip, self.lock, self._last = read, list(skip), asyncio.Lock(), None

    def next(self, releasing) -> asyncio.Future:
        return asyncio.ensure_future(self._look(releasing))

    def last(self, releasing) -> asyncio.Future:
        """The look after the prefill's end (started once)."""
        if self._last is None:
            self._last = self.next(releasing)
            self._last.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed room reads it never
        return self._last

    async def _look(self, releasing):
        async with self.lock:
            pages, per_prompt, loaded = await self.read(self.skip, releasing)
            self.skip = [n + more for n, more in zip(self.skip, per_prompt)]
            return pages, per_prompt, loaded


def _check_verdict(raw: bytes, meta: dict, secret: bytes) -> None:
    verdict = verify(secret, raw, "decode worker's verdict")
    if verdict.get("aborted") is True and not verdict.get("ok"):
        raise RoomAborted(f"the decode worker's request was aborted: {verdict.get('error', 'no reason given')}")
    if verdict.get("nonce") != meta["nonce"] or not verdict.get("ok"):
        raise TransferError(f"the decode worker refused the KV: {verdict.get('error', 'no reason given')}")


def _prefill_failure(prefill) -> dict | None:
    """Why a finished prefill has nothing to send, as the failed batch's metadata (None: it computed the
    prompts): `error`, and when it refused the request itself (bad input: a status below 500) `status`
    and `param`, which the decode worker answers with as one server would."""
    if prefill.cancelled():
        return {"error": "the prefill was cancelled"}
    e = prefill.exception()
    if e is not None and not isinstance(e, APIError):
        return {"error": f"the prefill failed: {e}"}
    if e is not None:
        message, status, param = e.message, e.status, e.param
    else:
        response = prefill.result()[0]
        if response.status_code == 200:
            return None
        error = _error_of(response)
        message = error.get("message") or "the prefill worker could not compute the prompt"
        status, param = response.status_code, error.get("param")
    return {"error": message, **({"status": status, "param": param} if 400 <= status < 500 else {})}


def _error_of(response) -> dict:
    """An error response's OpenAI error object ({} if its body is not one)."""
    try:
        error = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}


def _times(group: RequestGroup, finished: float) -> dict:
    """The prefill's share of the time to first token: queue (arrival to first step) and prefill."""
    scheduled = group.first_scheduled or finished
    return {"queue_s": scheduled - group.arrival, "prefill_s": finished - scheduled}
