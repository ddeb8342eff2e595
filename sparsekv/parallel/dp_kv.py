"""`engine.kv`'s prefix-cache calls on a data-parallel engine, for prefill/decode disaggregation
(docs/disaggregation.md), which moves a prompt's pages through them. Each rank has its own cache, so
each call goes to one rank:

- a decode worker's `held_prefix` *claims* the rank the prompt will run on: the router's choice at
  that moment, counted in that rank's load from then on. The pages it counts are that rank's, its
  `import_prefix` lands them there, and the request, once added, runs there (`take_claim`);
- a prefill worker's `export_prefix` reads the rank that holds most of the prompt's pages (the one
  that computed it).

A claim counts once per room that made it (rooms of the same prompt share its rank). A room whose
request will not come (its transfer failed, or /abort_request ended it) releases its claims at once
(`release_claims`); one that never says stops counting after `claim_ttl_s`: the disaggregation worker
sets it from its timeout, past which no transfer waits.
"""
from __future__ import annotations

import time
from collections import OrderedDict

MAX_CLAIMS = 1 << 16  # a bound on the claims kept; the oldest goes first


def claim_key(token_ids: list[int], tenant: str, cache_salt: str | None) -> tuple:
    return tenant, cache_salt, len(token_ids), hash(tuple(token_ids))


class DataParallelKV:
    def __init__(self, engine, claim_ttl_s: float = 600.0):
        self.engine, self.claim_ttl_s = engine, claim_ttl_s  # engine: a DataParallelEngine
        self._claims: OrderedDict[tuple, list] = OrderedDict()  # key -> [rank, expiry, rooms counted]

    @property
    def prefix(self):
        """Rank 0's prefix cache (every rank's engine has one alike, or none)."""
        return self.engine.local.kv.prefix

    # -- decode side -------------------------------------------------------------------------------
    def held_prefix(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None) -> int:
        """How many of the prompt's first pages the rank it is claimed to holds, claiming one first (a
        room each call: every claim is taken by a request or released)."""
        rank = self._claim(token_ids, tenant, cache_salt, new_room=True)
        return self.on_rank(rank, "held_prefix", token_ids, tenant, cache_salt)

    def import_prefix(self, pages: list, tenant: str = "default", prompts: list[list[int]] = (),
                      cache_salt: str | None = None, **options) -> int:
        """Keep the pages on the rank each prompt claimed, all or none: on every such rank, or, when one
        refuses them, on none (the ranks that had kept them forget them again, unless a request holds
        one). Prompts claimed by different ranks each get their own pages (their chains'; a page they
        share goes to each): another prompt's pages would only take room in that rank's pool."""
        if not prompts:  # pages for no prompt in particular: rank 0 keeps them
            return self.on_rank(0, "import_prefix", pages, tenant, (), cache_salt, **options)
        tails = options.pop("tails", None) or [None] * len(prompts)
        chains = options.pop("chains", None)
        ranks: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            ranks.setdefault(self._claim(prompt, tenant, cache_salt), []).append(i)
        named = chains if chains is not None or len(ranks) == 1 else self.prompt_chains(prompts, tenant, cache_salt)
        kept: list[int] = []
        try:
            for rank, mine in ranks.items():
                own = pages if len(ranks) == 1 else _pages_named(pages, [named[i] for i in mine])
                self.on_rank(rank, "import_prefix", own, tenant, [prompts[i] for i in mine], cache_salt,
                             tails=[tails[i] for i in mine], **options, **_chains_of(chains, mine))
                kept.append(rank)
        except Exception:
            for rank in kept:
                self.on_rank(rank, "forget_prefix", [name for name, _ in pages])
            raise
        return len(pages)

    def forget_prefix(self, names: list[bytes]) -> int:
        """Forget the named pages on every rank, in every tier, unless a request holds one (a failed
        transfer's pages kept so far, wherever they landed). Returns how many."""
        return sum(self.on_every_rank("forget_prefix", names))

    def take_claim(self, token_ids: list[int], tenant: str, cache_salt: str | None) -> int | None:
        """The rank a prompt claimed, its claim ended (the caller assigns the request there), or None."""
        self._expire()
        if not self._claims:  # no disaggregated request waits: nothing to hash
            return None
        return self._end_one(claim_key(token_ids, tenant, cache_salt))

    def release_claims(self, prompts: list[list[int]], tenant: str = "default", cache_salt: str | None = None) -> None:
        """A room whose request will not come: each of its prompts' claims stops counting (one room's
        share of it: another room of the same prompt keeps its own)."""
        for token_ids in prompts:
            self._end_one(claim_key(token_ids, tenant, cache_salt))

    def _end_one(self, key: tuple) -> int | None:
        """One room's share of claim `key` ends: its rank stops counting it; the rank, or None."""
        entry = self._claims.get(key)
        if entry is None:
            return None
        entry[2] -= 1
        if entry[2] == 0:
            del self._claims[key]
        self.engine.router.finished(entry[0])
        return entry[0]

    def _claim(self, token_ids: list[int], tenant: str, cache_salt: str | None, new_room: bool = False) -> int:
        """The prompt's claimed rank; `new_room`: a room more counts it (a claim made here counts one)."""
        self._expire()
        key = claim_key(token_ids, tenant, cache_salt)
        router = self.engine.router
        entry = self._claims.get(key)
        if entry is not None:
            if new_room:
                entry[1], entry[2] = time.monotonic() + self.claim_ttl_s, entry[2] + 1
                self._claims.move_to_end(key)
                router.reserve(entry[0])
            return entry[0]
        rank = router.peek(token_ids, tenant, cache_salt)
        router.reserve(rank)
        self._claims[key] = [rank, time.monotonic() + self.claim_ttl_s, 1]
        while len(self._claims) > MAX_CLAIMS:
            self._drop_oldest()
        return rank

    def _expire(self) -> None:
        now = time.monotonic()
        while self._claims and next(iter(self._claims.values()))[1] < now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """The oldest claim ends without its requests: its rank stops counting each room's."""
        rank, _, rooms = self._claims.popitem(last=False)[1]
        for _ in range(rooms):
            self.engine.router.finished(rank)

    @property
    def num_claims(self) -> int:
        return len(self._claims)

    # -- prefill side ------------------------------------------------------------------------------
    def export_prefix(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None,
                      skip: int = 0) -> list:
        """The prompt's pages from the rank that holds most of them (ties: the lowest rank)."""
        held = self.on_every_rank("held_prefix", token_ids, tenant, cache_salt)
        rank = max(range(len(held)), key=lambda r: (held[r], -r))
        return self.on_rank(rank, "export_prefix", token_ids, tenant, cache_salt, skip=skip)

    def keep_pages(self, request_ids: list[str]) -> None:
        """`CacheManager.keep_pages` on every rank (each keeps the pages of those that end there)."""
        self.on_every_rank("keep_pages", request_ids)

    def release_pages(self, request_ids: list[str], ended_only: bool = False) -> None:
        self.on_every_rank("release_pages", request_ids, ended_only=ended_only)

    def prompt_chains(self, prompts: list[list[int]], tenant: str = "default",
                      cache_salt: str | None = None) -> list[list[bytes]]:
        """Rank 0's (page names hash the tokens alone: every rank names a prompt's pages alike)."""
        return self.engine.local.kv.prompt_chains(prompts, tenant, cache_salt)

    def page_tensors(self) -> list:
        """Rank 0's (every rank's cache has the same tensors)."""
        return self.engine.local.kv.page_tensors()

    # -- the calls -----------------------------------------------------------------------------------
    def on_rank(self, rank: int, method: str, *args, **kwargs):
        """`engine.kv.<method>(...)` on one rank; an exception there is raised here."""
        if rank == 0:
            return getattr(self.engine.local.kv, method)(*args, **kwargs)
        return result_of(self.engine.kv_call(rank, method, args, kwargs)[rank])

    def on_every_rank(self, method: str, *args, **kwargs) -> list:
        return [result_of(r) for r in self.engine.kv_call(None, method, args, kwargs)]


