"""Request bodies a role holds at once, bounded in bytes.

A request's body is read whole before it is parsed, and a role keeps it, and the copies parsing
makes of it (its text, the media decoded from base64, the body a router forwards), until the
request is answered. ``client_max_size`` bounds one body; nothing bounded how many are held at
once, so a few dozen concurrent clients each sending a 20 MB image took a deployment's router and
encoder to gigabytes. A request with a body takes ``BODY_COPIES`` times each piece of it from the
role's bound as the piece arrives, and gives it all back once answered (a streamed answer: once
its stream ends). A piece past the bound ends the request with 429 and Retry-After, and what
arrived is dropped; with nothing else held, one request is always let through.

Counting what has arrived, not the declared length, keeps a client that sends slowly (or never)
from holding more of the bound than the bytes it has sent; counting it while it arrives keeps
many bodies arriving at once within the bound too. A body's declared length past
``client_max_size`` is refused (413) before any of it is read, and a body of which nothing
arrives for ``BODY_IDLE_S`` is dropped (408), what it held given back: a stalled client holds its
share of the bound for a minute at most, not for as long as it keeps the connection.

A route's access check (``api.auth.guard``) reads the body here once the request may be served,
so a request its credential refuses is refused before any of its body is read. The body read here
is what every handler parses (``api.http.read_body``); ``request.read()`` after it raises
``BodyTaken`` rather than give an empty body.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from epdserve.api.errors import BodyStalled, Overloaded, PayloadTooLarge
from epdserve.api.http import BODY, BodyTaken
from epdserve.common.byte_bound import MAX_INFLIGHT_BODY_BYTES, BoundFull, ByteBound, Held

__all__ = ["BODY_COPIES", "BODY_IDLE_S", "MAX_INFLIGHT_BODY_BYTES", "BodiesFull", "RequestBodies"]

# bytes a role holds per byte of a body: the body, its parsed text, the media decoded from it and
# the body a router forwards
BODY_COPIES = 4
BODY_IDLE_S = 60.0  # a body of which nothing arrives for this long is dropped (408), as nginx's client_body_timeout


class BodiesFull(BoundFull):
    """One more request body would take the role past its bound."""


class RequestBodies(ByteBound):
    """The bytes of request bodies a role holds (``BODY_COPIES`` per byte), and their bound."""

    Full = BodiesFull

    def __init__(self, limit: int, idle_s: float = BODY_IDLE_S) -> None:
        """``limit``: the bound in bytes; ``idle_s``: how long a body may send nothing."""
        super().__init__(limit, "request bodies are held")
        self.idle_s = idle_s

    @asynccontextmanager
    async def holding(self, request: web.Request, max_request_bytes: int) -> AsyncIterator[None]:
        """Read ``request``'s body within the bound (``read_body`` gives it to the handler) and
        hold its bytes until the block ends: 429 (``Overloaded``) past the bound, 413 past
        ``max_request_bytes``. A request without a body takes nothing."""
        if not request.body_exists:
            yield
            return
        with self.take(0) as held:
            try:
                request[BODY] = await _arrived(request, held, max_request_bytes, self.idle_s)
            except BodiesFull as e:
                raise Overloaded(f"The server is overloaded: {e}.") from None
            yield


async def _arrived(request: web.Request, held: Held, max_bytes: int, idle_s: float) -> bytes:
    """The whole body, each piece counted in ``held`` as it arrives; 413 past ``max_bytes``, 408
    when nothing arrives for ``idle_s``."""
    too_large = PayloadTooLarge(f"The request body exceeds {max_bytes} bytes.")
    if (request.content_length or 0) > max_bytes:
        raise too_large
    body = bytearray()
    while piece := await _next_piece(request, idle_s):
        if len(body) + len(piece) > max_bytes:
            raise too_large
        held.grow(BODY_COPIES * len(piece))
        body += piece
    request.content.set_exception(BodyTaken("the body was read by the bound on request bodies: use read_body"))
    return bytes(body)


async def _next_piece(request: web.Request, idle_s: float) -> bytes:
    """What has arrived of ``request``'s body since the last piece (b"" at its end)."""
    try:
        return await asyncio.wait_for(request.content.readany(), idle_s)
    except TimeoutError:
        raise BodyStalled(f"The request body stalled: nothing arrived for {idle_s:g} s.") from None
