"""The OpenAI-compatible server of a language-model instance (aggregated or PD role).

Routes: POST /v1/chat/completions (SSE streaming and not), GET /v1/models, /health, /metrics.
This process is the front end: it validates, fetches and preprocesses raw media, renders the
prompt, detokenizes and streams. The engine core (scheduler, model, EC fetches) runs in its own
process behind an ``EngineCoreClient``; if it dies, open streams end with an error, /health turns
503 and the server exits non-zero so its supervisor restarts it. Every failure reaches the client
as OpenAI-style error JSON with the right status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args

import msgspec
from aiohttp import web

from epdserve.api import logs
from epdserve.api.auth import is_internal, is_operator
from epdserve.api.chat_messages import template_messages
from epdserve.api.errors import EMBEDS_UNAVAILABLE, ApiError, BadRequest, NotFound, Unavailable, context_too_long
from epdserve.api.http import Route, json_response, read_body, role_app, run_app
from epdserve.api.kv_digest import KVDigest
from epdserve.api.load import CostRate, LoadReport, worker_ratio
from epdserve.api.logs import request_id
from epdserve.api.media import MediaResolver
from epdserve.api.metrics import CONTENT_TYPE, Metrics, public_metrics
from epdserve.api.protocol import (
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    EmbedsPart,
    FinishReason,
    ModelCard,
    ModelList,
    PrefillCompletion,
    RawMediaPart,
    RequestKind,
    ResponseMessage,
    TokenLogprob,
    Usage,
    check_embeds_trust,
    check_kv_trust,
    decode_chat_request,
    encode_json,
    new_completion_id,
    now_s,
    part_modality,
    request_kind,
    sse_error,
    sse_event,
    to_sampling_params,
)
from epdserve.api.quota import Quotas, check_max_tokens
from epdserve.api.registration import Registrar
from epdserve.api.timing import SERVER_TIMING, prefixed, server_timing, wanted
from epdserve.api.tokenizer import FastTokenizer, TooManyTokens
from epdserve.api.tracing import Tracing, wall_ns
from epdserve.engine.client import CoreStartError, EngineCoreClient, InprocClient, MPClient
from epdserve.engine.config import cpu_list
from epdserve.engine.detokenizer import Detokenizer
from epdserve.engine.inputs import InputBuilder, PromptError
from epdserve.engine.messages import AddRequest, EngineOutput, EngineStats, KVTransfer, StageTimes, WireTensor
from epdserve.kernels.resample import load_resampler
from epdserve.launcher import ENGINE_CORE_DIED_EXIT
from epdserve.media.audio import AudioProcessor, AudioProcessorConfig
from epdserve.media.fetch import media_session
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.media.workers import media_threads
from epdserve.models.config import ModelConfig
from epdserve.pd.completions import CompletionHandlers
from epdserve.pd.config import ServerConfig
from epdserve.pd.embeds import MetadataEmbeds
from epdserve.pd.launch import launch_core
from epdserve.pd.logprobs import TokenTexts

log = logging.getLogger(__name__)


class ChatService:
    """Owns the engine core client and the media pipeline; the HTTP handlers are thin wrappers."""

    def __init__(self, config: ServerConfig, core: MPClient | None = None) -> None:
        """``core``: a core process already launched (``pd.launch``); else one is started here."""
        self.config = config
        self.started = time.time()
        self.core: EngineCoreClient = self._make_core(core)  # first: the core loads while we set up
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.tokenizer = FastTokenizer(config.model)
        self.builder = InputBuilder(self.tokenizer, self.model_config)
        self.processor = VisionProcessor(ProcessorConfig.from_pretrained(config.model), load_resampler())
        self.audio = (
            AudioProcessor(AudioProcessorConfig.from_pretrained(config.model))
            if self.model_config.audio is not None
            else None
        )
        engine = config.engine
        threads = media_threads(config.preprocess_threads, cpu_list(engine.cpus), max(1, engine.threads))
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="epd-media")
        # prompts render and tokenize in their own pool: a long prompt never queues media work, nor
        # media work a prompt
        self.template_executor = ThreadPoolExecutor(config.template_threads, thread_name_prefix="epd-template")
        self.embeds = MetadataEmbeds(
            config.model_name,
            # a client's own embeddings carry every feature level of the model (DeepStack), side by side
            self.model_config.text.hidden_size * self.model_config.feature_levels,
            self.builder.num_tokens,
            second_per_grid=self.processor.config.second_per_grid,
        )
        self.tokens = TokenTexts(self.tokenizer)
        self.resolver: MediaResolver | None = None
        self.registrar: Registrar | None = None  # with --register-with: keeps this worker registered
        self.eos = sorted(_eos_ids(config.model, self.tokenizer))
        self.core_died: str | None = None
        self.stats = EngineStats()
        self.vision_rate = CostRate()  # seconds per patch of raw media encoded here
        self.fetch_rate = CostRate()  # seconds per embedding byte fetched from encoders
        self.metrics = Metrics()
        self.quotas = Quotas(config.quota)  # per-key limits, when clients call this instance directly
        self._init_metrics()
        role = {"both": "pd", "prefill": "prefill", "decode": "decode"}[config.role]
        self.tracing = Tracing(f"epdserve-{role}", config.otlp_traces_endpoint)
        self.window = Counter[str]()  # requests and tokens since the last stats line
        self._prefix_seen = (0, 0)  # prefix-cache (hits, queries) at the last stats line
        self.stats_line = logs.StatsLine(
            lambda: bool(self.window or self.stats.running), self._stats_fields, config.log_stats_interval_s
        )

    def _make_core(self, launched: MPClient | None) -> EngineCoreClient:
        cfg = self.config
        if cfg.engine_core == "thread":
            from epdserve.engine.core import EngineCore  # the thread core: torch in this process

            core = EngineCore.from_pretrained(
                cfg.model, cfg.engine, cfg.vision, cfg.ec, cfg.model_name, role=cfg.role, kv=cfg.kv
            )
            return InprocClient(core)
        client = launched or launch_core(cfg)
        if client is None:
            raise ValueError(f"engine_core {cfg.engine_core!r} starts no core process")
        client.on_death = self._core_died
        return client

    def _core_died(self, why: str) -> None:
        """Open streams have their error by now; report unhealthy, then stop so a supervisor
        (``epdserve up``, Kubernetes) restarts this instance with a fresh core."""
        self.core_died = why
        asyncio.get_running_loop().call_later(1.0, os.kill, os.getpid(), signal.SIGTERM)

    async def start(self) -> None:
        await self.core.start()
        self.stats_line.start()
        session = media_session(self.config.limits)
        self.resolver = MediaResolver(
            self.config.model_name, self.processor, self.config.limits, self.executor, session, self.embeds, self.audio
        )
        cfg = self.config
        pool = {"both": "pd", "prefill": "prefill", "decode": "decode"}[cfg.role]
        self.registrar = Registrar.of(cfg.registration, pool, cfg.host, cfg.port)
        self.registrar.start()
        ready = getattr(self.core, "ready", None)
        kv = cfg.kv.connector if cfg.kv is not None else None
        logs.banner(
            log,
            {"both": "prefill+decode worker", "prefill": "prefill worker", "decode": "decode worker"}[cfg.role],
            model=cfg.model_name,
            family=self.model_config.architecture,
            dtype=cfg.engine.dtype,
            device=cfg.engine.device,
            kernels=ready.kernels if ready else None,
            kv_blocks=cfg.engine.num_kv_blocks,
            kv_bytes=logs.gib(ready.kv_bytes) if ready else None,
            vision_tower="loaded" if cfg.vision else "not loaded",
            ec_connector=cfg.ec.connector,
            kv_connector=kv,
            listen=f"http://{cfg.host}:{cfg.port}",
            auth=logs.auth_mode(cfg.auth),
        )

    async def _stats_fields(self, seconds: float) -> dict[str, object]:
        await self.refresh_stats()
        w, self.window = self.window, Counter()
        st = self.stats
        hits = st.prefix_cache_hit_tokens - self._prefix_seen[0]
        queries = st.prefix_cache_query_tokens - self._prefix_seen[1]
        self._prefix_seen = (st.prefix_cache_hit_tokens, st.prefix_cache_query_tokens)
        return {
            "running": st.running,
            "waiting": st.waiting,
            "kv_cache_usage_pct": 100 * self._kv_usage(),
            "req_per_s": w["requests"] / seconds,
            "prompt_tok_per_s": w["prompt_tokens"] / seconds,
            "gen_tok_per_s": w["generation_tokens"] / seconds,
            "prefix_hit_pct": 100 * hits / queries if queries else 0.0,
        }

    async def close(self) -> None:
        role = "prefill+decode" if self.config.role == "both" else self.config.role
        log.info("%s worker on http://%s:%d stopping", role, self.config.host, self.config.port)
        if self.registrar is not None:
            await self.registrar.close()
        await self.stats_line.stop()
        self.tracing.shutdown()
        if self.resolver is not None and self.resolver.session is not None:
            await self.resolver.session.close()
        await self.core.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.template_executor.shutdown(wait=False, cancel_futures=True)

    def _init_metrics(self) -> None:
        m = self.metrics

        def stat(name: str) -> Callable[[], float]:
            return lambda: float(getattr(self.stats, name))

        m.gauge("vision_tower_loaded", "1 when this instance holds the vision tower", stat("vision"))
        m.gauge("num_requests_running", "requests in the running batch", stat("running"))
        m.gauge("num_requests_waiting", "requests waiting to be scheduled", stat("waiting"))
        m.gauge("kv_blocks_free", "free KV-cache blocks", stat("kv_blocks_free"))
        m.gauge("kv_cache_usage_perc", "fraction of KV-cache blocks in use (1 = full)", self._kv_usage)
        m.gauge(
            "load_ratio", "demand over capacity: KV usage, or requests over the batch (autoscaling)", self.load_ratio
        )
        counts = (
            ("prefix_cache_hits_total", "prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
            ("prefix_cache_queries_total", "prompt tokens looked up in the prefix cache", "prefix_cache_query_tokens"),
            ("num_preemptions_total", "requests preempted for lack of KV blocks", "preemptions"),
            ("encoder_cache_hits_total", "vision embeddings served from the local cache", "encoder_cache_hits"),
            ("ec_bytes_received_total", "embedding bytes fetched through the EC connector", "ec_bytes"),
            ("ec_fetch_seconds_total", "seconds spent fetching embeddings", "ec_seconds"),
            ("ec_fetches_skipped_total", "media items not fetched: their KV was cached here", "ec_fetches_skipped"),
            ("kv_transfers_out_total", "requests whose KV this prefill instance handed on", "kv_transfers_out"),
            ("kv_transfers_in_total", "requests continued from KV loaded here", "kv_transfers_in"),
            ("kv_fallbacks_total", "requests whose KV could not be loaded (prefill computed here)", "kv_fallbacks"),
            ("kv_bytes_received_total", "KV bytes loaded through the KV connector", "kv_bytes_in"),
        )
        for name, text, field in counts:
            m.gauge(name, text, stat(field), monotonic=True)

        def failures() -> dict[str, float]:
            st = self.stats
            return {"invalid_handle": st.ec_invalid_handles, "unavailable": st.ec_failures - st.ec_invalid_handles}

        m.counts("ec_failures_total", "media items whose embeddings could not be fetched, by cause", "cause", failures)
        m.gauge("encoder_cache_bytes", "bytes held by the local vision-embedding cache", stat("encoder_cache_bytes"))
        m.gauge("kv_live_handles", "KV leases handed out and not yet released or expired", stat("kv_live_handles"))
        m.gauge("quota_rejected_total", "requests answered 429 for their key's share", lambda: self.quotas.rejected,
                monotonic=True)  # fmt: skip
        m.inc("prompt_tokens_total", 0, help_text="prompt tokens")
        m.inc("generation_tokens_total", 0, help_text="generated tokens")
        answered = m.counter("requests_total", "chat requests answered, by kind and HTTP status", ("kind", "status"))
        for kind in get_args(RequestKind):
            answered.labels(kind=kind, status="200")  # exported at 0 before the first request
        self.ttft = m.histogram("time_to_first_token_seconds", "time to first token")
        self.itl = m.histogram("inter_token_latency_seconds", "time between streamed tokens")
        self.e2e = m.histogram("e2e_request_latency_seconds", "request latency")
        self.prep = m.histogram("request_preprocess_seconds", "media fetch + decode + preprocess + template")
        self.queue_time = m.histogram(
            "request_queue_time_seconds", "in the engine core until admitted (its running step, then ready)"
        )
        self.stage_hist = m.histogram("request_stage_seconds", "where requests' time went, by stage", ("stage",))
        for stage in STAGES:
            self.stage_hist.labels(stage=stage)  # exported before the first request

    def stages(self, preprocess: float, core: StageTimes | None) -> dict[str, float]:
        """A request's stages up to its first token, recorded in the histograms."""
        c = core or StageTimes()
        stages = {"preprocess": preprocess, "fetch": c.fetch, "queue": c.queue, "prefill": c.prefill}
        for name, seconds in stages.items():
            self.stage_hist.labels(stage=name).observe(seconds)
        self.queue_time.observe(c.queue)
        return stages

    def load_ratio(self) -> float:
        st = self.stats
        return worker_ratio(self._kv_usage(), st.running, st.waiting, self.config.engine.max_num_seqs)

    def load_report(self) -> LoadReport:
        """Demand over capacity, and what raw media and fetched embeddings cost here (the
        router's adaptive dispatch); the rates follow the stats refreshed since the last report."""
        st = self.stats
        return LoadReport(
            load_ratio=self.load_ratio(),
            vision=st.vision,
            vision_s_per_patch=self.vision_rate.update(st.vision_seconds, st.vision_patches),
            fetch_s_per_byte=self.fetch_rate.update(st.ec_seconds, st.ec_bytes),
            running=st.running,
            waiting=st.waiting,
        )

    def _kv_usage(self) -> float:
        st = self.stats
        return 1.0 - st.kv_blocks_free / st.kv_blocks_total if st.kv_blocks_total else 0.0

    def count(self, kind: str, status: int) -> None:
        self.metrics.inc("requests_total", labels={"kind": kind, "status": str(status)})

    async def refresh_stats(self) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError):
            self.stats = await self.core.stats()

    async def prepare(self, body: bytes, internal: bool = False) -> tuple[ChatRequest, AddRequest]:
        """Validate, resolve media and build the engine request. Handles of a request that fails
        here are given back at once: nothing a rejected request was given stays held."""
        cfg = self.config
        req = decode_chat_request(body, cfg.limits, cfg.max_prompt_chars)
        check_embeds_trust(req, internal, cfg.enable_mm_embeds)
        check_kv_trust(req, internal)
        try:
            return req, await self._prepare(req)
        except BaseException:
            if internal:
                kv = req.kv_transfer_params
                self.core.release(_handles(req), [kv.kv_handle] if kv is not None and kv.kv_handle else [])
            raise

    async def _prepare(self, req: ChatRequest) -> AddRequest:
        cfg = self.config
        if req.model and req.model != cfg.model_name:  # optional, as in vLLM
            raise NotFound.model(req.model)
        params = to_sampling_params(req, cfg.default_max_tokens, cfg.engine.max_model_len)
        check_max_tokens(req, cfg.quota.max_tokens_limit)
        kv = self._kv_transfer(req)
        t0 = time.perf_counter()
        assert self.resolver is not None
        parts = req.media_parts()
        takes = self.model_config.modalities
        for kind in sorted({part_modality(p) for p in parts} - takes):
            accepted = f"it takes {', '.join(sorted(takes))}" if takes else "it takes text only"
            raise BadRequest(f"This model ({cfg.model_name}) takes no {kind} input; {accepted}.", param="messages")
        if not self.core.vision and any(isinstance(p, RawMediaPart) for p in parts):
            raise BadRequest("This instance has no media encoder: send media through the router (metadata-only items).")
        messages, kwargs = template_messages(req), req.chat_template_kwargs
        limit = cfg.engine.max_model_len
        explicit = req.max_completion_tokens is not None or req.max_tokens is not None
        # a prompt over this many tokens is refused for the cost of counting that many
        budget = limit - params.max_tokens if explicit else limit - 1
        try:
            prompt = await self.resolver.resolve_then(
                parts, lambda media: self.builder.build(messages, media, kwargs, budget), self.template_executor
            )
        except TooManyTokens as e:
            raise context_too_long(limit, e.at_least, params.max_tokens if explicit else 0) from None
        except PromptError as e:
            raise BadRequest(str(e)) from None
        self.prep.observe(time.perf_counter() - t0)
        n = len(prompt.token_ids)
        if n >= limit:
            raise context_too_long(limit, n, 0, exact=True)
        if n + params.max_tokens > limit:
            if explicit:
                raise BadRequest(
                    f"This model's maximum context length is {limit} tokens, but {n + params.max_tokens} were "
                    f"requested ({n} in the messages, {params.max_tokens} in the completion).",
                    param="max_tokens",
                )
            params = dataclasses.replace(params, max_tokens=limit - n)
        return AddRequest(
            new_completion_id(),
            prompt.token_ids,
            params,
            prompt.mm_items,
            WireTensor.of(prompt.mrope_positions) if prompt.mrope_positions is not None else None,
            prompt.mrope_delta,
            self.eos,
            time.time(),
            kv,
        )

    def _kv_transfer(self, req: ChatRequest) -> KVTransfer | None:
        """The request's part in P/D, if this instance's role takes it."""
        kvp = req.kv_transfer_params
        if kvp is None:
            return None
        role = self.config.role
        if kvp.do_remote_decode:
            if role != "prefill":
                raise BadRequest(f"This is a {role} instance: it does not hand KV on.", param="kv_transfer_params")
            return KVTransfer(produce=True)
        if role != "decode":
            raise BadRequest(f"This is a {role} instance: it does not continue requests.", param="kv_transfer_params")
        return KVTransfer(first_token=kvp.first_token_id, handle=kvp.kv_handle)

    def release_kv(self, handles: list[dict]) -> None:
        """KV leases a decode instance will not read (the router gave up on the request)."""
        self.core.release([], handles)


