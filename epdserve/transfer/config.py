"""EC connector configuration (frozen, validated): which backend a producer uses, where its
memory and files live, how long unreleased leases survive, and the cluster secret that signs
handles and authenticates tcp connections."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from epdserve.common.store_config import StoreConfig
from epdserve.common.units import ByteSize
from epdserve.security.credentials import CLUSTER_SECRET_ENV, ClusterCredential
from epdserve.transfer.base import TransferError

Connector = Literal["shm", "tcp", "fs", "mooncake"]
CONNECTORS: tuple[Connector, ...] = get_args(Connector)
MooncakeProtocol = Literal["tcp", "rdma"]
STORE_HANDLE = "store"  # the connector a store handle names: an entry of the shared store, no lease
HANDLE_PURPOSE = "ec-handle"  # the key that signs embedding handles
KV_HANDLE_PURPOSE = "kv-handle"  # the key that signs KV-cache handles (never accepted as the other)
PIXEL_HANDLE_PURPOSE = "pixel-handle"  # the key that signs decoded-pixel handles (router → encoder)
TCP_PURPOSE = "ec-tcp"  # the key of the tcp connector's mutual authentication
MISSING_SECRET = "the EC connector needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file"
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _secret_from_env() -> str:
    return os.environ.get(CLUSTER_SECRET_ENV, "")


@dataclass(frozen=True)
class ECConfig:
    connector: Connector = "shm"  # producer backend: shm (same host), tcp or mooncake (any host), fs (debugging)
    shm_bytes: ByteSize = 0  # bytes of the producer's one /dev/shm slab (0 = auto from the free space of shm_dir)
    shm_dir: str = "/dev/shm"  # where slabs live; a consumer only maps slabs under this directory
    fs_dir: str = ""  # private directory of the fs connector ("" = fs handles are refused)
    tcp_host: str = "127.0.0.1"  # host the tcp data server binds to and advertises in handles
    tcp_port: int = 0  # port of the tcp data server (0 = any free port)
    tcp_advertise_host: str = ""  # host put in tcp handles when it differs from tcp_host ("" = tcp_host)
    tcp_bytes: ByteSize = 1 << 30  # bound on the bytes the tcp producer holds for unreleased leases
    secret: str = field(default_factory=_secret_from_env, repr=False)  # cluster secret ("" = no EC at all)
    ttl_s: float = 120.0  # leases not released within this many seconds expire and are reclaimed
    timeout_s: float = 30.0  # a consumer's get/release gives up after this many seconds
    instance: str = "ec"  # name of this instance, used in slab and file names
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")  # dtypes a consumer accepts
    mooncake_protocol: MooncakeProtocol = "tcp"  # mooncake connector transport: tcp, or rdma where the NICs have it
    mooncake_device: str = ""  # mooncake connector over rdma: the RDMA devices to use, e.g. mlx5_0 ("" = tcp)
    handle_purpose: str = HANDLE_PURPOSE  # which subkey signs and verifies handles (KV connectors: their own)
    store: StoreConfig = field(
        default_factory=StoreConfig
    )  # the shared embedding store (encoders, and consumers of store handles)

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"unknown EC connector {self.connector!r} (choose from {', '.join(CONNECTORS)})")
        if self.shm_bytes != 0 and self.shm_bytes < 1 << 20:
            raise ValueError("shm_bytes must be at least 1 MiB (or 0 for automatic)")
        if self.tcp_bytes < 1:
            raise ValueError("tcp_bytes must be positive")
        if not 0 <= self.tcp_port <= 65535:
            raise ValueError(f"tcp_port {self.tcp_port} is not a port number")
        if self.ttl_s <= 0 or self.timeout_s <= 0:
            raise ValueError("ttl_s and timeout_s must be positive")
        if self.secret:
            ClusterCredential.from_text(self.secret)  # raises CredentialError (a ValueError) if too short
        if not _INSTANCE_RE.fullmatch(self.instance):
            raise ValueError(f"instance {self.instance!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        if self.handle_purpose not in (HANDLE_PURPOSE, KV_HANDLE_PURPOSE, PIXEL_HANDLE_PURPOSE):
            raise ValueError(f"unknown handle purpose {self.handle_purpose!r}")
        if self.mooncake_protocol not in get_args(MooncakeProtocol):
            raise ValueError(f"unknown Mooncake protocol {self.mooncake_protocol!r} (tcp or rdma)")
        if self.mooncake_protocol == "rdma" and not self.mooncake_device:
            raise ValueError("the mooncake connector over rdma needs mooncake_device (e.g. mlx5_0)")
        if self.connector == "fs" and not self.fs_dir:
            raise ValueError("the fs connector needs fs_dir")

    @property
    def advertise_host(self) -> str:
        """The host consumers dial to reach this producer's tcp data server."""
        return self.tcp_advertise_host or self.tcp_host

    @property
    def has_secret(self) -> bool:
        return bool(self.secret)

    @property
    def handle_key(self) -> bytes:
        """The key of this connector's handles; TransferError without a secret."""
        return self.key(self.handle_purpose)

    def key(self, purpose: str) -> bytes:
        """The subkey of the cluster secret for ``purpose``; TransferError without a secret."""
        if not self.secret:
            raise TransferError(MISSING_SECRET)
        return ClusterCredential.from_text(self.secret).derive(purpose)
