"""Every counter and histogram of the router, declared once with its help text and used by
attribute (``metrics.pd_retries.inc()``). Values read at scrape time from a part's own state
(healthy workers, the directory, admission) are declared by that part, beside the state.

Counters the dashboards need before the first event are exported at 0 from the start
(``RouterMetrics.create``); the rest appear with their first event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from prometheus_client import Histogram

from epdserve.api.metrics import Metrics
from epdserve.api.protocol import RequestKind
from epdserve.router.trail import ROUTER_STAGES


@dataclass(frozen=True)
class Count:
    """One counter: its name and help, written here only."""

    metrics: Metrics
    name: str
    help: str
    labels: tuple[str, ...] = ()

    def inc(self, value: float = 1.0, **labels: str) -> None:
        self.metrics.inc(self.name, value, labels=labels or None, help_text=self.help)

    def declare(self, *label_sets: dict[str, str]) -> None:
        """Exported at 0 from now: unlabelled, or with each set of label values given."""
        counter = self.metrics.counter(self.name, self.help, self.labels)
        if not self.labels:
            counter.inc(0)
        for labels in label_sets:
            counter.labels(**labels)


@dataclass(frozen=True)
class RouterMetrics:
    registry: Metrics  # the role's registry: rendered at /metrics, shared with the read-at-scrape values
    dispatch: Count
    dispatch_fallbacks: Count
    kv_routed: Count
    kv_cached_tokens: Count
    encodes_skipped: Count
    encoder_retries: Count
    requests: Count
    pd_retries: Count
    scrape_failures: Count
    overloaded: Count
    streams_failed: Count
    leases_released: Count
    split_requests: Count
    prefill_retries: Count
    decode_retries: Count
    kv_released: Count
    encode_hist: Histogram
    stage_hist: Histogram
    ttfb_hist: Histogram

    @classmethod
    def create(cls, m: Metrics) -> RouterMetrics:
        def count(name: str, help_text: str, *labels: str) -> Count:
            return Count(m, name, help_text, labels)

        dispatch = count("router_dispatch_total", "media requests by where their media was encoded: "
                         "remote (encoders) or local (the worker, raw)", "path")  # fmt: skip
        dispatch.declare({"path": "remote"}, {"path": "local"})
        fallbacks = count("router_dispatch_fallbacks_total", "media sent raw because no encoder could take it")
        # counted with kv_aware routing; exported by every router so dashboards find them
        kv_routed = count("router_kv_routed_total", "requests sent to the worker holding their prefix")
        kv_cached_tokens = count("router_kv_cached_tokens_total", "prompt tokens cached on the chosen worker")
        skipped = count("router_encodes_skipped_total", "media items not encoded: the worker holds their KV")
        encoder_retries = count("router_encoder_retries_total", "encoder calls retried elsewhere")
        for c in (fallbacks, kv_routed, kv_cached_tokens, skipped, encoder_retries):
            c.declare()
        requests = count("router_requests_total", "chat requests answered, by kind and status", "kind", "status")
        requests.declare(*({"kind": kind, "status": "200"} for kind in get_args(RequestKind)))  # before the first
        pd_retries = count("router_pd_retries_total", "PD calls retried before the first byte")
        scrape_failures = count("router_scrape_failures_total", "worker metrics the router could not read")
        pd_retries.declare()
        scrape_failures.declare()
        encode_hist = m.histogram("router_encode_seconds", "time to encode a request's media")
        stage_hist = m.histogram("router_stage_seconds", "where requests' time went before a worker", ("stage",))
        for stage in ROUTER_STAGES:
            stage_hist.labels(stage=stage)  # exported before the first request
        return cls(
            m,
            dispatch,
            fallbacks,
            kv_routed,
            kv_cached_tokens,
            skipped,
            encoder_retries,
            requests,
            pd_retries,
            scrape_failures,
            overloaded=count("router_overloaded_total", "requests refused because encoders were busy"),
            streams_failed=count("router_streams_failed_total", "streams a worker broke off"),
            leases_released=count("router_leases_released_total", "leases given back to encoders"),
            split_requests=count("router_split_requests_total", "requests sent through prefill and decode workers"),
            prefill_retries=count("router_prefill_retries_total", "prefill calls retried elsewhere"),
            decode_retries=count("router_decode_retries_total", "decode calls recomputed elsewhere"),
            kv_released=count("router_kv_released_total", "KV leases given back to prefill workers"),
            encode_hist=encode_hist,
            stage_hist=stage_hist,
            ttfb_hist=m.histogram("router_first_byte_seconds", "time to the PD worker's first byte"),
        )
