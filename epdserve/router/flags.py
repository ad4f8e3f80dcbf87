"""The flags of ``epdserve router`` for ``RouterConfig`` (``router.config``) and its frontend
media decoding (``FrontendDecodeConfig``)."""

from __future__ import annotations

from epdserve.api.flags import OTLP, STATS_INTERVAL
from epdserve.config_flags import Flag

ROUTER = "epdserve.router.config:RouterConfig"
FRONTEND = "epdserve.router.frontend_decode:FrontendDecodeConfig"
ROUTER_FLAGS = (
    "host",
    "port",
    "encoders",
    "pds",
    "pd_engine",
    "prefills",
    "decodes",
    "policy",
    "kv_load_tokens",
    "encoder_policy",
    Flag("probe_interval_s", "--probe-interval"),
    "dns_interval_s",
    "worker_networks",
    "dispatch",
    "dispatch_interference",
    "directory_entries",
    "max_inflight_text",
    "max_inflight_media",
    "admission_wait_s",
    "text_ttft_target_ms",
    "encoder_wait_s",
    "max_inflight_body_bytes",
    STATS_INTERVAL,
    OTLP,
    Flag("model", default_help="the embedded model"),
)
FRONTEND_PREFIX = "--frontend-decode-"
FRONTEND_FLAGS = (Flag("enabled", "--frontend-decode"), "workers", "max_queued", "shm_bytes")
