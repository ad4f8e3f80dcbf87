"""Internal HTTP authentication: a MAC per request, bound to the peer it was sent to, and the proof
a worker gives the router that it holds the cluster credential.

Every internal request carries ``X-EPD-Peer-Auth: v1 target=<host:port> ts=<unix s> nonce=<hex>
mac=<hex>`` where::

    mac = HMAC-SHA256(k_http, "epd-http/v1" \\n target \\n METHOD \\n path?query \\n sha256(body) \\n ts \\n nonce)

``target`` is the authority the sender addressed (``host:port``, host lower-case, IPv6 in
brackets). A receiver accepts the request only when the target is one of its own identities (the
local address the connection arrived at, or a name it advertises, with its listening port), the
timestamp lies within ``WINDOW_S`` of its clock, the MAC verifies, and the nonce was not seen
before. So a request captured by one peer cannot be replayed to another, nor to the same one
twice, nor later; and the cluster secret never leaves the process (``k_http`` is a subkey).

Admission proof (``/v1/attest``): before the router sends a registered or discovered worker
anything, it posts a fresh nonce and the target it addressed; the worker answers
``HMAC(k_attest, "epd-attest/v1" \\n target \\n nonce)`` only for a target that is its own, so a
process without the secret cannot answer, nor relay the challenge to a real worker.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import secrets
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass

from epdserve.security.credentials import ClusterCredential

PEER_HEADER = "X-EPD-Peer-Auth"
WINDOW_S = 30.0  # a request older or newer than this (by the receiver's clock) is refused
REPLAY_CAPACITY = 1 << 18  # nonces remembered within one window; past it, internal calls are refused
HTTP_PURPOSE = "http/peer-mac"
ATTEST_PURPOSE = "attest"
NONCE_BYTES = 16
_MAX_HEADER = 512


class PeerAuthError(ValueError):
    """An internal request's proof is missing, malformed, wrong, expired or replayed."""


class WrongPeer(PeerAuthError):
    """A well-formed proof for another peer (a request replayed to the wrong receiver)."""


def authority(host: str, port: int) -> str:
    """``host:port`` as the MAC binds it: lower-case, IPv6 in brackets, no zone."""
    host = host.strip("[]").lower().split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host.rstrip('.')}:{port}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # a dual-stack socket's view
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def target_of(url: str) -> str:
    """The authority a URL addresses (the default port of its scheme filled in)."""
    u = urllib.parse.urlsplit(url)
    if not u.hostname:
        raise ValueError(f"{url!r} names no host")
    return authority(u.hostname, u.port or (443 if u.scheme == "https" else 80))


