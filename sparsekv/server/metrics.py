"""Prometheus metrics, named `sparsekv:*` after vLLM's `vllm:*` so existing dashboards map over.

Two sources:
  * latency histograms and request counters, observed by the engine loop as tokens come out;
  * the engine's own figures (`engine.stats()`), read from the loop's latest snapshot at scrape time
    by a custom collector, so engine counters are exported as they are instead of being re-counted.

`ENGINE_GAUGES` / `ENGINE_COUNTERS` name every figure the issue lists; each is exported (0 until the
engine reports it). Keys not in either table are exported too: `prefix_cache_hits_<tier>` as one
counter labelled by tier, `spec_decode_num_*` as speculative-decoding counters under vLLM's names
(`SPEC_COUNTERS`; the per-position one labelled by `position`), any other number as a gauge, so a new
engine figure reaches /metrics without a server change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "sparsekv:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# the tier label of a tenant's cached pages -> its key in the prefix cache's tenant_stats()
TENANT_TIERS = (("device", "cached_pages"), ("host", "host_pages"), ("disk", "disk_pages"))

# engine.stats() key -> (metric name, help)
ENGINE_GAUGES = {
    "decode_graph_buckets": ("decode_graph_buckets", "Batch-size buckets whose decode pieces are captured as CUDA "
                                                     "graphs."),
    "decode_graph_eager_buckets": ("decode_graph_eager_buckets", "Buckets left eager: their captured replay "
                                                                 "differed from their eager run, or their capture "
                                                                 "was refused."),
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting for a batch slot."),
    "device_kv_bytes": ("device_kv_bytes", "Device KV bytes in use (latent + indexer keys)."),
    "device_latent_bytes": ("device_latent_bytes", "Device bytes of MLA latents in use."),
    "device_indexer_bytes": ("device_indexer_bytes", "Device bytes of DSA indexer keys in use."),
    "host_kv_bytes": ("host_kv_bytes", "Host-tier KV bytes in use."),
    "host_kv_budget_bytes": ("host_kv_budget_bytes", "Host-tier KV budget in bytes."),
    "kv_pages_total": ("kv_pages_total", "Device KV pages in the pool."),
    "kv_pages_free": ("kv_pages_free", "Device KV pages free (prefix-cached pages included: reusable until evicted)."),
    "kv_pages_kept": ("kv_pages_kept", "Device KV pages of ended prompts a prefill worker holds until its transfer has "
                                       "read them."),
    "prefix_cached_pages": ("prefix_cached_pages", "KV pages no request holds, kept for prefix-cache hits."),
    "weights_version": ("weights_version", "Weight updates loaded since the engine started (0: its first weights)."),
    "indexer_scratch_bytes": ("indexer_scratch_bytes",
                              "Bytes of the indexer's prefill score buffer (CPU; freed when no request is left)."),
    "held_rows_bytes": ("held_rows_bytes", "Host bytes of KV rows a data-parallel prefill rank keeps until they "
                                           "leave for a decode worker."),
    "held_rooms": ("held_rooms", "Disaggregated rooms a data-parallel prefill rank sends itself, in flight."),
}
ENGINE_COUNTERS = {
    "decode_graph_steps": ("decode_graph_steps", "Decode steps run as the decode graphs' fixed-shape pieces "
                                                 "(replayed from CUDA graphs where captured)."),
    "decode_graph_draft_steps": ("decode_graph_draft_steps", "MTP draft steps run as the decode graphs' draft "
                                                             "piece."),
    "decode_graph_extend_steps": ("decode_graph_extend_steps", "MTP extend passes run as the decode graphs' "
                                                               "extend pieces."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens prefilled (recomputed after a preemption too; "
                                       "prefix-cache hits not)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "steps": ("engine_steps", "Engine steps run."),
    "tier_hits": ("tier_hits", "Selected KV entries (one per position and layer) found in the device working set."),
    "tier_misses": ("tier_misses", "Selected KV entries (one per position and layer) copied in from the host tier."),
    "tier_warmed": ("tier_warmed", "KV entries (one per position and layer) placed in a device working set before "
                                   "its first decode, from a disaggregated prefill's selections."),
    "h2d_bytes": ("h2d_bytes", "Bytes copied host to device."),
    "d2h_bytes": ("d2h_bytes", "Bytes copied device to host."),
    "preemptions": ("num_preemptions", "Requests preempted."),
    "prefix_cache_queries": ("prefix_cache_queries",
                             "Prompt tokens of admitted requests, looked up in the prefix cache."),
    "prefix_cache_preempted_queries": ("prefix_cache_preempted_queries", "Tokens of preempted requests looked up in "
                                       "the prefix cache again (not in prefix_cache_queries)."),
    "prefix_cache_expired_pages": ("prefix_cache_expired_pages", "Prefix-cache pages dropped past their TTL."),
    "prefix_host_saves": ("prefix_host_saves", "Pages saved to the prefix cache's host tier."),
    "prefix_host_loads": ("prefix_host_loads", "Pages copied back from the prefix cache's host tier."),
    "prefix_host_evictions": ("prefix_host_evictions", "Pages evicted from the prefix cache's host tier."),
    "prefix_disk_writes": ("prefix_disk_writes", "Page files written to the prefix cache's disk tier."),
    "prefix_disk_reads": ("prefix_disk_reads", "Page files read back from the prefix cache's disk tier."),
    "prefix_disk_evictions": ("prefix_disk_evictions", "Page files evicted from the prefix cache's disk tier."),
    "prefix_disk_failures": ("prefix_disk_failures", "Disk-tier page files that failed to write or read."),
    "prefix_disk_rekeyed": ("prefix_disk_rekeyed", "Disk-tier page files sealed with an old key, sealed again with the current one."),
    "prefix_disk_discarded": ("prefix_disk_discarded", "Disk-tier page files no key of this engine opens, removed at start."),
}
PREFIX_HITS = "prefix_cache_hits_"
# engine.stats() key prefix -> a counter by tier (the rest of the key), and its help
BY_TIER = {PREFIX_HITS: "Prefix-cache hit tokens, by tier.",
           "prefix_cache_preempted_hits_": "Tokens of preempted requests served by the prefix cache again, by tier "
                                           "(not in prefix_cache_hits)."}
# Speculative decoding, vLLM's counters (engine key = metric name; speculative.py defines them); exported
# only when the engine reports them (with drafting on), as vLLM does.
SPEC_COUNTERS = {
    "spec_decode_num_drafts": "Verification steps that fed the target drafts.",
    "spec_decode_num_draft_tokens": "Draft tokens fed to the target, accepted or not.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
}
SPEC_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class RequestTimer:
    """Monotonic times of one engine request, for its latency histograms."""

    arrival: float
    tenant: str = "default"
    first_token: float | None = None
    last_token: float | None = None
    queued: bool = False  # its queue time observed (a decode worker's first token comes before it is scheduled)


class ServerMetrics:
    """All metrics of one server, in their own registry (several servers can share a process in tests)."""

    def __init__(self, model_name: str, stats: Callable[[], dict], healthy: Callable[[], bool],
                 cache_config: dict[str, str] | None = None):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def hist(name, doc):
            return Histogram(P + name, doc, label, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive outputs of a request.")
        self.tpot = hist("request_time_per_output_token_seconds", "Decode time per output token, per request.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue = hist("request_queue_time_seconds", "Time from arrival to the first scheduled step.")
        # per tenant (the API keys' tenants, a bounded label set): what one tenant sees beside another
        self.tenant_ttft = Histogram(P + "tenant_time_to_first_token_seconds", "Time from arrival to the first "
                                     "token, by tenant.", label + ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_itl = Histogram(P + "tenant_inter_token_latency_seconds", "Time between consecutive outputs "
                                    "of a request, by tenant.", label + ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.success = Counter(P + "request_success", "Requests finished, by reason.",
                               label + ["finished_reason"], registry=r)
        self.rejected = Counter(P + "requests_rejected", "Requests refused before admission, by reason.",
                                label + ["reason"], registry=r)
        self.aborted = Counter(P + "requests_aborted", "Requests aborted (client gone, shutdown, fault).",
                               label + ["reason"], registry=r)
        r.register(EngineStatsCollector(model_name, stats, healthy))
        if cache_config:  # vLLM's info-as-a-gauge: the cache's layout in labels, value 1
            info = Gauge(P + "cache_config_info", "KV cache configuration (labels), always 1.",
                         label + sorted(cache_config), registry=r)
            info.labels(model_name, *[cache_config[k] for k in sorted(cache_config)]).set(1)

    def observe(self, t: RequestTimer, out, now: float, scheduled: float | None) -> None:
        """Latencies of one engine output; called by the engine loop as the output comes out. Token
        latencies come from outputs that carry tokens: the final output of an aborted request carries
        none, and its wait is no token's."""
        if out.new_token_ids:
            self._token_latencies(t, now)
        if scheduled is not None and not t.queued:
            t.queued = True
            self.queue.observe(max(0.0, scheduled - t.arrival))
        if out.finished:
            self.e2e.observe(now - t.arrival)
            if len(out.token_ids) > 1 and t.first_token is not None:
                self.tpot.observe((t.last_token - t.first_token) / (len(out.token_ids) - 1))
            self.finish(out.finish_reason)

    def _token_latencies(self, t: RequestTimer, now: float) -> None:
        if t.first_token is None:
            t.first_token = now
            self.ttft.observe(now - t.arrival)
            self.tenant_ttft.labels(self.model_name, t.tenant).observe(now - t.arrival)
        else:
            self.itl.observe(now - t.last_token)
            self.tenant_itl.labels(self.model_name, t.tenant).observe(now - t.last_token)
        t.last_token = now

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def abort(self, reason: str, count: int = 1) -> None:
        if count:
            self.aborted.labels(self.model_name, reason).inc(count)

    def finish(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def render(self, per_tenant: bool = True) -> bytes:
        """The exposition; without `per_tenant`, no series labelled by tenant (the app decides who
        may see them: they tell one tenant's activity)."""
        return generate_latest(self.registry if per_tenant else _WithoutTenants(self.registry))


class _WithoutTenants:
    """A registry's families less any labelled by tenant, so that a new per-tenant series is left
    out of the public view without being listed anywhere."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples) and "tenant" not in family.name:
                yield family


class EngineStatsCollector:
    """Exports the latest `engine.stats()` snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict], healthy: Callable[[], bool]):
        self.model_name, self.stats, self.healthy = model_name, stats, healthy

    def collect(self):
        stats = dict(self.stats())
        yield self._gauge("engine_healthy", "1 while the engine loop is alive.", float(self.healthy()))
        total = stats.get("kv_pages_total") or 0
        usage = 1.0 - stats.get("kv_pages_free", total) / total if total else 0.0
        yield self._gauge("kv_cache_usage_perc", "Fraction of device KV pages in use (0..1).", usage)
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield self._gauge(name, doc, stats.pop(key, 0))
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield self._counter(name, doc, stats.pop(key, 0))
        yield from self._extra(stats)

    def _tenants(self, by_tenant: dict):
        """The prefix cache per tenant (tenants are the server's API-key tenants: a bounded label set)."""
        queries = CounterMetricFamily(P + "prefix_cache_tenant_queries", "Prompt tokens looked up in the prefix "
                                      "cache, by tenant.", labels=["model_name", "tenant"])
        hits = CounterMetricFamily(P + "prefix_cache_tenant_hits", "Prompt tokens the prefix cache served, "
                                   "by tenant (all tiers).", labels=["model_name", "tenant"])
        pages = GaugeMetricFamily(P + "prefix_cache_tenant_cached_pages", "Prefix-cache pages no request holds, "
                                  "by the tenant whose request computed them and by tier (device: the KV pool).",
                                  labels=["model_name", "tenant", "tier"])
        for tenant, figures in sorted(by_tenant.items()):
            queries.add_metric([self.model_name, tenant], figures["queries"])
            hits.add_metric([self.model_name, tenant], figures["hits"])
            for tier, key in TENANT_TIERS:
                if key in figures:
                    pages.add_metric([self.model_name, tenant, tier], figures[key])
        yield from (queries, hits, pages)

    def _tenant_kv(self, by_tenant: dict):
        """Requests and reserved KV pages per tenant (tenants with a request running or waiting)."""
        requests = GaugeMetricFamily(P + "tenant_requests", "Requests by tenant and state (running, waiting).",
                                     labels=["model_name", "tenant", "state"])
        pages = GaugeMetricFamily(P + "tenant_kv_pages", "KV pages reserved (prompt + max_tokens) by the tenant's "
                                  "running requests.", labels=["model_name", "tenant"])
        for tenant, figures in sorted(by_tenant.items()):
            for state in ("running", "waiting"):
                requests.add_metric([self.model_name, tenant, state], figures[state])
            pages.add_metric([self.model_name, tenant], figures["kv_pages"])
        yield from (requests, pages)

    def _spec(self, stats: dict):
        """vLLM's speculative-decoding counters, the per-position one labelled by draft position."""
        for key, doc in SPEC_COUNTERS.items():
            if key in stats:
                yield self._counter(key, doc, stats.pop(key))
        per_position = stats.pop(SPEC_PER_POSITION, None)
        if per_position is not None:
            fam = CounterMetricFamily(P + SPEC_PER_POSITION, "Draft tokens accepted, by position in the draft "
                                      "chain (0: the first draft).", labels=["model_name", "position"])
            for position, value in enumerate(per_position):
                fam.add_metric([self.model_name, str(position)], value)
            yield fam

    def _ranks(self, ranks: list[dict]):
        """Each rank's weights and peak memory (a parallel engine's ranks hold different slices)."""
        for key, doc in (("weight_bytes", "Model weight bytes held by the rank."),
                         ("kv_pool_bytes", "KV pool bytes of the rank (latents and indexer keys of every slot; "
                                           "with tiering the host store's latents)."),
                         ("peak_rss_bytes", "Peak resident memory of the rank's process.")):
            fam = GaugeMetricFamily(P + "rank_" + key, doc, labels=["model_name", "rank"])
            for figures in ranks:
                fam.add_metric([self.model_name, str(figures["rank"])], float(figures[key]))
            yield fam

    def _data_parallel_ranks(self, ranks: list[dict]):
        """Each data-parallel rank's requests, KV use and token counts, labelled `dp_rank` (vLLM labels its
        data-parallel engines' series `engine`): the sums hide one rank's pool filling up while another
        idles. A figure of the engine tables keeps its name and type behind `dp_rank_`; any other number
        is a gauge `dp_rank_<key>`."""
        if not ranks:
            return
        usage = GaugeMetricFamily(P + "dp_rank_kv_cache_usage_perc", "Fraction of the rank's device KV pages in "
                                  "use (0..1), by data-parallel rank.", labels=["model_name", "dp_rank"])
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for rank, figures in enumerate(ranks):
            labels = [self.model_name, str(rank)]
            total = figures.get("kv_pages_total") or 0
            usage.add_metric(labels, 1.0 - figures.get("kv_pages_free", total) / total if total else 0.0)
            for key, value in figures.items():
                if isinstance(value, dict):  # waiting requests, by tenant
                    value = sum(value.values())
                if key in ENGINE_COUNTERS:
                    kind, (name, doc) = CounterMetricFamily, ENGINE_COUNTERS[key]
                else:
                    kind, (name, doc) = GaugeMetricFamily, ENGINE_GAUGES.get(key, (key, f"engine figure {key}."))
                if name not in families:
                    families[name] = kind(P + "dp_rank_" + name, f"{doc} By data-parallel rank.",
                                          labels=["model_name", "dp_rank"])
                families[name].add_metric(labels, float(value))
        yield usage
        yield from families.values()

    def _extra(self, stats: dict):
        yield from self._ranks(stats.pop("ranks", []))
        yield from self._data_parallel_ranks(stats.pop("by_data_parallel_rank", []))
        yield from self._tenants(stats.pop("prefix_cache_by_tenant", {}))
        yield from self._tenant_kv(stats.pop("kv_by_tenant", {}))
        yield from self._spec(stats)
        numeric = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for prefix, doc in BY_TIER.items():
            tiers = {k[len(prefix):]: v for k, v in numeric.items() if k.startswith(prefix)}
            if tiers:
                fam = CounterMetricFamily(P + prefix.rstrip("_"), doc, labels=["model_name", "tier"])
                for tier, value in sorted(tiers.items()):
                    fam.add_metric([self.model_name, tier], value)
                yield fam
        for key, value in sorted(numeric.items()):
            if key.startswith(tuple(BY_TIER)):
                continue
            yield self._gauge(key, f"engine figure {key}", value)

    def _gauge(self, name: str, doc: str, value) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(P + name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam

    def _counter(self, name: str, doc: str, value) -> CounterMetricFamily:
        fam = CounterMetricFamily(P + name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam
