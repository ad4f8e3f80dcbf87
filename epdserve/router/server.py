"""The router: public OpenAI endpoint of an E+PD deployment.

Per chat request: validate all of it (body and text size, model, sampling parameters, media
limits, who may send metadata-only parts) *before* any encoder spends time on it; extract the
media parts; assign each item an encoder (the pool's policy) and send the items of one encoder in
one ``/v1/encode`` call, all encoders concurrently; rewrite the parts to metadata-only
``image_embeds`` / ``video_embeds``; forward to a PD worker and pass its response bytes through
untouched (SSE included). Text-only requests skip the encoders. Every internal call carries the
cluster credential; the client's own credentials never leave the router.

Failures:

- an encoder that fails (connection, 5xx) gets its items retried on another encoder; one that
  answers 429 (queue or embedding store full) is skipped for this request but stays healthy; when
  every encoder is busy the client gets 429 with ``Retry-After``;
- a PD worker that fails before the first byte (connection, 5xx, or 503 ``embeddings_unavailable``
  because an encoder died) is retried once with a fresh encode on another worker;
- leases on embeddings the PD worker will not consume (it rejected the request, the request was
  retried, the client left) are given back to their encoders at once (``/v1/release``);
- a worker that dies mid-stream ends the client's stream with an OpenAI-style error event and
  ``[DONE]``; a non-streaming request never sees a partial body (502 JSON instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, get_args

import aiohttp
import msgspec
from aiohttp import web

from epdserve.api import logs
from epdserve.api.auth import AuthConfig, is_operator
from epdserve.api.completions import CompletionRequest, decode_completion_request
from epdserve.api.errors import (
    EMBEDS_UNAVAILABLE,
    ApiError,
    BadRequest,
    Forbidden,
    NotFound,
    Overloaded,
    Timeout,
    Unavailable,
    WorkerFailed,
)
from epdserve.api.exposure import ExposureConfig
from epdserve.api.http import Route, json_response, role_app, run_app
from epdserve.api.kv_digest import MAX_DIGEST_BYTES, decode_digest
from epdserve.api.load import MAX_LOAD_REPORT_BYTES, decode_load_report, recommended_replicas
from epdserve.api.logs import REQUEST_ID_HEADER, request_id
from epdserve.api.metrics import CONTENT_TYPE, Metrics, federate, public_metrics
from epdserve.api.protocol import (
    DEFAULT_CHAT_MAX_TOKENS as DEFAULT_MAX_TOKENS,
)
from epdserve.api.protocol import (
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_REQUEST_BYTES,
    SSE_DONE,
    ChatRequest,
    RequestKind,
    SamplingRequest,
    check_embeds_trust,
    check_kv_trust,
    decode_chat_request,
    prompt_chars,
    request_kind,
    sse_error,
    to_sampling_params,
)
from epdserve.api.quota import QuotaConfig, Quotas, check_max_tokens, requested_max_tokens
from epdserve.api.registration import HEARTBEATS_PER_LEASE
from epdserve.api.timing import SERVER_TIMING, wanted
from epdserve.api.tracing import Tracing
from epdserve.assets import default_model_dir
from epdserve.encoder.protocol import (
    EncodedItem,
    EncodeItem,
    EncodeRequest,
    ReleaseRequest,
    decode_response,
    encode_release,
    encode_request,
)
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig
from epdserve.router.admission import AutoLimit, Gate
from epdserve.router.directory import MediaDirectory, content_key
from epdserve.router.discovery import MAX_HEARTBEAT_S, DnsSource, Leases, is_worker_url, split_sources
from epdserve.router.dispatch import Dispatch, DispatchModel, Side
from epdserve.router.frontend_decode import FrontendDecodeConfig, FrontendDecoder
from epdserve.router.kv_routing import Blocks, KVIndex, PromptBlocks
from epdserve.router.membership import NotAllowed, WorkerNetworks, prove
from epdserve.router.pool import NoWorker, PDPolicy, Policy, Worker, WorkerPool
from epdserve.router.refs import MediaRef, media_refs, with_parts
from epdserve.router.split import SplitChat
from epdserve.router.trail import ROUTER_STAGES, Trail
from epdserve.router.upstream import RetryableWorker, about_media, error_code, error_response, passthrough_error
from epdserve.security.peers import sign
from epdserve.transfer.cached import cached_handle
from epdserve.transfer.config import HANDLE_PURPOSE

log = logging.getLogger(__name__)

FAST_PROBE_S = 0.1  # probe period while no worker is healthy, or at start-up until all have been
MAX_REFUSED = 4096  # refused workers remembered (to log each once)
STARTUP_PROBE_S = 60.0  # how long start-up's fast probing waits for workers named but not yet up

_TAIL = len(SSE_DONE)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_SCRAPE_BYTES = 4 << 20  # one worker's /metrics
CHARS_PER_TOKEN = 4  # a prompt's tokens as the router estimates them for its client's share (settled by usage)


Workers = tuple[str, ...]


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port
    encoders: Workers = ()  # encoder base URLs, or dns+http://name:port for each address (more can register)
    pds: Workers = ()  # prefill+decode worker base URLs (or dns+http://name:port)
    prefills: Workers = ()  # prefill worker base URLs, or dns+http://name:port (P/D, with decodes)
    decodes: Workers = ()  # decode worker base URLs, or dns+http://name:port (P/D, with prefills)
    policy: PDPolicy = "least_outstanding"  # PD worker selection; kv_aware: where the prompt's prefix is cached
    kv_load_tokens: int = 256  # kv_aware: cached prompt tokens one more outstanding request on a worker is worth
    model: str = ""  # kv_aware: checkpoint directory whose chat template and tokenizer the workers use ("" = embedded)
    encoder_policy: Policy = "affinity"  # encoder selection; affinity: the same media to the same encoder (cache hits)
    probe_interval_s: float = 2.0  # health probe period
    encode_timeout_s: float = 120.0  # one /v1/encode call
    request_timeout_s: float = 600.0  # one forwarded chat request, end to end
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest request body
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # most characters of text in one request's messages
    limits: MediaLimits = field(default_factory=MediaLimits)  # same validation as the PD workers
    frontend: FrontendDecodeConfig = field(default_factory=FrontendDecodeConfig)  # decode media here
    dispatch: Dispatch = "always"  # media to encoders; never: raw to workers; adaptive: by cost (router.dispatch)
    dispatch_interference: float = 0.0  # adaptive: weight of a decoding request's stall by a raw encode (its TPOT)
    max_items_per_encode: int = 32  # items per /v1/encode call (larger groups are split into calls)
    enable_mm_embeds: bool = False  # accept clients' inline image/video embeddings (never handles)
    retry_after_s: int = 1  # Retry-After of a 429 when every encoder is busy
    encoder_wait_s: float = 5.0  # while no encoder is healthy (starting, restarting), how long media waits for one
    max_inflight_text: int = 0  # text-only requests served at once (0: no limit); more wait in their own queue
    max_inflight_media: int = 0  # requests with images or video served at once (0: no limit); more wait apart
    admission_wait_s: float = 10.0  # longest a request waits for admission; then 429 with Retry-After
    text_ttft_target_ms: float = 0.0  # keep text TTFT p90 under this by lowering the media limit (0: off)
    otlp_traces_endpoint: str = ""  # OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces
    log_stats_interval_s: float = 10.0  # seconds between stats lines while there is traffic (0: none)
    directory_entries: int = 65536  # media held in the shared store the router remembers, to skip their encode
    dns_interval_s: float = 5.0  # how often dns+http:// worker sources are resolved again
    worker_networks: tuple[str, ...] = ()  # CIDRs registered or DNS-found workers may be in (default: the router's own)
    auth: AuthConfig = field(default_factory=AuthConfig)  # API key, admin key, cluster credential
    quota: QuotaConfig = field(default_factory=QuotaConfig)  # per-key limits: requests in flight, tokens per minute
    exposure: ExposureConfig = field(default_factory=ExposureConfig)  # what /metrics shows without credentials

    def __post_init__(self) -> None:
        for entries in (self.encoders, self.pds, self.prefills, self.decodes):
            split_sources(entries)  # a malformed dns+http:// entry is a configuration error
        if self.policy not in get_args(PDPolicy):
            raise ValueError(f"unknown PD policy {self.policy!r}; choose from {get_args(PDPolicy)}")
        if self.dispatch not in get_args(Dispatch):
            raise ValueError(f"unknown dispatch {self.dispatch!r}; choose from {get_args(Dispatch)}")
        if self.dispatch_interference < 0:
            raise ValueError("dispatch_interference must be >= 0")
        if self.encoder_policy not in get_args(Policy):
            raise ValueError(f"unknown encoder policy {self.encoder_policy!r}; choose from {get_args(Policy)}")
        if bool(self.prefills) != bool(self.decodes):
            raise ValueError("P/D disaggregation needs both prefill and decode workers")
        WorkerNetworks.of(self.worker_networks, self.host)  # a malformed CIDR is a configuration error
        if self.auth.cluster is None:
            raise ValueError(
                "the router needs the cluster credential to call its workers: set EPD_CLUSTER_SECRET "
                "or --cluster-secret-file"
            )


class _Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the encoder is broken: mark it and retry elsewhere
    BUSY = "busy"  # the encoder is saturated (429): retry elsewhere, keep it healthy
    ERROR = "error"  # the encoder answered with a server error: retry elsewhere; its health probe judges it


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        assert config.auth.cluster is not None  # checked by RouterConfig
        self.cluster = config.auth.cluster
        self.networks = WorkerNetworks.of(config.worker_networks, config.host)  # where workers may join from
        self._refused: set[tuple[str, str]] = set()  # (role, url) refused admission, not yet admitted
        # kv_aware chooses by cached prefix itself; the pools balance load when no prefix is known
        policy: Policy = "least_outstanding" if config.policy == "kv_aware" else config.policy
        self.dns: list[tuple[WorkerPool, DnsSource]] = []  # names resolved again every dns_interval_s
        self._dns_urls: dict[tuple[str, DnsSource], set[str]] = {}  # the workers each source added
        self._dns_at = 0.0
        self.static: set[tuple[str, str]] = set()  # (role, url) from the command line: never evicted
        self.leases = Leases()  # registrations with heartbeats

        def pool(role: str, entries: tuple[str, ...], policy: Policy) -> WorkerPool:
            urls, sources = split_sources(entries)
            p = WorkerPool(role, urls, policy)
            self.static |= {(role, w) for w in p.workers}
            self.dns += [(p, src) for src in sources]
            return p

        self.encoders = pool("encoder", config.encoders, config.encoder_policy)
        self.pds = pool("pd", config.pds, policy)
        self.prefills = pool("prefill", config.prefills, policy)
        self.decodes = pool("decode", config.decodes, policy)
        self.split = SplitChat(self)
        self.metrics = Metrics()
        self.quotas = Quotas(config.quota)
        self.metrics.gauge("router_quota_rejected_total", "requests answered 429 for their key's share",
                           lambda: self.quotas.rejected, monotonic=True)  # fmt: skip
        self.tracing = Tracing("epdserve-router", config.otlp_traces_endpoint)
        self.session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()
        self._model: tuple[str, int] | None = None  # (served name, max_model_len) of the PD workers
        self.directory = MediaDirectory(config.directory_entries)
        self.frontend: FrontendDecoder | None = None
        if config.frontend.enabled:  # its slab outlives any lease by the TTL: 2 encode timeouts
            model_dir = Path(config.model) if config.model else default_model_dir()
            self.frontend = FrontendDecoder(config.frontend, model_dir, config.limits, config.auth.cluster,
                                            f"router-{config.port}", 2 * config.encode_timeout_s, self.metrics)  # fmt: skip
        self.dispatcher: DispatchModel | None = None
        if config.dispatch == "adaptive":
            model_dir = Path(config.model) if config.model else default_model_dir()
            processor = ProcessorConfig.from_pretrained(model_dir)
            self.dispatcher = dispatcher = DispatchModel(processor, config.dispatch_interference)
            self.metrics.counts(
                "router_dispatch_cost_seconds",
                "adaptive dispatch's learnt costs: preprocess and forward per patch on encoders, hop per encode call",
                "term",
                dispatcher.costs,
                monotonic=False,
            )
        dispatched = self.metrics.counter("router_dispatch_total", "media requests by where their media was encoded: "
                                          "remote (encoders) or local (the worker, raw)", ("path",))  # fmt: skip
        for path in ("remote", "local"):
            dispatched.labels(path=path)
        self.metrics.inc(
            "router_dispatch_fallbacks_total", 0, help_text="media sent raw because no encoder could take it"
        )
        self.kv_index: KVIndex | None = None
        self.prompt_blocks: PromptBlocks | None = None
        # counted with kv_aware routing; exported by every router so dashboards find them
        self.metrics.inc("router_kv_routed_total", 0, help_text="requests sent to the worker holding their prefix")
        self.metrics.inc("router_kv_cached_tokens_total", 0, help_text="prompt tokens cached on the chosen worker")
        self.metrics.inc(
            "router_encodes_skipped_total", 0, help_text="media items not encoded: the worker holds their KV"
        )
        self.metrics.inc("router_encoder_retries_total", 0, help_text="encoder calls retried elsewhere")
        if config.policy == "kv_aware":
            self.kv_index = KVIndex(stale_s=3 * config.probe_interval_s + 1)
            self.prompt_blocks = PromptBlocks(Path(config.model) if config.model else default_model_dir())
            kv_index = self.kv_index
            self.metrics.gauge(
                "router_kv_workers_fresh",
                "workers whose KV digest is recent enough to route by",
                lambda: sum(kv_index.fresh(w.url) for w in self.lm_workers),
            )
        self.gates = {
            "text": Gate("text-only", config.max_inflight_text, config.admission_wait_s, config.retry_after_s),
            "media": Gate("image and video", config.max_inflight_media, config.admission_wait_s, config.retry_after_s),
        }
        self.auto_limit: AutoLimit | None = None
        if config.text_ttft_target_ms > 0:
            media = self.gates["media"]
            self.auto_limit = AutoLimit(media, config.text_ttft_target_ms / 1e3, ceiling=config.max_inflight_media)
        gates, m = self.gates, self.metrics
        m.counts("router_admission_limit", "requests admitted at once, by class (0: no limit)", "class",
                 lambda: {k: g.limit for k, g in gates.items()}, monotonic=False)  # fmt: skip
        m.counts("router_admission_in_flight", "requests admitted and not done, by class", "class",
                 lambda: {k: g.in_flight for k, g in gates.items()}, monotonic=False)  # fmt: skip
        m.counts("router_admission_waiting", "requests waiting for admission, by class", "class",
                 lambda: {k: g.waiting for k, g in gates.items()}, monotonic=False)  # fmt: skip
        lm_pools = (self.pds, self.prefills, self.decodes)

        def lm_requests() -> dict[str, int]:
            workers = [w for pool in lm_pools for w in pool.workers.values()]
            return {"awaiting_first_token": sum(w.awaiting for w in workers),
                    "past_first_token": sum(w.outstanding - w.awaiting for w in workers)}  # fmt: skip

        m.counts("router_lm_requests", "requests on the language-model workers, awaiting their first token "
                 "(media still encoding included) or past it", "state", lm_requests, monotonic=False)  # fmt: skip
        m.counts("router_admission_rejected_total", "requests answered 429 after waiting for admission, by class",
                 "class", lambda: {k: g.rejected for k, g in gates.items()})  # fmt: skip
        self.window = Counter[str]()  # requests since the last stats line
        self.stats_line = logs.StatsLine(lambda: bool(self.window), self._stats_fields, config.log_stats_interval_s)
        self._store_seen = False  # an encoder has handed out a store handle: store hits are possible
        self._handle_key = config.auth.cluster.derive(HANDLE_PURPOSE)  # signs cached handles
        m = self.metrics
        answered = m.counter("router_requests_total", "chat requests answered, by kind and status", ("kind", "status"))
        for kind in get_args(RequestKind):
            answered.labels(kind=kind, status="200")  # exported at 0 before the first request
        m.inc("router_pd_retries_total", 0, help_text="PD calls retried before the first byte")
        m.inc("router_scrape_failures_total", 0, help_text="worker metrics the router could not read")
        m.gauge(
            "router_directory_entries",
            "media items the directory knows (uuid, grid, store handle if any)",
            lambda: len(self.directory),
        )
        m.gauge(
            "router_directory_hits_total",
            "media items served from the directory (no encode call)",
            lambda: self.directory.hits,
        )
        m.gauge(
            "router_directory_waits_total",
            "media items that waited for a concurrent encode of the same content",
            lambda: self.directory.waits,
        )
        m.gauge("router_encoders_healthy", "healthy encoder workers", lambda: len(self.encoders.healthy))
        m.counts(
            "router_recommended_replicas",
            "replicas of each role that would serve its demand at the target utilization (autoscaling)",
            "role",
            self._replicas,
            monotonic=False,
        )
        m.counts(
            "router_load_ratio",
            "summed load ratio of each role's healthy workers (1 = one worker's capacity)",
            "role",
            lambda: {p.role: sum(w.load for w in p.healthy) for p in self.pools if p.workers},
            monotonic=False,
        )
        m.gauge("router_pds_healthy", "healthy PD workers", lambda: len(self.pds.healthy))
        m.gauge("router_prefills_healthy", "healthy prefill workers", lambda: len(self.prefills.healthy))
        m.gauge("router_decodes_healthy", "healthy decode workers", lambda: len(self.decodes.healthy))
        self.encode_hist = m.histogram("router_encode_seconds", "time to encode a request's media")
        self.stage_hist = m.histogram("router_stage_seconds", "where requests' time went before a worker", ("stage",))
        for stage in ROUTER_STAGES:
            self.stage_hist.labels(stage=stage)  # exported before the first request
        self.ttfb_hist = m.histogram("router_first_byte_seconds", "time to the PD worker's first byte")

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))
        self._probe_started, self._all_seen = time.monotonic(), False
        self._probe_task = asyncio.create_task(self._probe_loop())
        if self.frontend is not None:
            await self.frontend.start()
        self.stats_line.start()
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

    def _stats_fields(self, seconds: float) -> dict[str, object]:
        w, self.window = self.window, Counter()
        return {
            "req_per_s": w["requests"] / seconds,
            "in_flight": sum(wk.outstanding for wk in self.lm_workers),
            **{f"{pool.role}s_healthy": len(pool.healthy) for pool in self.pools if pool.workers},
        }

    async def close(self) -> None:
        log.info("router on http://%s:%d stopping", self.config.host, self.config.port)
        await self.stats_line.stop()
        if self._probe_task:
            self._probe_task.cancel()
        if self._releases:
            await asyncio.wait(self._releases, timeout=5)
        if self.session:
            await self.session.close()
        if self.frontend is not None:
            await self.frontend.close()
        if self.prompt_blocks is not None:
            self.prompt_blocks.executor.shutdown(wait=False, cancel_futures=True)
        self.tracing.shutdown()

    async def _probe_loop(self) -> None:
        assert self.session is not None
        while True:
            try:
                await self._discover()
                await asyncio.gather(*(pool.probe(self.session) for pool in self.pools))
                if self._model is None:
                    await self._learn_model()
                if self.kv_index is not None:
                    await asyncio.gather(*(self._poll_digest(w) for w in (*self.pds.healthy, *self.prefills.healthy)))
                await asyncio.gather(*(self._poll_load(w) for pool in self.pools for w in pool.healthy))
                if self.auto_limit is not None:
                    self.auto_limit.tick()
            except Exception:  # a probe round must never end the loop
                log.exception("health probe round failed")
            # while no worker can take a request (all down), and at start-up until every worker
            # named has answered once, probe often: the router uses a worker the moment it is up
            if not self._all_seen and time.monotonic() - self._probe_started < STARTUP_PROBE_S:
                self._all_seen = all(len(pool.healthy) == len(pool.workers) for pool in self.pools)
            else:
                self._all_seen = True
            # and while a role has no healthy worker, so media waiting for an encoder gets one soon
            fast = not self._all_seen or any(pool.workers and not pool.healthy for pool in self.pools)
            fast = fast or not (self.pds.healthy or self.splits)
            await asyncio.sleep(
                min(FAST_PROBE_S, self.config.probe_interval_s) if fast else self.config.probe_interval_s
            )

    async def _discover(self) -> None:
        """Workers from DNS (every ``dns_interval_s``), and registrations whose heartbeats stopped."""
        for role, url in self.leases.expired():
            if (role, url) not in self.static and self._pool(role).remove(url):
                log.warning("%s %s evicted: its registration was not renewed", role, url)
        now = time.monotonic()
        if not self.dns or now - self._dns_at < self.config.dns_interval_s:
            return
        self._dns_at = now
        found = await asyncio.gather(*(src.resolve() for _, src in self.dns))
        for (pool, src), urls in zip(self.dns, found, strict=True):
            before = self._dns_urls.get((pool.role, src), set())
            new = [url for url in urls - before if url not in pool.workers]
            refused = await asyncio.gather(*(self._admit(pool.role, url, f"found by {src}") for url in new))
            urls = urls - {url for url, why in zip(new, refused, strict=True) if why}  # asked again next time
            for url in urls - before:
                pool.add(url)
                log.info("%s %s found by %s", pool.role, url, src)
            for url in before - urls:
                if (pool.role, url) not in self.static and not self.leases.held(pool.role, url):
                    pool.remove(url)
                    log.info("%s %s gone from %s", pool.role, url, src)
            self._dns_urls[(pool.role, src)] = urls

    def signed(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """The proof of the cluster credential for one internal request (``security.peers``)."""
        return sign(self.cluster, method, url, body)

    async def _admit(self, role: str, url: str, why: str) -> str | None:
        """None when a worker not on the command line may join: its address is in the worker
        networks and it proves it holds the cluster credential; else the reason (logged)."""
        assert self.session is not None
        try:
            await self.networks.check(url)
            refused = await prove(self.session, self.cluster, url)
        except NotAllowed as e:
            refused = str(e)
        if refused is not None:  # said once per worker; a DNS name asks again every round
            level = logging.DEBUG if (role, url) in self._refused else logging.WARNING
            log.log(level, "%s %s (%s) kept out of the pool: %s", role, url, why, refused)
            if len(self._refused) >= MAX_REFUSED:
                self._refused.clear()  # a bound on what registrations can make the router hold
            self._refused.add((role, url))
        else:
            self._refused.discard((role, url))
        return refused

    async def _get_internal(self, w: Worker, path: str, limit: int, timeout_s: float) -> bytes | None:
        """The body (at most ``limit`` bytes) of a worker's internal ``GET path``, None unless it
        answers 200; a worker that cannot be reached raises (aiohttp, timeout, OS errors)."""
        assert self.session is not None
        async with self.session.get(
            w.url + path, headers=self.signed("GET", w.url + path), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            return await r.content.read(limit) if r.status == 200 else None

    async def _poll_load(self, w: Worker) -> None:
        """A worker's load report (the last one is kept when it cannot say or says nonsense)."""
        try:
            raw = await self._get_internal(w, "/v1/load", MAX_LOAD_REPORT_BYTES, 2)
            if raw is not None:
                w.report = decode_load_report(raw)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass

    def _replicas(self) -> dict[str, float]:
        """Per role with workers: the replicas that would serve its demand (api.load)."""
        return {
            pool.role: float(recommended_replicas([w.load for w in pool.healthy]))
            for pool in self.pools
            if pool.workers
        }

    async def _poll_digest(self, w: Worker) -> None:
        """A worker's prefix-cache digest into the KV index (a worker that cannot say goes stale)."""
        assert self.kv_index is not None
        try:
            raw = await self._get_internal(w, "/v1/kv/digest", MAX_DIGEST_BYTES + 1, 5)
            if raw is not None:
                self.kv_index.update(w.url, decode_digest(raw))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("no KV digest from %s: %s", w.url, e)

    async def choose_lm(
        self,
        pool: WorkerPool,
        req: ChatRequest,
        refs: list[MediaRef],
        exclude: set[str],
        skip_cached: bool = False,
        leases: int = 1,
    ) -> tuple[Worker, Blocks | None]:
        """The language-model worker for a request, and its prompt's blocks as named then.

        ``kv_aware``: by cached prefix and load, the prefix named from what is known of the media
        (encode results, else the directory's entries: this can run before any encode). With
        ``skip_cached``, each item not encoded yet whose placeholders lie inside the chosen
        worker's cached prefix gets a cached handle instead of an encode. Other policies: the
        pool's choice."""
        index, prompt_blocks = self.kv_index, self.prompt_blocks
        if index is None or prompt_blocks is None or not index.block_size:
            return pool.pick(exclude=exclude), None
        self._directory_keys(refs)
        media = [(r.modality, r.result or self._known(r)) for r in refs]
        try:
            # rendering and tokenizing a prompt is CPU work: not on the event loop
            named = await asyncio.get_running_loop().run_in_executor(
                prompt_blocks.executor, prompt_blocks.blocks, req, media, index.block_size, self._context_len()
            )
        except Exception:  # the router cannot name the blocks (e.g. a template error): balance load
            log.exception("could not compute the prompt's KV blocks")
            return pool.pick(exclude=exclude), None
        candidates = [w for w in pool.healthy if w.url not in exclude]
        chosen = index.choose(candidates, named.hashes, self.config.kv_load_tokens) if named.hashes else None
        if chosen is None:
            worker, tokens = pool.pick(exclude=exclude), 0
        else:
            worker, tokens = chosen
            self.metrics.inc("router_kv_routed_total", help_text="requests sent to the worker holding their prefix")
            self.metrics.inc(
                "router_kv_cached_tokens_total", tokens, help_text="prompt tokens cached on the chosen worker"
            )
        index.note(worker.url, named.hashes)
        if skip_cached and tokens:
            for r, (_, known), end in zip(refs, media, named.item_ends, strict=True):
                if r.result is None and known is not None and end <= tokens:
                    r.result = self._cached(known, leases)
                    r.encoder, r.skipped = "", True
                    self.metrics.inc(
                        "router_encodes_skipped_total", help_text="media items not encoded: the worker holds their KV"
                    )
        return worker, named

    def _known(self, r: MediaRef) -> EncodedItem | None:
        return self.directory.known(r.directory_key) if r.directory_key is not None else None

    def _cached(self, known: EncodedItem, leases: int) -> EncodedItem:
        """A stand-in for an encode result: ``leases`` cached handles (see ``transfer.cached``)."""
        ttl = self.config.request_timeout_s
        handles = [cached_handle(known.ec_handle, self._handle_key, ttl) for _ in range(leases)]
        return msgspec.structs.replace(known, ec_handle=handles[0], more_handles=handles[1:], store_handle=None)

    async def place(
        self,
        pool: WorkerPool,
        req: ChatRequest,
        refs: list[MediaRef],
        exclude: set[str],
        skip_cached: bool,
        leases: int,
        trail: Trail,
    ) -> Worker:
        """The worker of ``pool`` for a request, and every media ref filled (``leases`` handles
        each). kv_aware: the worker is chosen first, so items inside its cached prefix need no
        encode (``skip_cached``), and counts as busy while the rest are encoded; other policies
        choose after the encodes, by the load then."""
        worker: Worker | None = None
        named: Blocks | None = None
        if self.kv_index is not None or (self.dispatcher is not None and refs):
            worker, named = await self.choose_lm(pool, req, refs, exclude, skip_cached, leases)
        todo = [r for r in refs if not r.settled]
        if todo and worker is not None and self.dispatcher is not None:
            todo = self._dispatch(worker, todo)
        if todo:
            t0 = time.perf_counter()
            if worker is not None:  # it will need the worker's engine as soon as its media is encoded
                worker.outstanding += 1
                worker.awaiting += 1
            try:
                await self._encode_shielded(req.model, todo, leases, trail.request_id)
            except (Unavailable, WorkerFailed):
                if not self._raw_fallback(worker, todo):
                    raise
            finally:
                if worker is not None:
                    worker.outstanding -= 1
                    worker.awaiting -= 1
            encode = time.perf_counter() - t0
            self.encode_hist.observe(encode)
            trail.add("router_encode", encode)
        if worker is None:
            worker, named = await self.choose_lm(pool, req, refs, exclude)
        self.note_complete(worker, req, refs, named)
        trail.add_media(refs)
        for stage in ROUTER_STAGES:
            if stage in trail.stages:
                self.stage_hist.labels(stage=stage).observe(trail.stages[stage])
        return worker

    def _dispatch(self, worker: Worker, todo: list[MediaRef]) -> list[MediaRef]:
        """Adaptive dispatch (``router.dispatch``): mark the items the worker should encode itself
        raw; the rest, to encode. Items the directory holds always take the remote path."""
        model = self.dispatcher
        assert model is not None
        self._directory_keys(todo)
        fresh = [r for r in todo if self._known(r) is None]
        for r in fresh:
            r.patches = model.patches(r.modality, r.url)
        encoders = self.encoders.healthy
        least = min(encoders, key=lambda e: e.patches) if encoders else None
        side = Side(
            encoder=least.report if least else None,
            encoder_patches=least.patches if least else 0,
            worker=worker.report,
            worker_waiting=worker.awaiting,
            worker_decoding=max(0, worker.outstanding - worker.awaiting),
        )
        choice = model.choose(sum(r.patches for r in fresh), side) if fresh else None
        path = "local" if choice is not None and choice.local else "remote"
        self.metrics.inc("router_dispatch_total", labels={"path": path})
        if path == "remote":
            return todo
        for r in fresh:
            r.raw = True
        return [r for r in todo if not r.raw]

    def _raw_fallback(self, worker: Worker | None, todo: list[MediaRef]) -> bool:
        """Adaptive dispatch, the encoders gone or failing: the worker, if it has a vision tower,
        encodes what they did not. True when it takes them."""
        if self.dispatcher is None or worker is None or not worker.report.vision:
            return False
        for r in todo:
            if r.result is None:
                r.raw = True
        self.metrics.inc("router_dispatch_fallbacks_total", help_text="media sent raw because no encoder could take it")
        return True

    def note_complete(self, worker: Worker, req: ChatRequest, refs: list[MediaRef], named: Blocks | None) -> None:
        """After the encodes: note the blocks past the items that were unknown when the worker was
        chosen (in the background: the request does not wait for it)."""
        index, prompt_blocks = self.kv_index, self.prompt_blocks
        if index is None or prompt_blocks is None or named is None or named.complete:
            return
        media = [(r.modality, r.result) for r in refs]
        block_size = index.block_size

        async def note() -> None:
            try:
                full = await asyncio.get_running_loop().run_in_executor(
                    prompt_blocks.executor, prompt_blocks.blocks, req, media, block_size, self._context_len()
                )
            except Exception:
                log.exception("could not compute the prompt's KV blocks")
                return
            index.note(worker.url, full.hashes)

        self.spawn(note())

    def _context_len(self) -> int | None:
        """The workers' context length, once learnt: no prompt is tokenized past it."""
        return self._model[1] if self._model is not None and self._model[1] else None

    def _directory_keys(self, refs: list[MediaRef]) -> None:
        """Key the refs in the directory, once it can help: encoders hand out store handles, or
        the router names KV blocks (content is not hashed otherwise)."""
        use = self.directory.max_entries > 0 and (self._store_seen or self.kv_index is not None)
        for r in refs:
            if r.directory_key is None and use:
                r.directory_key = content_key(r.modality, r.url)

    @property
    def pools(self) -> tuple[WorkerPool, ...]:
        return (self.encoders, self.pds, self.prefills, self.decodes)

    @property
    def splits(self) -> bool:
        """Requests go E → P → D: healthy prefill and decode workers are there."""
        return bool(self.prefills.healthy and self.decodes.healthy)

    @property
    def lm_workers(self) -> list[Worker]:
        """Healthy language-model workers of every role."""
        return [*self.pds.healthy, *self.prefills.healthy, *self.decodes.healthy]

    # ---- validation --------------------------------------------------------------------------
    async def _pd_models(self) -> tuple[int, bytes] | None:
        """``GET /v1/models`` of the first healthy language-model worker that answers: (status, body)."""
        assert self.session is not None
        for pd in self.lm_workers:
            try:
                async with self.session.get(
                    pd.url + "/v1/models",
                    headers=self.signed("GET", pd.url + "/v1/models"),
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        return None

    async def _learn_model(self) -> tuple[str, int] | None:
        """The served model's name and context length, as the PD workers report them."""
        answer = await self._pd_models()
        if answer is None or answer[0] != 200:
            return None
        try:
            card = msgspec.json.decode(answer[1])["data"][0]
            self._model = (str(card["id"]), int(card.get("max_model_len") or 0))
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError):
            return None
        return self._model

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
        model = self._model or await self._learn_model()
        if model is None:
            raise Unavailable("No healthy prefill/decode worker is available.")
        name, max_model_len = model
        if not req.model:  # optional, as in vLLM: the one model served
            req.model = name
        if req.model != name:
            raise NotFound.model(req.model)
        to_sampling_params(req, 1, max_model_len or 1 << 30)
        check_max_tokens(req, self.config.quota.max_tokens_limit)

    # ---- encode ------------------------------------------------------------------------------
    async def encode(self, model: str, refs: list[MediaRef], leases: int = 1, rid: str = "") -> None:
        """Fill ``ref.result`` for every ref (``leases`` handles per item: 2 when a decode instance
        gets its own): from the media directory where it covers the item, else by encoders, one
        encode per item at a time across concurrent requests (``directory``). ``rid``: the
        request's id, for the encoders' access lines."""
        todo = list(refs)
        self._directory_keys(todo)
        for r in todo:
            r.from_directory = False
        while todo:
            lead: list[MediaRef] = []
            waits: list[tuple[MediaRef, asyncio.Future[None]]] = []
            leading: set[str] = set()
            for r in todo:
                # store hits and single-flight: only once the encoders share a store
                key = r.directory_key if self._store_seen else None
                item = self.directory.lookup(key) if key is not None else None
                if item is not None:
                    r.result = msgspec.structs.replace(item, more_handles=[item.ec_handle] * (leases - 1))
                    r.encoder, r.from_directory = "", True
                    continue
                running = self.directory.in_flight(key) if key is not None and key not in leading else None
                if running is not None:
                    waits.append((r, running))
                    continue
                if key is not None and key not in leading:
                    self.directory.begin(key)
                    leading.add(key)
                lead.append(r)
            try:
                if lead:
                    await self._encode_refs(model, lead, leases, rid)
            finally:
                for r in lead:
                    if r.result is not None and r.result.store_handle is not None:
                        self._store_seen = True
                    self._directory_keys([r])
                    if r.result is not None and r.directory_key is not None:
                        self.directory.record(r.directory_key, r.result)
                    if r.directory_key in leading:
                        self.directory.end(r.directory_key)
                        leading.discard(r.directory_key)
            if waits:
                self.directory.waits += len(waits)
                await asyncio.gather(*(asyncio.shield(f) for _, f in waits))
            todo = [r for r, _ in waits]

    def forget_directory_hits(self, refs: list[MediaRef]) -> None:
        """A worker could not use what the directory gave these refs (an entry evicted from the
        store, a worker without the store): encode them afresh from now on."""
        for r in refs:
            if r.from_directory and r.directory_key is not None:
                self.directory.forget(r.directory_key)

    async def _encode_refs(self, model: str, refs: list[MediaRef], leases: int, rid: str = "") -> None:
        """Fill ``ref.result`` for every ref by encoders (with ``--frontend-decode``, items the
        router decoded itself go as pixel handles, given back once every call is over)."""
        try:
            if self.frontend is not None:  # pixel handles instead of URLs where it can
                await self.frontend.prepare(model, refs)
            await self._encode_groups(model, refs, leases, rid)
        finally:
            if self.frontend is not None:  # every call that carried them is over
                self.frontend.release(refs)

    async def _await_encoder(self) -> bool:
        """With no encoder healthy (all starting or restarting), wait up to ``encoder_wait_s`` for
        one, rather than refuse media a moment before an encoder is back: whether one is."""
        deadline = time.monotonic() + self.config.encoder_wait_s
        while not self.encoders.healthy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(FAST_PROBE_S)
        return True

    async def _encode_groups(self, model: str, refs: list[MediaRef], leases: int, rid: str) -> None:
        """Items grouped per encoder, one call per group, failed groups retried elsewhere."""
        pending = list(refs)
        tried: set[str] = set()
        busy = errors = False
        while pending:
            try:
                groups: dict[str, tuple[Worker, list[MediaRef]]] = {}
                for r in pending:
                    w = self.encoders.pick(exclude=tried, key=r.url)
                    groups.setdefault(w.url, (w, []))[1].append(r)
            except NoWorker:
                if busy:
                    self.metrics.inc("router_overloaded_total", help_text="requests refused because encoders were busy")
                    raise Overloaded(
                        "Every encoder is busy; retry shortly.", retry_after_s=self.config.retry_after_s
                    ) from None
                if not tried and await self._await_encoder():
                    continue
                if errors:
                    raise WorkerFailed("The encoders failed on this request.") from None
                raise Unavailable(
                    "No healthy encoder worker is available.", retry_after_s=self.config.retry_after_s
                ) from None
            n = self.config.max_items_per_encode
            calls = [(w, rs[i : i + n]) for w, rs in groups.values() for i in range(0, len(rs), n)]
            results = await asyncio.gather(*(self._encode_on(model, w, rs, leases, rid) for w, rs in calls))
            pending = []
            for (w, rs), outcome in zip(calls, results, strict=True):
                if outcome is not _Outcome.OK:
                    tried.add(w.url)
                    busy |= outcome is _Outcome.BUSY
                    errors |= outcome is _Outcome.ERROR
                    self.metrics.inc("router_encoder_retries_total", help_text="encoder calls retried elsewhere")
                    pending += rs

    async def _encode_on(self, model: str, w: Worker, refs: list[MediaRef], leases: int, rid: str) -> _Outcome:
        assert self.session is not None
        items = [EncodeItem(r.modality, None if r.pixels else r.url, r.pixels) for r in refs]  # type: ignore[arg-type]
        body = encode_request(EncodeRequest(model=model, items=items, leases=leases))
        patches = sum(r.patches for r in refs)
        w.outstanding += 1
        w.patches += patches
        t0 = time.perf_counter()
        try:
            encoding = {"epd.encoder": w.url, "epd.items": len(refs)}
            with self.tracing.client_span("POST /v1/encode", **encoding) as trace:
                async with self.session.post(
                    w.url + "/v1/encode",
                    data=body,
                    headers={
                        "Content-Type": "application/json",
                        **self.signed("POST", w.url + "/v1/encode", body),
                        **({REQUEST_ID_HEADER: rid} if rid else {}),
                        **trace,
                    },
                    timeout=aiohttp.ClientTimeout(total=self.config.encode_timeout_s),
                ) as resp:
                    raw = await resp.read()
                    if resp.status == 429:
                        return _Outcome.BUSY
                    if resp.status in (401, 403):  # a worker that does not know our credential is misconfigured
                        log.error("encoder %s refused the cluster credential", w.url)
                        self.encoders.mark_failed(w)
                        return _Outcome.FAILED
                    if 400 <= resp.status < 500 or about_media(raw):  # the media itself is bad: the client's error
                        raise passthrough_error(resp.status, raw)
                    if resp.status != 200:
                        # it answered, so it is up: one request's failure does not mark it unhealthy
                        log.warning("encoder %s answered HTTP %d", w.url, resp.status)
                        return _Outcome.ERROR
                    out = decode_response(raw)
        except TimeoutError:
            raise Timeout("An encoder did not answer in time.") from None
        except (aiohttp.ClientError, OSError):
            self.encoders.mark_failed(w)
            return _Outcome.FAILED
        finally:
            w.outstanding -= 1
            w.patches -= patches
        if self.dispatcher is not None:
            self.dispatcher.observe(out.items, time.perf_counter() - t0)
        if len(out.items) != len(refs) or any(len(item.more_handles) != leases - 1 for item in out.items):
            self._release({w.url: [h for item in out.items for h in (item.ec_handle, *item.more_handles)]})
            raise WorkerFailed("An encoder returned a different number of items or leases than requested.")
        for r, item in zip(refs, out.items, strict=True):
            r.result, r.encoder = item, w.url
        return _Outcome.OK

    async def _encode_shielded(self, model: str, refs: list[MediaRef], leases: int = 1, rid: str = "") -> None:
        """``encode``, finishing in the background if the client leaves meanwhile: the leases the
        encoders issue for it are then given back as soon as they arrive, not after their TTL."""
        task = asyncio.ensure_future(self.encode(model, refs, leases, rid))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:

            def release(t: asyncio.Future) -> None:
                if not t.cancelled():
                    t.exception()  # retrieved: the client is gone, nobody else will read it
                self._release(self._take_leases(refs))

            task.add_done_callback(release)
            raise

    def _take_leases(self, refs: list[MediaRef]) -> dict[str, list[dict]]:
        """The leases the refs hold, per encoder; the refs forget them."""
        leases: dict[str, list[dict]] = {}
        for r in refs:
            if r.result is not None and not r.from_directory and r.encoder:  # a directory hit holds no lease
                leases.setdefault(r.encoder, []).extend((r.result.ec_handle, *r.result.more_handles))
            r.result, r.skipped, r.raw = None, False, False
        return leases

    def _release(self, leases: dict[str, list[dict]]) -> None:
        """Give leases back to their encoders in the background (it must outlive a cancelled handler)."""
        for url, handles in leases.items():
            if handles:
                self.spawn(self._release_on(url, handles))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, past the handler that started it (awaited at close)."""
        task = asyncio.create_task(work)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_on(self, url: str, handles: list[dict]) -> None:
        assert self.session is not None
        body = encode_release(ReleaseRequest(handles=handles))
        try:
            async with self.session.post(
                url + "/v1/release",
                data=body,
                headers={"Content-Type": "application/json", **self.signed("POST", url + "/v1/release", body)},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                await r.read()
            self.metrics.inc("router_leases_released_total", len(handles), help_text="leases given back to encoders")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.warning("could not release %d leases on %s (they expire by TTL): %s", len(handles), url, e)

    # ---- chat --------------------------------------------------------------------------------
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
        raw = await request.read()
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
        return -(-chars // CHARS_PER_TOKEN) + (max_tokens or DEFAULT_MAX_TOKENS)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` (a raw text prompt): validated here, answered by a language-model
        worker (a prefill+decode one, else a decode one), retried once on another before its first byte."""
        with self.tracing.server_span("POST /v1/completions", request.headers) as span:
            raw = await request.read()
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
        pool = self.pds if self.pds.healthy else self.decodes
        exclude: set[str] = set()
        for attempt in (1, 2):
            try:
                worker = pool.pick(exclude=exclude)
            except NoWorker:
                raise Unavailable("No healthy language-model worker is available.") from None
            try:
                resp, _ = await self._forward(request, worker, raw, bool(req.stream), trail, pool, COMPLETIONS_PATH)
                return resp
            except RetryableWorker as e:
                exclude.add(e.url)
                if attempt == 2:
                    raise WorkerFailed(f"The worker failed: {e}") from None
        raise AssertionError("unreachable")

    def _count(self, kind: str, status: int) -> None:
        self.metrics.inc("router_requests_total", labels={"kind": kind, "status": str(status)})

    async def _chat(self, request: web.Request, req: ChatRequest, raw: bytes, trail: Trail) -> web.StreamResponse:
        body: dict[str, Any] = msgspec.json.decode(raw)
        if self.splits:
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
                    pd = await self.place(self.pds, req, refs, exclude, skip_cached, 1, trail)
                except NoWorker:
                    raise Unavailable("No healthy prefill/decode worker is available.") from None
                worker_body = msgspec.json.encode(with_parts(body, refs))
                resp, consumed = await self._forward(request, pd, worker_body, bool(req.stream), trail)
                return resp
            except RetryableWorker as e:
                if not e.worker_ok:
                    exclude.add(e.url)
                self.forget_directory_hits(refs)
                skip_cached = False
                self.metrics.inc("router_pd_retries_total", help_text="PD calls retried before the first byte")
                if attempts_left <= 0:
                    raise WorkerFailed(f"The prefill/decode worker failed: {e}") from None
            finally:
                if not consumed:
                    self._release(self._take_leases(refs))

    async def _forward(
        self,
        request: web.Request,
        pd: Worker,
        body: bytes,
        stream: bool,
        trail: Trail,
        pool: WorkerPool | None = None,
        path: str = CHAT_PATH,
    ) -> tuple[web.StreamResponse, bool]:
        """The client's response, and whether the PD worker accepted the request (took its leases)."""
        assert self.session is not None
        pool = pool or self.pds
        t0 = time.perf_counter()
        pd.outstanding += 1
        pd.awaiting += 1
        awaiting = True

        def first_byte() -> None:
            nonlocal awaiting
            pd.awaiting -= 1
            awaiting = False
            self._first_byte(trail, time.perf_counter() - t0)

        try:
            with self.tracing.client_span(f"POST {path}", **{"epd.worker": pd.url, "epd.role": pool.role}) as trace:
                upstream = await self.post_chat(pool, pd, body, trail, path, trace)
                async with upstream:
                    trail.workers.append(upstream.headers.get(SERVER_TIMING, ""))
                    trail.ran_on.append(pd.url)
                    if upstream.status == 503:
                        raw = await upstream.read()
                        if error_code(raw) == EMBEDS_UNAVAILABLE:  # an encoder died: encode afresh
                            raise RetryableWorker(pd.url, "embeddings unavailable", worker_ok=True)
                        return error_response(upstream, raw), False
                    if upstream.status >= 500:
                        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                            raw = b""
                            raw = await upstream.read()
                        if about_media(raw):  # the request's own media failed there: the client's error
                            first_byte()
                            return trail.stamp(error_response(upstream, raw)), False
                        raise RetryableWorker(pd.url, f"HTTP {upstream.status}")
                    if upstream.status != 200 or not stream:
                        try:
                            raw = await upstream.read()
                        except (aiohttp.ClientError, TimeoutError, OSError) as e:
                            pool.mark_failed(pd)  # died mid-body: nothing reached the client yet
                            raise RetryableWorker(pd.url, f"failed mid-response: {e}") from None
                        first_byte()
                        return trail.stamp(error_response(upstream, raw)), upstream.status == 200
                    first_byte()
                    return await self._relay_stream(request, upstream, pd, trail, pool), True
        finally:
            pd.outstanding -= 1
            if awaiting:
                pd.awaiting -= 1

    def _first_byte(self, trail: Trail, from_worker_call: float) -> None:
        self.ttfb_hist.observe(from_worker_call)
        self.note_first_token(trail)

    def note_first_token(self, trail: Trail) -> None:
        """A request's first token is here: text TTFT feeds the media limit's controller."""
        if self.auto_limit is not None and trail.kind == "text":
            self.auto_limit.observe(time.perf_counter() - trail.t0)

    async def post_chat(
        self,
        pool: WorkerPool,
        worker: Worker,
        body: bytes,
        trail: Trail,
        path: str = CHAT_PATH,
        trace: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """POST a chat request to a worker, response unread. One that cannot be reached is marked
        failed and the call is retryable elsewhere."""
        assert self.session is not None
        try:
            return await self.session.post(
                worker.url + path,
                data=body,
                headers={
                    "Content-Type": "application/json",
                    **self.signed("POST", worker.url + path, body),
                    **trail.ask(),
                    **(trace or {}),
                },
                timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            )
        except TimeoutError:
            raise Timeout(f"The {pool.role} worker did not answer in time.") from None
        except (aiohttp.ClientError, OSError) as e:
            pool.mark_failed(worker)
            raise RetryableWorker(worker.url, str(e)) from None

    async def _relay_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, pd: Worker, trail: Trail, pool: WorkerPool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        for h in ("Content-Type", "Cache-Control"):
            if h in upstream.headers:
                resp.headers[h] = upstream.headers[h]
        trail.stamp(resp)
        await resp.prepare(request)
        await self.relay(resp, upstream, pd, pool)
        return resp

    async def relay(
        self, resp: web.StreamResponse, upstream: aiohttp.ClientResponse, worker: Worker, pool: WorkerPool
    ) -> None:
        """Pass a worker's SSE stream on to a client's prepared response, to its end. A worker
        that breaks off mid-stream is marked failed, and the stream ends with an error event."""
        tail = b""
        failure: str | None = None
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
                tail = (tail + chunk)[-_TAIL:]
            if tail != SSE_DONE:
                failure = "the stream ended early"
        except ConnectionResetError:
            return  # the client left: closing upstream makes the worker abort the request
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            failure = str(e) or type(e).__name__
        if failure is not None:
            # a worker that died mid-stream: say so in the stream, then end it cleanly
            log.warning("%s %s failed mid-stream: %s", pool.role, worker.url, failure)
            pool.mark_failed(worker)
            self.metrics.inc("router_streams_failed_total", help_text="streams a worker broke off")
            err = WorkerFailed("The worker failed while streaming; the answer is incomplete.")
            try:
                await resp.write(sse_error(err) + SSE_DONE)
            except ConnectionResetError:
                return
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()

    # ---- admin -------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        """``POST``/``DELETE /v1/workers`` (admin key): add or remove a worker. With
        ``heartbeat_s`` the registration lapses unless renewed within that many seconds times
        ``HEARTBEATS_PER_LEASE`` (a worker's ``--register-with``); without, it stays."""
        info = await _json_body(request)
        pool = self._pool(info.get("role"))
        url = info.get("url")
        if not isinstance(url, str) or not is_worker_url(url):
            raise BadRequest("url must be a worker's base URL: http(s)://host:port", param="url")
        url = url.rstrip("/")
        heartbeat = info.get("heartbeat_s")
        if heartbeat is not None and (
            not isinstance(heartbeat, int | float)
            or isinstance(heartbeat, bool)
            or not 0 < heartbeat <= MAX_HEARTBEAT_S
        ):
            raise BadRequest(f"heartbeat_s must be a number in (0, {MAX_HEARTBEAT_S}]", param="heartbeat_s")
        if request.method == "DELETE":
            self.leases.drop(pool.role, url)
            if heartbeat is not None and (pool.role, url) in self.static:
                return web.json_response({"removed": False})  # a worker leaving: the command line's entry stays
            self.static.discard((pool.role, url))  # the admin's removal: whatever listed it
            return web.json_response({"removed": pool.remove(url)})
        if url not in pool.workers:
            refused = await self._admit(pool.role, url, "registering")
            if refused is not None:
                raise Forbidden(f"The worker was not registered: {refused}.")
        if heartbeat is not None and (pool.role, url) not in self.static:
            self.leases.renew(pool.role, url, HEARTBEATS_PER_LEASE * heartbeat)
        elif heartbeat is None:
            self.leases.drop(pool.role, url)  # registered by hand: it stays
        if url not in pool.workers:
            log.info("%s %s registered", pool.role, url)
        pool.add(url)
        return web.json_response({"registered": url, "role": pool.role})

    def _pool(self, role: object) -> WorkerPool:
        for pool in self.pools:
            if role == pool.role:
                return pool
        raise BadRequest("role must be one of 'encoder', 'pd', 'prefill', 'decode'", param="role")

    async def workers(self, request: web.Request) -> web.Response:
        def rows(p: WorkerPool) -> list[dict]:
            return [{"url": w.url, "healthy": w.healthy, "outstanding": w.outstanding} for w in p.workers.values()]

        return web.json_response(
            {
                "encoders": rows(self.encoders),
                "pds": rows(self.pds),
                "prefills": rows(self.prefills),
                "decodes": rows(self.decodes),
            }
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        answer = await self._pd_models()
        if answer is None:
            raise Unavailable("No healthy prefill/decode worker is available.")
        return json_response(answer[1], answer[0])

    async def health(self, request: web.Request) -> web.Response:
        """Some requests can be served: a language-model path is healthy (encoders may be down)."""
        if not self.pds.healthy and not self.splits:
            raise Unavailable("no healthy prefill/decode worker", retry_after_s=self.config.retry_after_s)
        counts = {f"{pool.role}s": len(pool.healthy) for pool in self.pools}
        return web.json_response({"status": "ok", **counts})

    async def ready(self, request: web.Request) -> web.Response:
        """Every request can be served: each role the router was given has a worker that answered
        its health probe. ``up`` and a readiness probe wait for this; the counts say who is up."""
        counts = {f"{pool.role}s": len(pool.ready) for pool in self.pools}
        missing = [pool.role for pool in self.pools if pool.workers and not pool.ready]
        if not (self.pds.workers or self.prefills.workers):  # none named or registered yet
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
        assert self.session is not None
        if not is_operator(request, self.config.auth):
            return public_metrics(self.metrics, self.config.exposure.metrics_level(self.config.auth.api_key))
        workers = [(pool.role, w) for pool in self.pools for w in pool.workers.values()]
        texts = await asyncio.gather(*(self._scrape(w) for _, w in workers))
        federated = federate([(role, w.url, text) for (role, w), text in zip(workers, texts, strict=True) if text])
        return web.Response(body=self.metrics.render() + federated, headers={"Content-Type": CONTENT_TYPE})

    async def _scrape(self, w: Worker) -> str | None:
        try:
            raw = await self._get_internal(w, "/metrics", MAX_SCRAPE_BYTES, 2)
            if raw is not None:
                return raw.decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("no metrics from %s: %s", w.url, e)
        self.metrics.inc("router_scrape_failures_total", help_text="worker metrics the router could not read")
        return None


@dataclass
class _Answer:
    """How a public request ended, as far as it got."""

    kind: str = "unknown"  # until the body parses
    status: int = 200
    error: str = ""


async def _json_body(request: web.Request) -> dict:
    try:
        info = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(info, dict):
        raise BadRequest("body must be a JSON object")
    return info


def build_app(router: Router) -> web.Application:
    routes: list[Route] = [
        ("POST", "/v1/chat/completions", router.chat, "public"),
        ("POST", "/v1/completions", router.completions, "public"),
        ("GET", "/v1/models", router.models, "public"),
        ("GET", "/health", router.health, "open"),
        ("GET", "/ready", router.ready, "open"),
        ("GET", "/metrics", router.metrics_text, "open"),
        ("GET", "/v1/workers", router.workers, "admin"),
        ("POST", "/v1/workers", router.register, "admin"),
        ("DELETE", "/v1/workers", router.register, "admin"),
    ]
    return role_app(router.config.max_request_bytes, routes, router.start, router.close, router.config.auth)


def serve_router(config: RouterConfig) -> None:
    run_app(build_app(Router(config)), config.host, config.port)