def _handles(req: ChatRequest) -> list[dict]:
    out = []
    for part in req.media_parts():
        if isinstance(part, EmbedsPart) and part.ec_handle is not None:
            out.append(part.ec_handle)
    return out


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


# ------------------------------------------------------------------------------ generation


@dataclass
class Piece:
    """What the client is sent for one engine output: text, logprobs, and the end when it came."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    kv: dict | None = None  # prefill instance: what the decode instance continues from
    stages: StageTimes | None = None  # the engine core's stage times (first piece only)


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


STAGES = ("preprocess", "fetch", "queue", "prefill", "decode")


class Generation:
    """One request's engine outputs turned into text: incremental detokenization, stop strings
    (which end the request in the core), and OpenAI logprobs."""

    def __init__(self, service: ChatService, add: AddRequest) -> None:
        self.s = service
        self.add = add
        self.detok = Detokenizer(service.tokenizer, add.params.stop)
        self.completion_tokens = 0
        self.prompt_tokens = len(add.prompt_token_ids)
        if add.kv is not None and add.kv.first_token is not None:
            # a decode instance continues after a token the prefill instance already sent: the
            # detokenizer starts where the prefill instance's stood, its text is not sent again
            self.detok.push([add.kv.first_token])
            self.completion_tokens = 1
        self._outputs = service.core.generate(add)

    async def aclose(self) -> None:
        await self._outputs.aclose()  # type: ignore[attr-defined]

    @classmethod
    async def started(cls, service: ChatService, add: AddRequest) -> tuple[Generation, Piece]:
        """A generation and its first piece (the request is aborted if that fails)."""
        gen = cls(service, add)
        try:
            return gen, await gen.first()
        except BaseException:
            await gen.aclose()
            raise

    async def first(self) -> Piece:
        """The first piece; raises the request's error as an HTTP error (nothing is sent yet)."""
        out = await anext(self._outputs)
        if out.finish_reason == "error":
            raise _engine_error(out)
        return self._piece(out)

    async def rest(self) -> AsyncGenerator[Piece, None]:
        async for out in self._outputs:
            yield self._piece(out)
            if out.finish_reason is not None or self.detok.stopped:
                return

    def _piece(self, out: EngineOutput) -> Piece:
        if out.finish_reason == "error":
            raise WorkerFailedMidStream(_engine_error(out))
        self.completion_tokens += len(out.token_ids)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        finish = out.finish_reason
        if finish == "transferred":  # a decode instance continues the answer: nothing is final yet
            finish = None
        text = self.detok.push(out.token_ids, final=finish is not None)
        p = self.add.params
        if finish is None and self.detok.stopped and self.completion_tokens >= p.min_tokens:
            finish = "stop"  # a stop string: the core is told to stop when this stream closes
            text += self.detok.push([], final=True)
        logprobs = None
        if p.logprobs and out.logprobs is not None:
            logprobs = [
                self.s.tokens.logprob(t, lp, top[i] if (top := out.top_logprobs) else [])
                for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
            ]
        kv = None
        if out.kv_handle is not None:
            if finish is None:
                kv = {"kv_handle": out.kv_handle, "first_token_id": out.token_ids[0]}
            else:  # a stop string ended the answer with its first token: nobody will read the KV
                self.s.core.release([], [out.kv_handle])
        return Piece(text, logprobs, _finish(finish), self.prompt_tokens, self.completion_tokens, kv, out.stages)


