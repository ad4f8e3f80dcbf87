"""Publishing a call's embeddings through the EC connector: ``leases`` handles per item, all of
them or none (a failed put gives back the leases the call already took)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from epdserve.api.errors import Overloaded, Unavailable
from epdserve.api.metrics import Metrics
from epdserve.encoder.protocol import ItemTimings, ms
from epdserve.transfer.base import ECProducer, Handle, ProducerFull, TransferError

log = logging.getLogger(__name__)


class Encoded(Protocol):
    """An item whose embeddings are ready to put."""

    @property
    def uuid(self) -> str: ...
    @property
    def embeddings(self) -> torch.Tensor: ...
    @property
    def timings(self) -> ItemTimings: ...


class Publisher:
    """The encoder's side of the EC connector. Runs on the encoder's put thread."""

    def __init__(
        self, producer: ECProducer, model_id: str, feature_levels: int, metrics: Metrics, retry_after_s: int
    ) -> None:
        self.producer, self.model_id, self.feature_levels = producer, model_id, feature_levels
        self.metrics, self.retry_after_s = metrics, retry_after_s

    def put_all(self, ready: Sequence[Encoded], leases: int) -> list[list[Handle]]:
        """Put every item's embeddings: ``leases`` handles per item, the later ones leases on the
        payload the first stored. Each item's ``timings.put_ms`` is set."""
        handles: list[list[Handle]] = []
        for i, r in enumerate(ready):
            t0 = time.perf_counter()
            try:
                handles.append([])
                for _ in range(leases):
                    handles[-1].append(self.producer.put(r.uuid, r.embeddings, self.model_id, self.feature_levels))
            except ProducerFull as e:
                # consumers hold everything the connector can store: a load signal, not a failure,
                # so the encoder stays healthy and the router spreads or sheds the load
                self.release_all([h for hs in handles for h in hs])
                self.metrics.inc("encoder_put_failures_total", labels={"cause": "full"})
                log.warning("EC connector full: %s", e)
                raise Overloaded(
                    "The encoder's embedding store is full; retry shortly.",
                    param=f"items[{i}]",
                    retry_after_s=self.retry_after_s,
                ) from None
            except TransferError as e:
                self.release_all([h for hs in handles for h in hs])
                self.metrics.inc("encoder_put_failures_total", labels={"cause": "error"})
                raise Unavailable(f"The embeddings could not be published: {e}", param=f"items[{i}]") from None
            r.timings.put_ms = ms(time.perf_counter() - t0)
        return handles

    def release_all(self, handles: list[Handle]) -> int:
        """Producer-side release of leases this encoder issued (abandoned requests); returns how many
        were live. Handles that do not verify or are not this producer's are ignored."""
        released = 0
        for h in handles:
            try:
                released += bool(self.producer.release(h))
            except TransferError as e:
                log.warning("refused a release: %s", e)
        return released


def handle_nbytes(handle: Handle, tensor: torch.Tensor) -> int:
    """Bytes a put moved: the handle's ``nbytes`` when it reports one, else the tensor's size."""
    n = handle.get("nbytes")
    return n if isinstance(n, int) else tensor.numel() * tensor.element_size()
