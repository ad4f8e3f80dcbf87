"""The skeleton every role's HTTP server shares (encoder, language-model instance, router): the
aiohttp app with its routes behind the error middleware and their access checks, ``GET /version``
and the lifecycle hooks (``role_app``); serving it (``run_app``); and what each role's service
keeps beside its own work, started and stopped the same way (``RoleBasics``): its metrics
registry and ``/metrics`` answer, its tracer, the window of counts its stats line reports, and its
registration with a router (``--register-with``)."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from aiohttp import web

from epdserve.allocator import FreeMemoryReturner
from epdserve.api import logs
from epdserve.api.auth import Access, AuthConfig, attest_route, guard
from epdserve.api.bodies import MAX_INFLIGHT_BODY_BYTES, RequestBodies
from epdserve.api.http import Handler, error_middleware
from epdserve.api.metrics import CONTENT_TYPE, Metrics
from epdserve.api.registration import Registrar, RegistrationConfig
from epdserve.api.tracing import Tracing
from epdserve.memory import resident_bytes

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
    bodies: RequestBodies,
) -> web.Application:
    """The aiohttp app of one role: its routes (and ``GET /version``, as vLLM serves it) behind
    the error middleware and their access checks, which read each body within the bound on request
    bodies held (``bodies``), with lifecycle hooks."""
    app = web.Application(client_max_size=max_request_bytes, middlewares=[error_middleware])
    verifier = auth.verifier()  # one replay cache per app

    def hold_body(request: web.Request) -> AbstractAsyncContextManager[None]:
        return bodies.holding(request, max_request_bytes)

    extra: list[Route] = [("GET", "/version", version, "open"), ("POST", "/v1/attest", attest_route(verifier), "open")]
    for method, path, handler, access in [*routes, *extra]:
        app.router.add_route(method, path, guard(handler, access, auth, hold_body, verifier))

    async def on_startup(app: web.Application) -> None:
        await start()

    async def on_cleanup(app: web.Application) -> None:
        await close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run_app(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; handlers are cancelled when their client disconnects. Free
    heap pages go back to the kernel meanwhile, so that the role's memory follows what it holds."""
    FreeMemoryReturner().start()
    # a short shutdown grace: a supervisor's SIGTERM must end the role (and unlink its slab) promptly
    web.run_app(
        app,
        host=host,
        port=port,
        handler_cancellation=True,
        print=None,
        access_log=None,
        shutdown_timeout=5.0,
        loop=new_event_loop(),
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a base dependency on Linux and macOS): every
    hop of a request through the roles costs less; else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class RoleBasics:
    """A role service's metrics, tracer, stats window and line, registration, and the bound on the
    request bodies it holds."""

    def __init__(
        self,
        service: str,
        otlp_traces_endpoint: str,
        read_stats: Callable[[float], Any],
        stats_interval_s: float,
        busy: Callable[[], bool] | None = None,
        body_bytes: int = MAX_INFLIGHT_BODY_BYTES,
        prefix: str = "",
    ) -> None:
        """``read_stats(seconds)``: the stats line's fields (``take_window`` gives the counts);
        ``busy``: whether there was traffic for a line (default: the window is not empty);
        ``body_bytes``: the bound on request bodies (``api.bodies``), whose metrics are named
        with ``prefix`` (the role's: ``router_``, ``encoder_``)."""
        self.metrics = Metrics()
        self.prefix = prefix
        self.bodies = RequestBodies(body_bytes)
        held = "bytes of request bodies held, with the copies parsing makes of them"
        self.metrics.gauge(f"{prefix}request_bodies_bytes", held, lambda: float(self.bodies.held))
        refused = "requests refused (429) because the request bodies held were at their bound"
        self.metrics.gauge(
            f"{prefix}request_bodies_refused_total", refused, lambda: float(self.bodies.refused), monotonic=True
        )
        self.tracing = Tracing(service, otlp_traces_endpoint)
        self.window = Counter[str]()  # counts since the last stats line
        self.stats_line = logs.StatsLine(busy or (lambda: bool(self.window)), read_stats, stats_interval_s)
        self.registrar: Registrar | None = None  # with --register-with: keeps this instance registered

    def export_memory(
        self, planned: Mapping[str, int], pids: Callable[[], Iterable[int]] = lambda: (os.getpid(),)
    ) -> None:
        """Export the role's memory account as it stated it at start-up (by ``part``, and
        ``total``; ``epdserve.memory``) beside what its processes (``pids``: this one) hold now."""
        by_part = {part: float(n) for part, n in planned.items()}
        plan = "the role's memory account at start-up, by part (total: all of them), in bytes"
        self.metrics.counts(f"{self.prefix}memory_planned_bytes", plan, "part", lambda: by_part, monotonic=False)
        held = "bytes the role's processes hold in memory now (resident sets, the engine core's included)"
        self.metrics.gauge(f"{self.prefix}memory_resident_bytes", held, lambda: float(sum(map(resident_bytes, pids()))))

    def take_window(self) -> Counter[str]:
        """The counts since the last stats line; the window starts again empty."""
        taken = self.window.copy()
        self.window.clear()
        return taken

    def start(
        self, registration: RegistrationConfig | None = None, pool: str = "", host: str = "", port: int = 0
    ) -> None:
        self.stats_line.start()
        if registration is not None:
            self.registrar = Registrar.of(registration, pool, host, port)
            self.registrar.start()

    async def close(self) -> None:
        if self.registrar is not None:
            await self.registrar.close()
        await self.stats_line.stop()
        self.tracing.shutdown()

    def metrics_response(self) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
