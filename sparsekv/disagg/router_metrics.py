"""The router's own Prometheus series, `sparsekv:router_*` (named as server/metrics.py names the server's):
requests by endpoint and status, in flight, request seconds, worker failures by role, and each worker's
state read at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..server.metrics import LATENCY_BUCKETS, P
from .router_workers import WorkerPool


class RouterMetrics:
    """The router's own series, `sparsekv:router_*`, in their own registry."""

    def __init__(self, pool: WorkerPool):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "router_requests", "Requests answered, by endpoint and status (the HTTP "
                                "status, or the error event's code when a stream ended with one).",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge(P + "router_requests_in_flight", "Requests being answered.", registry=r)
        self.seconds = Histogram(P + "router_request_seconds", "Time from a request's arrival to the end of its "
                                 "answer.", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.failures = Counter(P + "router_transfer_failures", "Requests a worker failed (an error status >= 500, "
                                "a connection error, a timeout), by that worker's role.", ["role"], registry=r)
        r.register(WorkerCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerCollector:
    """Each worker's state at scrape time: up, its reported load, this router's requests in flight there."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self):
        labels = ["worker", "role"]
        up = GaugeMetricFamily(P + "router_worker_up", "1 while the worker is healthy and in its role.", labels=labels)
        load = GaugeMetricFamily(P + "router_worker_load", "Requests on the worker (the larger of its report and "
                                 "this router's in flight there).", labels=labels)
        mine = GaugeMetricFamily(P + "router_worker_requests_in_flight", "This router's requests in flight on the "
                                 "worker.", labels=labels)
        for w in self.pool.all():
            up.add_metric([w.url, w.role], float(w.up))
            load.add_metric([w.url, w.role], float(w.load))
            mine.add_metric([w.url, w.role], float(w.in_flight))
        yield from (up, load, mine)
