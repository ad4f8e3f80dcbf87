"""Where a request runs: the language-model worker (the pool's policy, or ``kv_aware``: where its
prompt's prefix is cached, so media inside that prefix need no encode), and where each media
item is encoded (``dispatch``: on an encoder, or raw on the worker itself)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec

from epdserve.api.errors import Unavailable, WorkerFailed
from epdserve.api.protocol import ChatRequest
from epdserve.assets import default_model_dir
from epdserve.encoder.protocol import EncodedItem
from epdserve.router.config import RouterConfig
from epdserve.router.dispatch import Side
from epdserve.router.encode import Encodes
from epdserve.router.kv_routing import Blocks, PromptBlocks
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pool import Worker, WorkerPool
from epdserve.router.refs import MediaRef
from epdserve.router.trail import ROUTER_STAGES, Trail
from epdserve.router.workers import WorkerPools
from epdserve.transfer.cached import cached_handle
from epdserve.transfer.config import HANDLE_PURPOSE

log = logging.getLogger(__name__)


class Placement:
    """The worker for a request, with its media encoded (or marked raw) as that worker needs them."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, workers: WorkerPools, encodes: Encodes) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.encodes = encodes
        assert config.auth.cluster is not None  # checked by RouterConfig
        self._handle_key = config.auth.cluster.derive(HANDLE_PURPOSE)  # signs cached handles
        self.prompt_blocks: PromptBlocks | None = None
        if config.policy == "kv_aware":
            self.prompt_blocks = PromptBlocks(Path(config.model) if config.model else default_model_dir())

    def close(self) -> None:
        if self.prompt_blocks is not None:
            self.prompt_blocks.executor.shutdown(wait=False, cancel_futures=True)

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
        index, prompt_blocks = self.workers.kv_index, self.prompt_blocks
        if index is None or prompt_blocks is None or not index.block_size:
            return pool.pick(exclude=exclude), None
        self.encodes.directory_keys(refs)
        media = [(r.modality, r.result or self.encodes.known(r)) for r in refs]
        try:
            # rendering and tokenizing a prompt is CPU work: not on the event loop
            named = await asyncio.get_running_loop().run_in_executor(
                prompt_blocks.executor, prompt_blocks.blocks, req, media, index.block_size, self.workers.context_len()
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
            self.metrics.kv_routed.inc()
            self.metrics.kv_cached_tokens.inc(tokens)
        index.note(worker.url, named.hashes)
        if skip_cached and tokens:
            for r, (_, known), end in zip(refs, media, named.item_ends, strict=True):
                if r.result is None and known is not None and end <= tokens:
                    r.result = self._cached(known, leases)
                    r.encoder, r.skipped = "", True
                    self.metrics.encodes_skipped.inc()
        return worker, named

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
        if self.workers.kv_index is not None or (self.encodes.dispatcher is not None and refs):
            worker, named = await self.choose_lm(pool, req, refs, exclude, skip_cached, leases)
        todo = [r for r in refs if not r.settled]
        if todo and worker is not None and self.encodes.dispatcher is not None:
            todo = self._dispatch(worker, todo)
        if todo:
            t0 = time.perf_counter()
            if worker is not None:  # it will need the worker's engine as soon as its media is encoded
                worker.outstanding += 1
                worker.awaiting += 1
            try:
                await self.encodes.encode_for(req, todo, leases, trail.request_id)
            except (Unavailable, WorkerFailed):
                if not self._raw_fallback(worker, todo):
                    raise
            finally:
                if worker is not None:
                    worker.outstanding -= 1
                    worker.awaiting -= 1
            encode = time.perf_counter() - t0
            self.metrics.encode_hist.observe(encode)
            trail.add("router_encode", encode)
        if worker is None:
            worker, named = await self.choose_lm(pool, req, refs, exclude)
        self.note_complete(worker, req, refs, named)
        trail.add_media(refs)
        for stage in ROUTER_STAGES:
            if stage in trail.stages:
                self.metrics.stage_hist.labels(stage=stage).observe(trail.stages[stage])
        return worker

    def _dispatch(self, worker: Worker, todo: list[MediaRef]) -> list[MediaRef]:
        """Adaptive dispatch (``router.dispatch``): mark the items the worker should encode itself
        raw; the rest, to encode. Items the directory holds always take the remote path."""
        model = self.encodes.dispatcher
        assert model is not None
        self.encodes.directory_keys(todo)
        fresh = [r for r in todo if self.encodes.known(r) is None]
        for r in fresh:
            r.patches = model.patches(r.modality, r.url)
        encoders = self.workers.encoders.healthy
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
        self.metrics.dispatch.inc(path=path)
        if path == "remote":
            return todo
        for r in fresh:
            r.raw = True
        return [r for r in todo if not r.raw]

    def _raw_fallback(self, worker: Worker | None, todo: list[MediaRef]) -> bool:
        """Adaptive dispatch, the encoders gone or failing: the worker, if it has a vision tower,
        encodes what they did not. True when it takes them."""
        if self.encodes.dispatcher is None or worker is None or not worker.report.vision:
            return False
        for r in todo:
            if r.result is None:
                r.raw = True
        self.metrics.dispatch_fallbacks.inc()
        return True

    def note_complete(self, worker: Worker, req: ChatRequest, refs: list[MediaRef], named: Blocks | None) -> None:
        """After the encodes: note the blocks past the items that were unknown when the worker was
        chosen (in the background: the request does not wait for it)."""
        index, prompt_blocks = self.workers.kv_index, self.prompt_blocks
        if index is None or prompt_blocks is None or named is None or named.complete:
            return
        media = [(r.modality, r.result) for r in refs]
        block_size = index.block_size

        async def note() -> None:
            try:
                full = await asyncio.get_running_loop().run_in_executor(
                    prompt_blocks.executor, prompt_blocks.blocks, req, media, block_size, self.workers.context_len()
                )
            except Exception:
                log.exception("could not compute the prompt's KV blocks")
                return
            index.note(worker.url, full.hashes)

        self.encodes.spawn(note())
