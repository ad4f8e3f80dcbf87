"""The encoder-only instance (the E of EPD): media in, embeddings out through the EC connector.

Routes: ``POST /v1/encode`` (see ``epdserve.encoder.protocol``), ``GET /v1/models``, ``/health``,
``/metrics``. Per item::

    fetch (event loop) → hash (pool) → cached? ─yes──────────────────────────────────┐
    (pixel handle: uuid from its signed header) ┘
                                          └─no─→ in the shared store? ─yes────────────┤
                                                 └─no (claimed) → decode + preprocess │
                                                   → batcher (one forward thread)     │
                                                   → shared store ────────────────────┴→ put (one put thread)

With a shared store (``--store-url``) an item computed by any encoder is not computed again, and
concurrent misses on one item across encoders compute it once (``store.single_flight``).

An item may arrive decoded: a pixel handle (``transfer.pixels``) on frames a router that decodes
media (``--frontend-decode``) put into its shm slab. Then nothing is fetched, hashed or decoded
here: the uuid comes from the handle, and the frames are read only when the item is computed.

Only the media encoder is loaded (``parts={"vision"}``: the vision tower, or an audio model's audio
tower; audio arrives as ``data:audio/<format>`` URLs): no language model, KV cache or sampler.
Item uuids are computed exactly as the language-model server computes them (same model name,
same ``MediaResolver`` processor kwargs), so every role agrees on a media item's identity.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, get_args

import msgspec
import torch
from aiohttp import web
from PIL import Image

from epdserve.api import logs
from epdserve.api.auth import AuthConfig
from epdserve.api.errors import (
    ApiError,
    BadRequest,
    NotFound,
    Overloaded,
    Unavailable,
    from_media_error,
)
from epdserve.api.http import Route, json_response, read_body, role_app, run_app
from epdserve.api.load import CostRate, EncoderLoad, LoadReport
from epdserve.api.logs import request_id
from epdserve.api.media import MediaResolver
from epdserve.api.metrics import CONTENT_TYPE, Metrics
from epdserve.api.protocol import ModelCard, ModelList, encode_json
from epdserve.api.registration import Registrar, RegistrationConfig
from epdserve.api.tracing import Tracing
from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.encoder.batcher import BatcherClosed, BatcherConfig, BatchReport, EncodeBatcher, EncodeError, QueueFull
from epdserve.encoder.protocol import (
    EncodedItem,
    EncodeItem,
    EncodeResponse,
    ItemStatus,
    ItemTimings,
    decode_release,
    decode_request,
    encode_response,
)
from epdserve.engine.inputs import MediaInput
from epdserve.engine.memory import MemoryBudgetError, plan_encoder
from epdserve.kernels import KernelChoice
from epdserve.kernels.ops import select_ops
from epdserve.kernels.resample import load_resampler
from epdserve.media.audio import AudioProcessor, AudioProcessorConfig, audio_format_of
from epdserve.media.errors import MediaError
from epdserve.media.fetch import load_media_bytes, media_session
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionInput, VisionProcessor
from epdserve.media.workers import media_threads
from epdserve.models.config import ModelConfig
from epdserve.models.loader import checkpoint_files, load_model
from epdserve.models.precision import DType, torch_dtype
from epdserve.models.registry import prompt_layout
from epdserve.store.base import EmbeddingStore
from epdserve.store.factory import open_store
from epdserve.store.record import STORE_PURPOSE, EntryCheck, Grid, StoredItem
from epdserve.store.single_flight import fetch_or_claim, holding
from epdserve.transfer import signing
from epdserve.transfer.base import ECProducer, Handle, ProducerFull, TransferError
from epdserve.transfer.config import STORE_HANDLE, ECConfig
from epdserve.transfer.factory import make_producer
from epdserve.transfer.header import WireHeader, to_handle
from epdserve.transfer.pixels import PixelItem, PixelReader, processor_digest

VISUAL_TOKENS = "visual tokens (embedding rows) served, by how"
PIXEL_ITEMS = "items that arrived decoded (the router's pixel handles): not fetched, hashed or decoded here"
log = logging.getLogger(__name__)
T = TypeVar("T")
STORED_REMEMBERED = 65536  # uuids whose store entries this encoder remembers (for store handles on cache hits)


@dataclass(frozen=True)
class EncoderConfig:
    """One encoder instance."""

    model: Path  # checkpoint directory (Hugging Face format); only the vision tower is read
    served_model_name: str = ""  # model name clients and the LM instances use; empty: the directory name
    host: str = "127.0.0.1"  # listen address
    port: int = 8100  # listen port (0: any free port)
    encode_token_budget: int = 8192  # most patch rows per vision forward (items of concurrent requests batch up to it)
    batch_wait_ms: float = 0.0  # extra wait for more items before a forward (0: batch what is queued)
    max_queued_items: int = 1024  # items waiting for a forward beyond which requests get 429
    encoder_cache_bytes: int = 512 << 20  # byte budget of the local embedding cache (0: no cache)
    max_items_per_request: int = 32  # media items one /v1/encode request may carry
    max_request_bytes: int = 64 << 20  # largest request body
    preprocess_threads: int = 0  # threads hashing, decoding and preprocessing media (0: one per core it may run on)
    kernels: KernelChoice = "auto"  # auto: the tower's rotary in the fused C++ kernels (CPU, float32/bfloat16); torch
    threads: int = 1  # torch intra-op threads for the vision forward (0: torch default); 1 suits small models
    device: str = "cpu"  # torch device of the vision tower
    dtype: DType = "float32"  # weights and activations: float32 | bfloat16 | float16
    limits: MediaLimits = field(default_factory=MediaLimits)  # what media clients may send
    ec: ECConfig = field(default_factory=ECConfig)  # EC connector the embeddings are put into
    auth: AuthConfig = field(default_factory=AuthConfig)  # the cluster credential /v1/encode needs
    retry_after_s: int = 1  # Retry-After of a 429 when the queue or the connector is full
    otlp_traces_endpoint: str = ""  # OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces
    log_stats_interval_s: float = 10.0  # seconds between stats lines while there is traffic (0: none)
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)  # advertised host, router

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # raises for an unknown name
        if self.kernels not in get_args(KernelChoice):
            raise ValueError(f"kernels must be one of {', '.join(get_args(KernelChoice))}, got {self.kernels!r}")
        for name in ("max_items_per_request", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EncoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("encoder_cache_bytes", "threads", "preprocess_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"EncoderConfig.{name} must be >= 0, got {getattr(self, name)}")
        self.batcher  # noqa: B018 - validates the batching fields

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def batcher(self) -> BatcherConfig:
        return BatcherConfig(
            token_budget=self.encode_token_budget,
            max_wait_ms=self.batch_wait_ms,
            max_queued_items=self.max_queued_items,
        )


class _Ready(NamedTuple):
    """One item with its embeddings, before the put."""

    item: EncodeItem
    uuid: str
    grid_thw: tuple[int, int, int]
    embeddings: torch.Tensor
    status: ItemStatus
    timings: ItemTimings
    stored: WireHeader | None = None  # its shared-store entry, when this encoder knows there is one
    second_per_grid: float | None = None  # a video's seconds per temporal patch (None: not a video)


def _remember(table: OrderedDict[str, T], uuid: str, value: T) -> None:
    """``table[uuid] = value``, most recent last; the oldest go past ``STORED_REMEMBERED``."""
    table[uuid] = value
    table.move_to_end(uuid)
    while len(table) > STORED_REMEMBERED:
        table.popitem(last=False)


def _with_param(e: ApiError, param: str) -> ApiError:
    """``e`` pointing at the request field that caused it."""
    return type(e)(e.message, param=param, code=e.code)


class EncoderService:
    """Owns the vision tower, the batcher, the media pipeline and the EC producer."""

    def __init__(self, config: EncoderConfig, producer: ECProducer | None = None) -> None:
        """Loads the vision tower; ``producer`` defaults to ``make_producer(config.ec)``."""
        self.config = config
        self.started = time.time()
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        memory = plan_encoder(
            config.model, config.dtype, config.device, config.encode_token_budget, config.encoder_cache_bytes
        )  # refuses before any weight is read
        log.info("%s", memory.line())
        model, self.load_report = load_model(
            config.model,
            parts=frozenset({"vision"}),
            dtype=config.torch_dtype,
            device=config.device,
            kernels=config.kernels,
        )
        # one media encoder per model: the vision tower, or an audio model's audio tower
        visual = getattr(model, "visual", None)
        if visual is None:
            visual = getattr(model, "audio", None)
        if not isinstance(visual, torch.nn.Module):
            raise ValueError(f"{config.model}: the model has no media encoder")
        tower: Any = visual  # a vision tower runs its rotary and activation with these ops (an audio tower has none)
        if hasattr(tower, "ops"):
            tower.ops = select_ops(config.kernels, config.torch_dtype, torch.device(config.device))
        self.checkpoint_tensors = len(checkpoint_files(config.model))
        log.info(
            "encoder loaded %d of %d checkpoint tensors (vision tower only) in %.2f s",
            len(self.load_report.tensors),
            self.checkpoint_tensors,
            self.load_report.seconds,
        )
        model_config = ModelConfig.from_pretrained(config.model)
        self.feature_levels = model_config.feature_levels  # written into every EC header it produces
        self.processor = VisionProcessor(ProcessorConfig.from_pretrained(config.model), load_resampler())
        self.audio = AudioProcessor(AudioProcessorConfig.from_pretrained(config.model)) if model_config.audio else None
        self.executor = ThreadPoolExecutor(media_threads(config.preprocess_threads), thread_name_prefix="epd-media")
        # one thread: puts are short copies, kept off the event loop and the forward thread
        self.put_executor = ThreadPoolExecutor(1, thread_name_prefix="epd-ec-put")
        self.producer = producer if producer is not None else make_producer(config.ec)
        self.metrics = Metrics()
        self.batcher = EncodeBatcher(
            visual,
            config.batcher,
            EmbeddingCache(config.encoder_cache_bytes),
            rows_of=prompt_layout(model_config).num_placeholders,
            device=config.device,
            dtype=config.torch_dtype,
            on_batch=self._on_batch,
        )
        self.resolver: MediaResolver | None = None
        self.registrar: Registrar | None = None  # with --register-with: keeps this encoder registered
        self.preprocess_cpu_s = 0.0  # CPU seconds of preprocessing items computed here
        self.preprocess_patches = 0  # and their patches (adaptive dispatch reads the rate)
        self.preprocess_rate = CostRate()
        self.pixels: PixelReader | None = None  # pixel handles need the cluster secret, as EC handles do
        if config.ec.has_secret:
            kwargs = self.processor.config.hash_kwargs(config.limits.video_frames)
            digest = processor_digest(config.model_name, kwargs)
            self.pixels = PixelReader(config.ec, config.model_name, digest, config.limits)
        self.store: EmbeddingStore | None = None
        self._stored: OrderedDict[str, WireHeader] = OrderedDict()
        self._timings: OrderedDict[str, float] = OrderedDict()  # videos' second_per_grid, for cache hits
        if config.ec.store.enabled:
            check = EntryCheck(
                config.model_name,
                config.ec.key(STORE_PURPOSE),
                model_config.text.hidden_size,
                prompt_layout(model_config).num_placeholders,
                levels=model_config.feature_levels,
            )
            self.store = open_store(config.ec.store, check, lend=True)
        self.load = EncoderLoad()  # the autoscaling signal
        self._init_metrics()
        self.tracing = Tracing("epdserve-encoder", config.otlp_traces_endpoint)
        self.metrics.gauge(
            "encoder_load_ratio",
            "visual work offered over what the vision forward serves (autoscaling)",
            self.load.ratio,
        )
        self.window = Counter[str]()  # requests and items since the last stats line
        self.stats_line = logs.StatsLine(lambda: bool(self.window), self._stats_fields, config.log_stats_interval_s)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.resolver = MediaResolver(
            cfg.model_name, self.processor, cfg.limits, self.executor, media_session(cfg.limits), audio=self.audio
        )
        self.batcher.start()
        self.stats_line.start()
        self.registrar = Registrar.of(self.config.registration, "encoder", self.config.host, self.config.port)
        self.registrar.start()

    def _stats_fields(self, seconds: float) -> dict[str, object]:
        w, self.window = self.window, Counter()
        fields: dict[str, object] = {"req_per_s": w.pop("requests", 0) / seconds}
        fields.update({f"{how}_items_per_s": n / seconds for how, n in sorted(w.items())})
        fields["queue_depth"] = self.batcher.queue_depth
        fields["ec_held_pct"] = 100 * self.producer.held_bytes / max(1, self.producer.capacity_bytes)
        return fields

    async def close(self) -> None:
        log.info("encoder on http://%s:%d stopping", self.config.host, self.config.port)
        if self.registrar is not None:
            await self.registrar.close()
        await self.stats_line.stop()
        self.tracing.shutdown()
        if self.resolver is not None and self.resolver.session is not None:
            await self.resolver.session.close()
        self.batcher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.put_executor.shutdown(wait=True)
        self.producer.close()
        if self.pixels is not None:
            await self.pixels.close()
        if self.store is not None:
            await self.store.close()

    # ---- metrics ---------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        m, b = self.metrics, self.batcher
        m.gauge("encoder_queue_depth", "media items waiting for a vision forward", lambda: b.queue_depth)
        m.gauge("encoder_cache_bytes", "bytes held by the local embedding cache", lambda: b.cache.nbytes)
        m.gauge("encoder_cache_items", "items held by the local embedding cache", lambda: len(b.cache))
        m.gauge(
            "encoder_coalesced_items",
            "submissions that joined an in-flight forward of the same item",
            lambda: b.coalesced,
        )
        n = len(self.load_report.tensors)
        m.gauge("encoder_weight_tensors_loaded", "checkpoint tensors read at startup (vision tower only)", lambda: n)
        total = self.checkpoint_tensors
        m.gauge("encoder_checkpoint_tensors", "tensors in the checkpoint (all parts)", lambda: total)
        self.forward_seconds = m.histogram("encoder_forward_seconds", "wall time of one batched vision forward")
        self.request_seconds = m.histogram("encode_request_seconds", "wall time of one /v1/encode request")
        self.put_seconds = m.histogram("encoder_put_seconds", "wall time of one EC-connector put")
        self.batch_size = m.histogram(
            "encoder_batch_size", "distinct items per batched vision forward", buckets=(1, 2, 4, 8, 16, 32, 64)
        )
        failures = m.counter("encoder_put_failures_total", "EC-connector puts that failed, by cause", ("cause",))
        for cause in ("full", "error"):
            failures.labels(cause=cause)
        # declared up front so a scrape shows zeros before the first request
        for status in get_args(ItemStatus):
            m.inc("encoder_items_total", 0, {"status": status}, "media items encoded, by how")
            m.inc("encoder_visual_tokens_total", 0, {"status": status}, VISUAL_TOKENS)
        if self.store is not None:
            st = self.store.stats
            for name, text in (
                ("hits", "items found in the shared store"),
                ("misses", "items not in the shared store"),
                ("rejected", "store entries that failed validation"),
                ("writes", "items written to the shared store"),
                ("errors", "store operations that failed or timed out"),
                ("skipped", "store operations skipped after a recent failure"),
                ("waits", "items another encoder was computing"),
                ("takeovers", "claims taken over from an encoder that stopped computing"),
            ):
                m.gauge(f"encoder_store_{name}_total", text, partial(getattr, st, name))
        m.inc("encoder_batches_total", 0, help_text="batched vision forwards run")
        m.inc("encoder_put_bytes_total", 0, help_text="bytes put into the EC connector")
        m.inc("encoder_batch_items_total", 0, help_text="items in batched vision forwards")
        m.inc("encoder_batch_rows_total", 0, help_text="patch rows in batched vision forwards")
        m.inc("encode_requests_total", 0, help_text="/v1/encode requests received")
        m.inc("encoder_pixel_items_total", 0, help_text=PIXEL_ITEMS)
        p = self.producer
        m.gauge("encoder_ec_live_handles", "leases issued and not yet released or expired", lambda: p.live_handles)
        m.gauge("encoder_ec_live_entries", "embedding payloads held for consumers", lambda: p.live_entries)
        m.gauge("encoder_ec_held_bytes", "payload bytes held for consumers", lambda: p.held_bytes)
        m.gauge("encoder_ec_capacity_bytes", "bytes the EC connector can hold", lambda: p.capacity_bytes)

    def _on_batch(self, report: BatchReport) -> None:
        m = self.metrics
        m.inc("encoder_batches_total", help_text="batched vision forwards run")
        m.inc("encoder_batch_items_total", report.items, help_text="items in batched vision forwards")
        m.inc("encoder_batch_rows_total", report.rows, help_text="patch rows in batched vision forwards")
        self.batch_size.observe(report.items)
        if report.error is None:
            self.load.served(report.rows, report.seconds)
        if report.error is not None:
            m.inc("encoder_batch_errors_total", help_text="vision forwards that failed")
        self.forward_seconds.observe(report.seconds)

    # ---- one request -----------------------------------------------------------------------
    async def encode(self, body: bytes) -> EncodeResponse:
        cfg = self.config
        req = decode_request(body, cfg.max_items_per_request)
        if req.model != cfg.model_name:
            raise NotFound.model(req.model)
        outcomes = await asyncio.gather(*(self._item(it) for it in req.items), return_exceptions=True)
        ready: list[_Ready] = []
        for i, out in enumerate(outcomes):
            if isinstance(out, MediaError):
                out = from_media_error(out)
            if isinstance(out, ApiError):  # client errors are about the media the URL (or pixel handle) names
                named = f"items[{i}].{'url' if req.items[i].pixels is None else 'pixels'}"
                raise _with_param(out, named if out.status in (400, 413, 504) else f"items[{i}]")
            if isinstance(out, BaseException):
                raise out
            ready.append(out)
        loop = asyncio.get_running_loop()
        handles = await loop.run_in_executor(self.put_executor, self._put_all, ready, req.leases)
        items: list[EncodedItem] = []
        for r, (handle, *more) in zip(ready, handles, strict=True):
            self.put_seconds.observe(r.timings.put_ms / 1000)
            self.metrics.inc(
                "encoder_put_bytes_total",
                handle_nbytes(handle, r.embeddings),
                help_text="bytes put into the EC connector",
            )
            status = r.status
            self.metrics.inc("encoder_items_total", 1, {"status": status}, "media items encoded, by how")
            self.metrics.inc("encoder_visual_tokens_total", r.embeddings.shape[0], {"status": status}, VISUAL_TOKENS)
            items.append(
                EncodedItem(
                    uuid=r.uuid,
                    modality=r.item.modality,
                    grid_thw=r.grid_thw,
                    num_embeddings=r.embeddings.shape[0],
                    dtype=str(r.embeddings.dtype).removeprefix("torch."),
                    shape=(r.embeddings.shape[0], r.embeddings.shape[1]),
                    ec_handle=handle,
                    more_handles=more,
                    store_handle=self._store_handle(r.stored) if r.stored is not None else None,
                    status=status,
                    timings=r.timings,
                    second_per_grid=r.second_per_grid,
                )
            )
        return EncodeResponse(items=items)

    async def _item(self, item: EncodeItem) -> _Ready:
        resolver = self.resolver
        if resolver is None:
            raise Unavailable("the encoder is starting")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        data: bytes | None = None
        second: float | None = None  # a video's timing, known here for pixels (the router decoded it)
        if item.url is None:  # then it carries pixels (decode_request)
            (uuid, interval), t1 = self._pixel_item(item), t0
            if item.modality == "video":
                second = self.processor.config.video_second_per_grid(interval)
        else:
            data = await load_media_bytes(item.url, self.config.limits, resolver.session)
            t1 = time.perf_counter()
            uuid = await loop.run_in_executor(
                self.executor, media_uuid, resolver.model_id, item.modality, data, resolver.hash_kwargs(item.modality)
            )
        cached = self.batcher.lookup(uuid)
        if cached is not None:
            second = await self._video_timing(item, uuid, data, second)
            timings = ItemTimings(fetch_ms=_ms(t1 - t0), preprocess_ms=_ms(time.perf_counter() - t1))
            stored = await self._ensure_stored(uuid, cached.grid_thw, cached.embeddings)
            return _Ready(item, uuid, cached.grid_thw, cached.embeddings, "cache_hit", timings, stored, second)
        if self.store is None:
            return self._timed(await self._compute(item, uuid, data, t0, t1, second))
        store, cfg = self.store, self.config.ec.store
        got = await fetch_or_claim(store, uuid, cfg.wait_s)
        if isinstance(got, StoredItem):
            self.batcher.remember(uuid, got.grid_thw, got.embeddings)
            self._remember_stored(uuid, got.header)
            second = await self._video_timing(item, uuid, data, second)
            timings = ItemTimings(fetch_ms=_ms(t1 - t0), preprocess_ms=_ms(time.perf_counter() - t1))
            return _Ready(item, uuid, got.grid_thw, got.embeddings, "store_hit", timings, got.header, second)
        async with holding(store, uuid, got, cfg.claim_ttl_s / 3):
            ready = await self._compute(item, uuid, data, t0, t1, second)
            if ready.status == "computed":
                header = await store.put(uuid, ready.grid_thw, ready.embeddings)
                if header is not None:
                    self._remember_stored(uuid, header)
                    ready = ready._replace(stored=header)
        return self._timed(ready)

    async def _ensure_stored(self, uuid: str, grid: Grid, embeddings: torch.Tensor) -> WireHeader | None:
        """The store entry of an item this encoder has cached, written again if the store lost it
        (so a store handle it gives out names an entry that exists)."""
        if self.store is None:
            return None
        header = self._stored.get(uuid)
        if header is not None and await self.store.present(uuid):
            return header
        header = await self.store.put(uuid, grid, embeddings)
        if header is not None:
            self._remember_stored(uuid, header)
        return header

    def _remember_stored(self, uuid: str, header: WireHeader) -> None:
        """Which items have a store entry (bounded: the oldest are forgotten first)."""
        _remember(self._stored, uuid, header)

    def _timed(self, ready: _Ready) -> _Ready:
        """``ready``, its video timing remembered: a cache hit on it need not read its bytes again."""
        if ready.second_per_grid is not None:
            _remember(self._timings, ready.uuid, ready.second_per_grid)
        return ready

    def _store_handle(self, header: WireHeader) -> Handle:
        cfg = self.config.ec
        handle = to_handle(header, STORE_HANDLE)
        return signing.issue(handle, cfg.handle_key, cfg.store.ttl_s, signing.new_lease())

    def _pixel_item(self, item: EncodeItem) -> PixelItem:
        """The uuid and timing a pixel handle names, once it verified and validated."""
        if self.pixels is None:
            raise BadRequest("This encoder has no cluster credential, so it accepts no pixel handle.")
        try:
            named = self.pixels.item(item.pixels, item.modality)
        except TransferError as e:
            raise BadRequest(f"Invalid pixel handle: {e}", code="invalid_pixel_handle") from None
        self.metrics.inc("encoder_pixel_items_total", help_text=PIXEL_ITEMS)
        return named

    async def _video_timing(self, item: EncodeItem, uuid: str, data: bytes | None, known: float | None) -> float | None:
        """A video's seconds per temporal patch when its embeddings were not computed for this
        call: a pixel handle's (``known``), the one remembered when this encoder computed or read it
        (the uuid covers the bytes), else read from the URL's bytes without decoding the frames."""
        if item.modality != "video" or data is None:
            return known
        remembered = self._timings.get(uuid)
        if remembered is not None:
            return remembered
        assert self.resolver is not None
        loop = asyncio.get_running_loop()
        second = await loop.run_in_executor(self.executor, self.resolver.video_second_per_grid, data)
        if second is not None:
            _remember(self._timings, uuid, second)
        return second

    def _preprocess(self, item: EncodeItem, data: bytes | None) -> VisionInput | MediaInput:
        """Decode a URL's bytes, or read a pixel handle's frames (decoded and resized by the
        router), then normalize and patchify (CPU work, runs in the executor)."""
        if data is not None:
            assert self.resolver is not None
            return self.resolver.process_bytes(item.modality, data, audio_format_of(item.url or ""))
        assert self.pixels is not None  # _pixel_uuid checked
        frames = [Image.fromarray(f) for f in self.pixels.read(item.pixels, item.modality)]
        return self.processor.image(frames[0]) if item.modality == "image" else self.processor.video(frames)

    def _timed_preprocess(self, item: EncodeItem, data: bytes | None) -> tuple[VisionInput | MediaInput, float]:
        """``_preprocess`` and the CPU time it took this thread: its cost, not counting waits for
        the pool or for a core shared with other threads."""
        t = time.thread_time()
        media = self._preprocess(item, data)
        return media, time.thread_time() - t

    async def _compute(
        self, item: EncodeItem, uuid: str, data: bytes | None, t0: float, t1: float, second: float | None
    ) -> _Ready:
        """Preprocess and encode one item here (the batcher joins it with concurrent ones);
        ``second``: a pixel handle's video timing (a URL's comes with its preprocessing)."""
        loop = asyncio.get_running_loop()
        try:
            media, cpu_s = await loop.run_in_executor(self.executor, self._timed_preprocess, item, data)
        except TransferError as e:  # the pixel handle's region is gone, or its bytes are corrupt
            raise BadRequest(f"Invalid pixel handle: {e}", code="invalid_pixel_handle") from None
        except ValueError as e:  # e.g. an extreme aspect ratio the resize refuses
            raise BadRequest(f"The {item.modality} could not be preprocessed: {e}") from None
        t2 = time.perf_counter()
        if media.pixel_values is None:  # process_bytes always returns pixels
            raise ApiError("preprocessing produced no pixels")
        self.load.offer(media.pixel_values.shape[0])
        self.preprocess_cpu_s += cpu_s
        self.preprocess_patches += media.pixel_values.shape[0]
        try:
            res = await self.batcher.encode(uuid, media.grid_thw, torch.from_numpy(media.pixel_values))
        except QueueFull as e:
            raise Overloaded(f"The encoder is overloaded: {e}.", retry_after_s=self.config.retry_after_s) from None
        except BatcherClosed as e:
            raise Unavailable(f"The encoder is not accepting work: {e}.") from None
        except EncodeError as e:
            raise ApiError(f"Encoding failed: {e}", code="encode_failed") from None
        timings = ItemTimings(
            fetch_ms=_ms(t1 - t0),
            preprocess_ms=_ms(t2 - t1),
            queue_ms=_ms(res.queue_s),
            encode_ms=_ms(res.encode_s),
        )
        if isinstance(media, MediaInput):
            second = media.second_per_grid
        status: ItemStatus = "cache_hit" if res.cache_hit else "computed"
        return _Ready(item, uuid, media.grid_thw, res.embeddings, status, timings, second_per_grid=second)

    def _put_all(self, ready: list[_Ready], leases: int) -> list[list[Handle]]:
        """Put every item's embeddings (runs on the put thread): ``leases`` handles per item, the
        later ones leases on the payload the first stored."""
        handles: list[list[Handle]] = []
        model_id = self.config.model_name
        for i, r in enumerate(ready):
            t0 = time.perf_counter()
            try:
                handles.append([])
                for _ in range(leases):
                    handles[-1].append(self.producer.put(r.uuid, r.embeddings, model_id, self.feature_levels))
            except ProducerFull as e:
                # consumers hold everything the connector can store: a load signal, not a failure,
                # so the encoder stays healthy and the router spreads or sheds the load
                self._release_all([h for hs in handles for h in hs])
                self.metrics.inc("encoder_put_failures_total", labels={"cause": "full"})
                log.warning("EC connector full: %s", e)
                raise Overloaded(
                    "The encoder's embedding store is full; retry shortly.",
                    param=f"items[{i}]",
                    retry_after_s=self.config.retry_after_s,
                ) from None
            except TransferError as e:
                self._release_all([h for hs in handles for h in hs])
                self.metrics.inc("encoder_put_failures_total", labels={"cause": "error"})
                raise Unavailable(f"The embeddings could not be published: {e}", param=f"items[{i}]") from None
            r.timings.put_ms = _ms(time.perf_counter() - t0)
        return handles

    def _release_all(self, handles: list[Handle]) -> int:
        """Producer-side release of leases this encoder issued (abandoned requests); returns how many
        were live. Handles that do not verify or are not this producer's are ignored."""
        released = 0
        for h in handles:
            try:
                released += bool(self.producer.release(h))
            except TransferError as e:
                log.warning("refused a release: %s", e)
        return released

    async def release(self, body: bytes) -> int:
        req = decode_release(body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.put_executor, self._release_all, req.handles)


