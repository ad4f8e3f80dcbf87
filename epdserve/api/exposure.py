"""What the public endpoint shows to whom: other users' traffic is the operator's business.

A request's stage timing (``Server-Timing``, asked for with ``X-EPD-Timing: 1``) names how each
media item was obtained and how long the encoders took for it; ``cache_hit``, ``store_hit``,
``directory`` and ``skipped`` tell that someone sent the same media recently. Only a caller holding
the admin key or the cluster credential (``auth.is_operator``) gets those details (the ``media``
description, the ``router_*`` and ``encoder_*`` stages); anyone else gets the language-model
stages of its own request. (Latency itself still differs with what is cached.)

``/metrics`` without credentials shows, by ``public_metrics``:

=======  ======================================================================================
none     nothing (401): scrape with the admin key or the cluster credential
health   the health gauges only (workers healthy, vision tower loaded, KV usage, load ratio)
full     every metric, request counters included
=======  ======================================================================================

The default is ``full`` while the public API is open (no API key: anyone can send requests, and
count them), ``health`` once an API key is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PublicMetrics = Literal["auto", "none", "health", "full"]
HEALTH_METRICS = (  # what ``health`` shows of a role's metrics (by name, without the prefix), and *_healthy
    "vision_tower_loaded",
    "kv_cache_usage_perc",
    "load_ratio",
    "num_requests_running",
    "num_requests_waiting",
)


@dataclass(frozen=True)
class ExposureConfig:
    public_metrics: PublicMetrics = "auto"  # /metrics without credentials (auto: health with an API key, else full)

    def metrics_level(self, api_key: str) -> str:
        """What ``/metrics`` shows a caller without credentials."""
        if self.public_metrics != "auto":
            return self.public_metrics
        return "health" if api_key else "full"


def health_metric(name: str) -> bool:
    return name in HEALTH_METRICS or name.endswith("_healthy")
