"""The cache manager: builds and owns every KV store of one engine, behind one interface.

It holds the page allocator (pages.py), the device pool (pool.py, or the tiered pool of tiers.py
with `kv_tiering`) and the prefix cache (prefix.py) with its host and disk tiers. The engine and the
scheduler never ask which kind of pool it is: both pools answer the same step, release and
observability calls.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import replace
from fractions import Fraction

import torch

from ..config import ConfigError, EngineConfig
from ..request import Request
from ..sampling_params import InvalidRequest
from .memory import device_memory_bytes
from .pages import PageAllocator
from .pool import KVPool

logger = logging.getLogger(__name__)
DEFAULT_KV_CACHE_TOKENS = 1 << 21  # pool size when neither num_kv_pages nor a budget is given


class CacheManager:
    def __init__(self, config: EngineConfig, model, dtype: torch.dtype, device: torch.device, max_model_len: int):
        self.config, self.model, self.dtype, self.device = config, model, dtype, device
        self.page_size, self.max_model_len = config.kv_page_size, max_model_len
        self.pool, self.allocator = self._build_pool()
        self.prefix = self._build_prefix_cache() if config.enable_prefix_caching else None
        share = config.tenant_kv_share
        self.tenant_pages = None if share is None else _share_of(share, self.allocator.num_pages)
        self._keep: set[str] = set()  # requests whose pages stay held when they end (`keep_pages`)
        self._kept: dict[str, list[int]] = {}  # ended requests' pages, held until `release_pages`

    # -- building ------------------------------------------------------------------------------
    def _build_pool(self):
        pool, allocator = self._build_plain_or_tiered_pool()
        padding = getattr(pool, "padding_slot", None)  # a plain pool's padding page (decode graphs)
        for selector in self.model.selectors():  # state kept per slot (Quest's page bounds)
            selector.reserve_slots(pool.num_slots if padding is None else padding + self.page_size)
        return pool, allocator

    def _build_plain_or_tiered_pool(self):
        config, cfg = self.config, self.model.cfg
        if config.kv_tiering:  # the tiered pool sizes the (logical) page table from its budgets
            from .tiers import build_tiered_cache
            pool = build_tiered_cache(config, self.model, self.dtype, self.device, self._num_pages())
            return pool, PageAllocator(pool.sizes.num_pages, self.page_size)
        allocator = PageAllocator(self._fitting(self._num_pages()), self.page_size)
        mtp = self._mtp_layers()
        # Quest reads no indexer keys (the MTP layer's own indexer does): none kept for the full layers,
        # as the tiered pool keeps none, so both hold (and move) pages of one layout
        keyed = [] if config.selector == "quest" else cfg.full_layers
        pool = KVPool(cfg, allocator.num_pages, self.page_size, self.dtype, self.device,
                      list(range(cfg.num_hidden_layers)) + mtp, keyed + mtp, self._latent_format(),
                      padding_page=config.decode_graph_mode() != "off")
        return pool, allocator

    def _fitting(self, num_pages: int) -> int:
        """`num_pages`, once checked against the device's memory (ConfigError if the pool could never be
        allocated there, rather than failing deep in an allocation or being killed for memory)."""
        from .sizing import format_of, untiered_bytes_per_token
        per_token = untiered_bytes_per_token(self.config, self.model.cfg, format_of(self.dtype.itemsize),
                                             self._latent_format().row_bytes)
        need, have = num_pages * self.page_size * per_token, device_memory_bytes(self.device)
        if have is not None and need > have:
            raise ConfigError(f"the KV cache would take {need / 2 ** 30:.1f} GiB ({num_pages} pages of "
                              f"{self.page_size} tokens: max_num_seqs x max_model_len={self.max_model_len}, or "
                              f"num_kv_pages) and the {self.device.type} has {have / 2 ** 30:.1f} GiB; lower "
                              f"max_model_len or max_num_seqs, or set num_kv_pages or device_kv_budget_bytes")
        return num_pages

    def _mtp_layers(self) -> list[int]:
        drafting = self.config.num_speculative_tokens and self.model.mtp is not None
        return [self.model.cfg.num_hidden_layers] if drafting else []

    def _latent_format(self):
        from .latent_format import latent_format
        return latent_format(self.config.kv_cache_dtype, self.model.cfg, self.dtype)

    def _num_pages(self) -> int:
        config = self.config
        if config.num_kv_pages:
            return config.num_kv_pages
        if config.device_kv_budget_bytes and not config.kv_tiering:
            from .sizing import format_of, untiered_pages
            return untiered_pages(config, self.model.cfg, format_of(self.dtype.itemsize),
                                  self._latent_format().row_bytes)
        # max_num_seqs requests of max_model_len each (whole pages each), up to the default budget
        per_request = -(-self.max_model_len // self.page_size)
        return min(per_request * config.max_num_seqs, -(-max(DEFAULT_KV_CACHE_TOKENS, self.max_model_len) // self.page_size))

    def _build_prefix_cache(self):
        from .prefix import PrefixCache
        from .prefix_host import PageRows, PrefixHostStore
        config, tiers = self.config, {}
        lookahead = 1 if config.num_speculative_tokens else 0
        rows = PageRows(self.pool.slot_tensors() + [t for s in self.model.selectors() for t in s.slot_tensors()],
                        self.page_size)
        quotas = [q for q in (config.prefix_cache_max_pages_per_tenant, self._tenant_quota(self.allocator.num_pages))
                  if q is not None]
        self.allocator.cached.max_per_tenant = min(quotas, default=None)
        for name in ("prefix_cache_host_bytes", "prefix_cache_disk_bytes"):
            budget = getattr(config, name)
            if budget is not None and budget < rows.page_bytes:
                raise ConfigError(f"{name}={budget} holds less than one {self.page_size}-token page of the "
                                  f"prefix cache ({rows.page_bytes} B); raise it")
        disk = self._build_disk_tier(rows, lookahead) if config.prefix_cache_disk_path else None
        if config.prefix_cache_host_bytes:
            tiers["host"] = PrefixHostStore(rows, config.prefix_cache_host_bytes,
                                            spill=disk.save_rows if disk is not None else None,
                                            max_pages_per_tenant=self._tenant_quota(
                                                config.prefix_cache_host_bytes // rows.page_bytes))
        if disk is not None:
            tiers["disk"] = disk
        return PrefixCache(self.allocator, lookahead=lookahead, tiers=tiers, before_copy=self.pool.flush,
                           ttl_s=config.prefix_cache_ttl_s, disk_read_ahead=config.prefix_cache_disk_read_ahead,
                           rows=rows, land_in_pool=True)  # imports: in pool pages, as admission would take them

    def _tenant_quota(self, tier_pages: int) -> int | None:
        """A tenant's share of a prefix-cache tier of `tier_pages` pages, in pages (None: no bound)."""
        share = self.config.prefix_cache_tenant_share
        return None if share is None else _share_of(share, tier_pages)

    def _disk_key_file(self) -> str | None:
        """The disk tier's key file: the operator's, else one generated in the tier's directory
        (kept there, so a restart reads its earlier pages); None for an unencrypted tier."""
        from .prefix_disk import default_key_file
        config = self.config
        if config.prefix_cache_disk_unencrypted or config.prefix_cache_disk_key_file is not None:
            return config.prefix_cache_disk_key_file
        try:
            path, made = default_key_file(config.prefix_cache_disk_path)
        except OSError as e:
            raise ConfigError(f"prefix_cache_disk_path: {e}") from None
        if made:
            logger.info("prefix cache disk tier: generated the encryption key %s (keep it with the tier; "
                        "prefix_cache_disk_key_file to keep one elsewhere)", path)
        return path

    def _build_disk_tier(self, rows, lookahead: int):
        from .prefix_disk import PrefixDiskStore, namespace, page_file_bytes
        config, key = self.config, self._disk_key_file()
        space = namespace(config, rows, lookahead, sealed=key is not None)
        option = "prefix_cache_disk_key_file" if config.prefix_cache_disk_key_file else "prefix_cache_disk_path's key"
        cipher = None if key is None else _page_cipher(option, key, space)
        old = [_page_cipher("prefix_cache_disk_old_key_files", path, space)
               for path in config.prefix_cache_disk_old_key_files or ()]
        if cipher is None:
            logger.warning("prefix cache disk tier %s is unencrypted (prefix_cache_disk_unencrypted): anyone who "
                           "can read its files reads the cached prompts' KV", config.prefix_cache_disk_path)
        file_bytes = page_file_bytes(rows, cipher)
        if config.prefix_cache_disk_bytes < file_bytes:
            raise ConfigError(f"prefix_cache_disk_bytes={config.prefix_cache_disk_bytes} holds less than one page "
                              f"file of the prefix cache ({file_bytes} B, metadata included); raise it")
        quota = self._tenant_quota(config.prefix_cache_disk_bytes // file_bytes)
        try:
            return PrefixDiskStore(rows, config.prefix_cache_disk_path, space, config.prefix_cache_disk_bytes, cipher,
                                   max_pages_per_tenant=quota, old_ciphers=old)
        except (ValueError, OSError) as e:
            raise ConfigError(f"prefix_cache_disk_path: {e}") from None

    # -- admission -----------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """InvalidRequest if prompt + max_tokens can never be held (by the whole cache, or a tenant's share)."""
        pages, total = self.allocator.pages_for(num_prompt_tokens + max_tokens), self.allocator.num_pages
        need = (f"request needs {pages} KV pages for {num_prompt_tokens} + {max_tokens} tokens "
                f"(prompt + max_tokens); ")
        if pages > total:
            where = f"the pool has {total}"
            if self.config.kv_tiering:
                where = (f"the tiered cache holds {total} pages ({total * self.page_size} tokens), "
                         f"bounded by {self.pool.sizes.limit}")
            raise InvalidRequest(need + where, "max_tokens")
        optimistic = self.config.kv_admission == "optimistic"  # there the share is a guarantee, not a cap
        if self.tenant_pages is not None and pages > self.tenant_pages and not optimistic:
            raise InvalidRequest(need + f"a tenant may hold {self.tenant_pages} of the {total} "
                                 f"(tenant_kv_share {self.config.tenant_kv_share})", "max_tokens")

    # -- the step ------------------------------------------------------------------------------
    def register(self, req: Request) -> None:
        """Name the request's newly full, computed pages for the prefix cache."""
        if self.prefix is not None:
            self.prefix.register(req)

    def release(self, req: Request, name_pages: bool, keep_counters: bool) -> None:
        """A request leaving the running set (finished, aborted or preempted), before its pages are freed:
        its full pages named for the prefix cache (`name_pages`), its prefix chain and its tier working
        set let go (its tier counters too unless `keep_counters`)."""
        if self.prefix is not None:
            if name_pages:
                self.prefix.register(req)
            self.prefix.forget_request(req.request_id, keep_served=keep_counters)
        self.pool.release(req.request_id, keep_counters=keep_counters)

    # -- prefill/decode disaggregation (docs/disaggregation.md): pages move through the prefix cache --
    def keep_pages(self, request_ids: list[str]) -> None:
        """When these requests end, their pages stay held until `release_pages`: a prefill worker names a
        prompt's last pages to the decode worker after its request ended, and an ended request's pages,
        cached but held by no one, may be evicted by the very next step's allocation."""
        self._keep.update(request_ids)

    def release_pages(self, request_ids: list[str], ended_only: bool = False) -> None:
        """Let go of the pages `keep_pages` held (cached, as any ended request's), and of the wish to keep
        those of the requests that have not ended (`ended_only`: not of that wish)."""
        for request_id in request_ids:
            if not ended_only:
                self._keep.discard(request_id)
            pages = self._kept.pop(request_id, None)
            if pages:
                self.allocator.free(_keeper(request_id), pages)

    def hold_ended(self, req: Request) -> None:
        """A request's end, before its pages are freed: held on if `keep_pages` asked (last page first, as
        the scheduler frees a request's: the tail of a prompt is evicted before its head)."""
        if req.request_id in self._keep and req.page_ids:
            self._keep.discard(req.request_id)
            self._kept[req.request_id] = req.page_ids[::-1]
            self.allocator.add_owner(_keeper(req.request_id), req.page_ids)

    def export_prefix(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None,
                      skip: int = 0) -> list:
        return self._prefix_cache().export(token_ids, tenant, cache_salt, skip)

    def page_tensors(self) -> list:
        """A page's slot-indexed tensors with their tokens per row, in the order export_prefix gives its rows."""
        return self._prefix_cache().rows.tensors

    def held_prefix(self, token_ids: list[int], tenant: str = "default", cache_salt: str | None = None) -> int:
        return self._prefix_cache().held(token_ids, tenant, cache_salt)

    def import_prefix(self, pages: list, tenant: str = "default", prompts: list[list[int]] = (),
                      cache_salt: str | None = None, tails: list | None = None, tail_uses: int = 1,
                      chains: list[list[bytes]] | None = None) -> int:
        """Keep exported pages, all or none. They land in the pool (with `kv_tiering` its latents in the
        host store the request decodes from), with the pages of `prompts` this cache already held before
        them; when the pool has no room, in the prefix cache's host tier (a hit copies them into pool
        pages). `tails`: per prompt, None or the rows of its last token's page through that token, one
        tensor per kind; its requests (`tail_uses`: the prompt's choices), each added with the first
        token sampled where the prompt was computed, then compute from that token on
        (`PrefixCache.take`). Or a short tail, through the token before: its requests, added without
        a first token, compute the last token and sample from it. `chains`: the prompts' page names
        (`prompt_chains`), for a caller that imports a prompt's pages in several calls."""
        prefix = self._prefix_cache()
        if tail_uses < 1:
            raise ValueError(f"tail_uses must be >= 1, got {tail_uses}")
        if chains is None:
            chains = self.prompt_chains(prompts, tenant, cache_salt)
        elif len(chains) != len(prompts):
            raise ValueError(f"{len(chains)} chains of page names for {len(prompts)} prompts")
        padded = prefix.padded_tails([(prefix.tail_name(p, tenant, cache_salt, chain), rows, len(p))
                                      for p, chain, rows in zip(prompts, chains, tails or ()) if rows])
        n = prefix.import_pages(pages, tenant, chains)
        prefix.keep_tails(padded, tail_uses, tenant)
        return n

    def prompt_chains(self, prompts: list[list[int]], tenant: str = "default",
                      cache_salt: str | None = None) -> list[list[bytes]]:
        """The names of each prompt's cacheable pages (hashes of its tokens: no engine state is read)."""
        prefix = self._prefix_cache()
        return [prefix.prompt_names(p, tenant, cache_salt) for p in prompts]

    def forget_prefix(self, names: list[bytes]) -> int:
        """Forget the named pages in every tier unless a request holds one (an import undone)."""
        return self._prefix_cache().forget(names)

    def _prefix_cache(self):
        if self.prefix is None:
            raise ValueError("moving KV pages between engines needs enable_prefix_caching")
        return self.prefix

    def expire(self) -> int:
        return self.prefix.expire() if self.prefix is not None else 0

    def reset(self, tenant: str | None = None) -> int:
        return self.prefix.reset(tenant) if self.prefix is not None else 0

    def new_weights(self, checkpoint: str | None) -> int:
        """The weights changed (`checkpoint`: the directory they came from; None for tensors given in
        process): no page computed with the old ones is served again (PrefixCache.new_weights). The disk
        tier reopens in the new checkpoint's namespace, or stays off until weights come from one."""
        if self.prefix is None:
            return 0
        disk = None
        if checkpoint is not None and self.config.prefix_cache_disk_path:
            self.config = replace(self.config, model=checkpoint)
            old = self.prefix.tiers.pop("disk", None)
            if old is not None:
                old.close()  # first: the same weights again name the same directory, which one engine locks
            try:
                disk = self._build_disk_tier(self.prefix.rows, self.prefix.lookahead)
                if old is not None:
                    disk.carry_counts(old)  # the tier's counters count since the engine started
            except ConfigError as e:
                logger.warning("prefix cache disk tier: not reopened for the new weights: %s", e)
        return self.prefix.new_weights(disk)

    def wait_for_reads(self, timeout: float) -> None:
        if self.prefix is not None:
            self.prefix.wait_for_reads(timeout)

    def close(self) -> None:
        """Save the prefix cache's pages to its disk tier, if any, and let go of it."""
        if self.prefix is not None and "disk" in self.prefix.tiers:
            self.prefix.persist()
            disk = self.prefix.tiers.pop("disk")
            if "host" in self.prefix.tiers:
                self.prefix.tiers["host"].spill = None
            disk.close()

    # -- observability -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the page table can address (the device pool's, or the tiered cache's logical one)."""
        return self.allocator.num_pages * self.page_size

    def request_metrics(self, req: Request) -> dict:
        """Where its cached prompt tokens came from, and its tier figures."""
        served = self.prefix.served(req.request_id) if self.prefix is not None else {"host": 0, "disk": 0}
        return {"prefix_cached_tokens_device": req.num_cached_tokens - served["host"] - served["disk"],
                **{f"prefix_cached_tokens_{tier}": n for tier, n in served.items()},
                **self.pool.request_metrics(req.request_id, len(req.page_ids) * self.page_size)}

    def stats(self) -> dict:
        used_tokens = (self.allocator.num_pages - self.allocator.num_free) * self.page_size
        prefix = self.prefix.stats() if self.prefix is not None else {}
        return {**self.pool.stats(used_tokens), "kv_pages_total": self.allocator.num_pages,
                "kv_pages_free": self.allocator.num_free, "kv_pages_kept": sum(map(len, self._kept.values())), **prefix}

    def layout(self) -> dict[str, str]:
        """How the KV cache is laid out, as strings (vLLM's `cache_config_info` labels, and ours)."""
        config, tiers = self.config, self.prefix.tiers if self.prefix is not None else {}
        return {"block_size": str(self.page_size), "cache_dtype": config.kv_cache_dtype,
                "num_gpu_blocks": str(self.allocator.num_pages), "enable_prefix_caching": str(self.prefix is not None),
                **self.pool.layout(), "indexer_key_dtype": config.indexer_key_dtype, "selector": config.selector,
                "prefix_cache_tiers": ",".join(["device", *tiers]), "kv_admission": config.kv_admission,
                **({"prefix_cache_disk_encrypted": str(tiers["disk"].cipher is not None)} if "disk" in tiers else {})}

    def check_integrity(self, running: list[Request], waiting: set[str]) -> None:
        self.allocator.check_integrity()
        holders: dict[int, int] = {}  # page -> requests holding it (several: a shared prefix page), ended ones kept
        for request_id, pages in [(r.request_id, r.page_ids) for r in running] + list(self._kept.items()):
            assert len(set(pages)) == len(pages), f"{request_id} holds a page twice"
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        assert not self._kept.keys() & {r.request_id for r in running}, "a running request's pages are kept as ended"
        assert len(holders) == self.allocator.num_pages - self.allocator.num_free, "allocator and requests disagree"
        assert all(self.allocator.num_owners(p) == n for p, n in holders.items()), "page owners and requests disagree"
        shared = [p for p, n in holders.items() if n > 1]
        assert not shared or (self.prefix is not None and self.prefix.names_all(shared)), "a shared page has no name"
        active = {r.request_id for r in running}
        self.pool.check_integrity(active, waiting)
        if self.prefix is not None:
            self.prefix.check_integrity(active | waiting)


def _keeper(request_id: str) -> str:
    """The allocator's owner of an ended request's kept pages (`CacheManager.keep_pages`)."""
    return f"kept:{request_id}"


def _share_of(share: float, pages: int) -> int:
    """floor(share x pages) of the share as written: 0.29 of 100 pages is 29 (0.29 * 100 is 28.999...
    in binary floating point, which int() truncates to 28)."""
    return int(Fraction(repr(share)) * pages)


def _page_cipher(option: str, path: str, space: str):
    from .page_cipher import PageCipher
    try:
        with open(path, "rb") as f:
            _refuse_shared_key_file(path, os.fstat(f.fileno()).st_mode)
            return PageCipher(f.read(), space)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{option}: {e}") from None


def _refuse_shared_key_file(path: str, mode: int) -> None:
    """A key file group or others may read (or replace) protects nothing: refused, not used."""
    if mode & 0o077:
        raise ValueError(f"{path} may be read or written by group or others (mode {stat.S_IMODE(mode):o}); "
                         f"`chmod 600 {path}`")
