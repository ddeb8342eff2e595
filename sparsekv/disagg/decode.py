"""The decode worker: takes a request's KV from the prefill worker, then generates as asked.

Before the request reaches its engine it claims the room on the prefill worker's bootstrap store,
telling it how many of each prompt's first pages it already holds (`engine.kv.held_prefix`: those
are not sent), receives the rest and checks every tensor's size and digest. Each batch's pages are
kept as the batch comes (`engine.kv.import_prefix`), in pool pages (with `--kv-tiering` their latents
are rows of the host store the request decodes from), or in the prefix cache's host tier when the
pool has no room; a room that fails forgets them again. The request then runs as a prefix hit, from
the first token the prefill worker sampled (`first_token`): with the last page's rows (a tail) it
computes that token alone (with `--kv-tiering` the positions the tail's rows selected on the prefill
side fill its device working set first), else the page holding the prompt's last token too (the
positions those rows select fill it). With MTP drafting on the prefill side a first token and a tail
come only for greedy choices; otherwise it samples the first token itself, after computing the
prompt's last token alone from a short tail (the page's rows before that token; the MTP layer's entry
at the last token depends on the token sampled after it).
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from types import SimpleNamespace

import torch

from ..cache.prefix import cacheable_pages, tail_tokens
from ..outputs import check_warm
from ..sampling_params import InvalidRequest
from ..server.errors import APIError
from ..server.serving import Job, answer, answer_aborted
from .first_token import first_tokens_from_wire
from .transfer import BACKENDS, Room, connect, meta_key, receiver
from .weights_stamp import check_same_weights, loaded_weights
from .wire import (PrefillRefused, RoomAborted, TransferError, at_once, check_received, prompt_digest, sign,
                   tensors_to_pages, verify)
from .worker import PeerTimeout, Worker

log = logging.getLogger("sparsekv.disagg")
PACE_DUTY = 0.2  # the share of the core a batch's receive work takes while the engine has requests running
PACE_MAX_PAUSE_S = 0.05  # the longest pause after one slice
KEEP_SLICE_PAGES = 8  # a batch before the last is kept this many pages per engine call (a step may run between)


class DecodeWorker(Worker):
    def __init__(self, state, settings):
        super().__init__(state, settings)
        self.owners: dict[str, RoomOwner] = {}  # room -> whose request it is, until the request is added

    async def serve(self, request, job: Job, field, prompts: list[list[int]]):
        room = self.open_room(field)
        ids = frozenset(job.group.client_id_of(i) for i in range(len(job.subs)))
        owner = self.owners[room] = RoomOwner(job.tenant, ids)
        failure = None
        try:
            figures = await self._take_kv(request, field, job, prompts)
        except TransferError as e:  # RoomAborted and PrefillRefused too
            failure = e
        finally:
            self.close_room(room)
            del self.owners[room]
        # NOTE: `owner.aborted` is read with no await between it and answer() queuing the add (app.abort_request)
        if owner.aborted or failure is not None:
            await self._release_claims(job, prompts)
        if owner.aborted:  # NOTE: an aborted request ends as aborted, whatever failed meanwhile
            log.info("disaggregation room %s: the request was aborted during its transfer", room)
            return await answer_aborted(request, self.state.loop, job, self.state.metrics)
        if failure is not None:
            raise self._error(room, failure) from None
        self.metrics.bytes.inc(figures["bytes"])
        self.metrics.pages_skipped.inc(figures["pages_skipped"])
        self.metrics.seconds.observe(figures["transfer_s"])
        log.info("disaggregation room %s received: %s", room, figures)
        job.builder.disaggregation = DecodeFigures(figures, job.group, time.monotonic())
        return await answer(request, self.state.loop, job, self.state.metrics)

    async def _release_claims(self, job: Job, prompts: list[list[int]]) -> None:
        """A data-parallel engine counts a claimed prompt in its rank's load until its request comes
        (parallel/dp_kv.py); this room's request never will, so its claims stop counting now."""
        engine = self.state.engine
        if engine.config.data_parallel_size > 1:
            try:
                await self.state.loop.call(engine.kv.release_claims, prompts, job.tenant, job.cache_salt)
            except Exception:  # the engine is going away: its claims go with it
                log.exception("releasing the claims of a room that ended without its request failed")

    def _error(self, room: str, e: TransferError) -> APIError:
        """What the client gets for a room that failed: the prefill worker's refusal of the request as
        one server answers it, else a failed transfer's 503."""
        if isinstance(e, PrefillRefused):
            return APIError(e.status, e.message, e.param)
        return self.failed(room, e)

    def abort_in_transfer(self, tenant: str, client_id: str | None) -> int:
        """/abort_request for the tenant's requests still in their transfer (named `client_id`, or all):
        each room ends at its next wait for the prefill worker or its next batch (`abort_asked`), forgets
        the pages it kept, tells the prefill worker in its verdict, and its client gets finish_reason
        "abort" with no token. How many it ended, as EngineLoop.abort_requests counts them: each of a
        room's client ids (a /generate batch's prompts given a `rid` each count one each, a room ending
        them all), so that a request counts alike in its transfer and after it; one already ended is not
        counted again."""
        ended = [owner for owner in self.owners.values() if not owner.aborted and owner.tenant == tenant
                 and (client_id is None or client_id in owner.client_ids)]
        for owner in ended:
            owner.aborted = True
        return sum(len(owner.client_ids) for owner in ended)

    def abort_asked(self, room: str) -> bool:
        """Whether /abort_request ended the room's request, once its claim is written. NOTE: not before:
        the prefill worker learns of the abort from the verdict, and without a claim it would wait for
        one until its timeout, its prefill running."""
        owner = self.owners.get(room)
        return owner is not None and owner.aborted and owner.claimed

    async def _take_kv(self, request, field, job: Job, prompts: list[list[int]]) -> dict:
        engine, loop = self.state.engine, self.state.loop
        held = await _on_engine(loop, lambda: [engine.kv.held_prefix(p, job.tenant, job.cache_salt) for p in prompts])
        chains = await self.blocking(engine.kv.prompt_chains, prompts, job.tenant, job.cache_salt)
        weights = await self.blocking(self.weights.stamp, await _on_engine(loop, loaded_weights, engine))
        self.rooms[field.room] = "claim"
        claim = {"room": field.room, "nonce": secrets.token_hex(16), "tenant": job.tenant,
                 "cache_salt": job.cache_salt, "prompts": [prompt_digest(p) for p in prompts], "held": held,
                 "device": self.device.type, "gpu": self.gpu, "transfer": self.settings.transfer,
                 "weights": weights,  # the prefill worker refuses other weights early
                 "warm": bool(engine.config.kv_tiering),  # a tail's selections warm a tiered cache
                 "layout": self.layout}  # the prefill worker refuses pages of another layout before sending
        link, meta = await self._claim(request, field, claim)
        inbox = Inbox(link, self.settings, self.device, self.nixl,
                      pacer=Pacer(lambda: loop.stats().get("running", 0) > 0), held=held)
        keep = Keep(job, prompts, chains, kept=[])
        early = 0  # pages kept before the last batch came
        try:
            while True:  # the batches, each checked as it comes, its pages kept (all of the room's, or none)
                self.stop_if_aborted(field.room)
                self._check_meta(meta, claim, inbox.weights)
                self.rooms[field.room] = "receive"
                if inbox.open(meta):  # the room's first tensors: join the prefill worker's data path
                    await self.connected(inbox.path, link, request)
                await self.blocking(inbox.receive, meta)
                if meta.get("last"):
                    break
                await self._keep(meta, inbox, keep)
                early = len(keep.kept)
                meta = await self._next_batch(request, inbox)
            self.stop_if_aborted(field.room)
            prefill_ended = time.monotonic()
            self.rooms[field.room] = "import"
            firsts = first_tokens_from_wire(meta["first"], len(job.subs)) if "first" in meta else None
            tails = inbox.complete_tails(prompts, engine.config.kv_page_size, len(engine.kv.page_tensors()),
                                         short=firsts is None)
            warm = self._warm(inbox, prompts, tails)
            version = await self._keep(meta, inbox, keep, tails)
        except BaseException as e:
            await self._forget(keep.kept)
            if not isinstance(e, TransferError):
                raise
            if inbox.peer_failed:  # NOTE: the prefill worker failed and left the room to us
                await self.blocking(link.forget, inbox.batches + 1)
            else:
                await self.blocking(self._verdict, link, meta, str(e), inbox.batches, isinstance(e, RoomAborted))
            raise
        finally:  # NOTE: a group's teardown takes ms; neither the event loop nor the request waits for it
            self.pool.submit(inbox.close)
        await self.blocking(self._verdict, link, meta, None, inbox.batches)
        if firsts is not None:  # NOTE: an update before the request's add drops them (add_request)
            per_prompt = len(job.subs) // len(prompts)
            stamped = [None if f is None else dataclasses.replace(f, weights_version=version, warm=warm[i // per_prompt])
                       for i, f in enumerate(firsts)]
            job.subs = [dataclasses.replace(sub, first_token=first) for sub, first in zip(job.subs, stamped)]
        return {"role": "decode", "room": field.room, "queue_s": meta["queue_s"], "prefill_s": meta["prefill_s"],
                "transfer_s": time.monotonic() - prefill_ended, "backend": meta["backend"], "bytes": inbox.nbytes,
                "pages_sent": len(keep.kept), "pages_streamed": meta.get("streamed", 0), "pages_kept_early": early,
                "pages_skipped": sum(held), "batches": inbox.batches, "paced_s": inbox.pacer.paused_s,
                "pages_by_layer": inbox.pages_by_layer, "layer_batches": inbox.layer_batches,
                "tail_tokens": sum(t[0].shape[0] for t in tails if t is not None),
                "first_tokens": 0 if firsts is None else sum(f is not None for f in firsts)}

    async def _claim(self, request, field, claim: dict):
        """Claim the room and wait for the prefill worker's first batch: (room link, its metadata)."""
        secret, timeout = self.settings.secret, self.settings.timeout_s
        # NOTE: a TCPStore client retries its connect for up to twice `timeout`: on a thread of its own,
        # so a dead prefill worker's address holds no transfer thread, and the wait ends with the client
        try:
            link = await self.with_peer(SimpleNamespace(name=field.room), "answer from the prefill worker's bootstrap",
                                        request, lambda: Room(connect(field.bootstrap_host, field.bootstrap_port, timeout),
                                                              field.room), thread="sparsekv-disagg-connect")
        except PeerTimeout:  # NOTE: what answered there, if anything, is not told (the request named the address)
            raise TransferError(f"cannot reach the prefill worker's bootstrap at {field.bootstrap_host}:"
                                f"{field.bootstrap_port} (no answer within {timeout:g} s)") from None
        try:
            await self.blocking(link.put, "claim", sign(secret, claim))
            self.owners[field.room].claimed = True
            meta = await self._batch_meta(request, link, 0)
        except RoomAborted as e:  # NOTE: the prefill worker reads why in the verdict, then deletes the room
            await self.blocking(self._verdict, link, {"nonce": claim["nonce"]}, str(e), 0, True)
            raise
        except TransferError:
            await self.blocking(link.forget)  # NOTE: the prefill worker is gone, or failed and left the room to us
            raise
        return link, meta

    async def _next_batch(self, request, inbox: "Inbox") -> dict:
        try:
            return await self._batch_meta(request, inbox.link, inbox.batches)
        except RoomAborted:  # the prefill worker is there: it reads the verdict
            raise
        except TransferError:
            inbox.peer_failed = True  # gone, failed or timed out: it reads no verdict
            raise

    async def _batch_meta(self, request, link: Room, batch: int) -> dict:
        raw = await self.take(link, meta_key(batch), "KV from the prefill worker", request)
        meta = verify(self.settings.secret, raw, "prefill worker's metadata")
        if "error" in meta:
            status, param = meta.get("status"), meta.get("param")
            if type(status) is int and 400 <= status < 500:
                raise PrefillRefused(status, str(meta["error"]), param if isinstance(param, str) else None)
            raise TransferError(f"the prefill worker failed: {meta['error']}")
        return meta

    async def _keep(self, meta: dict, inbox: "Inbox", keep: "Keep", tails: list | None = None) -> int:
        """Land the pages received since the last call, adding their names to `keep.kept`: a batch's as
        it comes, `KEEP_SLICE_PAGES` per engine call, so that its copies into the pool spread over the
        prefill between the engine's steps (a running request's step waits for a slice, not a batch);
        the last batch's at once (the request waits for it), with the tails. Returns the weights
        version they were kept under."""
        pages = inbox.take_pages()
        if not pages and tails is None:
            return -1
        mine = await self._weights_of(meta)
        size = KEEP_SLICE_PAGES if tails is None else max(1, len(pages))
        for start in range(0, max(1, len(pages)), size):
            part = pages[start:start + size]
            await self._import(mine, part, keep, tails if start + size >= len(pages) else None)
            keep.kept += [name for name, _ in part]
        return mine["weights_version"]

    async def _forget(self, names: list[bytes]) -> None:
        """A failed room's pages kept so far, forgotten again (unless a request holds one)."""
        if names:
            engine = self.state.engine
            try:
                await _on_engine(self.state.loop, engine.kv.forget_prefix, names)
            except TransferError:  # the engine is going away: its cache with it
                pass

    async def _weights_of(self, meta: dict) -> dict:
        """This worker's weights stamp, if the prefill worker computed the batch under the same weights
        (TransferError naming both otherwise)."""
        engine, loop = self.state.engine, self.state.loop
        mine = await self.blocking(self.weights.stamp, await _on_engine(loop, loaded_weights, engine))
        check_same_weights(meta.get("weights"), mine)
        return mine

    async def _import(self, mine: dict, pages: list, keep: "Keep", tails: list | None) -> None:
        """Keep the pages, all or none, under the weights of `mine`. The version is read again with the
        import, on the engine loop: an update in between forgets the cached pages, so none may be kept
        after it."""
        engine, job = self.state.engine, keep.job

        def land():
            if engine.weights_version != mine["weights_version"]:
                raise TransferError(f"this decode worker's weights changed during the transfer (weights_version "
                                    f"{mine['weights_version']} -> {engine.weights_version})")
            engine.kv.import_prefix(pages, job.tenant, keep.prompts, job.cache_salt, tails=tails or [],
                                    tail_uses=len(job.subs) // len(keep.prompts),  # each choice of a prompt
                                    chains=keep.chains)
        await _on_engine(self.state.loop, land)

    def _warm(self, inbox: "Inbox", prompts: list[list[int]], tails: list) -> list[tuple]:
        """Per prompt, the selections its tail's rows made (FirstToken.warm), checked against this
        worker's model and the prompt; none for a prompt without a whole tail (its page is computed here)."""
        cfg, warm = self.state.engine.model_config, []
        for p, (prompt, tail) in enumerate(zip(prompts, tails)):
            warm.append(inbox.warm(p) if tail is not None else ())
            try:
                check_warm(warm[-1], cfg.full_layers, cfg.index_topk, len(prompt))
            except InvalidRequest as e:
                raise TransferError(f"the prefill worker's selections for prompt {p} do not fit: {e}") from None
        return warm

    @staticmethod
    def _check_meta(meta: dict, claim: dict, weights: dict | None) -> None:
        """One batch's metadata: it answers this claim, its lists agree, and its pages were computed
        under the weights of the batches before it."""
        if meta.get("nonce") != claim["nonce"] or meta.get("room") != claim["room"]:
            raise TransferError("the prefill worker's metadata answers another claim")
        names, per_prompt = meta.get("names"), meta.get("pages")
        if not (isinstance(names, list) and isinstance(per_prompt, list) and len(per_prompt) == len(claim["held"])
                and sum(per_prompt) == len(names) and isinstance(meta.get("tensors"), list)):
            raise TransferError("the prefill worker's metadata is malformed")
        if not names and meta["tensors"] and "layer_rows" not in meta:
            raise TransferError("the prefill worker announced tensors for no pages")
        if meta.get("backend") not in BACKENDS:
            raise TransferError(f"the prefill worker named an unknown transfer backend {meta.get('backend')!r}")
        if weights is not None and meta.get("weights") != weights:
            raise TransferError("the prefill worker's weights changed during the transfer")

    def _verdict(self, link: Room, meta: dict | None, error: str | None, batches: int, aborted: bool = False) -> None:
        """Tell the prefill worker whether the KV was kept (it answers its own request from that, and
        deletes the room's keys). A prefill worker that left the room before (its client gone: it deleted
        the room's keys, the claim first) reads no verdict: the room's keys written since, the verdict and
        the pair group's rendezvous key of this side, are then this side's to delete (`batches`: the
        metadata keys read). So are they when the prefill worker failed too and wrote its error before
        this verdict, unread here: it looks for the verdict after writing its error (`Batches.error`),
        this side for an error after writing the verdict, so one of the two sees the other's key."""
        body = {"room": link.name, "nonce": (meta or {}).get("nonce"), "ok": error is None}
        if error is not None:
            body["error"] = error
        if aborted:  # the prefill worker ends its prefill as aborted, not as a failed transfer
            body["aborted"] = True
        try:
            link.put("done", sign(self.settings.secret, body))
            # NOTE: after the put: a prefill worker that deletes the room after it deletes the verdict too
            if not link.ready("claim"):
                link.forget(batches + 1)
            elif self._unread_error(link, batches):
                link.forget(batches + 2)
        except TransferError:
            pass  # the prefill worker is gone: it learns nothing, and needs nothing

    def _unread_error(self, link: Room, batches: int) -> bool:
        """Whether the prefill worker wrote an error this side never read: the batch after the last one
        read, or the one after it (this side may have failed between a batch's metadata and its tensors)."""
        for part in (meta_key(batches), meta_key(batches + 1)):
            raw = link.peek(part)  # NOTE: not get: the prefill worker may delete it meanwhile
            try:
                if raw is not None and "error" in verify(self.settings.secret, raw, "prefill worker's metadata"):
                    return True
            except TransferError:  # not signed with the room's secret: not the prefill worker's
                continue
        return False


@dataclasses.dataclass
class RoomOwner:
    """Whose request a room's transfer is for, as /abort_request names it (its tenant and client ids:
    a /generate batch's prompts may each have one, and naming any ends the whole room, which moves as
    one); whether an abort ended it, and whether the room's claim is written (the abort is acted on
    from then)."""
    tenant: str
    client_ids: frozenset[str]
    aborted: bool = False
    claimed: bool = False


@dataclasses.dataclass
class Keep:
    """What a room's pages are kept for: its request, its prompts and their page names (hashed once
    per room, for every call that keeps some), and the names of the pages kept so far."""
    job: Job
    prompts: list[list[int]]
    chains: list[list[bytes]]
    kept: list[bytes]


class Inbox:
    """The decode side of a room: the batches received so far, checked, and the data path they came
    over (transfer.receiver, made at the first tensor, kept for the room); the engine copies the rows
    into its pool when it keeps them. `pacer`: spreads a batch's receives and digests over the engine's
    steps (Pacer), all but the last batch's (the request waits for that one)."""

    def __init__(self, link: Room, settings, device, agent, pacer: "Pacer | None" = None, held: list[int] = ()):
        self.link, self.settings, self.device, self.agent = link, settings, device, agent
        self.pacer = pacer
        self.pages, self.batches, self.tags, self.nbytes = [], 0, 0, 0  # pages: named, complete, not taken yet
        self.weights, self.path = None, None
        self.peer_failed = False  # no next batch came: the prefill worker reads no verdict
        self.next_page = list(held)  # per prompt, the page its next named page is
        self.partial: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # (prompt, page) -> rows by kind, layer by layer
        self.tails: dict[int, tuple[int, int, dict[int, torch.Tensor]]] = {}  # prompt -> (page, rows, rows by kind)
        self.selections: dict[int, dict[int, tuple]] = {}  # prompt -> layer -> its tail's (union, last row's)
        self.pages_by_layer = self.layer_batches = 0

    def receive(self, meta: dict) -> None:
        """One batch's tensors, each checked against its size and digest: a layer batch's rows kept
        until their pages are named, a named batch's pages (with their rows that came layer by layer)."""
        try:
            names = [bytes.fromhex(n) for n in meta["names"]]
            specs = meta["tensors"]
            sizes = [int(t["nbytes"]) for t in specs]
        except (ValueError, TypeError, KeyError):
            raise TransferError("the prefill worker's metadata is malformed") from None
        self.batches += 1
        self.weights = meta.get("weights")
        pace = self.pacer if self.pacer is not None and not meta.get("last") else at_once  # NOTE: the last is awaited
        tensors = self._tensors(meta, specs, sizes, pace) if sizes else []
        if "layer_rows" in meta:
            self._keep_layer_rows(meta, tensors, pace)
        else:
            self.pages += self._named_pages(meta, names, tensors, pace)
        if meta.get("last") and self.partial:
            raise TransferError(f"rows came layer by layer for {len(self.partial)} pages the prefill worker never named")

    def open(self, meta: dict) -> bool:
        """Make the room's data path at the first batch with tensors; whether it was made now."""
        if self.path is not None or not meta.get("tensors"):
            return False
        self.path = receiver(meta["backend"], self.link, self.settings, self.device, self.agent)
        return True

    def _tensors(self, meta: dict, specs: list, sizes: list[int], pace) -> list[torch.Tensor]:
        self.open(meta)
        received = self.path.pull(meta, sizes, self.tags, pace)
        secret = self.settings.secret
        tensors = [pace(lambda: check_received(secret, spec, data, self.tags + i))
                   for i, (spec, data) in enumerate(zip(specs, received))]
        self.tags += len(sizes)
        self.nbytes += sum(sizes)
        return tensors

    def _keep_layer_rows(self, meta: dict, tensors: list[torch.Tensor], pace) -> None:
        """Rows of some layers for pages [first, first + count) of a prompt, kept until the pages are
        named; or a prompt's tail (the first rows of the page after its named ones), kept for the import."""
        prompt, first, count, kinds, selected = _layer_rows_of(meta, len(self.next_page))
        rows_end = len(tensors) - 2 * len(selected)  # a tail's selections follow its rows, two per layer
        tensors, selections = tensors[:rows_end], tensors[rows_end:]
        if len(kinds) != len(tensors) or any(t.shape[0] != count for t in tensors):
            raise TransferError(f"{len(kinds)} kinds of {count} pages announced, tensors of "
                                f"{[tuple(t.shape[:1]) for t in tensors]} received")
        tail = meta["layer_rows"].get("tail", 0)
        if selected and not tail:
            raise TransferError("selections came with layer rows that are not a prompt's tail")
        if tail:
            self._keep_tail(prompt, first, tail, kinds, tensors)
            self._keep_selections(prompt, selected, selections)
            self.layer_batches += 1
            return
        if first < self.next_page[prompt]:
            raise TransferError(f"layer rows came for page {first} of prompt {prompt}, already named")
        for i in range(count):
            rows = self.partial.setdefault((prompt, first + i), {})
            self.pages_by_layer += not rows
            for kind, t in zip(kinds, tensors):
                if kind in rows:
                    raise TransferError(f"rows of kind {kind} came twice for page {first + i} of prompt {prompt}")
                rows[kind] = t[i]
        self.layer_batches += 1

    def _keep_tail(self, prompt: int, page: int, tail: int, kinds: list[int], tensors: list[torch.Tensor]) -> None:
        if type(tail) is not int or page < 0 or {tuple(t.shape[:2]) for t in tensors} != {(1, tail)}:
            raise TransferError(f"a tail of {tail!r} rows announced for prompt {prompt}, tensors of "
                                f"{[tuple(t.shape[:2]) for t in tensors]} received")
        first, rows, by_kind = self.tails.setdefault(prompt, (page, tail, {}))
        if (first, rows) != (page, tail):
            raise TransferError(f"prompt {prompt}'s tail came as page {page} of {tail} rows, then as page {first} "
                                f"of {rows}")
        for kind, t in zip(kinds, tensors):
            if kind in by_kind:
                raise TransferError(f"rows of kind {kind} came twice for prompt {prompt}'s tail")
            by_kind[kind] = t[0].clone()

    def _keep_selections(self, prompt: int, layers: list[int], tensors: list[torch.Tensor]) -> None:
        """A tail's selections on its full layers (the positions its rows selected, the last row's), as
        FirstToken.warm takes them; checked against the prompt and the model with the first token."""
        kept = self.selections.setdefault(prompt, {})
        for layer, union, last in zip(layers, tensors[0::2], tensors[1::2]):
            if layer in kept or union.dtype != torch.int64 or last.dtype != torch.int64 or union.dim() != 1 \
                    or last.dim() != 1:
                raise TransferError(f"prompt {prompt}'s tail selections of layer {layer} came twice or malformed")
            kept[layer] = (union.numpy().copy(), last.numpy().copy())

    def warm(self, prompt: int) -> tuple:
        """FirstToken.warm for the choices of `prompt`: its tail's selections by layer."""
        return tuple((layer, union, last) for layer, (union, last) in sorted(self.selections.get(prompt, {}).items()))

    def complete_tails(self, prompts: list[list[int]], page_size: int, num_kinds: int, short: bool = False) -> list:
        """Per prompt, its tail's rows (one tensor per kind, in kind order) when it came whole, at the
        page after the prompt's cacheable ones and as long as its rows through its last token (`short`:
        through the token before, when no first token came: the decode engine computes the last token
        and samples it), else None (the decode engine computes that page)."""
        out = []
        for prompt, token_ids in enumerate(prompts):
            page, rows, by_kind = self.tails.get(prompt, (None, 0, {}))
            expected = (cacheable_pages(len(token_ids), page_size), tail_tokens(len(token_ids), page_size) - short)
            if page is not None and (page, rows) != expected:
                raise TransferError(f"prompt {prompt}'s tail came as page {page} of {rows} rows, not page "
                                    f"{expected[0]} of {expected[1]}" + (" (no first token came)" if short else ""))
            whole = page is not None and sorted(by_kind) == list(range(num_kinds))
            out.append([by_kind[k] for k in range(num_kinds)] if whole else None)
        return out

    def _named_pages(self, meta: dict, names: list[bytes], tensors: list[torch.Tensor], pace) -> list:
        """(name, rows) of a named batch's pages, each completed by the rows that came layer by layer."""
        pages = tensors_to_pages(names, tensors)
        kinds, num_kinds = _kinds_of(meta, len(tensors))
        out = iter(pages)
        complete = []
        for prompt, count in enumerate(meta["pages"]):
            for _ in range(count):
                name, carried = next(out)
                early = self.partial.pop((prompt, self.next_page[prompt]), {})
                self.next_page[prompt] += 1
                complete.append((name, _merged(dict(zip(kinds, carried)), early, num_kinds, prompt)))
        return complete

    def take_pages(self) -> list:
        """The complete pages received since the last call, for the engine to keep (their rows freed here)."""
        pages, self.pages = self.pages, []
        return pages

    def close(self) -> None:
        if self.path is not None:
            self.path.close()


class Pacer:
    """Spreads a batch's work on the decode worker's core (receives, digests) over the engine's
    steps: after each slice, while the engine has requests running (`busy()`), it pauses long enough
    for the slices to take at most `duty` of the core. A running stream's step then waits for a slice
    or so, not for the whole batch (several ms), so the streams' inter-token latency tail stays where it
    is; the batches of a long prompt still arrive well within its prefill.

    A slice is measured in this thread's CPU time (`clock`), not in wall time: a receive waiting for
    bytes still on the wire costs the core nothing, and pausing for it would only slow the transfer
    down on a slow link. Each pause is at most `max_pause_s`."""

    def __init__(self, busy, duty: float = PACE_DUTY, clock=time.thread_time, sleep=time.sleep,
                 max_pause_s: float = PACE_MAX_PAUSE_S):
        if not 0 < duty <= 1:
            raise ValueError(f"a pacer's duty must be in (0, 1], got {duty}")
        self.busy, self.duty, self.clock, self.sleep, self.max_pause_s = busy, duty, clock, sleep, max_pause_s
        self.paused_s = 0.0

    def __call__(self, fn):
        start = self.clock()
        out = fn()
        if self.duty < 1 and self.busy():
            pause = min((self.clock() - start) * (1 - self.duty) / self.duty, self.max_pause_s)
            self.sleep(pause)
            self.paused_s += pause
        return out


def _layer_rows_of(meta: dict, num_prompts: int) -> tuple[int, int, int, list[int], list[int]]:
    """A layer batch's (prompt, first page, pages, kinds, layers whose tail selections follow), checked."""
    try:
        rows, kinds = meta["layer_rows"], meta["kinds"]
        prompt, first, count = (rows[k] for k in ("prompt", "first", "count"))
        selected = rows.get("selected", [])
        ok = (all(type(v) is int for v in (prompt, first, count, *kinds, *selected)) and 0 <= prompt < num_prompts
              and first >= 0 and count >= 1 and len(set(kinds)) == len(kinds) and len(set(selected)) == len(selected))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise TransferError("the prefill worker's layer rows metadata is malformed")
    return prompt, first, count, kinds, selected


def _kinds_of(meta: dict, num_tensors: int) -> tuple[list[int], int]:
    """A named batch's kinds of row, in its tensors' order, and how many kinds a page has."""
    kinds, num_kinds = meta.get("kinds"), meta.get("num_kinds")
    if kinds is None:
        return list(range(num_tensors)), num_tensors
    if not (isinstance(kinds, list) and type(num_kinds) is int and len(kinds) == num_tensors
            and all(type(k) is int and 0 <= k < num_kinds for k in kinds) and len(set(kinds)) == len(kinds)):
        raise TransferError("the prefill worker's kinds of row are malformed")
    return kinds, num_kinds


def _merged(carried: dict, early: dict, num_kinds: int, prompt: int) -> list:
    """A page's rows by kind: those of its named batch and those that came layer by layer before it."""
    if not early:
        rows = carried
    elif carried.keys() & early.keys():
        raise TransferError(f"a page of prompt {prompt} got rows of kinds {sorted(carried.keys() & early.keys())} twice")
    else:
        rows = {**carried, **early}
    if rows.keys() != set(range(num_kinds)):
        raise TransferError(f"a page of prompt {prompt} has rows of kinds {sorted(rows)}, not 0 to {num_kinds - 1}")
    return [rows[k] for k in range(num_kinds)]


async def _on_engine(loop, fn, *args):
    try:
        return await loop.call(fn, *args)
    except TransferError:
        raise
    except Exception as e:  # rows that do not fit this cache (ValueError), or the engine going away
        raise TransferError(f"the engine could not take the KV: {e}") from None


class DecodeFigures:
    """The request's time to first token split by where it went, for the response's extension:
    the prefill worker's queue and prefill, the transfer, this worker's queue and first decode step
    (none when the prefill worker's first token came: the queue then ends with its output)."""

    def __init__(self, transfer: dict, group, submitted: float):
        self.transfer, self.group, self.submitted = transfer, group, submitted

    def __call__(self, firsts: list[float]) -> dict:
        """`firsts`: when each choice's first output came (monotonic), of those that have one."""
        scheduled = self.group.first_scheduled
        figures = dict(self.transfer)
        if figures.get("first_tokens") and firsts:  # the prefill worker's, output once the engine took them
            figures["decode_queue_s"], figures["first_decode_s"] = max(0.0, min(firsts) - self.submitted), 0.0
        elif scheduled is not None:
            figures["decode_queue_s"] = max(0.0, scheduled - self.submitted)
            if firsts:
                figures["first_decode_s"] = min(firsts) - scheduled
        return figures
