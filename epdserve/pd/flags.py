"""The flags of ``epdserve serve`` for ``ServerConfig`` (``pd.config``): which fields the command
offers, and under which name where the flag is older than the field."""

from __future__ import annotations

from epdserve.api.flags import OTLP, STATS_INTERVAL
from epdserve.config_flags import Flag

SERVER = "epdserve.pd.config:ServerConfig"
SERVER_FLAGS = (
    "served_model_name",
    "host",
    "port",
    Flag("vision", "--vision-tower"),
    "warmup",
    "role",
    STATS_INTERVAL,
    OTLP,
)
PUBLIC_FLAGS = ("max_prompt_chars", "enable_mm_embeds")  # of ServerConfig and RouterConfig alike
