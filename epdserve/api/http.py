"""HTTP plumbing shared by every role's server: the error middleware and JSON responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from epdserve.api.errors import ApiError, PayloadTooLarge, from_media_error
from epdserve.media.errors import MediaError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (ApiError, MediaError) as exc:
        # no local may hold the error: its traceback holds this frame, and such a cycle keeps the
        # failed request's buffers (its media's pixels) alive until a full garbage collection
        return error_response(from_media_error(exc) if isinstance(exc, MediaError) else exc)
    except web.HTTPRequestEntityTooLarge:
        return json_response(PayloadTooLarge("The request body is too large.").to_json(), 413)
    except web.HTTPException as e:  # unknown route, wrong method, ...
        body = {"error": {"message": e.reason, "type": "invalid_request_error", "param": None, "code": None}}
        return web.json_response(body, status=e.status)
    except Exception as e:  # keep serving; report a clean 500
        log.exception("unhandled error")
        return json_response(ApiError(f"Internal server error: {type(e).__name__}").to_json(), 500)


def error_response(e: ApiError) -> web.Response:
    """The OpenAI-style JSON answer to ``e``, with its headers (Retry-After)."""
    resp = json_response(e.to_json(), e.status)
    resp.headers.update(e.headers)
    return resp


BODY = web.RequestKey("epd_body", bytes)  # a request's body, as the role's bound on bodies read it


class BodyTaken(RuntimeError):
    """``request.read()`` on a body the role's bound on bodies has read: use ``read_body``."""


async def read_body(request: web.Request) -> bytes:
    """The request body, as the role's bound on bodies (``api.bodies``) read it; in an app
    without that bound, read here (413, OpenAI JSON, past the app's ``client_max_size``)."""
    body = request.get(BODY)
    return await request.read() if body is None else body
