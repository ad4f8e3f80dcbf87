"""Command-line flags every role shares: the model, stats lines, tracing, credentials and
registration (``epdserve.config_flags`` reads each field's default and help from its dataclass)."""

from __future__ import annotations

import argparse

from epdserve.config_flags import Flag
from epdserve.security.credentials import ADMIN_KEY_ENV, API_KEY_ENV

AUTH = "epdserve.api.auth:AuthConfig"
REGISTRATION = "epdserve.api.registration:RegistrationConfig"
REGISTRATION_FLAGS = ("advertise_host", "register_with", "heartbeat_s")
QUOTA = "epdserve.api.quota:QuotaConfig"
QUOTA_FLAGS = ("max_inflight_per_key", "max_tokens_per_minute_per_key", "max_tokens_limit")
EXPOSURE = "epdserve.api.exposure:ExposureConfig"

MODEL = Flag("model", default=None, default_help="the embedded model")
STATS_INTERVAL = Flag("log_stats_interval_s", "--log-stats-interval")
OTLP = "otlp_traces_endpoint"
API_KEY = Flag("api_key", default=None, default_help=f"${API_KEY_ENV}; unset: no key needed")
ADMIN_KEY = Flag("admin_key", default=None, default_help=f"${ADMIN_KEY_ENV}; unset: registration is off")


def add_log_args(s: argparse.ArgumentParser, default: str | None = "text") -> None:
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default,
        help="log lines as text or as one JSON object each (default: text)",
    )
    s.add_argument(
        "--no-access-log",
        action="store_true",
        help="no access line per request (the other lines stay); each costs a busy router CPU time",
    )
