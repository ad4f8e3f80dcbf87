"""The router's HTTP face: the public endpoints (chat, completions, models), health, metrics
federated across the workers, the admin's worker list and registration, and the app that serves
them (``build_app``, ``serve_router``).

Per chat request: validate all of it (body and text size, model, sampling parameters, media
limits, who may send metadata-only parts) *before* any encoder spends time on it; admit it (its
class's gate); place it (``router.placement``: the worker, the media encoded); forward it
(``router.forward``) and account for how it ended (counters, span, access line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from epdserve.api import logs
from epdserve.api.auth import is_operator
from epdserve.api.completions import CompletionRequest, decode_completion_request
from epdserve.api.errors import ApiError, NotFound, Unavailable, WorkerFailed
from epdserve.api.http import json_response, read_body
from epdserve.api.logs import request_id
from epdserve.api.metrics import CONTENT_TYPE, federate, public_metrics
from epdserve.api.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    ChatRequest,
    SamplingRequest,
    check_embeds_trust,
    check_kv_trust,
    decode_chat_request,
    prompt_chars,
    request_kind,
    to_sampling_params,
)
from epdserve.api.quota import check_max_tokens, requested_max_tokens
from epdserve.api.role_app import Route, role_app, run_app
from epdserve.api.timing import wanted
from epdserve.api.tracing import Tracing
from epdserve.assets import default_model_dir
from epdserve.common.health import health_body
from epdserve.memory import MemoryBudgetError, available_memory, check_free
from epdserve.router.config import RouterConfig
from epdserve.router.forward import COMPLETIONS_PATH
from epdserve.router.memory import account_router
from epdserve.router.pool import NoWorker, Worker, WorkerPool
from epdserve.router.refs import MediaRef, media_refs, with_parts
from epdserve.router.server import Router
from epdserve.router.trail import Trail
from epdserve.router.upstream import RetryableWorker
from epdserve.router.vllm_worker import as_sent, vllm_body

log = logging.getLogger(__name__)

MAX_SCRAPE_BYTES = 4 << 20  # one worker's /metrics
CHARS_PER_TOKEN = 4  # a prompt's tokens as the router estimates them for its client's share (settled by usage)


class Handlers:
    """The router's HTTP handlers, over the parts of a ``Router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config
        self.metrics = router.metrics
        self.tracing = router.tracing
        self.worker_pools = router.workers
        self.encodes = router.encodes
        self.placement = router.placement
        self.forwarder = router.forwarder
        self.split = router.split
        self.gates = router.gates
        self.quotas = router.quotas
        self.window = router.role.window  # requests since the last stats line

    async def start(self) -> None:
        await self.router.start()
        cfg = self.config
        logs.banner(
            log,
            "router",
            encoders=",".join(cfg.encoders) or "none",
            pds=",".join(cfg.pds) or "none",
            prefills=",".join(cfg.prefills) or "none",
            decodes=",".join(cfg.decodes) or "none",
            policy=cfg.policy,
            dispatch=cfg.dispatch,
            listen=f"http://{cfg.host}:{cfg.port}",
            auth=logs.auth_mode(cfg.auth),
        )

    async def close(self) -> None:
        log.info("router on http://%s:%d stopping", self.config.host, self.config.port)
        await self.router.close()

    async def validate(self, raw: bytes) -> ChatRequest:
        """Everything a PD worker would refuse without running the model, checked here so that no
        encoder works (and no lease is taken) for a request that cannot run."""
        cfg = self.config
        req = decode_chat_request(raw, cfg.limits, cfg.max_prompt_chars)
        check_embeds_trust(req, internal=False, enable_mm_embeds=cfg.enable_mm_embeds)
        check_kv_trust(req, internal=False)
        await self._check_sampling(req)
        return req

    async def _check_sampling(self, req: SamplingRequest) -> None:
        """The model named (the one served when none is) and the sampling fields in range."""
        model = self.worker_pools.model or await self.worker_pools.learn_model()
        if model is None:
            raise Unavailable("No healthy prefill/decode worker is available.")
        name, max_model_len = model
        if not req.model:  # optional, as in vLLM: the one model served
            req.model = name
        if req.model != name:
            raise NotFound.model(req.model)
        to_sampling_params(req, 1, max_model_len or 1 << 30)
        check_max_tokens(req, self.config.quota.max_tokens_limit)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.tracing.server_span("POST /v1/chat/completions", request.headers) as span:
            return await self._chat_logged(request, span)

    @contextlib.contextmanager
    def _answered(self, trail: Trail, span: Any = None, endpoint: str = "") -> Iterator[_Answer]:
        """Account for one public request however it ends: the request counter by kind and
        status, the stats window, its span's attributes and its access line."""
        answer, t0 = _Answer(), time.perf_counter()
        try:
            yield answer
        except ApiError as e:
            answer.status, answer.error = e.status, e.code or ""
            raise
        finally:
            self._count(answer.kind, answer.status)
            self.window["requests"] += 1
            Tracing.set(
                span, **{"epd.request_id": trail.request_id, "epd.kind": answer.kind, "http.status_code": answer.status}
            )
            logs.access(
                id=trail.request_id,
                status=answer.status,
                kind=answer.kind,
                endpoint=endpoint,
                e2e_ms=1e3 * (time.perf_counter() - t0),
                encode_ms=1e3 * trail.stages.get("router_encode", 0.0),
                media=", ".join(f"{n} {how}" for how, n in sorted(trail.media.items())),
                ran_on=" ".join(trail.ran_on),
                error=answer.error,
            )

    async def _chat_logged(self, request: web.Request, span: Any) -> web.StreamResponse:
        raw = await read_body(request)
        trail = Trail(
            wanted(request.headers), request_id(request.headers), details=is_operator(request, self.config.auth)
        )
        with self._answered(trail, span) as answer:
            req = await self.validate(raw)
            answer.kind = trail.kind = request_kind(req)
            with self.quotas.share(request, self._reserve(prompt_chars(req), requested_max_tokens(req))) as settle:
                async with self.gates["text" if answer.kind == "text" else "media"].admit():
                    resp = await self._chat(request, req, raw, trail)
                settle(resp)
            answer.status = resp.status
            return resp

    def _reserve(self, chars: int, max_tokens: int | None) -> int:
        """The tokens a request reserves of its client's share (``api.quota``): its prompt as
        estimated from its characters, plus ``max_tokens``; settled by the answer's usage."""
        return -(-chars // CHARS_PER_TOKEN) + (max_tokens or DEFAULT_CHAT_MAX_TOKENS)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` (a raw text prompt): validated here, answered by a language-model
        worker (a prefill+decode one, else a decode one), retried once on another before its first byte."""
        with self.tracing.server_span("POST /v1/completions", request.headers) as span:
            raw = await read_body(request)
            trail = Trail(
                wanted(request.headers), request_id(request.headers), details=is_operator(request, self.config.auth)
            )
            with self._answered(trail, span, "completions") as answer:
                answer.kind = trail.kind = "text"
                req = decode_completion_request(raw, self.config.max_prompt_chars)
                await self._check_sampling(req)
                chars = len(req.prompt) * (1 if isinstance(req.prompt, str) else CHARS_PER_TOKEN)
                with self.quotas.share(request, self._reserve(chars, requested_max_tokens(req))) as settle:
                    async with self.gates["text"].admit():
                        resp = await self._complete_text(request, req, raw, trail)
                    settle(resp)
                answer.status = resp.status
                return resp

    async def _complete_text(
        self, request: web.Request, req: CompletionRequest, raw: bytes, trail: Trail
    ) -> web.StreamResponse:
        """A text completion on a language-model worker, retried once on another before its first byte."""
        pool = self.worker_pools.pds if self.worker_pools.pds.healthy else self.worker_pools.decodes
        exclude: set[str] = set()
        for attempt in (1, 2):
            try:
                worker = pool.pick(exclude=exclude)
            except NoWorker:
                raise Unavailable("No healthy language-model worker is available.") from None
            try:
                resp, _ = await self.forwarder.forward(
                    request, worker, raw, bool(req.stream), trail, pool, COMPLETIONS_PATH
                )
                return resp
            except RetryableWorker as e:
                exclude.add(e.url)
                if attempt == 2:
                    raise WorkerFailed(f"The worker failed: {e}") from None
        raise AssertionError("unreachable")

    def _count(self, kind: str, status: int) -> None:
        self.metrics.requests.inc(kind=kind, status=str(status))

    async def _chat(self, request: web.Request, req: ChatRequest, raw: bytes, trail: Trail) -> web.StreamResponse:
        body: dict[str, Any] = msgspec.json.decode(raw)
        if self.worker_pools.splits:
            return await self.split.chat(request, req, body, trail)
        refs = [] if self.config.dispatch == "never" else media_refs(body)
        attempts_left = 2
        exclude: set[str] = set()
        skip_cached = True  # until a worker could not use a cached handle: then encode everything
        while True:
            attempts_left -= 1
            consumed = False  # once the PD worker accepted the request, its leases are its own
            try:
                try:
                    pd = await self.placement.place(self.worker_pools.pds, req, refs, exclude, skip_cached, 1, trail)
                except NoWorker:
                    raise Unavailable("No healthy prefill/decode worker is available.") from None
                worker_body = self._worker_body(raw, body, refs)
                resp, consumed = await self.forwarder.forward(request, pd, worker_body, bool(req.stream), trail)
                return resp
            except RetryableWorker as e:
                if not e.worker_ok:
                    exclude.add(e.url)
                self.encodes.forget_directory_hits(refs)
                skip_cached = False
                self.metrics.pd_retries.inc()
                if attempts_left <= 0:
                    raise WorkerFailed(f"The prefill/decode worker failed: {e}") from None
            finally:
                if not consumed:
                    self.encodes.release(self.encodes.take_leases(refs))

    def _worker_body(self, raw: bytes, body: dict[str, Any], refs: list[MediaRef]) -> bytes:
        """The body for the language-model worker: the client's bytes when nothing in them changes
        (no media the router settled, nothing a vLLM worker must not be sent), else rewritten."""
        vllm = self.config.pd_engine == "vllm"
        if not refs and (not vllm or as_sent(body)):
            return raw
        return msgspec.json.encode((vllm_body if vllm else with_parts)(body, refs))

    async def workers(self, request: web.Request) -> web.Response:
        def rows(p: WorkerPool) -> list[dict]:
            return [{"url": w.url, "healthy": w.healthy, "outstanding": w.outstanding} for w in p.workers.values()]

        return web.json_response(
            {
                "encoders": rows(self.worker_pools.encoders),
                "pds": rows(self.worker_pools.pds),
                "prefills": rows(self.worker_pools.prefills),
                "decodes": rows(self.worker_pools.decodes),
            }
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        answer = await self.worker_pools.pd_models()
        if answer is None:
            raise Unavailable("No healthy prefill/decode worker is available.")
        return json_response(answer[1], answer[0])

    async def health(self, request: web.Request) -> web.Response:
        """Some requests can be served: a language-model path is healthy (encoders may be down)."""
        if not self.worker_pools.pds.healthy and not self.worker_pools.splits:
            raise Unavailable("no healthy prefill/decode worker", retry_after_s=self.config.retry_after_s)
        counts = {f"{pool.role}s": len(pool.healthy) for pool in self.worker_pools.pools}
        return web.json_response(health_body("router", **counts))

    async def ready(self, request: web.Request) -> web.Response:
        """Every request can be served: each role the router was given has a worker that answered
        its health probe. ``up`` and a readiness probe wait for this; the counts say who is up."""
        pools = self.worker_pools
        counts = {f"{pool.role}s": len(pool.ready) for pool in pools.pools}
        missing = [pool.role for pool in pools.pools if pool.workers and not pool.ready]
        if not (pools.pds.workers or pools.prefills.workers):  # none named or registered yet
            missing.append("language-model")
        if missing:
            raise Unavailable(
                "not ready: no healthy " + ", ".join(missing) + " worker yet",
                retry_after_s=self.config.retry_after_s,
            )
        return web.json_response({"status": "ready", **counts})

    async def metrics_text(self, request: web.Request) -> web.Response:
        """The router's own metrics, then, for the operator (the admin key or the cluster
        credential: the labels name internal addresses), every worker's with ``role`` and
        ``instance`` labels added: one scrape target for the whole deployment."""
        assert self.worker_pools.session is not None
        if not is_operator(request, self.config.auth):
            return public_metrics(self.metrics.registry, self.config.exposure.metrics_level(self.config.auth.api_key))
        workers = [(pool.role, w) for pool in self.worker_pools.pools for w in pool.workers.values()]
        texts = await asyncio.gather(*(self._scrape(w) for _, w in workers))
        federated = federate([(role, w.url, text) for (role, w), text in zip(workers, texts, strict=True) if text])
        return web.Response(body=self.metrics.registry.render() + federated, headers={"Content-Type": CONTENT_TYPE})

    async def _scrape(self, w: Worker) -> str | None:
        try:
            raw = await self.worker_pools.get_internal(w, "/metrics", MAX_SCRAPE_BYTES, 2)
            if raw is not None:
                return raw.decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("no metrics from %s: %s", w.url, e)
        self.metrics.scrape_failures.inc()
        return None


class _Answer:
    """How a public request ended, as far as it got."""

    kind: str = "unknown"  # until the body parses
    status: int = 200
    error: str = ""


def build_app(router: Router) -> web.Application:
    h = Handlers(router)
    routes: list[Route] = [
        ("POST", "/v1/chat/completions", h.chat, "public"),
        ("POST", "/v1/completions", h.completions, "public"),
        ("GET", "/v1/models", h.models, "public"),
        ("GET", "/health", h.health, "open"),
        ("GET", "/ready", h.ready, "open"),
        ("GET", "/metrics", h.metrics_text, "open"),
        ("GET", "/v1/workers", h.workers, "admin"),
        ("POST", "/v1/workers", router.workers.register, "admin"),
        ("DELETE", "/v1/workers", router.workers.register, "admin"),
    ]
    return role_app(router.config.max_request_bytes, routes, h.start, h.close, router.config.auth, router.role.bodies)


def serve_router(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM, once its memory account fits the memory free."""
    model_dir = Path(config.model) if config.model else default_model_dir()
    memory = account_router(model_dir, config.max_inflight_body_bytes, config.frontend)
    try:
        check_free(memory, available_memory())
    except MemoryBudgetError as e:  # its message names every figure: no traceback to read
        log.error("%s", e)
        raise SystemExit(1) from None
    log.info("%s", memory.line())
    router = Router(config)
    router.role.export_memory(memory.parts())
    run_app(build_app(router), config.host, config.port)
