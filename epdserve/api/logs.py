"""How every long-running role logs: one line per event on stderr, as text or as JSON
(``--log-format json``: one object per line, with the event's fields as keys, for log pipelines).

Two kinds of lines beyond ordinary messages: an *access line* per request (``access``), and a
periodic *stats line* while there is traffic (``StatsLine``), as vLLM prints one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from epdserve.common.logs import ACCESS_LOGGER

if TYPE_CHECKING:
    from epdserve.api.auth import AuthConfig

ACCESS = logging.getLogger(ACCESS_LOGGER)
STATS = logging.getLogger("epdserve.stats")
STATS_INTERVAL_S = 10.0


REQUEST_ID_HEADER = "X-Request-Id"  # one id per request across the roles' access lines
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def request_id(headers: Mapping[str, str]) -> str:
    """The request's id: the caller's ``X-Request-Id`` when it is a plain token, else a new one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if _ID.fullmatch(given) else os.urandom(8).hex()


def _text(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None and v != "")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.1f}"
    text = str(v)
    return f'"{text}"' if " " in text else text


def banner(logger: logging.Logger, role: str, **fields: Any) -> None:
    """A role's one start-up line, once it serves: what it runs, how and where (``fields`` in
    order as ``key=value``, or as JSON keys with ``event: started``)."""
    logger.info("%s started: %s", role, _text(fields), extra={"fields": {"event": "started", "role": role, **fields}})


def auth_mode(auth: AuthConfig) -> str:
    """Who a role's public routes take, for its start-up line."""
    if auth.internal_only:
        return "cluster only"
    return "api key" if auth.api_key else "off"


def lending(lends: bool) -> str | None:
    """A start-up line's ``borrows`` field: what a role computes on besides its own threads."""
    return "idle roles' cores" if lends else None


def gib(n: int) -> str:
    """Bytes for a start-up line."""
    return f"{n / (1 << 30):.2f}GiB"


def access(**fields: Any) -> None:
    """One request's access line: ``fields`` in order (text), or as JSON keys. Inside a role's
    event loop it is formatted and written when the loop next turns, which is after the handler
    that called this has handed its answer to the socket: the line is off the request's path."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        _write_access(fields)
        return
    loop.call_soon(_write_access, fields)


def _write_access(fields: dict[str, Any]) -> None:
    """The record made and handled directly: ``Logger.info`` would also walk the stack for the
    caller's file and line, which no line prints."""
    record = ACCESS.makeRecord(
        ACCESS.name, logging.INFO, __file__, 0, _text(fields), (), None, extra={"fields": fields}
    )
    ACCESS.handle(record)


def stats(**fields: Any) -> None:
    STATS.info(_text(fields), extra={"fields": fields})


class StatsLine:
    """Every ``interval_s``, while there was traffic since the last line (``busy``), log the
    fields ``read(seconds since the last line)`` returns (or awaits: it may ask the engine core)."""

    def __init__(
        self, busy: Callable[[], bool], read: Callable[[float], Any], interval_s: float = STATS_INTERVAL_S
    ) -> None:
        self.busy, self.read, self.interval_s = busy, read, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval_s > 0:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            if self.busy():
                try:
                    fields = self.read(now - last)
                    if asyncio.iscoroutine(fields):
                        fields = await fields
                    stats(**fields)
                except Exception:  # a stats line must never end the role
                    logging.getLogger(__name__).exception("stats line failed")
            last = now
