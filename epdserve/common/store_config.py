"""Configuration of the shared embedding store (frozen, validated): where it is, the credential it
asks for, how long entries live, and how quickly a slow or absent store is given up on."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

Transport = Literal["tcp", "rdma"]  # how Mooncake members move data
STORE_PASSWORD_ENV = "EPD_STORE_PASSWORD"  # the store's password (never a flag: flags show in ps)
_URL_RE = re.compile(r"(redis://[A-Za-z0-9_.\-\[\]:]+(/\d{1,2})?|mooncake://[A-Za-z0-9_.\-\[\]]+:\d{1,5})")


def _password_from_env() -> str:
    return os.environ.get(STORE_PASSWORD_ENV, "")


@dataclass(frozen=True)
class StoreConfig:
    url: str = ""  # shared embedding store: redis://host:port[/db] or mooncake://master-host:rpc-port ("" = none)
    username: str = ""  # the store's ACL user ("" = the default user)
    password: str = field(default_factory=_password_from_env, repr=False)  # from EPD_STORE_PASSWORD
    ttl_s: float = 3600.0  # entries expire this long after they were written (the store also evicts by LRU)
    max_item_bytes: int = 64 << 20  # larger embeddings are not shared through the store
    timeout_s: float = 0.5  # one store operation gives up after this long; the encoder then computes
    down_s: float = 5.0  # after a failure the store is not asked again for this long
    claim_ttl_s: float = 10.0  # a claim to compute an item lapses this long after its holder last renewed it
    wait_s: float = 30.0  # the longest an encoder waits for another encoder computing the same item
    local_host: str = "127.0.0.1"  # mooncake: the address this instance's store client is reached at by peers
    segment_bytes: int = 256 << 20  # mooncake: memory an encoder lends to the store (readers lend none)
    protocol: Transport = "tcp"  # mooncake: transport between members, tcp or rdma (where the NICs have it)
    device: str = ""  # mooncake over rdma: the RDMA devices to use, e.g. mlx5_0

    def __post_init__(self) -> None:
        if self.url and not _URL_RE.fullmatch(self.url):
            raise ValueError(
                f"store url must look like redis://host:port[/db] or mooncake://host:port, got {self.url!r}"
            )
        for name in ("ttl_s", "timeout_s", "down_s", "claim_ttl_s", "wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store {name} must be positive")
        if self.max_item_bytes < 1:
            raise ValueError("store max_item_bytes must be positive")
        if self.protocol not in get_args(Transport) or (self.protocol == "rdma" and not self.device):
            raise ValueError("store protocol must be tcp, or rdma with a device")
        if self.segment_bytes < 0:
            raise ValueError("store segment_bytes must be 0 or more")

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @property
    def backend(self) -> str:
        """ "redis" or "mooncake" (the url's scheme); "" without a store."""
        return self.url.split("://", 1)[0] if self.url else ""
