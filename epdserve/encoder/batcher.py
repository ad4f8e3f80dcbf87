"""Batching vision forwards across concurrent requests, with an embedding cache and coalescing.

The event loop submits preprocessed items; ONE worker thread owns the vision tower and runs::

    queue (FIFO of jobs, one per distinct uuid in flight)
      └─ take the oldest job, then the next ones while their patch rows fit the token budget
         and the forward's time, at the rate timed so far, fits ``forward_s`` (a single job
         larger than either runs alone: a large tower answers a burst's requests in turn)
          └─ one ``visual(pixels, grids)`` call → split per job → cache → resolve every waiter

Invariants, kept under ``_lock``:

* a uuid is in ``_inflight`` from submission until its result is in the cache and its waiters
  are resolved, so a second submission of the same uuid waits on the first job (one forward);
* a uuid is never both in the cache and in ``_inflight`` when the lock is free.

A forward that raises fails exactly the jobs of that batch (with ``EncodeError``); the worker
keeps serving the queue. A forward whose every caller has left stops before the tower's next layer
(``stop_abandoned``) and keeps nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.cache.pages import in_own_pages
from epdserve.common.rates import CostRate

log = logging.getLogger(__name__)

VisionForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Grid = tuple[int, int, int]


class EncodeError(RuntimeError):
    """The vision forward of the batch an item ran in failed (a server-side failure)."""


class BatcherClosed(RuntimeError):
    """The batcher is shut down and accepts no more work."""


class QueueFull(RuntimeError):
    """More items are queued than the batcher accepts; the caller should retry later."""


class Abandoned(RuntimeError):
    """Every caller of the running batch has left: its forward stops before its next layer."""


@dataclass(frozen=True)
class BatcherConfig:
    """How the worker forms batches."""

    token_budget: int = 8192  # most patch rows (sum of t*h*w) per vision forward; larger items run alone
    max_wait_ms: float = 0.0  # after the first item arrives, wait this long for more before running
    forward_s: float = 0.5  # most seconds of one forward at the rate timed so far (0: no bound)
    max_queued_items: int = 1024  # queued (not yet running) items beyond which submissions are refused

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"BatcherConfig.token_budget must be >= 1, got {self.token_budget}")
        if self.max_wait_ms < 0 or self.forward_s < 0:
            raise ValueError(
                f"BatcherConfig.max_wait_ms and forward_s must be >= 0, got {self.max_wait_ms}, {self.forward_s}"
            )
        if self.max_queued_items < 1:
            raise ValueError(f"BatcherConfig.max_queued_items must be >= 1, got {self.max_queued_items}")


class Cached(NamedTuple):
    """An embedding the cache already holds."""

    embeddings: torch.Tensor  # [num_embeddings, width], CPU
    grid_thw: Grid


class EncodeResult(NamedTuple):
    """The embeddings of one item and how they were obtained."""

    embeddings: torch.Tensor  # [num_embeddings, width], CPU
    cache_hit: bool  # True: no forward ran for this submission
    queue_s: float  # submission → start of the forward that computed it
    encode_s: float  # wall time of that forward (shared by its batch)


class BatchReport(NamedTuple):
    """One finished forward, reported on the event loop (for metrics)."""

    items: int  # distinct items in the batch
    rows: int  # patch rows in the batch
    seconds: float  # forward wall time
    error: str | None  # None on success


@dataclass
class _Job:
    uuid: str
    grid_thw: Grid
    pixel_values: torch.Tensor  # [t*h*w, patch_dim]
    submitted: float
    waiters: list[asyncio.Future[EncodeResult]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def abandoned(self) -> bool:
        return all(f.done() for f in self.waiters)


class EncodeBatcher:
    """Asyncio-facing queue in front of one vision-forward worker thread.

    ``visual`` is called only from the worker thread; it maps an item to ``rows_of(grid)``
    embeddings (the model's ``PromptLayout.num_placeholders``). ``device``/``dtype`` are where and how the pixels go in.
    Embeddings come back (and are cached) on the CPU in the tower's output dtype.
    """

    def __init__(
        self,
        visual: VisionForward,
        config: BatcherConfig,
        cache: EmbeddingCache,
        rows_of: Callable[[tuple[int, int, int]], int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        on_batch: Callable[[BatchReport], None] | None = None,
    ) -> None:
        self.visual = visual
        self.config = config
        self.cache = cache
        self.device = torch.device(device)
        self.dtype = dtype
        self.on_batch = on_batch
        self._rows_of = rows_of
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._inflight: dict[str, _Job] = {}
        # grids of cached uuids, so a cache hit needs no preprocessing; pruned against the cache
        self._grids: OrderedDict[str, Grid] = OrderedDict()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="epd-encoder-forward", daemon=True)
        self.batches = 0  # forwards run (worker thread writes, others read)
        self.abandoned = 0  # of them, stopped part-way: every caller had left
        self._running: list[_Job] = []  # the batch in the tower (worker thread)
        self.row_rate = CostRate()  # seconds per patch row of the recent forwards (0: none timed yet; worker thread)
        self.coalesced = 0  # submissions that joined an in-flight job of the same uuid

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker; call from the event loop that will await ``encode``."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after the running batch; queued jobs fail with ``BatcherClosed``."""
        with self._lock:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            for job in dropped:
                self._inflight.pop(job.uuid, None)
            self._wake.notify_all()
        for job in dropped:
            self._resolve(job, BatcherClosed("the encoder is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def stop_abandoned(self, tower: torch.nn.Module) -> None:
        """Before each layer of ``tower`` (every element of its module lists), stop the forward of
        a batch whose callers have all left: a large image nobody waits for no longer holds the
        tower for the rest of its forward."""
        for m in tower.modules():
            if isinstance(m, torch.nn.ModuleList):
                for layer in m:
                    layer.register_forward_pre_hook(self._still_wanted)

    def _still_wanted(self, module: torch.nn.Module, args: object) -> None:
        batch = self._running
        if batch and all(job.abandoned() for job in batch):
            raise Abandoned(f"every caller of the {len(batch)} items left")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Items waiting for a forward (not counting the running batch)."""
        return len(self._queue)

    def lookup(self, uuid: str) -> Cached | None:
        """The cached embeddings and grid of ``uuid``, if both are known."""
        with self._lock:
            grid = self._grids.get(uuid)
            if grid is None:
                return None
            emb = self.cache.get(uuid)
            if emb is None:
                del self._grids[uuid]
                return None
            self._grids.move_to_end(uuid)
            return Cached(emb, grid)

    def remember(self, uuid: str, grid_thw: Grid, embeddings: torch.Tensor) -> None:
        """Cache embeddings computed elsewhere (another encoder, through the shared store)."""
        with self._lock:
            self.cache.put(uuid, embeddings)
            if uuid in self.cache:
                self._remember_grid(uuid, grid_thw)

    async def encode(self, uuid: str, grid_thw: Grid, pixel_values: torch.Tensor) -> EncodeResult:
        """Embeddings of one preprocessed item: from the cache, an in-flight job, or a new forward."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EncodeResult] = loop.create_future()
        with self._lock:
            if self._closed or not self._thread.is_alive():
                raise BatcherClosed("the encoder is not running")
            cached = self.cache.get(uuid)
            if cached is not None:
                self._remember_grid(uuid, grid_thw)
                return EncodeResult(cached, True, 0.0, 0.0)
            job = self._inflight.get(uuid)
            if job is not None:
                job.waiters.append(fut)
                self.coalesced += 1
            else:
                if len(self._queue) >= self.config.max_queued_items:
                    raise QueueFull(f"{len(self._queue)} items are waiting to be encoded; retry later")
                job = _Job(uuid, tuple(grid_thw), pixel_values, time.perf_counter(), [fut])  # type: ignore[arg-type]
                self._inflight[uuid] = job
                self._queue.append(job)
                self._wake.notify()
        return await fut

    # ---- worker side -----------------------------------------------------------------------
    def _take_batch(self) -> list[_Job] | None:
        """The next batch (FIFO, within the token budget); None once closed."""
        budget = self.config.token_budget
        with self._lock:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            if self.config.max_wait_ms > 0:
                deadline = time.monotonic() + self.config.max_wait_ms / 1000
                while not self._closed and sum(j.rows for j in self._queue) < budget:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._closed:
                    return None
            batch: list[_Job] = []
            rows = 0
            # the rows one forward may take in forward_s at the rate timed so far
            timed = self.row_rate.value and self.config.forward_s
            within = self.config.forward_s / self.row_rate.value if timed else float("inf")
            while self._queue:
                job = self._queue[0]
                if batch and (rows + job.rows > budget or rows + job.rows > within):
                    break
                self._queue.popleft()
                if job.abandoned():  # every waiter gave up (client gone): skip the compute
                    self._inflight.pop(job.uuid, None)
                    continue
                batch.append(job)
                rows += job.rows
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if batch:
                self._forward(batch)

    def _forward(self, batch: list[_Job]) -> None:
        start = time.perf_counter()
        rows = sum(j.rows for j in batch)
        self.batches += 1
        try:
            with torch.inference_mode():
                pixels = torch.cat([j.pixel_values for j in batch]).to(self.device, self.dtype)
                grid = torch.tensor([j.grid_thw for j in batch], dtype=torch.long)
                self._running = batch
                try:
                    out = self.visual(pixels, grid)
                finally:
                    self._running = []
                sizes = [self._rows_of(j.grid_thw) for j in batch]
                if out.shape[0] != sum(sizes):
                    raise EncodeError(f"the vision tower returned {out.shape[0]} rows for {sum(sizes)} embeddings")
                # own storage per item, so a cached item does not pin the whole batch's output,
                # in pages of its own, so it does not pin the heap around it either
                parts = [in_own_pages(p.to("cpu")) for p in out.split(sizes)]
        except Abandoned:  # nobody to answer: the items are computed afresh if asked again
            self.abandoned += 1
            with self._lock:
                for job in batch:
                    if job.abandoned():
                        self._inflight.pop(job.uuid, None)
                    else:  # a caller joined it since the check (coalescing): it runs again
                        self._queue.appendleft(job)
            return
        except Exception as e:
            seconds = time.perf_counter() - start
            log.exception("vision forward of %d items (%d patch rows) failed", len(batch), rows)
            # a fresh error for the waiters: ``e``'s traceback holds this frame and its batch's pixels
            why = str(e) if isinstance(e, EncodeError) else f"vision forward failed: {type(e).__name__}: {e}"
            err = EncodeError(why)
            with self._lock:
                for job in batch:
                    self._inflight.pop(job.uuid, None)
            for job in batch:
                self._resolve(job, err)
            self._report(BatchReport(len(batch), rows, seconds, str(err)))
            return
        seconds = time.perf_counter() - start
        self.row_rate.add(seconds, rows)
        with self._lock:
            for job, emb in zip(batch, parts, strict=True):
                self.cache.put(job.uuid, emb)
                self._remember_grid(job.uuid, job.grid_thw)
                self._inflight.pop(job.uuid, None)
        for job, emb in zip(batch, parts, strict=True):
            self._resolve(job, EncodeResult(emb, False, start - job.submitted, seconds))
        self._report(BatchReport(len(batch), rows, seconds, None))

    def _remember_grid(self, uuid: str, grid: Grid) -> None:
        """Caller holds the lock."""
        self._grids[uuid] = grid
        self._grids.move_to_end(uuid)
        if len(self._grids) > 2 * len(self.cache) + 1024:
            for stale in [k for k in self._grids if k not in self.cache]:
                del self._grids[stale]

    def _resolve(self, job: _Job, outcome: EncodeResult | BaseException) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for fut in job.waiters:
            loop.call_soon_threadsafe(_settle, fut, outcome)

    def _report(self, report: BatchReport) -> None:
        loop, cb = self._loop, self.on_batch
        if cb is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(cb, report)


def _settle(fut: asyncio.Future[EncodeResult], outcome: EncodeResult | BaseException) -> None:
    if fut.done():  # the waiter was cancelled (client disconnected)
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
