"""Where a role says it can be reached, and its registration with a router.

An internal role binds where it is told (``--host``, e.g. ``0.0.0.0`` in a container) and
*advertises* the address peers should use (``--advertise-host``, e.g. the pod's IP): the URL it
registers and the host its connectors put in their handles. With ``--register-with URL`` it
registers with that router (``POST /v1/workers`` with the admin key) as soon as it listens, again
every ``heartbeat_s`` (the router evicts a worker whose registration was not renewed within three
heartbeats), and deregisters when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)

HEARTBEATS_PER_LEASE = 3  # a registration lapses after this many heartbeats without renewal


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::`` or empty: every interface, not an address a peer can dial."""
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a name


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class RegistrationConfig:
    advertise_host: str = ""  # address peers reach this role at ("" = --host)
    register_with: str = ""  # a router's URL to register with (admin key: EPD_ADMIN_KEY)
    heartbeat_s: float = 5.0  # seconds between registrations; the router evicts after 3 missed
    admin_key: str = field(default="", repr=False)  # the router's admin key (from EPD_ADMIN_KEY)

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be > 0")
        if self.register_with and not self.register_with.startswith(("http://", "https://")):
            raise ValueError(f"register_with must be the router's http(s) URL, got {self.register_with!r}")
        if self.register_with and not self.admin_key:
            raise ValueError("registering with a router needs its admin key: set EPD_ADMIN_KEY")

    def advertised(self, host: str) -> str:
        """The host peers should dial, for a role listening on ``host``."""
        if self.advertise_host:
            return self.advertise_host
        if is_wildcard(host) and self.register_with:
            raise ValueError(f"listening on {host or 'every interface'}: set --advertise-host, the address peers use")
        return host


class Registrar:
    """Keeps one role registered with a router while it runs."""

    def __init__(self, config: RegistrationConfig, role: str, url: str, listen: tuple[str, int]) -> None:
        self.config, self.role, self.url = config, role, url
        self.listen = ("127.0.0.1" if is_wildcard(listen[0]) else listen[0], listen[1])
        self.registered = False
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def of(cls, config: RegistrationConfig, role: str, host: str, port: int) -> Registrar:
        """The registrar of a role listening on ``host:port``."""
        return cls(config, role, http_url(config.advertised(host), port), (host, port))

    def start(self) -> None:
        if self.config.register_with:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        await self._listening()
        while True:
            ok = await self._call("POST")
            if ok != self.registered:
                log.log(
                    logging.INFO if ok else logging.WARNING,
                    "%s with %s as %s %s",
                    "registered" if ok else "could not register",
                    self.config.register_with,
                    self.role,
                    self.url,
                )
            self.registered = ok
            await asyncio.sleep(self.config.heartbeat_s)

    async def _listening(self) -> None:
        """Register only once peers can connect (the app starts listening after its startup)."""
        while True:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(*self.listen)
                writer.close()
                return
            await asyncio.sleep(0.05)

    async def _call(self, method: str) -> bool:
        assert self._session is not None
        body = {"role": self.role, "url": self.url, "heartbeat_s": self.config.heartbeat_s}
        try:
            async with self._session.request(
                method,
                self.config.register_with.rstrip("/") + "/v1/workers",
                json=body,
                headers={"Authorization": f"Bearer {self.config.admin_key}"},
            ) as r:
                answer = await r.content.read(2048)
                if r.status != 200:  # its error says why (e.g. the address is not in its worker networks)
                    why = answer.decode("utf-8", "replace")
                    log.warning("the router answered %s to %s %s: %s", r.status, method, self.url, why)
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def close(self) -> None:
        """Stop heartbeats and deregister (best effort: the lease lapses anyway)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            if self.registered:
                await self._call("DELETE")
        if self._session is not None:
            await self._session.close()
