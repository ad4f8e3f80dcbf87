"""The encoder's metrics, declared at start-up so that a scrape shows every series (at zero)
before the first request: gauges read from the batcher, the EC producer and the shared store,
and the histograms the service observes into."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, get_args

from prometheus_client import Histogram

from epdserve.api.metrics import Metrics
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.protocol import ItemStatus
from epdserve.media.pending import PendingMedia
from epdserve.models.loader import LoadReport
from epdserve.store.base import EmbeddingStore
from epdserve.transfer.base import ECProducer

VISUAL_TOKENS = "visual tokens (embedding rows) served, by how"
PIXEL_ITEMS = "items that arrived decoded (the router's pixel handles): not fetched, hashed or decoded here"


class Histograms(NamedTuple):
    forward: Histogram  # one batched vision forward
    request: Histogram  # one /v1/encode request
    put: Histogram  # one EC-connector put
    batch_size: Histogram  # distinct items per forward


def declare_metrics(
    metrics: Metrics,
    batcher: EncodeBatcher,
    producer: ECProducer,
    store: EmbeddingStore | None,
    load_report: LoadReport,
    checkpoint_tensors: int,
    pending: PendingMedia,
) -> Histograms:
    """Every metric of an encoder on ``metrics``; the histograms it observes into."""
    m, b = metrics, batcher
    m.gauge("encoder_queue_depth", "media items waiting for a vision forward", lambda: b.queue_depth)
    held = "media held for the vision tower, from their decoding to their forward"
    m.gauge("encoder_pending_media_bytes", held, lambda: pending.held)
    m.gauge(
        "encoder_pending_media_refused",
        "items refused (429) because the media held for the vision tower was at its bound",
        lambda: pending.refused,
    )
    m.gauge("encoder_cache_bytes", "bytes held by the local embedding cache", lambda: b.cache.nbytes)
    m.gauge(
        "encoder_forwards_abandoned", "vision forwards stopped part-way: every caller had left", lambda: b.abandoned
    )
    m.gauge("encoder_cache_items", "items held by the local embedding cache", lambda: len(b.cache))
    m.gauge(
        "encoder_coalesced_items",
        "submissions that joined an in-flight forward of the same item",
        lambda: b.coalesced,
    )
    n = len(load_report.tensors)
    m.gauge("encoder_weight_tensors_loaded", "checkpoint tensors read at startup (vision tower only)", lambda: n)
    total = checkpoint_tensors
    m.gauge("encoder_checkpoint_tensors", "tensors in the checkpoint (all parts)", lambda: total)
    forward = m.histogram("encoder_forward_seconds", "wall time of one batched vision forward")
    request = m.histogram("encode_request_seconds", "wall time of one /v1/encode request")
    put = m.histogram("encoder_put_seconds", "wall time of one EC-connector put")
    batch_size = m.histogram(
        "encoder_batch_size", "distinct items per batched vision forward", buckets=(1, 2, 4, 8, 16, 32, 64)
    )
    failures = m.counter("encoder_put_failures_total", "EC-connector puts that failed, by cause", ("cause",))
    for cause in ("full", "error"):
        failures.labels(cause=cause)
    # declared up front so a scrape shows zeros before the first request
    for status in get_args(ItemStatus):
        m.inc("encoder_items_total", 0, {"status": status}, "media items encoded, by how")
        m.inc("encoder_visual_tokens_total", 0, {"status": status}, VISUAL_TOKENS)
    if store is not None:
        st = store.stats
        for name, text in (
            ("hits", "items found in the shared store"),
            ("misses", "items not in the shared store"),
            ("rejected", "store entries that failed validation"),
            ("writes", "items written to the shared store"),
            ("errors", "store operations that failed or timed out"),
            ("skipped", "store operations skipped after a recent failure"),
            ("waits", "items another encoder was computing"),
            ("takeovers", "claims taken over from an encoder that stopped computing"),
        ):
            m.gauge(f"encoder_store_{name}_total", text, partial(getattr, st, name))
    m.inc("encoder_batches_total", 0, help_text="batched vision forwards run")
    m.inc("encoder_put_bytes_total", 0, help_text="bytes put into the EC connector")
    m.inc("encoder_batch_items_total", 0, help_text="items in batched vision forwards")
    m.inc("encoder_batch_rows_total", 0, help_text="patch rows in batched vision forwards")
    m.inc("encode_requests_total", 0, help_text="/v1/encode requests received")
    m.inc("encoder_pixel_items_total", 0, help_text=PIXEL_ITEMS)
    p = producer
    m.gauge("encoder_ec_live_handles", "leases issued and not yet released or expired", lambda: p.live_handles)
    m.gauge("encoder_ec_live_entries", "embedding payloads held for consumers", lambda: p.live_entries)
    m.gauge("encoder_ec_held_bytes", "payload bytes held for consumers", lambda: p.held_bytes)
    m.gauge("encoder_ec_capacity_bytes", "bytes the EC connector can hold", lambda: p.capacity_bytes)
    return Histograms(forward, request, put, batch_size)
