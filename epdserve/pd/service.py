"""A language-model instance's service: the engine core client, the media pipeline, the prompt
renderer and tokenizer, and the metrics; everything the HTTP handlers (``pd.server``) call."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import get_args

from epdserve.api import logs
from epdserve.api.chat_messages import template_messages
from epdserve.api.errors import BadRequest, NotFound, Overloaded, context_too_long
from epdserve.api.load import LoadReport, worker_ratio
from epdserve.api.media import Hold, MediaResolver
from epdserve.api.protocol import (
    ChatRequest,
    EmbedsPart,
    RawMediaPart,
    RequestKind,
    check_embeds_trust,
    check_kv_trust,
    decode_chat_request,
    part_modality,
    to_sampling_params,
)
from epdserve.api.quota import Quotas, check_max_tokens
from epdserve.api.responses import new_completion_id
from epdserve.api.role_app import RoleBasics
from epdserve.api.tokenizer import FastTokenizer, TooManyTokens
from epdserve.common.rates import CostRate
from epdserve.engine.client import EngineCoreClient, InprocClient, MPClient
from epdserve.engine.config import cpu_list
from epdserve.engine.inputs import InputBuilder, PromptError
from epdserve.engine.messages import AddRequest, EngineStats, KVTransfer, StageTimes, WireTensor
from epdserve.kernels.resample import load_resampler
from epdserve.media.audio import AudioProcessor, AudioProcessorConfig
from epdserve.media.fetch import media_session
from epdserve.media.pending import Pending, PendingFull, PendingMedia, Reservation
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.media.workers import media_threads
from epdserve.models.config import ModelConfig
from epdserve.pd.config import ServerConfig
from epdserve.pd.embeds import MetadataEmbeds
from epdserve.pd.launch import launch_core
from epdserve.pd.logprobs import TokenTexts
from epdserve.pd.warmup import warm_up

log = logging.getLogger(__name__)


STAGES = ("preprocess", "fetch", "queue", "prefill", "decode")


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
        self.eos = sorted(_eos_ids(config.model, self.tokenizer))
        self.core_died: str | None = None
        self.stats = EngineStats()
        self.vision_rate = CostRate()  # seconds per patch of raw media encoded here
        self.pending = PendingMedia(engine.max_pending_media_bytes)  # pixels the core holds for its tower
        self.fetch_rate = CostRate()  # seconds per embedding byte fetched from encoders
        role = {"both": "pd", "prefill": "prefill", "decode": "decode"}[config.role]
        self.role = RoleBasics(
            f"epdserve-{role}",
            config.otlp_traces_endpoint,
            self._stats_fields,
            config.log_stats_interval_s,
            lambda: bool(self.window or self.stats.running),
            body_bytes=config.engine.max_inflight_body_bytes,
        )
        self.metrics, self.tracing = self.role.metrics, self.role.tracing
        self.window = self.role.window  # requests and tokens since the last stats line
        self.quotas = Quotas(config.quota)  # per-key limits, when clients call this instance directly
        self._init_metrics()
        self._prefix_seen = (0, 0)  # prefix-cache (hits, queries) at the last stats line

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
        session = media_session(self.config.limits)
        self.resolver = MediaResolver(
            self.config.model_name, self.processor, self.config.limits, self.executor, session, self.embeds, self.audio
        )
        cfg = self.config
        pool = {"both": "pd", "prefill": "prefill", "decode": "decode"}[cfg.role]
        if cfg.warmup:  # before registering; a prefill or decode instance runs it whole (no KV moves)
            await warm_up(self)
        self.role.start(cfg.registration, pool, cfg.host, cfg.port)
        ready = getattr(self.core, "ready", None)
        if ready is not None and ready.memory:  # the account the core started under; its process and this
            self.role.export_memory(ready.memory, lambda: {os.getpid(), ready.pid})
        kv = cfg.kv.connector if cfg.kv is not None else None
        logs.banner(
            log,
            {"both": "prefill+decode worker", "prefill": "prefill worker", "decode": "decode worker"}[cfg.role],
            model=cfg.model_name,
            family=self.model_config.architecture,
            dtype=cfg.engine.dtype,
            device=cfg.engine.device,
            kernels=ready.kernels if ready else None,
            threads=ready.threads if ready else None,
            borrows=logs.lending(ready.lends) if ready else None,
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
        w = self.role.take_window()
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
        await self.role.close()
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
            "kv_cache_touched_bytes",
            "bytes of the KV-cache blocks ever used (on a CPU: its pages mapped so far, up to the planned size)",
            lambda: float(self.stats.kv_blocks_touched * self.stats.kv_block_bytes),
        )
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
            ("vision_sliced_items_total", "media items encoded in slices between steps", "vision_sliced_items"),
        )
        for name, text, field in counts:
            m.gauge(name, text, stat(field), monotonic=True)
        held = "media held for the vision tower, from their decoding to their request's first token"
        m.gauge("pending_media_bytes", held, lambda: float(self.pending.held))
        refused = "requests refused (429) because the media held for the vision tower was at its bound"
        m.gauge("pending_media_refused_total", refused, lambda: float(self.pending.refused), monotonic=True)

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

    async def prepare(self, body: bytes, internal: bool = False) -> tuple[ChatRequest, AddRequest, Pending]:
        """Validate, resolve media and build the engine request, its pixels counted among those
        held for the vision tower (release the ``Pending`` once its first token is out). Handles of
        a request that fails here are given back at once: nothing a rejected request was given
        stays held."""
        cfg = self.config
        req = decode_chat_request(body, cfg.limits, cfg.max_prompt_chars)
        check_embeds_trust(req, internal, cfg.enable_mm_embeds)
        check_kv_trust(req, internal)
        # its media count against the bound from before their pixels are decoded; until its first
        # token the core holds its pixels: a burst waits at its clients
        reservation = Reservation(self.pending)
        try:
            add = await self._prepare(req, reservation.take)
            return req, add, reservation.settle(sum(len(m.pixels.data) for m in add.media if m.pixels is not None))
        except BaseException as e:
            if internal:
                kv = req.kv_transfer_params
                self.core.release(_handles(req), [kv.kv_handle] if kv is not None and kv.kv_handle else [])
            if isinstance(e, PendingFull):
                raise Overloaded(f"The server is overloaded: {e}.") from None
            raise
        finally:
            reservation.close()  # what a failed or abandoned request took; nothing once settled

    async def _prepare(self, req: ChatRequest, hold: Hold) -> AddRequest:
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
                parts, lambda media: self.builder.build(messages, media, kwargs, budget), self.template_executor, hold
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
