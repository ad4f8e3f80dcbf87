"""The OpenAI-compatible server of a language-model instance (aggregated or PD role).

Routes: POST /v1/chat/completions (SSE streaming and not), GET /v1/models, /health, /metrics.
Every failure reaches the client as OpenAI-style error JSON with the right status; the engine
runs in its own thread (``AsyncEngine``), so this event loop only parses, fetches and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from epdserve.api.auth import AuthConfig, is_internal
from epdserve.api.errors import ApiError, BadRequest, NotFound, PayloadTooLarge, Unavailable
from epdserve.api.http import Route, json_response, role_app, run_app
from epdserve.api.media import MediaResolver
from epdserve.api.metrics import Metrics
from epdserve.api.protocol import (
    DEFAULT_MAX_PROMPT_CHARS,
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Choice,
    ChunkChoice,
    Delta,
    FinishReason,
    ImageUrlPart,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
    VideoUrlPart,
    check_embeds_trust,
    decode_chat_request,
    encode_json,
    new_completion_id,
    now_s,
    sse_error,
    sse_event,
    to_sampling_params,
)
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine import AsyncEngine, LLMEngine, RequestOutput
from epdserve.engine.inputs import InputBuilder, PromptError
from epdserve.engine.request import Request
from epdserve.media.fetch import media_session
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.pd.embeds import ConnectorEmbeds
from epdserve.pd.messages import template_messages
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_consumer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model: Path  # checkpoint directory (Hugging Face format)
    served_model_name: str = ""  # name clients use; empty: the directory name
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (0: any free port)
    default_max_tokens: int = 256  # max_tokens when the request sets none
    max_request_bytes: int = 64 << 20  # largest request body
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # most characters of text in one request's messages
    preprocess_threads: int = 2  # threads decoding and preprocessing media
    template_threads: int = 2  # threads rendering and tokenizing prompts (apart from media work)
    enable_mm_embeds: bool = False  # accept clients' inline image/video embeddings (never handles)
    auth: AuthConfig = field(default_factory=AuthConfig)  # API key, cluster credential, internal-only
    vision: bool = True  # load the vision tower (False: metadata-only requests only)
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: MediaLimits = field(default_factory=MediaLimits)
    ec: ECConfig = field(default_factory=ECConfig)  # EC consumer for metadata-only media

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name


class ChatService:
    """Owns the engine and the media pipeline; the HTTP handlers are thin wrappers around it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.started = time.time()
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.engine = LLMEngine.from_pretrained(config.model, config.engine, vision=config.vision)
        self.async_engine = AsyncEngine(self.engine)
        self.builder = InputBuilder(self.engine.tokenizer, self.model_config)
        self.processor = VisionProcessor(ProcessorConfig.from_pretrained(config.model))
        self.executor = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="epd-media")
        # prompts render and tokenize in their own pool: a long prompt never queues media work, nor
        # media work a prompt
        self.template_executor = ThreadPoolExecutor(config.template_threads, thread_name_prefix="epd-template")
        self.consumer = make_consumer(config.ec)
        self.embeds = ConnectorEmbeds(
            self.consumer,
            config.model_name,
            self.model_config.text.hidden_size,
            self.model_config.vision.spatial_merge_size,
        )
        self.resolver: MediaResolver | None = None
        self.eos = frozenset(_eos_ids(config.model, self.engine.tokenizer))
        self.metrics = Metrics()
        self._init_metrics()

    async def start(self) -> None:
        session = media_session(self.config.limits)
        self.resolver = MediaResolver(
            self.config.model_name, self.processor, self.config.limits, self.executor, session, self.embeds
        )

    async def close(self) -> None:
        if self.resolver is not None and self.resolver.session is not None:
            await self.resolver.session.close()
        self.async_engine.close()
        await self.consumer.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.template_executor.shutdown(wait=False, cancel_futures=True)

    def _init_metrics(self) -> None:
        m, sch = self.metrics, self.engine.scheduler
        vision = float(self.engine.runner.model.visual is not None)
        m.gauge("vision_tower_loaded", "1 when this instance holds the vision tower", lambda: vision)
        m.gauge("num_requests_running", "requests in the running batch", lambda: len(sch.running))
        m.gauge("num_requests_waiting", "requests waiting to be scheduled", lambda: len(sch.waiting))
        m.gauge("kv_blocks_free", "free KV-cache blocks", lambda: sch.blocks.num_free)
        m.gauge("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", lambda: sch.blocks.hits)
        m.gauge("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", lambda: sch.blocks.queries)
        m.gauge("num_preemptions", "requests preempted for lack of KV blocks", lambda: sch.num_preemptions)
        enc = self.engine.runner.encoder_cache
        m.gauge("encoder_cache_hits", "vision embeddings served from the local cache", lambda: enc.hits)
        m.gauge("encoder_cache_bytes", "bytes held by the local vision-embedding cache", lambda: enc.nbytes)
        self.ttft = m.histogram("time_to_first_token_seconds", "time to first token")
        self.itl = m.histogram("inter_token_latency_seconds", "time between streamed tokens")
        self.e2e = m.histogram("e2e_request_latency_seconds", "request latency")
        self.prep = m.histogram("request_preprocess_seconds", "media fetch + decode + preprocess + template")
        m.gauge("ec_bytes_received", "embedding bytes fetched through the EC connector", lambda: self.embeds.bytes)
        m.gauge("ec_seconds", "seconds spent fetching embeddings", lambda: self.embeds.seconds)
        m.gauge(
            "ec_failures", "metadata-only items whose embeddings could not be fetched", lambda: self.embeds.failures
        )

    async def prepare(self, body: bytes, internal: bool = False) -> tuple[object, Request]:
        """Validate, resolve media and build the engine request. Handles of a request that fails
        here are released at once: nothing a rejected request was given stays held."""
        cfg = self.config
        req = decode_chat_request(body, cfg.limits, cfg.max_prompt_chars)
        check_embeds_trust(req, internal, cfg.enable_mm_embeds)
        try:
            return await self._prepare(req)
        except BaseException:
            if internal:
                await self.embeds.release_all(req)
            raise

    async def _prepare(self, req: ChatRequest) -> tuple[object, Request]:
        cfg = self.config
        if req.model != cfg.model_name:
            raise NotFound.model(req.model)
        params = to_sampling_params(req, cfg.default_max_tokens, cfg.engine.max_model_len)
        t0 = time.perf_counter()
        assert self.resolver is not None
        parts = req.media_parts()
        if not cfg.vision and any(isinstance(p, ImageUrlPart | VideoUrlPart) for p in parts):
            raise BadRequest("This instance has no vision tower: send media through the router (metadata-only items).")
        media = await self.resolver.resolve(parts)
        loop = asyncio.get_running_loop()
        try:
            prompt = await loop.run_in_executor(
                self.template_executor, self.builder.build, template_messages(req), media, req.chat_template_kwargs
            )
        except PromptError as e:
            raise BadRequest(str(e)) from None
        self.prep.observe(time.perf_counter() - t0)
        n = len(prompt.token_ids)
        limit = cfg.engine.max_model_len
        if n >= limit:
            raise BadRequest(f"The prompt is {n} tokens long; this model's maximum context length is {limit} tokens.")
        explicit = req.max_completion_tokens is not None or req.max_tokens is not None
        if n + params.max_tokens > limit:
            if explicit:
                raise BadRequest(
                    f"This model's maximum context length is {limit} tokens, but {n + params.max_tokens} were "
                    f"requested ({n} in the messages, {params.max_tokens} in the completion).",
                    param="max_tokens",
                )
            params = dataclasses.replace(params, max_tokens=limit - n)
        rid = new_completion_id()
        engine_req = Request(
            rid,
            prompt.token_ids,
            params,
            prompt.mm_items,
            prompt.mrope_positions,
            prompt.mrope_delta,
            arrival=time.time(),
            eos_token_ids=self.eos,
        )
        return req, engine_req


