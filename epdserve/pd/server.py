"""The OpenAI-compatible server of a language-model instance (aggregated or PD role).

Routes: POST /v1/chat/completions (SSE streaming and not), GET /v1/models, /health, /metrics.
This process is the front end: it validates, fetches and preprocesses raw media, renders the
prompt, detokenizes and streams. The engine core (scheduler, model, EC fetches) runs in its own
process behind an ``EngineCoreClient``; if it dies, open streams end with an error, /health turns
503 and the server exits non-zero so its supervisor restarts it. Every failure reaches the client
as OpenAI-style error JSON with the right status.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from aiohttp import web

from epdserve.api import logs
from epdserve.api.auth import is_internal, is_operator
from epdserve.api.errors import ApiError, BadRequest, Unavailable
from epdserve.api.http import json_response, read_body
from epdserve.api.kv_digest import KVDigest
from epdserve.api.logs import request_id
from epdserve.api.metrics import public_metrics
from epdserve.api.protocol import ChatRequest, request_kind
from epdserve.api.quota import Quotas
from epdserve.api.responses import (
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    PrefillCompletion,
    ResponseMessage,
    Usage,
    encode_json,
    now_s,
    sse_error,
    sse_event,
)
from epdserve.api.role_app import Route, role_app, run_app
from epdserve.api.timing import SERVER_TIMING, prefixed, server_timing, wanted
from epdserve.api.tracing import Tracing, wall_ns
from epdserve.common.health import health_body
from epdserve.engine.client import CoreStartError, MPClient
from epdserve.engine.messages import AddRequest
from epdserve.launcher import ENGINE_CORE_DIED_EXIT
from epdserve.pd.completions import CompletionHandlers
from epdserve.pd.config import ServerConfig
from epdserve.pd.generation import Generation, Piece, WorkerFailedMidStream
from epdserve.pd.service import ChatService

log = logging.getLogger(__name__)


@dataclass
class Timing:
    """One answered request's stages so far, whether its client asked to see them, and (once it
    is done) its size and length, for its access line."""

    stages: dict[str, float]
    ttft: float
    t0: float
    role: str  # prefixes the stage names in the header: pd, prefill or decode
    wanted: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    e2e: float = 0.0

    def header(self, stages: dict[str, float]) -> str:
        return server_timing(prefixed(self.role, stages))


class KVRelease(msgspec.Struct, forbid_unknown_fields=True):
    handles: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=1024)]


# ---------------------------------------------------------------------------------- handlers


class ChatHandlers:
    def __init__(self, service: ChatService) -> None:
        self.s = service

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.s.tracing.server_span("POST /v1/chat/completions", request.headers) as span:
            return await self._chat(request, span)

    async def _chat(self, request: web.Request, span: Any) -> web.StreamResponse:
        s = self.s
        t0 = time.perf_counter()
        body = await read_body(request)
        kind = "unknown"  # until the body parses
        rid = request_id(request.headers)
        ticket = None
        try:
            if not is_internal(request):  # a client's share (api.quota); the router counted its calls
                ticket = s.quotas.admit(Quotas.client(request))
            req, add, held = await s.prepare(body, is_internal(request))
            with held:
                t_prepared = time.perf_counter()
                kind = request_kind(req)
                if ticket is not None:
                    ticket.reserve(len(add.prompt_token_ids) + add.params.max_tokens)
                gen, first = await Generation.started(s, add)
                add = gen.add  # without the pixels: the core has them, this request keeps no copy
        except BaseException as e:
            if ticket is not None:
                ticket.failed()
            if not isinstance(e, ApiError):
                raise
            s.count(kind, e.status)
            Tracing.set(span, **{"epd.request_id": rid, "http.status_code": e.status})
            logs.access(id=rid, status=e.status, kind=kind, e2e_ms=1e3 * (time.perf_counter() - t0), error=e.code)
            raise
        s.count(kind, 200)
        ttft = time.perf_counter() - t0
        s.ttft.observe(ttft)
        stages = s.stages(t_prepared - t0, first.stages)
        s.tracing.stages(wall_ns(t0), stages)
        timing = Timing(stages, ttft, t0, s.config.role if s.config.role != "both" else "pd", wanted(request.headers))
        try:
            async with contextlib.aclosing(gen.rest()) as rest:  # closing early aborts the request
                if add.kv is not None and add.kv.produce:
                    return await self._complete(req, add, first, rest, timing, prefill=True)
                if req.stream:
                    return await self._stream(request, req, add, gen, first, rest, timing)
                return await self._complete(req, add, first, rest, timing)
        finally:
            if ticket is not None:
                ticket.done(timing.prompt_tokens + timing.completion_tokens if timing.e2e else None)
            Tracing.set(span, **{"epd.request_id": rid, "epd.kind": kind, "http.status_code": 200})
            if timing.e2e:
                s.tracing.stages(wall_ns(t0 + ttft), {"decode": timing.e2e - ttft})
            logs.access(
                id=rid,
                status=200,
                kind=kind,
                prompt_tokens=timing.prompt_tokens,
                output_tokens=timing.completion_tokens,
                ttft_ms=1e3 * ttft,
                e2e_ms=1e3 * (timing.e2e or time.perf_counter() - t0),
                ran_on=f"{timing.role} {s.config.host}:{s.config.port}",
                finished="yes" if timing.e2e else "no (client left or worker failed)",
            )

    def _done(self, last: Piece, timing: Timing) -> float:
        """Record a finished answer; its decode time (after the first token)."""
        s = self.s
        e2e = timing.e2e = time.perf_counter() - timing.t0
        timing.prompt_tokens, timing.completion_tokens = last.prompt_tokens, last.completion_tokens
        s.e2e.observe(e2e)
        s.stage_hist.labels(stage="decode").observe(e2e - timing.ttft)
        s.metrics.inc("generation_tokens_total", last.completion_tokens, help_text="generated tokens")
        s.metrics.inc("prompt_tokens_total", last.prompt_tokens, help_text="prompt tokens")
        s.window.update(requests=1, prompt_tokens=last.prompt_tokens, generation_tokens=last.completion_tokens)
        return e2e - timing.ttft

    async def _complete(
        self, req: ChatRequest, add: AddRequest, first: Piece, rest, timing: Timing, prefill: bool = False
    ) -> web.Response:
        s = self.s
        text, logprobs, last = [first.text], list(first.logprobs or []), first
        try:
            if first.finish_reason is None and first.kv is None:
                async for piece in rest:
                    text.append(piece.text)
                    logprobs += piece.logprobs or []
                    last = piece
        except WorkerFailedMidStream as e:
            raise e.error from None
        decode = self._done(last, timing)
        choice = Choice(
            message=ResponseMessage(content="".join(text)),
            logprobs=ChoiceLogprobs(content=logprobs) if add.params.logprobs else None,
            finish_reason=last.finish_reason,
        )
        resp = (PrefillCompletion if prefill else ChatCompletion)(
            id=_completion_id(req, add),
            created=now_s(),
            model=s.config.model_name,
            choices=[choice],
            usage=Usage.of(last.prompt_tokens, last.completion_tokens),
        )
        if isinstance(resp, PrefillCompletion):
            resp.kv_transfer_params = first.kv
        out = json_response(encode_json(resp))
        if timing.wanted:
            out.headers[SERVER_TIMING] = timing.header({**timing.stages, "decode": decode})
        return out

    async def _stream(
        self,
        request: web.Request,
        req: ChatRequest,
        add: AddRequest,
        gen: Generation,
        first: Piece,
        rest,
        timing: Timing,
    ) -> web.StreamResponse:
        s = self.s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if timing.wanted:  # what is known before the first byte: up to the first token
            resp.headers[SERVER_TIMING] = timing.header(timing.stages)
        await resp.prepare(request)
        model, created = s.config.model_name, now_s()
        want_lp = add.params.logprobs
        completion_id = _completion_id(req, add)
        continuing = add.kv is not None and add.kv.first_token is not None  # the router sent the start

        def chunk(delta: Delta, piece: Piece | None = None, usage: Usage | None = None) -> bytes:
            choices = []
            if usage is None:
                lp = ChoiceLogprobs(content=piece.logprobs or []) if piece is not None and want_lp else None
                choices = [ChunkChoice(delta=delta, logprobs=lp, finish_reason=piece.finish_reason if piece else None)]
            c = ChatCompletionChunk(id=completion_id, created=created, model=model, choices=choices, usage=usage)
            return sse_event(c)

        # the client may leave mid-stream; closing the generator then aborts the request
        with contextlib.suppress(ConnectionResetError):
            if not continuing:
                await resp.write(chunk(Delta(role="assistant", content="")))
            last, t_prev = first, time.perf_counter()
            failed = False
            try:
                await resp.write(chunk(Delta(content=first.text) if first.text else Delta(), first))
                if first.finish_reason is None:
                    async for piece in rest:
                        now = time.perf_counter()
                        s.itl.observe(now - t_prev)
                        t_prev, last = now, piece
                        if piece.text or piece.finish_reason or piece.logprobs:
                            await resp.write(chunk(Delta(content=piece.text) if piece.text else Delta(), piece))
            except WorkerFailedMidStream as e:
                failed = True
                await resp.write(sse_error(e.error))
            if not failed:
                self._done(last, timing)
                if req.include_usage:
                    await resp.write(chunk(Delta(), usage=Usage.of(last.prompt_tokens, last.completion_tokens)))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        return resp

    async def release_kv(self, request: web.Request) -> web.Response:
        """Internal: KV leases a decode instance will not read, given back (prefill instances)."""
        body = await read_body(request)
        try:
            handles = msgspec.json.decode(body, type=KVRelease).handles
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise BadRequest(f"Invalid release request: {e}") from None
        self.s.release_kv(handles)
        return web.json_response({"released": len(handles)})

    async def load(self, request: web.Request) -> web.Response:
        """Internal: this worker's load ratio (the router's autoscaling signal)."""
        await self.s.refresh_stats()
        return json_response(msgspec.json.encode(self.s.load_report()))

    async def kv_digest(self, request: web.Request) -> web.Response:
        """Internal: the block hashes of this instance's prefix cache (KV-aware routing)."""
        stats = await self.s.core.stats(digest=True)
        digest = KVDigest(model=self.s.config.model_name, block_size=stats.block_size, hashes=stats.kv_digest)
        return json_response(msgspec.json.encode(digest))

    async def models(self, request: web.Request) -> web.Response:
        s = self.s
        card = ModelCard(id=s.config.model_name, created=int(s.started), max_model_len=s.config.engine.max_model_len)
        return json_response(encode_json(ModelList(data=[card])))

    async def health(self, request: web.Request) -> web.Response:
        if not self.s.core.healthy:
            raise Unavailable(f"the engine core is not running: {self.s.core_died or 'stopped'}")
        return web.json_response(health_body(self.s.config.role if self.s.config.role != "both" else "pd"))

    async def metrics(self, request: web.Request) -> web.Response:
        await self.s.refresh_stats()
        cfg = self.s.config
        if not is_operator(request, cfg.auth):
            return public_metrics(self.s.metrics, cfg.exposure.metrics_level(cfg.auth.api_key))
        return self.s.role.metrics_response()


