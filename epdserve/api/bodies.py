"""Request bodies a role holds at once, bounded in bytes.

A request's body is read whole before it is parsed, and a role keeps it, and the copies parsing
makes of it (its text, the media decoded from base64, the body a router forwards), until the
request is answered. ``client_max_size`` bounds one body; nothing bounded how many are held at
once, so a few dozen concurrent clients each sending a 20 MB image took a deployment's router and
encoder to gigabytes. Each request with a body now takes ``BODY_COPIES`` times its length from
the role's bound once its body has arrived, before anything parses it, and gives it back once
answered (a streamed answer: once its stream ends). A request past the bound is answered 429 with
Retry-After and its body dropped; with nothing held, one request is always let through.

Counting a body from when it has arrived, not from its declared length, keeps a client that sends
slowly (or never) from holding the bound: it holds only the bytes it has sent, in the connection's
buffer, and none of the bound.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from epdserve.api.errors import Overloaded
from epdserve.api.http import Handler, read_body
from epdserve.common.byte_bound import MAX_INFLIGHT_BODY_BYTES, BoundFull, ByteBound

__all__ = ["BODY_COPIES", "MAX_INFLIGHT_BODY_BYTES", "BodiesFull", "RequestBodies"]

# bytes a role holds per byte of a body: the body, its parsed text, the media decoded from it and
# the body a router forwards
BODY_COPIES = 4


class BodiesFull(BoundFull):
    """One more request body would take the role past its bound."""


class RequestBodies(ByteBound):
    """The bytes of request bodies a role holds (``BODY_COPIES`` per byte), and their bound."""

    Full = BodiesFull

    def __init__(self, limit: int) -> None:
        super().__init__(limit, "request bodies are held")

    def middleware(self, max_request_bytes: int) -> Middleware:
        """The aiohttp middleware that holds each request's body within the bound."""

        @web.middleware
        async def bounded(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.body_exists:
                return await handler(request)
            size = len(await read_body(request, max_request_bytes))  # the handler reads it from here
            try:
                held = self.take(BODY_COPIES * size)
            except BodiesFull as e:
                raise Overloaded(f"The server is overloaded: {e}.") from None
            with held:
                return await handler(request)

        return bounded
