"""Who may join the router's pools besides the operator's own worker lists: a registered or
DNS-discovered worker must have an address in the deployment's networks and prove it holds the
cluster credential before it gets any request.

- ``WorkerNetworks``: the networks workers may be in (``--worker-networks``; by default the
  router's own: loopback when it listens on loopback, else the networks of its interfaces).
  Link-local networks and cloud metadata addresses are never allowed, whatever is configured.
- ``prove``: the admission challenge (``security.peers``): a fresh nonce to the worker's
  ``/v1/attest``; only a holder of the cluster secret answering for the address the router dialled
  passes. The challenge carries no credential, so a process without the secret learns nothing.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import socket
import struct
import urllib.parse
from dataclasses import dataclass

import aiohttp
import msgspec

from epdserve.security.credentials import ClusterCredential
from epdserve.security.peers import challenge, proves, target_of

log = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# never a worker: link-local (where cloud metadata services live) and the metadata addresses
# some clouds put elsewhere
DENIED: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "100.100.100.200/32", "0.0.0.0/32", "::/128")
)
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address and mask
PROOF_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 1024  # a proof is a short JSON object


class NotAllowed(ValueError):
    """A worker address outside the deployment's networks (or one never allowed)."""


def interface_networks() -> tuple[Network, ...]:
    """The networks of this host's interfaces (Linux; loopback only where they cannot be read)."""
    nets: list[Network] = list(LOOPBACK)
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
            except OSError:
                continue  # no IPv4 address on it
            nets.append(ipaddress.ip_network(f"{addr}/{mask}", strict=False))
    try:
        with open("/proc/net/if_inet6") as f:  # address, index, prefix length, scope, flags, name
            for line in f:
                hexaddr, _, plen, *_ = line.split()
                addr6 = ipaddress.ip_address(":".join(hexaddr[i : i + 4] for i in range(0, 32, 4)))
                nets.append(ipaddress.ip_network(f"{addr6}/{int(plen, 16)}", strict=False))
    except OSError:
        pass
    return tuple(dict.fromkeys(n for n in nets if not any(n.overlaps(d) for d in DENIED[:2])))


@dataclass(frozen=True)
class WorkerNetworks:
    """The networks registered and discovered workers may be in."""

    networks: tuple[Network, ...]

    @classmethod
    def of(cls, cidrs: tuple[str, ...], router_host: str) -> WorkerNetworks:
        """``cidrs`` when given, else the deployment's own networks for a router on ``router_host``."""
        if cidrs:
            try:
                return cls(tuple(ipaddress.ip_network(c, strict=False) for c in cidrs))
            except ValueError as e:
                raise ValueError(f"--worker-networks: {e}") from None
        try:
            local = ipaddress.ip_address(router_host).is_loopback
        except ValueError:
            local = router_host == "localhost"
        return cls(LOOPBACK if local else interface_networks())

    def allows(self, ip: Address) -> bool:
        ip = getattr(ip, "ipv4_mapped", None) or ip
        if any(ip in d for d in DENIED):
            return False
        return any(ip in n for n in self.networks)

    async def check(self, url: str) -> None:
        """Raise ``NotAllowed`` unless every address ``url``'s host stands for is allowed."""
        host = urllib.parse.urlsplit(url).hostname or ""
        try:
            addrs = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except (socket.gaierror, OSError) as e:
                raise NotAllowed(f"{host} does not resolve: {e}") from None
            addrs = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        for ip in addrs:
            if not self.allows(ip):
                raise NotAllowed(
                    f"{url} ({ip}) is not in the worker networks "
                    f"({', '.join(map(str, self.networks))}; set them with --worker-networks)"
                    if not any(ip in d for d in DENIED)
                    else f"{url} ({ip}) is a link-local or metadata address, never a worker"
                )

    def __str__(self) -> str:
        return ", ".join(map(str, self.networks))


async def prove(session: aiohttp.ClientSession, cluster: ClusterCredential, url: str) -> str | None:
    """None when the worker at ``url`` proves it holds the cluster credential, else why not."""
    nonce = challenge()
    try:
        async with session.post(
            url + "/v1/attest",
            json={"nonce": nonce, "target": target_of(url)},
            timeout=aiohttp.ClientTimeout(total=PROOF_TIMEOUT_S),
            allow_redirects=False,
        ) as r:
            if r.status != 200:
                return f"it answered {r.status} to the credential challenge"
            answer = msgspec.json.decode(await r.content.read(MAX_ANSWER_BYTES)).get("proof")
    except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError, AttributeError) as e:
        return f"the credential challenge failed: {type(e).__name__}: {e}"
    return None if proves(cluster, url, nonce, answer) else "its answer to the credential challenge is wrong"