def _path_of(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    return (u.path or "/") + (f"?{u.query}" if u.query else "")


@functools.lru_cache(maxsize=1024)
def _url_parts(url: str) -> tuple[str, str]:
    """``target_of(url)`` and its path: a router signs every call to the same few worker URLs."""
    return target_of(url), _path_of(url)


def _mac(key: bytes, target: str, method: str, path: str, body: bytes, ts: int, nonce: str) -> str:
    msg = "\n".join(("epd-http/v1", target, method.upper(), path, hashlib.sha256(body).hexdigest(), str(ts), nonce))
    return hmac.digest(key, msg.encode(), "sha256").hex()


def sign(
    cluster: ClusterCredential, method: str, url: str, body: bytes = b"", now: float | None = None
) -> dict[str, str]:
    """The header proving the cluster credential on one request to ``url`` (and only that one)."""
    target, path = _url_parts(url)
    ts, nonce = int(time.time() if now is None else now), secrets.token_hex(NONCE_BYTES)
    mac = _mac(cluster.derive(HTTP_PURPOSE), target, method, path, body, ts, nonce)
    return {PEER_HEADER: f"v1 target={target} ts={ts} nonce={nonce} mac={mac}"}


@dataclass(frozen=True)
class Proof:
    target: str
    ts: int
    nonce: str
    mac: str

    @classmethod
    def parse(cls, value: str) -> Proof:
        if len(value) > _MAX_HEADER:
            raise PeerAuthError("the peer proof header is too long")
        version, _, rest = value.partition(" ")
        if version != "v1":
            raise PeerAuthError("unknown peer proof version")
        fields = dict(part.partition("=")[::2] for part in rest.split())
        try:
            proof = cls(fields["target"], int(fields["ts"]), fields["nonce"], fields["mac"])
        except (KeyError, ValueError):
            raise PeerAuthError("malformed peer proof") from None
        if len(proof.nonce) != 2 * NONCE_BYTES or len(proof.mac) != 64:
            raise PeerAuthError("malformed peer proof")
        return proof


class ReplayCache:
    """Nonces seen within the window, forgotten once their timestamp left it."""

    def __init__(self, capacity: int = REPLAY_CAPACITY) -> None:
        self.capacity = capacity
        self._until: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten

    def first_use(self, nonce: str, until: float, now: float) -> bool:
        """Record ``nonce``; False when it was seen before (or the cache is full of live nonces)."""
        while self._until and next(iter(self._until.values())) < now:
            self._until.popitem(last=False)
        if nonce in self._until:
            return False
        if len(self._until) >= self.capacity:
            self._until = OrderedDict((n, t) for n, t in self._until.items() if t >= now)
            if len(self._until) >= self.capacity:
                return False
        self._until[nonce] = until
        return True


class PeerVerifier:
    """One role's check of internal requests: its identities, the window, its replay cache."""

    def __init__(self, cluster: ClusterCredential, names: tuple[str, ...] = (), window_s: float = WINDOW_S) -> None:
        self._key = cluster.derive(HTTP_PURPOSE)
        self._attest_key = cluster.derive(ATTEST_PURPOSE)
        self.names = tuple(n.strip("[]").lower() for n in names if n)
        self.window_s = window_s
        self.replays = ReplayCache()

    def identities(self, sockname: tuple | None) -> set[str]:
        """The authorities a peer may have addressed to reach this role over a connection whose
        local end is ``sockname``: that address, and each advertised name, on its port."""
        if not sockname:
            return set()
        host, port = str(sockname[0]), int(sockname[1])
        out = {authority(host, port), *(authority(n, port) for n in self.names)}
        try:
            if ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
                out.add(authority("localhost", port))
        except ValueError:
            pass
        return out

    def verify(
        self, header: str | None, method: str, path: str, body: bytes, sockname: tuple | None, now: float | None = None
    ) -> None:
        """Raise ``PeerAuthError`` (``WrongPeer`` for another target) unless the proof holds."""
        if not header:
            raise PeerAuthError("no peer proof")
        proof = Proof.parse(header)
        now = time.time() if now is None else now
        if abs(now - proof.ts) > self.window_s:
            raise PeerAuthError("the peer proof has expired (or the clocks disagree)")
        expected = _mac(self._key, proof.target, method, path, body, proof.ts, proof.nonce)
        if not hmac.compare_digest(expected, proof.mac):
            raise PeerAuthError("the peer proof does not verify")
        if proof.target not in self.identities(sockname):
            raise WrongPeer(f"the request was addressed to {proof.target}, not to this instance")
        if not self.replays.first_use(proof.nonce, proof.ts + self.window_s, now):
            raise PeerAuthError("the peer proof was used before")

    def attest(self, target: str, nonce: str, sockname: tuple | None) -> str:
        """This role's answer to an admission challenge for ``target`` (one of its own only)."""
        if target not in self.identities(sockname):
            raise WrongPeer(f"asked to prove {target}, which is not this instance")
        return attestation(self._attest_key, target, nonce)


def attestation(key: bytes, target: str, nonce: str) -> str:
    return hmac.new(key, f"epd-attest/v1\n{target}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def challenge() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proves(cluster: ClusterCredential, url: str, nonce: str, answer: object) -> bool:
    """Whether ``answer`` is the proof for the challenge ``nonce`` sent to ``url``."""
    if not isinstance(answer, str):
        return False
    return hmac.compare_digest(attestation(cluster.derive(ATTEST_PURPOSE), target_of(url), nonce), answer)
