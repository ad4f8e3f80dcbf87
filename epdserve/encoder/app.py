"""The encoder's HTTP face: ``/v1/encode``, ``/v1/release`` and ``/v1/load`` for the router,
``/v1/models``, ``/health`` and ``/metrics``, over an ``EncoderService``; ``serve`` runs it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import msgspec
from aiohttp import web

from epdserve.api import logs
from epdserve.api.errors import ApiError, Unavailable
from epdserve.api.http import json_response, read_body
from epdserve.api.load import LoadReport
from epdserve.api.logs import request_id
from epdserve.api.responses import ModelCard, ModelList, encode_json
from epdserve.api.role_app import Route, role_app, run_app
from epdserve.api.tracing import Tracing
from epdserve.common.health import health_body
from epdserve.encoder.config import EncoderConfig
from epdserve.encoder.protocol import encode_response
from epdserve.encoder.server import EncoderService
from epdserve.engine.memory import MemoryBudgetError

log = logging.getLogger(__name__)


class EncoderHandlers:
    def __init__(self, service: EncoderService) -> None:
        self.s = service

    async def encode(self, request: web.Request) -> web.Response:
        with self.s.tracing.server_span("POST /v1/encode", request.headers) as span:
            return await self._encode(request, span)

    async def _encode(self, request: web.Request, span: Any) -> web.Response:
        s = self.s
        t0 = time.perf_counter()
        rid = request_id(request.headers)
        s.metrics.inc("encode_requests_total", help_text="/v1/encode requests received")
        s.window["requests"] += 1
        try:
            body = await read_body(request)
            resp = await s.encode(body)
        except ApiError as e:
            s.metrics.inc("encode_request_errors_total", labels={"status": str(e.status)}, help_text="requests failed")
            logs.access(id=rid, status=e.status, e2e_ms=1e3 * (time.perf_counter() - t0), error=e.code)
            raise
        seconds = time.perf_counter() - t0
        s.request_seconds.observe(seconds)
        how = Counter(item.status for item in resp.items)
        s.window.update(how)
        Tracing.set(
            span, **{"epd.request_id": rid, "epd.items": len(resp.items), **{f"epd.{k}": n for k, n in how.items()}}
        )
        logs.access(
            id=rid,
            status=200,
            items=len(resp.items),
            media=", ".join(f"{n} {status}" for status, n in sorted(how.items())),
            visual_tokens=sum(item.num_embeddings for item in resp.items),
            e2e_ms=1e3 * seconds,
        )
        return json_response(encode_response(resp))

    async def load(self, request: web.Request) -> web.Response:
        """Internal: this encoder's load ratio (the router's autoscaling signal)."""
        load = self.s.load
        s = self.s
        report = LoadReport(
            load_ratio=load.ratio(),
            s_per_patch=1 / load.capacity if load.capacity else 0.0,
            preprocess_s_per_patch=s.preprocess_rate.update(s.preprocess_cpu_s, s.preprocess_patches),
        )
        return json_response(msgspec.json.encode(report))

    async def release(self, request: web.Request) -> web.Response:
        released = await self.s.release(await read_body(request))
        self.s.metrics.inc("encoder_released_by_router_total", released, help_text="leases the router gave back")
        return web.json_response({"released": released})

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(id=self.s.config.model_name, created=int(self.s.started))
        return json_response(encode_json(ModelList(data=[card])))

    async def health(self, request: web.Request) -> web.Response:
        if not self.s.batcher.alive:
            raise Unavailable("the vision-forward thread is not running")
        return web.json_response(health_body("encoder"))

    async def metrics(self, request: web.Request) -> web.Response:
        return self.s.role.metrics_response()


def build_app(service: EncoderService) -> web.Application:
    h = EncoderHandlers(service)
    routes: list[Route] = [
        ("POST", "/v1/encode", h.encode, "internal"),
        ("POST", "/v1/release", h.release, "internal"),
        ("GET", "/v1/load", h.load, "internal"),
        ("GET", "/v1/models", h.models, "internal"),
        ("GET", "/health", h.health, "open"),
        ("GET", "/metrics", h.metrics, "open"),
    ]
    cfg = service.config
    return role_app(cfg.max_request_bytes, routes, service.start, service.close, cfg.auth, service.role.bodies)


def serve(config: EncoderConfig) -> None:
    """Run the encoder until SIGINT/SIGTERM."""
    try:
        service = EncoderService(config)
    except MemoryBudgetError as e:  # its message names every figure: no traceback to read
        log.error("%s", e)
        raise SystemExit(1) from None
    run_app(build_app(service), config.host, config.port)
