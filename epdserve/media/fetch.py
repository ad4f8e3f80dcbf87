"""Loading media bytes from ``data:`` and http(s) URLs, under size, time and address limits.

The SSRF guard runs at two points, so that neither an IP literal nor a name that resolves
differently on a second lookup (DNS rebinding) reaches a private address:

* before every request hop (the first URL and each redirect target): scheme, domain allowlist,
  IP literal or every address the name resolves to;
* inside the connector's resolver of sessions made by ``media_session``: the addresses the
  connection will actually use.

Redirects are followed by hand so each hop passes the first check again.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
import urllib.parse
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from epdserve.media.errors import InvalidMedia, MediaError, MediaTimeout, MediaTooLarge
from epdserve.media.limits import MediaLimits

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _short(url: str, n: int = 100) -> str:
    return url if len(url) <= n else url[: n - 3] + "..."


def address_is_public(address: str) -> bool:
    """True when ``address`` is a globally routable unicast address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        # addresses that embed an IPv4 address are judged by the embedded one
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


def _refuse_address(host: str, address: str) -> InvalidMedia:
    shown = host if host == address else f"{host} ({address})"
    return InvalidMedia(f"Media URL host {shown} is a private, loopback, link-local or reserved address; refused.")


def _check_addresses(host: str, addresses: list[str], limits: MediaLimits) -> None:
    if limits.allow_private_addresses:
        return
    for a in addresses:
        if not address_is_public(a):
            raise _refuse_address(host, a)


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that refuses names resolving to non-public addresses."""

    def __init__(self, limits: MediaLimits) -> None:
        self._limits = limits
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        _check_addresses(host, [r["host"] for r in results], self._limits)
        return results

    async def close(self) -> None:
        await self._inner.close()


def media_session(limits: MediaLimits) -> aiohttp.ClientSession:
    """A client session for media fetches whose connections pass the address guard."""
    connector = aiohttp.TCPConnector(resolver=GuardedResolver(limits), limit=64)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=True)


async def check_url(url: URL, limits: MediaLimits) -> None:
    """Refuse URLs the policy does not allow; never opens a connection (only resolves names)."""
    if url.scheme not in ("http", "https"):
        raise InvalidMedia(
            f"Unsupported media URL scheme {url.scheme + ':' if url.scheme else '(none)'}; use http(s) or data:."
        )
    host = url.raw_host
    if not host:
        raise InvalidMedia(f"Media URL {_short(str(url))} has no host.")
    host = host.rstrip(".").lower()
    if not limits.domain_allowed(host):
        raise InvalidMedia(f"Media domain {host} is not in the allowed media domains.")
    if limits.allow_private_addresses:
        return
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    else:
        _check_addresses(host, [host], limits)
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidMedia(f"Could not resolve media host {host}: {e}") from None
    _check_addresses(host, [str(info[4][0]) for info in infos], limits)


def decode_data_url(url: str, limits: MediaLimits) -> bytes:
    """Bytes of ``data:[<mime>][;base64],<payload>`` (base64 or percent-encoded)."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise InvalidMedia("Malformed data URL: missing ','.")
    is_base64 = header.split(";")[-1].strip().lower() == "base64"
    if not is_base64:
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        # tolerate line breaks and URL-safe alphabet, refuse everything else
        text = "".join(payload.split()).replace("-", "+").replace("_", "/")
        if len(text) * 3 // 4 > limits.max_bytes + 3:
            raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
        if len(text) % 4:
            text += "=" * (-len(text) % 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidMedia("Invalid base64 payload in data URL.") from None
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    if not data:
        raise InvalidMedia("Empty media in data URL.")
    return data


async def _read_limited(resp: aiohttp.ClientResponse, limits: MediaLimits) -> bytes:
    if resp.content_length is not None and resp.content_length > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):
        buf += chunk
        if len(buf) > limits.max_bytes:
            raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    if not buf:
        raise InvalidMedia("Media URL returned an empty body.")
    return bytes(buf)


async def _fetch(url: URL, limits: MediaLimits, session: aiohttp.ClientSession) -> bytes:
    headers: dict[str, Any] = {"Accept": "image/*, video/*, */*;q=0.5"}
    for _ in range(limits.max_redirects + 1):
        await check_url(url, limits)
        async with session.get(url, allow_redirects=False, headers=headers) as resp:
            if resp.status in _REDIRECTS:
                location = resp.headers.get("Location")
                if not location:
                    raise InvalidMedia(f"Media URL {_short(str(url))} redirected without a Location.")
                url = url.join(URL(location))
                continue
            if not 200 <= resp.status < 300:
                raise InvalidMedia(f"Fetching media from {_short(str(url))} failed with HTTP {resp.status}.")
            return await _read_limited(resp, limits)
    raise InvalidMedia(f"Media URL made more than {limits.max_redirects} redirects.")


async def load_media_bytes(url: str, limits: MediaLimits, session: aiohttp.ClientSession | None = None) -> bytes:
    """Raw bytes of a media item given as a ``data:`` or http(s) URL.

    Pass a session from ``media_session`` to reuse connections; a plain session still gets the
    pre-connection checks but not the resolver guard against DNS rebinding.
    """
    if url[:5].lower() == "data:":
        return decode_data_url(url, limits)
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        raise InvalidMedia(f"Malformed media URL {_short(url)}.") from None
    if parsed.scheme not in ("http", "https"):
        await check_url(parsed, limits)  # raises the scheme error
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            if session is None:
                async with media_session(limits) as own:
                    return await _fetch(parsed, limits, own)
            return await _fetch(parsed, limits, session)
    except MediaError:
        raise
    except TimeoutError:
        raise MediaTimeout(f"Fetching media from {_short(url)} took longer than {limits.fetch_timeout_s} s.") from None
    except aiohttp.ClientConnectorDNSError as e:
        if isinstance(e.__cause__, MediaError):
            raise e.__cause__ from None
        raise InvalidMedia(f"Could not resolve media host of {_short(url)}.") from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise InvalidMedia(f"Could not fetch media from {_short(url)}: {type(e).__name__}: {e}") from None
