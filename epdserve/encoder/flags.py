"""The flags of ``epdserve encoder`` for ``EncoderConfig``."""

from __future__ import annotations

from epdserve.api.flags import OTLP, STATS_INTERVAL
from epdserve.config_flags import Flag

ENCODER = "epdserve.encoder.config:EncoderConfig"
ENCODER_FLAGS = (
    "served_model_name",
    "host",
    "port",
    "encode_token_budget",
    "encode_forward_s",
    Flag("batch_wait_ms", "--encode-batch-wait-ms"),
    "encoder_cache_bytes",
    "max_pending_media_bytes",
    "max_inflight_body_bytes",
    "kernels",
    "threads",
    "core_board",
    "yield_to_decodes",
    "device",
    "dtype",
    "warmup",
    STATS_INTERVAL,
    OTLP,
)