class KVRelease(msgspec.Struct, forbid_unknown_fields=True):
    handles: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=1024)]


class WorkerFailedMidStream(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


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
        body = await read_body(request, s.config.max_request_bytes)
        kind = "unknown"  # until the body parses
        rid = request_id(request.headers)
        ticket = None
        try:
            if not is_internal(request):  # a client's share (api.quota); the router counted its calls
                ticket = s.quotas.admit(Quotas.client(request))
            req, add = await s.prepare(body, is_internal(request))
            t_prepared = time.perf_counter()
            kind = request_kind(req)
            if ticket is not None:
                ticket.reserve(len(add.prompt_token_ids) + add.params.max_tokens)
            gen, first = await Generation.started(s, add)
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
        body = await read_body(request, self.s.config.max_request_bytes)
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
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        await self.s.refresh_stats()
        cfg = self.s.config
        if not is_operator(request, cfg.auth):
            return public_metrics(self.s.metrics, cfg.exposure.metrics_level(cfg.auth.api_key))
        return web.Response(body=self.s.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _completion_id(req: ChatRequest, add: AddRequest) -> str:
    """The id the client sees: the one its stream already carries when this instance continues it."""
    kv = req.kv_transfer_params
    return kv.completion_id if kv is not None and kv.completion_id else add.request_id


def _finish(reason: str | None) -> FinishReason | None:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return None


def _engine_error(out: EngineOutput) -> ApiError:
    message = out.error or "the request failed"
    if out.error_kind in ("invalid_handle", "invalid_request"):
        return BadRequest(message)
    if out.error_kind == "embeddings_unavailable":
        return Unavailable(message, code=EMBEDS_UNAVAILABLE)
    if out.error_kind == "media":
        return Unavailable(message)
    return ApiError(message)


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
    return role_app(service.config.max_request_bytes, routes, service.start, service.close, service.config.auth)


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