def _eos_ids(model_dir: Path, tokenizer) -> list[int]:
    import json

    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids += e if isinstance(e, list) else [e] if e is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


# ---------------------------------------------------------------------------------- handlers


class ChatHandlers:
    def __init__(self, service: ChatService) -> None:
        self.s = service

    async def chat(self, request: web.Request) -> web.StreamResponse:
        s = self.s
        t0 = time.perf_counter()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"The request body exceeds {s.config.max_request_bytes} bytes.") from None
        s.metrics.inc("requests_total", help_text="chat requests received")
        try:
            req, ereq = await s.prepare(body, is_internal(request))
        except ApiError as e:
            s.metrics.inc("request_errors_total", labels=f'status="{e.status}"', help_text="requests failed")
            raise
        if getattr(req, "stream", False):
            return await self._stream(request, req, ereq, t0)
        return await self._complete(req, ereq, t0)

    async def _complete(self, req, ereq: Request, t0: float) -> web.Response:
        s = self.s
        text: list[str] = []
        last: RequestOutput | None = None
        first = True
        async with contextlib.aclosing(s.async_engine.generate(ereq)) as outputs:
            async for out in outputs:
                if first:
                    s.ttft.observe(time.perf_counter() - t0)
                    first = False
                text.append(out.text)
                last = out
        assert last is not None
        if last.finish_reason == "error":
            raise _engine_error(last)
        s.e2e.observe(time.perf_counter() - t0)
        s.metrics.inc("generation_tokens_total", last.completion_tokens, help_text="generated tokens")
        s.metrics.inc("prompt_tokens_total", last.prompt_tokens, help_text="prompt tokens")
        resp = ChatCompletion(
            id=ereq.request_id,
            created=now_s(),
            model=s.config.model_name,
            choices=[Choice(message=ResponseMessage(content="".join(text)), finish_reason=_finish(last.finish_reason))],
            usage=Usage.of(last.prompt_tokens, last.completion_tokens),
        )
        return json_response(encode_json(resp))

    async def _stream(self, request: web.Request, req, ereq: Request, t0: float) -> web.StreamResponse:
        s = self.s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        model, created = s.config.model_name, now_s()

        def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None) -> bytes:
            choices = [ChunkChoice(delta=delta, finish_reason=_finish(finish))] if usage is None else []
            c = ChatCompletionChunk(id=ereq.request_id, created=created, model=model, choices=choices, usage=usage)
            return sse_event(c)

        # the client may leave mid-stream; closing the generator has aborted the request by then
        with contextlib.suppress(ConnectionResetError):
            await self._write_stream(resp, ereq, req, t0, chunk)
        return resp

    async def _write_stream(self, resp: web.StreamResponse, ereq: Request, req, t0: float, chunk) -> None:
        s = self.s
        await resp.write(chunk(Delta(role="assistant", content="")))
        last: RequestOutput | None = None
        t_prev = None
        # aclosing: a client that leaves mid-stream closes the generator now, which aborts the request
        async with contextlib.aclosing(s.async_engine.generate(ereq)) as outputs:
            async for out in outputs:
                now = time.perf_counter()
                if t_prev is None:
                    s.ttft.observe(now - t0)
                else:
                    s.itl.observe(now - t_prev)
                t_prev = now
                last = out
                if out.finish_reason == "error":
                    await resp.write(sse_error(_engine_error(out)))
                    break
                if out.text or out.finished:
                    await resp.write(chunk(Delta(content=out.text) if out.text else Delta(), out.finish_reason))
        if last is not None and last.finish_reason != "error":
            s.e2e.observe(time.perf_counter() - t0)
            s.metrics.inc("generation_tokens_total", last.completion_tokens, help_text="generated tokens")
            s.metrics.inc("prompt_tokens_total", last.prompt_tokens, help_text="prompt tokens")
            if req.include_usage:
                await resp.write(chunk(Delta(), usage=Usage.of(last.prompt_tokens, last.completion_tokens)))
        await resp.write(SSE_DONE)
        await resp.write_eof()

    async def models(self, request: web.Request) -> web.Response:
        s = self.s
        card = ModelCard(id=s.config.model_name, created=int(s.started), max_model_len=s.config.engine.max_model_len)
        return json_response(encode_json(ModelList(data=[card])))

    async def health(self, request: web.Request) -> web.Response:
        if not self.s.async_engine._thread.is_alive():
            raise Unavailable("the engine thread is not running")
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.s.metrics.render(), content_type="text/plain")


def _finish(reason: str | None) -> FinishReason | None:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return None


def _engine_error(out: RequestOutput) -> ApiError:
    message = out.error or "the request failed"
    return Unavailable(message) if out.error_status == 503 else ApiError(message)


def build_app(service: ChatService) -> web.Application:
    h = ChatHandlers(service)
    routes: list[Route] = [
        ("POST", "/v1/chat/completions", h.chat, "public"),
        ("GET", "/v1/models", h.models, "public"),
        ("GET", "/health", h.health, "open"),
        ("GET", "/metrics", h.metrics, "open"),
    ]
    return role_app(service.config.max_request_bytes, routes, service.start, service.close, service.config.auth)


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM."""
    service = ChatService(config)
    log.info("epdserve serving %s on http://%s:%d", config.model_name, config.host, config.port)
    run_app(build_app(service), config.host, config.port)
