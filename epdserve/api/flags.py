"""Command-line flags every role shares: the model, stats lines, tracing, credentials and
registration (``epdserve.config_flags`` reads each field's default and help from its dataclass)."""

from __future__ import annotations

from epdserve.config_flags import Flag
from epdserve.security.credentials import ADMIN_KEY_ENV, API_KEY_ENV

AUTH = "epdserve.api.auth:AuthConfig"
REGISTRATION = "epdserve.api.registration:RegistrationConfig"
REGISTRATION_FLAGS = ("advertise_host", "register_with", "heartbeat_s")

MODEL = Flag("model", default=None, default_help="the embedded model")
STATS_INTERVAL = Flag("log_stats_interval_s", "--log-stats-interval")
OTLP = "otlp_traces_endpoint"
API_KEY = Flag("api_key", default=None, default_help=f"${API_KEY_ENV}; unset: no key needed")
ADMIN_KEY = Flag("admin_key", default=None, default_help=f"${ADMIN_KEY_ENV}; unset: registration is off")
