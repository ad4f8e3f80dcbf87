"""How the router learns its workers besides static lists: DNS names re-resolved now and then,
and registrations that live only as long as their heartbeats.

- ``dns+http://name:port`` (or ``dns+https://``) in a worker list stands for every address the
  name resolves to — a Kubernetes headless Service, say. ``DnsSource.resolve`` returns the
  worker URLs it stands for now; the router adds the new ones to the pool and removes the ones
  that are gone (only those it added for this source).
- A worker that registers itself (``POST /v1/workers``, admin key) renews a lease with every
  heartbeat; ``Leases.expired`` names the workers whose lease lapsed, which the router evicts.
  Workers from static lists or DNS have no lease and are never evicted this way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass

log = logging.getLogger(__name__)

DNS_SCHEMES = {"dns+http": "http", "dns+https": "https"}
MAX_ADDRESSES = 256  # addresses one name may stand for (a bound on what a resolver can make us add)
MAX_HEARTBEAT_S = 3600.0  # the longest heartbeat a registration may announce


class DiscoveryError(ValueError):
    """A worker list entry that is neither a URL nor a DNS source."""


@dataclass(frozen=True)
class DnsSource:
    scheme: str  # of the workers' URLs: http or https
    name: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DnsSource | None:
        """The source a list entry names, or None when it is a plain worker URL."""
        u = urllib.parse.urlsplit(text)
        if u.scheme not in DNS_SCHEMES:
            return None
        if not u.hostname or u.port is None or u.path.strip("/") or u.query:
            raise DiscoveryError(f"{text!r}: a DNS source is dns+http://name:port (the workers' port)")
        return cls(DNS_SCHEMES[u.scheme], u.hostname, u.port)

    def __str__(self) -> str:
        return f"dns+{self.scheme}://{self.name}:{self.port}"

    async def resolve(self) -> set[str]:
        """The worker URLs the name stands for now (empty when it does not resolve)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, OSError) as e:
            log.warning("%s does not resolve: %s", self, e)
            return set()
        urls = set()
        for *_, sockaddr in infos[:MAX_ADDRESSES]:
            ip = ipaddress.ip_address(sockaddr[0])
            host = f"[{ip}]" if ip.version == 6 else str(ip)
            urls.add(f"{self.scheme}://{host}:{self.port}")
        return urls


def is_worker_url(text: str) -> bool:
    """A worker's base URL: http(s)://host[:port], nothing else (no credentials, path or query)."""
    try:
        u = urllib.parse.urlsplit(text)
        u.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return False
    return (
        u.scheme in ("http", "https")
        and bool(u.hostname)
        and u.username is None
        and u.path in ("", "/")
        and not u.query
        and not u.fragment
    )


def split_sources(entries: tuple[str, ...]) -> tuple[list[str], list[DnsSource]]:
    """A worker list as (plain URLs, DNS sources)."""
    urls: list[str] = []
    sources: list[DnsSource] = []
    for e in entries:
        src = DnsSource.parse(e)
        if src is None:
            urls.append(e)
        else:
            sources.append(src)
    return urls, sources


class Leases:
    """Registered workers and when their registration lapses."""

    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}  # (role, url) → expiry

    def renew(self, role: str, url: str, ttl_s: float, now: float | None = None) -> None:
        self._until[(role, url)] = (time.monotonic() if now is None else now) + ttl_s

    def drop(self, role: str, url: str) -> None:
        self._until.pop((role, url), None)

    def held(self, role: str, url: str) -> bool:
        return (role, url) in self._until

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """The (role, url) whose lease lapsed; they are forgotten."""
        now = time.monotonic() if now is None else now
        gone = [k for k, until in self._until.items() if until < now]
        for k in gone:
            del self._until[k]
        return gone