def handle_nbytes(handle: Handle, tensor: torch.Tensor) -> int:
    """Bytes a put moved: the handle's ``nbytes`` when it reports one, else the tensor's size."""
    n = handle.get("nbytes")
    return n if isinstance(n, int) else tensor.numel() * tensor.element_size()


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# ---------------------------------------------------------------------------------- handlers


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
            body = await read_body(request, s.config.max_request_bytes)
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
        released = await self.s.release(await request.read())
        self.s.metrics.inc("encoder_released_by_router_total", released, help_text="leases the router gave back")
        return web.json_response({"released": released})

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(id=self.s.config.model_name, created=int(self.s.started))
        return json_response(encode_json(ModelList(data=[card])))

    async def health(self, request: web.Request) -> web.Response:
        if not self.s.batcher.alive:
            raise Unavailable("the vision-forward thread is not running")
        return web.json_response({"status": "ok", "role": "encoder"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.s.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


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
    return role_app(service.config.max_request_bytes, routes, service.start, service.close, service.config.auth)


def serve(config: EncoderConfig) -> None:
    """Run the encoder until SIGINT/SIGTERM."""
    try:
        service = EncoderService(config)
    except MemoryBudgetError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    log.info("epdserve encoder for %s on http://%s:%d", config.model_name, config.host, config.port)
    run_app(build_app(service), config.host, config.port)
