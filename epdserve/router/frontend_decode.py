"""Frontend media decoding (``--frontend-decode``): the router fetches, hashes, decodes and
resizes media items in a bounded pool of its own, and the encoders get the frames through the
router's shm slab (``transfer.pixels``), so their time goes to the vision tower::

    encode path (one call's items)                     decode pool (threads)
    ───────────────────────────────                    ─────────────────────────────────────
    http(s): fetch (event loop, fetch.py's rules) ───→ data: base64 → uuid (the encoder's hash)
    data:  ─────────────────────────────────────────→  → decode → resize → slab → pixel handle
                                                          │
    pool full, slab full, odd size: the item goes ←───────┘ (as before: the encoder decodes it)
    by URL

Threads, not processes: Pillow's decoders and resampling and hashlib's sha256 release the GIL for
their work, so the threads run in parallel with each other and with the event loop, and they write
into the slab with no pickling of bytes or pixels between processes. The pool is bounded: beyond
``workers + max_queued`` items in it, an item goes to the encoder as a URL (load shedding, not an
error), as does one the slab cannot hold until leases come back. Media the encoder would refuse
(fetch rules, size and pixel limits) is refused here with the same status.

Items keep the identity an encoder would give them: the uuid is ``media.hashing``'s over the raw
bytes with the processor settings of the model directory the encoders load (``--model``), and the
frames are the ones ``VisionProcessor`` would normalize, so answers are the same with the flag on
or off. The router holds each pixel lease until the encode call that carried it is over
(``release``); the lease TTL and the slab's removal at exit cover the rest.

Torch-free, as the whole router.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from epdserve.api.errors import from_media_error
from epdserve.api.metrics import Metrics
from epdserve.kernels.resample import load_resampler
from epdserve.media.budget import DecodeBudget
from epdserve.media.decode import decode_image, decode_video
from epdserve.media.errors import MediaError
from epdserve.media.fetch import decode_data_url, load_media_bytes, media_session
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.router.refs import MediaRef
from epdserve.security.credentials import ClusterCredential
from epdserve.transfer.base import Handle, ProducerFull, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.pixels import PixelProducer, processor_digest

log = logging.getLogger(__name__)
OUTCOMES = ("pixels", "busy", "full", "unsized")  # how an item left the decode path (metric label)


@dataclass(frozen=True)
class FrontendDecodeConfig:
    """The router's own media decoding."""

    enabled: bool = False  # fetch and decode media here; encoders get pixels by shm
    workers: int = 2  # threads decoding media (Pillow and sha256 release the GIL)
    max_queued: int = 64  # items waiting for a thread; more go to encoders as URLs
    shm_bytes: int = 0  # bytes of the pixel slab (0 = auto from the free space of /dev/shm)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_queued < 0:
            raise ValueError("frontend decode needs workers >= 1 and max_queued >= 0")
        if self.shm_bytes != 0 and self.shm_bytes < 1 << 20:
            raise ValueError("the pixel slab needs at least 1 MiB (or 0 for automatic)")


