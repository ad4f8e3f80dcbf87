"""The encoder-only instance (the E of EPD): media in, embeddings out through the EC connector.

The service behind the routes (``encoder.app``): ``POST /v1/encode`` (see ``epdserve.encoder.protocol``),
``/v1/release``, ``/v1/load``, ``GET /v1/models``, ``/health``, ``/metrics``. Per item::

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
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from PIL import Image

from epdserve.api import logs
from epdserve.api.errors import (
    ApiError,
    BadRequest,
    NotFound,
    Overloaded,
    Unavailable,
    from_media_error,
)
from epdserve.api.load import EncoderLoad
from epdserve.api.media import Hold, MediaResolver
from epdserve.api.role_app import RoleBasics
from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.common.rates import CostRate
from epdserve.encoder.batcher import BatcherClosed, BatchReport, EncodeBatcher, EncodeError, QueueFull
from epdserve.encoder.config import EncoderConfig
from epdserve.encoder.metrics import PIXEL_ITEMS, VISUAL_TOKENS, declare_metrics
from epdserve.encoder.protocol import (
    EncodedItem,
    EncodeItem,
    EncodeResponse,
    ItemStatus,
    ItemTimings,
    decode_release,
    decode_request,
    ms,
)
from epdserve.encoder.publish import Publisher, handle_nbytes
from epdserve.encoder.room import PromptRoom, Seat
from epdserve.encoder.warmup import warm_up
from epdserve.engine.inputs import MediaInput
from epdserve.engine.memory import plan_encoder
from epdserve.kernels.lending import CoreLender
from epdserve.kernels.ops import kernels_in_use, select_ops
from epdserve.kernels.parallel import threads_for
from epdserve.kernels.resample import load_resampler
from epdserve.media.audio import AudioProcessor, AudioProcessorConfig, audio_format_of
from epdserve.media.budget import run_decode
from epdserve.media.errors import MediaError
from epdserve.media.fetch import load_media_bytes, media_session
from epdserve.media.hashing import media_uuid
from epdserve.media.pending import Pending, PendingFull, PendingMedia, Reservation
from epdserve.media.processor import ProcessorConfig, VisionInput, VisionProcessor
from epdserve.media.workers import media_threads
from epdserve.models.config import ModelConfig
from epdserve.models.loader import checkpoint_files, load_model
from epdserve.models.registry import prompt_layout
from epdserve.store.base import Claim, EmbeddingStore
from epdserve.store.factory import open_store
from epdserve.store.record import STORE_PURPOSE, EntryCheck, Grid, StoredItem
from epdserve.store.single_flight import fetch_or_claim, holding
from epdserve.transfer import signing
from epdserve.transfer.base import ECProducer, Handle, TransferError
from epdserve.transfer.config import STORE_HANDLE
from epdserve.transfer.factory import make_producer, producer_bytes
from epdserve.transfer.header import WireHeader, to_handle
from epdserve.transfer.pixels import PixelItem, PixelReader, processor_digest

log = logging.getLogger(__name__)
T = TypeVar("T")
STORED_REMEMBERED = 65536  # uuids whose store entries this encoder remembers (for store handles on cache hits)


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


class _Prepared(NamedTuple):
    """One item preprocessed and counted in its call's room."""

    media: VisionInput | MediaInput
    pixels: np.ndarray  # its patches (or log-mel frames)
    done: float  # when its preprocessing ended (perf_counter)
    held: Pending  # its bytes among the media waiting for the tower: released once it is encoded


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
            config.model,
            config.dtype,
            config.device,
            config.encode_token_budget,
            config.encoder_cache_bytes,
            config.max_pending_media_bytes,
            config.max_inflight_body_bytes,
            producer_bytes(config.ec),
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
        visual = getattr(model, "visual", None) or getattr(model, "audio", None)
        if not isinstance(visual, torch.nn.Module):
            raise ValueError(f"{config.model}: the model has no media encoder")
        self.threads = config.threads or threads_for(visual)
        torch.set_num_threads(self.threads)
        tower: Any = visual  # a vision tower runs its rotary and activation with these ops (an audio tower has none)
        self.kernels = "torch (the tower has no fused ops)"
        if hasattr(tower, "ops"):
            device = torch.device(config.device)
            tower.ops = select_ops(config.kernels, config.torch_dtype, device)
            self.kernels = kernels_in_use(tower.ops, config.kernels, config.torch_dtype, device)
        self.checkpoint_tensors = len(checkpoint_files(config.model))
        log.info(
            "encoder loaded %d of %d checkpoint tensors (vision tower only) in %.2f s",
            len(self.load_report.tensors),
            self.checkpoint_tensors,
            self.load_report.seconds,
        )
        model_config = self.model_config = ModelConfig.from_pretrained(config.model)
        self.feature_levels = model_config.feature_levels  # written into every EC header it produces
        self.processor = VisionProcessor(ProcessorConfig.from_pretrained(config.model), load_resampler())
        self.audio = AudioProcessor(AudioProcessorConfig.from_pretrained(config.model)) if model_config.audio else None
        self.executor = ThreadPoolExecutor(media_threads(config.preprocess_threads), thread_name_prefix="epd-media")
        # one thread: puts are short copies, kept off the event loop and the forward thread
        self.put_executor = ThreadPoolExecutor(1, thread_name_prefix="epd-ec-put")
        self.producer = producer if producer is not None else make_producer(config.ec)
        basics = (config.otlp_traces_endpoint, self._stats_fields, config.log_stats_interval_s)
        self.role = RoleBasics(
            "epdserve-encoder", *basics, body_bytes=config.max_inflight_body_bytes, prefix="encoder_"
        )
        self.metrics, self.tracing = self.role.metrics, self.role.tracing
        self.role.export_memory(memory.parts())
        self.publisher = Publisher(
            self.producer, config.model_name, self.feature_levels, self.metrics, config.retry_after_s
        )
        self.window = self.role.window  # requests and items since the last stats line
        # on a core board, forwards also run on the cores of the host's idle roles (and yield theirs)
        lends = bool(config.core_board) and threads_for(visual) > 1  # weights large enough to split
        self.lender = CoreLender(config.core_board, self.threads, yields=config.yield_to_decodes) if lends else None
        forward: Any = visual
        if self.lender is not None:
            self.lender.attach(visual)
            forward = self.lender.wrap(visual)
        self.rows_of = prompt_layout(model_config).num_placeholders  # an item's placeholder tokens
        self.batcher = EncodeBatcher(
            forward,
            config.batcher,
            EmbeddingCache(config.encoder_cache_bytes),
            rows_of=self.rows_of,
            device=config.device,
            dtype=config.torch_dtype,
            on_batch=self._on_batch,
        )
        self.batcher.stop_abandoned(visual)
        self.resolver: MediaResolver | None = None
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
                self.rows_of,
                levels=model_config.feature_levels,
            )
            self.store = open_store(config.ec.store, check, lend=True)
        self.load = EncoderLoad()  # the autoscaling signal
        self.pending = PendingMedia(config.max_pending_media_bytes)  # pixels held until encoded
        hist = declare_metrics(
            self.metrics,
            self.batcher,
            self.producer,
            self.store,
            self.load_report,
            self.checkpoint_tensors,
            self.pending,
        )
        self.forward_seconds, self.request_seconds, self.put_seconds, self.batch_size = hist
        self.metrics.gauge(
            "encoder_load_ratio",
            "visual work offered over what the vision forward serves (autoscaling)",
            self.load.ratio,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.resolver = MediaResolver(
            cfg.model_name, self.processor, cfg.limits, self.executor, media_session(cfg.limits), audio=self.audio
        )
        self.batcher.start()
        if cfg.warmup:
            await warm_up(self)
        self.role.start(self.config.registration, "encoder", self.config.host, self.config.port)
        logs.banner(
            log,
            "encoder",
            model=cfg.model_name,
            family=self.model_config.architecture,
            dtype=cfg.dtype,
            device=cfg.device,
            kernels=self.kernels,
            threads=self.threads,
            borrows=logs.lending(self.lender is not None),
            cache_bytes=logs.gib(cfg.encoder_cache_bytes),
            ec_connector=cfg.ec.connector,
            store=cfg.ec.store.url.split(":", 1)[0] or None,  # its kind: the address stays out of logs
            listen=f"http://{cfg.host}:{cfg.port}",
            auth="cluster only",
        )

    def _stats_fields(self, seconds: float) -> dict[str, object]:
        w = self.role.take_window()
        fields: dict[str, object] = {"req_per_s": w.pop("requests", 0) / seconds}
        fields.update({f"{how}_items_per_s": n / seconds for how, n in sorted(w.items())})
        fields["queue_depth"] = self.batcher.queue_depth
        fields["ec_held_pct"] = 100 * self.producer.held_bytes / max(1, self.producer.capacity_bytes)
        return fields

    async def close(self) -> None:
        log.info("encoder on http://%s:%d stopping", self.config.host, self.config.port)
        await self.role.close()
        if self.resolver is not None and self.resolver.session is not None:
            await self.resolver.session.close()
        self.batcher.close()
        if self.lender is not None:
            self.lender.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.put_executor.shutdown(wait=True)
        self.producer.close()
        if self.pixels is not None:
            await self.pixels.close()
        if self.store is not None:
            await self.store.close()

    # ---- metrics ---------------------------------------------------------------------------
    def _on_batch(self, report: BatchReport) -> None:
        m = self.metrics
        m.inc("encoder_batches_total", help_text="batched vision forwards run")
        m.inc("encoder_batch_items_total", report.items, help_text="items in batched vision forwards")
        m.inc("encoder_batch_rows_total", report.rows, help_text="patch rows in batched vision forwards")
        self.batch_size.observe(report.items)
        aside = self.lender.take_yielded() if self.lender is not None else 0.0  # paused, its cores lent
        m.inc("encoder_yielded_seconds_total", aside, help_text="seconds forwards paused for steps holding decodes")
        seconds = max(report.seconds - aside, 1e-6)  # what the forward computed for
        if report.error is None:
            self.load.served(report.rows, seconds)
        else:
            m.inc("encoder_batch_errors_total", help_text="vision forwards that failed")
        self.forward_seconds.observe(seconds)

    # ---- one request -----------------------------------------------------------------------
    async def encode(self, body: bytes) -> EncodeResponse:
        cfg = self.config
        req = decode_request(body, cfg.max_items_per_request)
        if req.model != cfg.model_name:
            raise NotFound.model(req.model)
        room = PromptRoom(req.context, len(req.items))
        outcomes = await asyncio.gather(*(self._seated(it, room.seat()) for it in req.items), return_exceptions=True)
        if room.refusal is not None:  # none of them was encoded
            raise room.refusal
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
        handles = await self._put(ready, req.leases)
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

    async def _put(self, ready: list[_Ready], leases: int) -> list[list[Handle]]:
        """The call's embeddings put on the put thread; if the caller leaves meanwhile, the leases
        the put issues go back as soon as it is done (nobody will read them)."""
        loop = asyncio.get_running_loop()
        putting = loop.run_in_executor(self.put_executor, self.publisher.put_all, ready, leases)
        try:
            return await asyncio.shield(putting)
        except asyncio.CancelledError:

            def give_back(f: asyncio.Future[list[list[Handle]]]) -> None:
                if not f.cancelled() and f.exception() is None:
                    handles = [h for hs in f.result() for h in hs]
                    loop.run_in_executor(self.put_executor, self.publisher.release_all, handles)

            putting.add_done_callback(give_back)
            raise

    async def _seated(self, item: EncodeItem, seat: Seat) -> _Ready:
        try:
            return await self._item(item, seat)
        finally:
            seat.leave()  # counted already, unless it failed before its tokens were known

    async def _item(self, item: EncodeItem, seat: Seat) -> _Ready:
        """One item, counted in its call's room (``seat``) before it is encoded."""
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
            await seat.admit(cached.embeddings.shape[0])
            second = await self._video_timing(item, uuid, data, second)
            timings = ItemTimings(fetch_ms=ms(t1 - t0), preprocess_ms=ms(time.perf_counter() - t1))
            stored = await self._ensure_stored(uuid, cached.grid_thw, cached.embeddings)
            return _Ready(item, uuid, cached.grid_thw, cached.embeddings, "cache_hit", timings, stored, second)
        if self.store is None:
            alone = await self._prepare(item, data, seat)
            with alone.held:
                return self._timed(await self._compute(item, uuid, alone, t0, t1, second))
        store, cfg = self.store, self.config.ec.store
        got: StoredItem | Claim | None = await store.get(uuid)
        prepared: _Prepared | None = None
        try:
            if got is None:
                # counted before it is claimed: no claim is held while the call's other items are
                # counted (they may wait for claims other encoders hold)
                prepared = await self._prepare(item, data, seat)
                got = await fetch_or_claim(store, uuid, cfg.wait_s, missed=True)
            if isinstance(got, StoredItem):
                await seat.admit(got.embeddings.shape[0])
                self.batcher.remember(uuid, got.grid_thw, got.embeddings)
                self._remember_stored(uuid, got.header)
                second = await self._video_timing(item, uuid, data, second)
                timings = ItemTimings(fetch_ms=ms(t1 - t0), preprocess_ms=ms(time.perf_counter() - t1))
                return _Ready(item, uuid, got.grid_thw, got.embeddings, "store_hit", timings, got.header, second)
            assert prepared is not None  # a claim follows a miss
            async with holding(store, uuid, got, cfg.claim_ttl_s / 3):
                ready = await self._compute(item, uuid, prepared, t0, t1, second)
                if ready.status == "computed":
                    header = await store.put(uuid, ready.grid_thw, ready.embeddings)
                    if header is not None:
                        self._remember_stored(uuid, header)
                        ready = ready._replace(stored=header)
            return self._timed(ready)
        finally:
            if prepared is not None:
                prepared.held.release()

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

    def _preprocess(
        self, item: EncodeItem, data: bytes | None, hold: Hold | None = None, cancelled: threading.Event | None = None
    ) -> VisionInput | MediaInput:
        """Decode a URL's bytes (under the item's decode budget; ``cancelled`` is set when the
        request is abandoned; ``hold`` takes what it will hold before its pixels are decoded), or
        read a pixel handle's frames (decoded and resized by the router), then normalize and
        patchify (CPU work, runs in the executor)."""
        if data is not None:
            assert self.resolver is not None
            return self.resolver.process_bytes(item.modality, data, audio_format_of(item.url or ""), cancelled, hold)
        assert self.pixels is not None  # _pixel_uuid checked
        frames = [Image.fromarray(f) for f in self.pixels.read(item.pixels, item.modality)]
        if hold is not None and frames:  # decoded already: counted before they are made into patches
            hold(self.processor.footprint(item.modality, len(frames), frames[0].width, frames[0].height))
        return self.processor.image(frames[0]) if item.modality == "image" else self.processor.video(frames)

    def _timed_preprocess(
        self, item: EncodeItem, data: bytes | None, hold: Hold, cancelled: threading.Event
    ) -> tuple[VisionInput | MediaInput, float]:
        """``_preprocess`` and the CPU time it took this thread: its cost, not counting waits for
        the pool or for a core shared with other threads."""
        t = time.thread_time()
        media = self._preprocess(item, data, hold, cancelled)
        return media, time.thread_time() - t

    async def _prepare(self, item: EncodeItem, data: bytes | None, seat: Seat) -> _Prepared:
        """Preprocess one item within the bound of pending media (counted from before its pixels
        are decoded, or a pixel handle's made into patches), then count it in its call's room
        (``seat``): the call's items go on to the vision tower only together, within the room."""
        reservation = Reservation(self.pending)
        try:
            media, cpu_s = await run_decode(
                self.executor, partial(self._timed_preprocess, item, data, reservation.take)
            )
            held = reservation.settle(media.pixel_values.nbytes if media.pixel_values is not None else 0)
        except TransferError as e:  # the pixel handle's region is gone, or its bytes are corrupt
            raise BadRequest(f"Invalid pixel handle: {e}", code="invalid_pixel_handle") from None
        except ValueError as e:  # e.g. an extreme aspect ratio the resize refuses
            raise BadRequest(f"The {item.modality} could not be preprocessed: {e}") from None
        except PendingFull as e:
            raise Overloaded(f"The encoder is overloaded: {e}.", retry_after_s=self.config.retry_after_s) from None
        finally:
            reservation.close()  # what a failed or abandoned item took; nothing once settled
        done = time.perf_counter()
        if media.pixel_values is None:  # process_bytes always returns pixels
            held.release()
            raise ApiError("preprocessing produced no pixels")
        self.preprocess_cpu_s += cpu_s
        self.preprocess_patches += media.pixel_values.shape[0]
        try:
            await seat.admit(self.rows_of(media.grid_thw))
        except BaseException:
            held.release()
            raise
        return _Prepared(media, media.pixel_values, done, held)

    async def _compute(
        self, item: EncodeItem, uuid: str, prepared: _Prepared, t0: float, t1: float, second: float | None
    ) -> _Ready:
        """Encode one preprocessed item here (the batcher joins it with concurrent ones);
        ``second``: a pixel handle's video timing (a URL's comes with its preprocessing)."""
        media, pixels = prepared.media, prepared.pixels
        self.load.offer(pixels.shape[0])
        try:
            res = await self.batcher.encode(uuid, media.grid_thw, torch.from_numpy(pixels))
        except QueueFull as e:
            raise Overloaded(f"The encoder is overloaded: {e}.", retry_after_s=self.config.retry_after_s) from None
        except BatcherClosed as e:
            raise Unavailable(f"The encoder is not accepting work: {e}.") from None
        except EncodeError as e:
            raise ApiError(f"Encoding failed: {e}", code="encode_failed") from None
        timings = ItemTimings(
            fetch_ms=ms(t1 - t0),
            preprocess_ms=ms(prepared.done - t1),
            queue_ms=ms(res.queue_s),
            encode_ms=ms(res.encode_s),
        )
        if isinstance(media, MediaInput):
            second = media.second_per_grid
        status: ItemStatus = "cache_hit" if res.cache_hit else "computed"
        return _Ready(item, uuid, media.grid_thw, res.embeddings, status, timings, second_per_grid=second)

    async def release(self, body: bytes) -> int:
        req = decode_release(body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.put_executor, self.publisher.release_all, req.handles)
