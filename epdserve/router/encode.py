"""Media to encoders: which encoder encodes which item (the pool's policy, one call per encoder
and group, failed groups retried elsewhere), the media directory (items the shared store holds
need no encode; one encode per content at a time), and the leases the encoders hand out, given
back at once when no worker will read them (``/v1/release``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec

from epdserve.api.errors import Overloaded, Timeout, Unavailable, WorkerFailed
from epdserve.api.logs import REQUEST_ID_HEADER
from epdserve.api.protocol import SamplingRequest
from epdserve.api.quota import requested_max_tokens
from epdserve.api.tracing import Tracing
from epdserve.assets import default_model_dir
from epdserve.encoder.protocol import (
    Context,
    EncodedItem,
    EncodeItem,
    EncodeRequest,
    EncoderProtocolError,
    ReleaseRequest,
    decode_response,
    encode_release,
    encode_request,
)
from epdserve.media.processor import ProcessorConfig
from epdserve.router.config import RouterConfig
from epdserve.router.directory import MediaDirectory, content_key
from epdserve.router.dispatch import DispatchModel
from epdserve.router.frontend_decode import FrontendDecoder
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pool import NoWorker, Worker
from epdserve.router.refs import MediaRef
from epdserve.router.upstream import about_media, passthrough_error
from epdserve.router.workers import FAST_PROBE_S, WorkerPools

log = logging.getLogger(__name__)


class _Outcome(Enum):
    OK = "ok"
    FAILED = "failed"  # the encoder is broken: mark it and retry elsewhere
    BUSY = "busy"  # the encoder is saturated (429): retry elsewhere, keep it healthy
    ERROR = "error"  # the encoder answered with a server error: retry elsewhere; its health probe judges it


class Encodes:
    """Encodes for the router's requests, and the leases they hold."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, workers: WorkerPools, tracing: Tracing) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.tracing = tracing
        self._releases: set[asyncio.Task] = set()
        self._store_seen = False  # an encoder has handed out a store handle: store hits are possible
        self.directory = MediaDirectory(config.directory_entries)
        m = metrics.registry
        self.frontend: FrontendDecoder | None = None
        if config.frontend.enabled:  # its slab outlives any lease by the TTL: 2 encode timeouts
            assert config.auth.cluster is not None  # checked by RouterConfig
            model_dir = Path(config.model) if config.model else default_model_dir()
            self.frontend = FrontendDecoder(config.frontend, model_dir, config.limits, config.auth.cluster,
                                            f"router-{config.port}", 2 * config.encode_timeout_s, m)  # fmt: skip
        # adaptive dispatch's cost model: learnt from the encodes here, asked by the placement
        self.dispatcher: DispatchModel | None = None
        if config.dispatch == "adaptive":
            model_dir = Path(config.model) if config.model else default_model_dir()
            processor = ProcessorConfig.from_pretrained(model_dir)
            self.dispatcher = dispatcher = DispatchModel(processor, config.dispatch_interference)
            m.counts(
                "router_dispatch_cost_seconds",
                "adaptive dispatch's learnt costs: preprocess and forward per patch on encoders, hop per encode call",
                "term",
                dispatcher.costs,
                monotonic=False,
            )
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

    async def start(self) -> None:
        if self.frontend is not None:
            await self.frontend.start()

    async def drain(self) -> None:
        """Wait (a while) for the background work still running, such as lease releases."""
        if self._releases:
            await asyncio.wait(self._releases, timeout=5)

    async def close(self) -> None:
        if self.frontend is not None:
            await self.frontend.close()

    async def encode(
        self, model: str, refs: list[MediaRef], leases: int = 1, rid: str = "", context: Context | None = None
    ) -> None:
        """Fill ``ref.result`` for every ref (``leases`` handles per item: 2 when a decode instance
        gets its own): from the media directory where it covers the item, else by encoders, one
        encode per item at a time across concurrent requests (``directory``). ``rid``: the
        request's id, for the encoders' access lines; ``context``: the prompt's room, which the
        encoders count the items against before they encode any (``context_of``)."""
        todo = list(refs)
        self.directory_keys(todo)
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
                    await self._encode_refs(model, lead, leases, rid, context)
            finally:
                for r in lead:
                    if r.result is not None and r.result.store_handle is not None:
                        self._store_seen = True
                    self.directory_keys([r])
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

    async def _encode_refs(
        self, model: str, refs: list[MediaRef], leases: int, rid: str = "", context: Context | None = None
    ) -> None:
        """Fill ``ref.result`` for every ref by encoders (with ``--frontend-decode``, items the
        router decoded itself go as pixel handles, given back once every call is over)."""
        try:
            if self.frontend is not None:  # pixel handles instead of URLs where it can
                await self.frontend.prepare(model, refs)
            await self._encode_groups(model, refs, leases, rid, context)
        finally:
            if self.frontend is not None:  # every call that carried them is over
                self.frontend.release(refs)

    async def _await_encoder(self) -> bool:
        """With no encoder healthy (all starting or restarting), wait up to ``encoder_wait_s`` for
        one, rather than refuse media a moment before an encoder is back: whether one is."""
        deadline = time.monotonic() + self.config.encoder_wait_s
        while not self.workers.encoders.healthy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(FAST_PROBE_S)
        return True

    async def _encode_groups(
        self, model: str, refs: list[MediaRef], leases: int, rid: str, context: Context | None
    ) -> None:
        """Items grouped per encoder, one call per group, failed groups retried elsewhere."""
        pending = list(refs)
        tried: set[str] = set()
        busy = errors = False
        while pending:
            try:
                groups: dict[str, tuple[Worker, list[MediaRef]]] = {}
                for r in pending:
                    w = self.workers.encoders.pick(exclude=tried, key=r.url)
                    groups.setdefault(w.url, (w, []))[1].append(r)
            except NoWorker:
                if busy:
                    self.metrics.overloaded.inc()
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
            results = await asyncio.gather(*(self._encode_on(model, w, rs, leases, rid, context) for w, rs in calls))
            pending = []
            for (w, rs), outcome in zip(calls, results, strict=True):
                if outcome is not _Outcome.OK:
                    tried.add(w.url)
                    busy |= outcome is _Outcome.BUSY
                    errors |= outcome is _Outcome.ERROR
                    self.metrics.encoder_retries.inc()
                    pending += rs

    async def _encode_on(
        self, model: str, w: Worker, refs: list[MediaRef], leases: int, rid: str, context: Context | None
    ) -> _Outcome:
        items = [EncodeItem(r.modality, None if r.pixels else r.url, r.pixels) for r in refs]  # type: ignore[arg-type]
        body = encode_request(EncodeRequest(model=model, items=items, leases=leases, context=context))
        patches = sum(r.patches for r in refs)
        w.outstanding += 1
        w.patches += patches
        t0 = time.perf_counter()
        try:
            encoding = {"epd.encoder": w.url, "epd.items": len(refs)}
            with self.tracing.client_span("POST /v1/encode", **encoding) as trace:
                headers = {REQUEST_ID_HEADER: rid, **trace} if rid else trace
                status, raw = await self.workers.call(w.url + "/v1/encode", body, self.config.encode_timeout_s, headers)
        except TimeoutError:
            raise Timeout("An encoder did not answer in time.") from None
        except OSError:
            self.workers.encoders.mark_failed(w)
            return _Outcome.FAILED
        finally:
            w.outstanding -= 1
            w.patches -= patches
        if status == 429:
            return _Outcome.BUSY
        if status in (401, 403):  # a worker that does not know our credential is misconfigured
            log.error("encoder %s refused the cluster credential", w.url)
            self.workers.encoders.mark_failed(w)
            return _Outcome.FAILED
        if 400 <= status < 500 or about_media(raw):  # the media itself is bad: the client's error
            raise passthrough_error(status, raw)
        if status != 200:
            # it answered, so it is up: one request's failure does not mark it unhealthy
            log.warning("encoder %s answered HTTP %d", w.url, status)
            return _Outcome.ERROR
        try:
            out = decode_response(raw)
        except EncoderProtocolError as e:  # another version, or not an encoder: its leases expire by TTL
            log.warning("encoder %s answered what is not an encode response: %s", w.url, e)
            return _Outcome.ERROR
        if self.dispatcher is not None:
            self.dispatcher.observe(out.items, time.perf_counter() - t0)
        if len(out.items) != len(refs) or any(len(item.more_handles) != leases - 1 for item in out.items):
            self.release({w.url: [h for item in out.items for h in (item.ec_handle, *item.more_handles)]})
            raise WorkerFailed("An encoder returned a different number of items or leases than requested.")
        for r, item in zip(refs, out.items, strict=True):
            r.result, r.encoder = item, w.url
        return _Outcome.OK

    async def encode_for(self, req: SamplingRequest, refs: list[MediaRef], leases: int = 1, rid: str = "") -> None:
        """``encode`` for ``req``'s media (its model, against its prompt's room). If the client
        leaves meanwhile, its calls to encoders are closed (an encoder drops the items they still
        queue, and gives back the leases of a put it was making), and the leases of the calls that
        were answered go back once the encode has wound down, not after their TTL."""
        task = asyncio.ensure_future(self.encode(req.model, refs, leases, rid, self.context_of(req)))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:

            def release(t: asyncio.Future) -> None:
                if not t.cancelled():
                    t.exception()  # retrieved: the client is gone, nobody else will read it
                self.release(self.take_leases(refs))

            task.add_done_callback(release)
            task.cancel()  # nobody will read it: the encoders' queues are not spent on it
            raise

    def context_of(self, req: SamplingRequest) -> Context | None:
        """The room of ``req``'s prompt: the workers' context length less the completion it asks
        for (None while the context length is not known)."""
        limit = self.workers.context_len()
        if limit is None or limit < 1:
            return None
        return Context(max_model_len=limit, completion_tokens=requested_max_tokens(req) or 0)

    def take_leases(self, refs: list[MediaRef]) -> dict[str, list[dict]]:
        """The leases the refs hold, per encoder; the refs forget them."""
        leases: dict[str, list[dict]] = {}
        for r in refs:
            if r.result is not None and not r.from_directory and r.encoder:  # a directory hit holds no lease
                leases.setdefault(r.encoder, []).extend((r.result.ec_handle, *r.result.more_handles))
            r.result, r.skipped, r.raw = None, False, False
        return leases

    def release(self, leases: dict[str, list[dict]]) -> None:
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
        body = encode_release(ReleaseRequest(handles=handles))
        if await self.workers.release(url + "/v1/release", body, f"release {len(handles)} leases"):
            self.metrics.leases_released.inc(len(handles))

    def known(self, r: MediaRef) -> EncodedItem | None:
        return self.directory.known(r.directory_key) if r.directory_key is not None else None

    def directory_keys(self, refs: list[MediaRef]) -> None:
        """Key the refs in the directory, once it can help: encoders hand out store handles, or
        the router names KV blocks (content is not hashed otherwise)."""
        use = self.directory.max_entries > 0 and (self._store_seen or self.workers.kv_index is not None)
        for r in refs:
            if r.directory_key is None and use:
                r.directory_key = content_key(r.modality, r.url)