class FrontendDecoder:
    """The decode pool, the pixel slab's producer, and their metrics."""

    def __init__(
        self,
        config: FrontendDecodeConfig,
        model_dir: Path,
        limits: MediaLimits,
        cluster: ClusterCredential,
        instance: str,
        lease_ttl_s: float,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.limits = limits
        processor = ProcessorConfig.from_pretrained(model_dir)
        self.processor = VisionProcessor(processor, load_resampler())
        self.hash_kwargs = processor.hash_kwargs(limits.video_frames)
        ec = ECConfig(shm_bytes=config.shm_bytes, secret=cluster.secret.decode(), ttl_s=lease_ttl_s, instance=instance)
        self.producer = PixelProducer(ec)
        self.pool = ThreadPoolExecutor(config.workers, thread_name_prefix="epd-frontend-decode")
        self.session: aiohttp.ClientSession | None = None
        self.in_pool = 0  # items handed to the pool and not back (event loop only)
        self._waiting = 0  # of those, not started by a thread yet
        self._lock = threading.Lock()
        m = self.metrics = metrics
        outcomes = m.counter("router_frontend_decode_items_total", "media items by how frontend decode sent them: "
                             "pixels, or as URLs (busy: pool full; full: slab full; unsized)", ("outcome",))  # fmt: skip
        for outcome in OUTCOMES:
            outcomes.labels(outcome=outcome)
        m.gauge("router_frontend_decode_queue_depth", "media items waiting for a decode thread", lambda: self._waiting)
        m.gauge("router_frontend_decode_slab_bytes", "pixel bytes held for encoders", lambda: self.producer.held_bytes)
        self.wait_hist = m.histogram("router_frontend_decode_wait_seconds", "time an item waited for a decode thread")
        self.decode_hist = m.histogram(
            "router_frontend_decode_seconds", "time a decode thread spent on an item (hash, decode, resize, copy)"
        )
        log.info(
            "frontend decode: %d threads, pixel slab %s (%d bytes)",
            config.workers,
            self.producer.path,
            self.producer.capacity_bytes,
        )

    async def start(self) -> None:
        self.session = media_session(self.limits)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.pool.shutdown(wait=True, cancel_futures=True)  # no thread may write into a closed slab
        self.producer.close()

    async def prepare(self, model: str, refs: list[MediaRef]) -> None:
        """Decode what it can of ``refs`` into the slab (``ref.pixels``, ``ref.decode_s``); the
        others stay URLs. Raises the media error (as an API error) of the first bad item, once
        every item is done (so no lease is taken after the caller gave them back)."""
        todo = [r for r in refs if r.pixels is None and r.modality != "audio"]  # audio: the encoder decodes it
        outcomes = await asyncio.gather(*(self._one(model, r) for r in todo), return_exceptions=True)
        for out in outcomes:
            if isinstance(out, BaseException):
                raise out

    async def _one(self, model: str, r: MediaRef) -> None:
        if self.in_pool >= self.config.workers + self.config.max_queued:
            self._count("busy")
            return
        t0 = time.perf_counter()
        self.in_pool += 1
        try:
            data = None
            if r.url[:5].lower() != "data:":  # base64 of data: URLs is decoded by the threads
                data = await load_media_bytes(r.url, self.limits, self.session)
            with self._lock:
                self._waiting += 1
            cancelled = threading.Event()
            decoding = asyncio.get_running_loop().run_in_executor(
                self.pool, self._decode, model, r.modality, r.url, data, time.perf_counter(), cancelled
            )
            try:
                handle = await asyncio.shield(decoding)
            except asyncio.CancelledError:
                # the decode stops at its next budget check; a lease it took is given back when it is done
                cancelled.set()
                decoding.add_done_callback(self._drop)
                raise
        except MediaError as e:
            raise from_media_error(e) from None
        except ProducerFull as e:
            log.warning("pixel slab full, the encoder decodes this item: %s", e)
            self._count("full")
            return
        finally:
            self.in_pool -= 1
        r.decode_s = time.perf_counter() - t0
        r.pixels = handle
        self._count("pixels" if handle is not None else "unsized")

    def _decode(
        self,
        model: str,
        modality: str,
        url: str,
        data: bytes | None,
        queued_at: float,
        cancelled: threading.Event | None = None,
    ) -> Handle | None:
        """One item (runs on a decode thread): its pixel handle, or None when its frames would be
        resized again by the encoder (extreme aspect ratios; an exact answer needs the URL)."""
        t0 = time.perf_counter()
        with self._lock:
            self._waiting -= 1
        self.wait_hist.observe(t0 - queued_at)
        try:
            if data is None:
                data = decode_data_url(url, self.limits)
            uuid = media_uuid(model, modality, data, self.hash_kwargs)
            p = self.processor
            budget = DecodeBudget(self.limits, cancelled)
            interval = None  # a video's timing travels in the handle: the encoder reports it
            try:
                if modality == "image":
                    frames = [p.resized_image(decode_image(data, self.limits, budget))]
                else:
                    video = decode_video(data, self.limits, budget)
                    frames, interval = p.resized_video(video.frames), video.interval_s
            except ValueError:  # a size the resize refuses: the encoder gives the client its error
                return None
            sizes = {f.size for f in frames}
            (w, h), *others = sizes
            if others or not p.is_resized(h, w, modality):
                return None
            pixels = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])
            digest = processor_digest(model, self.hash_kwargs)
            return self.producer.put(uuid, model, modality, digest, pixels, interval)
        finally:
            self.decode_hist.observe(time.perf_counter() - t0)

    def _drop(self, decoding: asyncio.Future[Handle | None]) -> None:
        if not decoding.cancelled() and decoding.exception() is None and (handle := decoding.result()) is not None:
            self.producer.release(handle)

    def release(self, refs: list[MediaRef]) -> None:
        """Give back the pixel leases of ``refs`` (their encode calls are over)."""
        for r in refs:
            handle, r.pixels = r.pixels, None
            if handle is not None:
                try:
                    self.producer.release(handle)
                except TransferError as e:  # closed at shutdown: the slab goes with it
                    log.debug("pixel lease not released: %s", e)

    def _count(self, outcome: str) -> None:
        self.metrics.inc("router_frontend_decode_items_total", labels={"outcome": outcome})
