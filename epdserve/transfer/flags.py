"""The flags of ``ECConfig`` (``transfer.config``): the EC connector of encoders (producer) and
language-model instances (consumer), and the KV connector (``--kv-``) of P/D instances."""

from __future__ import annotations

from epdserve.config_flags import Flag

EC = "epdserve.transfer.config:ECConfig"
EC_PREFIX = "--ec-"
EC_PRODUCER_FLAGS = (
    "connector",
    "shm_bytes",
    "fs_dir",
    "tcp_port",
    "tcp_bytes",
    "mooncake_protocol",
    "mooncake_device",
    Flag("instance", default=None, default_help="encoder-<port>"),
)
EC_CONSUMER_FLAGS = ("fs_dir", "mooncake_protocol", "mooncake_device")
KV_PREFIX = "--kv-"
KV_FLAGS = (
    Flag("connector", help="how a prefill instance hands a prompt's KV to decode instances: shm (same host) or tcp"),
    "shm_bytes",
    "shm_dir",
    "tcp_host",
    "tcp_port",
    "tcp_bytes",
    Flag("instance", default=None, default_help="<role>-<port>"),
)
