"""HTTP plumbing shared by every role's server: the error middleware and JSON responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from epdserve.api.auth import Access, AuthConfig, attest_route, guard
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
        e = from_media_error(exc) if isinstance(exc, MediaError) else exc
        resp = json_response(e.to_json(), e.status)
        resp.headers.update(e.headers)
        return resp
    except web.HTTPRequestEntityTooLarge:
        return json_response(PayloadTooLarge("The request body is too large.").to_json(), 413)
    except web.HTTPException as e:  # unknown route, wrong method, ...
        body = {"error": {"message": e.reason, "type": "invalid_request_error", "param": None, "code": None}}
        return web.json_response(body, status=e.status)
    except Exception as e:  # keep serving; report a clean 500
        log.exception("unhandled error")
        return json_response(ApiError(f"Internal server error: {type(e).__name__}").to_json(), 500)


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The request body; 413 (OpenAI JSON) when it exceeds the app's ``client_max_size``."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"The request body exceeds {max_bytes} bytes.") from None


Route = tuple[str, str, Handler, Access]  # (method, path, handler, who may call it)


async def version(request: web.Request) -> web.Response:
    from epdserve import __version__

    return web.json_response({"version": __version__})


def role_app(
    max_request_bytes: int,
    routes: list[Route],
    start: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
    auth: AuthConfig,
) -> web.Application:
    """The aiohttp app of one role: its routes (and ``GET /version``, as vLLM serves it) behind
    the error middleware and their access checks, with lifecycle hooks."""
    app = web.Application(client_max_size=max_request_bytes, middlewares=[error_middleware])
    verifier = auth.verifier()  # one replay cache per app
    extra: list[Route] = [("GET", "/version", version, "open"), ("POST", "/v1/attest", attest_route(verifier), "open")]
    for method, path, handler, access in [*routes, *extra]:
        app.router.add_route(method, path, guard(handler, access, auth, verifier))

    async def on_startup(app: web.Application) -> None:
        await start()

    async def on_cleanup(app: web.Application) -> None:
        await close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run_app(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; handlers are cancelled when their client disconnects."""
    # a short shutdown grace: a supervisor's SIGTERM must end the role (and unlink its slab) promptly
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None, access_log=None, shutdown_timeout=5.0)