def _completion_id(req: ChatRequest, add: AddRequest) -> str:
    """The id the client sees: the one its stream already carries when this instance continues it."""
    kv = req.kv_transfer_params
    return kv.completion_id if kv is not None and kv.completion_id else add.request_id


def build_app(service: ChatService) -> web.Application:
    h = ChatHandlers(service)
    routes: list[Route] = [
        ("POST", "/v1/chat/completions", h.chat, "public"),
        ("POST", "/v1/completions", CompletionHandlers(service).completions, "public"),
        ("GET", "/v1/models", h.models, "public"),
        ("GET", "/health", h.health, "open"),
        ("GET", "/metrics", h.metrics, "open"),
        ("POST", "/v1/kv/release", h.release_kv, "internal"),
        ("GET", "/v1/kv/digest", h.kv_digest, "internal"),
        ("GET", "/v1/load", h.load, "internal"),
    ]
    cfg = service.config
    return role_app(cfg.max_request_bytes, routes, service.start, service.close, cfg.auth, service.role.bodies)


def serve(config: ServerConfig, core: MPClient | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; exits ``ENGINE_CORE_DIED_EXIT`` when the engine core died."""
    service = ChatService(config, core)
    log.info(
        "epdserve serving %s on http://%s:%d (role %s, vision tower %s%s)",
        config.model_name,
        config.host,
        config.port,
        config.role,
        "loaded" if config.vision else "not loaded",
        ", internal only" if config.auth.internal_only else "",
    )
    try:
        run_app(build_app(service), config.host, config.port)
    except CoreStartError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    if service.core_died is not None:
        log.error("stopped because the engine core died: %s", service.core_died)
        raise SystemExit(ENGINE_CORE_DIED_EXIT)