def kv_call(engine, rank: int, wanted: int | None, method: str, args, kwargs):
    """A rank's side of `DataParallelKV`'s calls: ("ok", value) or ("error", exception), None when
    another rank is wanted."""
    return answer_if_wanted(rank, wanted, lambda: getattr(engine.kv, method)(*args, **kwargs))


def answer_if_wanted(rank: int, wanted: int | None, fn):
    """A rank's answer to a call for one rank (`wanted`; None: every rank): ("ok", fn()) or ("error",
    exception), None when another rank is wanted (`result_of` reads it on rank 0)."""
    if wanted is not None and wanted != rank:
        return None
    try:
        return "ok", fn()
    except Exception as e:  # bad pages (ValueError) fail the call, never the rank
        return "error", e


def _pages_named(pages: list, chains: list[list[bytes]]) -> list:
    """The exported pages (name, rows) that these chains of page names name, in their order."""
    wanted = {name for chain in chains for name in chain}
    return [page for page in pages if page[0] in wanted]


def _chains_of(chains: list | None, prompts: list[int]) -> dict:
    """`import_prefix`'s chains of the prompts it lands on a rank, when the caller named them."""
    return {} if chains is None else {"chains": [chains[i] for i in prompts]}


def result_of(answer):
    status, value = answer
    if status == "error":
        raise value
    return value
