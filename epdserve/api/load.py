"""The autoscaling signal: each role's demand over its capacity, and the replica count that
would serve the demand at a target utilization (what a Kubernetes HPA or KEDA scales on).

- an encoder's ``load ratio``: the visual work offered over the last ``WINDOW_S`` (patches of items
  that need a forward, per second) over what its vision forward serves per second of forward time
  (measured, batch by batch); 1 means busy all the time, above 1 the queue grows;
- a language-model worker's: the larger of its KV-cache usage and its requests (running and
  waiting) over the batch it can run (``max_num_seqs``): above 1, requests wait.

The router reads every worker's ratio with its health probes (``GET /v1/load``, internal) and
exports, per role, ``ceil(sum of ratios / TARGET_UTILIZATION)`` replicas (at least 1). The same
report carries the measured costs the router's adaptive dispatch weighs (``LoadReport``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Annotated, Final

import msgspec

WINDOW_S = 30.0  # the offered load is averaged over this long
TARGET_UTILIZATION = 0.8  # the recommended replica count keeps each replica this busy
LOAD_PROTOCOL_VERSION: Final = 1
MAX_LOAD_REPORT_BYTES: Final = 4096

Ratio = Annotated[float, msgspec.Meta(ge=0, lt=1e6)]
Cost = Annotated[float, msgspec.Meta(ge=0, lt=1e3)]  # seconds per unit: bounded, it is read from a peer
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class LoadReport(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """``GET /v1/load``: a worker's demand over capacity and what its work costs it (0: unmeasured)."""

    load_ratio: Ratio = 0.0
    s_per_patch: Cost = 0.0  # encoder: seconds of vision forward per patch
    preprocess_s_per_patch: Cost = 0.0  # encoder: CPU seconds per patch of decoding, resizing, patchifying
    vision: bool = False  # language-model worker: it holds a vision tower (raw media can go to it)
    vision_s_per_patch: Cost = 0.0  # language-model worker: seconds per patch of the forwards it ran itself
    fetch_s_per_byte: Cost = 0.0  # language-model worker: seconds per embedding byte fetched from encoders
    running: Count = 0  # language-model worker: requests in its batch (an encode here stalls them)
    waiting: Count = 0
    version: int = LOAD_PROTOCOL_VERSION


def decode_load_report(raw: bytes) -> LoadReport:
    """A peer's report, bounds checked; ``ValueError`` for another version or a bad value."""
    try:
        report = msgspec.json.decode(raw, type=LoadReport)
    except msgspec.DecodeError as e:  # ValidationError is one
        raise ValueError(f"bad load report: {e}") from None
    if report.version != LOAD_PROTOCOL_VERSION:
        raise ValueError(f"load report version {report.version}, expected {LOAD_PROTOCOL_VERSION}")
    return report


class RateWindow:
    """Sums of a quantity over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, value))
        self._sum += value
        self._trim(now)

    def total(self, now: float | None = None) -> float:
        self._trim(time.monotonic() if now is None else now)
        return self._sum

    def rate(self, now: float | None = None) -> float:
        return self.total(now) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._sum -= self._events.popleft()[1]


class EncoderLoad:
    """An encoder's offered visual work against its measured forward throughput."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.offered = RateWindow(window_s)
        self.capacity = 0.0  # patches per second of forward time (exponential average)

    def offer(self, patches: int) -> None:
        self.offer_at(patches, time.monotonic())

    def offer_at(self, patches: int, now: float) -> None:
        self.offered.add(patches, now)

    def served(self, patches: int, seconds: float) -> None:
        if patches > 0 and seconds > 0:
            rate = patches / seconds
            self.capacity = rate if not self.capacity else 0.8 * self.capacity + 0.2 * rate

    def ratio(self, now: float | None = None) -> float:
        offered = self.offered.rate(now)
        if offered == 0:
            return 0.0
        return offered / self.capacity if self.capacity else 1.0  # work offered, none measured yet


def worker_ratio(kv_usage: float, running: int, waiting: int, max_num_seqs: int) -> float:
    return max(kv_usage, (running + waiting) / max(1, max_num_seqs))


def recommended_replicas(ratios: list[float], target: float = TARGET_UTILIZATION) -> int:
    """Replicas that would keep each at ``target`` utilization under the summed demand (at least 1)."""
    return max(1, math.ceil(sum(ratios) / target - 1e-9))
