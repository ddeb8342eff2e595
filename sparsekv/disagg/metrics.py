"""A worker's transfer metrics, in its server's registry (named like server/metrics.py's)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ..server.metrics import LATENCY_BUCKETS, P


class TransferMetrics:
    """Bytes, seconds, failures and transfers in flight, on either side of a transfer."""

    def __init__(self, registry, model_name: str):
        label = ["model_name"]
        self.bytes = Counter(P + "disagg_transfer_bytes", "KV bytes transferred between prefill and decode "
                             "workers (tensor payload).", label, registry=registry).labels(model_name)
        self.seconds = Histogram(P + "disagg_transfer_seconds", "Time of one KV transfer past the prompt's "
                                 "prefill: from its end to the pages kept (decode) or the verdict (prefill); what "
                                 "streamed during the prefill is not in it.", label, buckets=LATENCY_BUCKETS,
                                 registry=registry).labels(model_name)
        self.failed = Counter(P + "disagg_transfers_failed", "KV transfers that failed (peer gone, timeout, "
                              "authentication, corruption).", label, registry=registry).labels(model_name)
        self.in_flight = Gauge(P + "disagg_transfers_in_flight", "Requests of this worker in a KV transfer room.",
                               label, registry=registry).labels(model_name)
        self.pages_skipped = Counter(P + "disagg_pages_skipped", "Prompt pages not sent because the decode worker "
                                     "held them.", label, registry=registry).labels(model_name)
