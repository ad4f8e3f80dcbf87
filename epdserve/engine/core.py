"""The engine core: schedule → execute → update, with nothing of HTTP, text or the event loop.

It takes ``AddRequest``/abort messages and returns ``EngineOutput`` token ids per step; the front
end (``client``) owns detokenization, stop strings and streaming. Metadata-only media items carry a
signed EC handle: the core fetches it (``EmbeddingFetcher``) while the request waits in the
scheduler, not ready, so a slow fetch never stalls the running batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

import torch

from epdserve.engine.config import EngineConfig, PDRole
from epdserve.engine.embeddings import EmbeddingFetcher, Fetched
from epdserve.engine.messages import (
    AddRequest,
    CoreReady,
    EngineOutput,
    EngineStats,
    ErrorKind,
    FinishReason,
    StageTimes,
)
from epdserve.engine.model_runner import ModelRunner, StepResult
from epdserve.engine.request import MediaItem, Request, Status
from epdserve.engine.scheduler import Scheduler
from epdserve.kernels.lending import CoreLender
from epdserve.kernels.parallel import threads_for
from epdserve.memory import RoleMemory
from epdserve.transfer import signing
from epdserve.transfer.base import InvalidHandle, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.kv import KVProducer, prompt_digest

log = logging.getLogger(__name__)

KV_INDEX = -1  # the ``Fetched.index`` of a request's KV (media items count from 0)


class EngineCore:
    def __init__(
        self,
        model,
        config: EngineConfig,
        ec: ECConfig | None = None,
        model_id: str = "",
        on_wake=None,
        role: PDRole = "both",
        kv: ECConfig | None = None,
    ) -> None:
        self.config = config
        self.memory: RoleMemory | None = None  # the account it was started under (from_pretrained)
        self.runner = ModelRunner(model, config)
        self.threads = config.threads or threads_for(model)  # torch intra-op threads of the steps
        # on a core board, steps also run on the cores of the host's idle roles (where the
        # model's weights are large enough to split over them)
        lends = bool(config.core_board) and threads_for(model) > 1
        self.lender = CoreLender(config.core_board, self.threads) if lends else None
        if self.lender is not None:
            self.lender.attach(model)
            if self.runner.decode.fused is not None:  # the one-call stack hands borrowed cores back itself
                self.runner.decode.fused.lender = self.lender
        self.scheduler = Scheduler(config)
        self.scheduler.media_needed = self._media_needed
        self.scheduler.vision_cost = self.runner.vision_cost
        self.scheduler.sliced_item = self.runner.sliced_item
        self.fetches_skipped = 0  # media items not fetched: their KV was cached here
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.last_step_idle = False
        self._fetched: deque[Fetched] = deque()
        self._on_wake = on_wake  # called (any thread) when a fetch finished: the loop should step
        self._fetcher: EmbeddingFetcher | None = None
        self._fetch_lock = threading.Lock()
        self._ec, self._model_id = ec, model_id
        # P/D disaggregation: a prefill instance puts KV, a decode instance fetches it
        self.role = role
        self._kv_cfg = kv
        self._kv_fetcher: EmbeddingFetcher | None = None
        self.kv_layout = self.runner.kv_layout()
        self.kv_producer = KVProducer(kv, self.kv_layout, model_id) if role == "prefill" and kv else None
        if role == "prefill" and self.kv_producer is None:
            raise ValueError("a prefill instance needs a KV connector")
        self.kv_out = self.kv_in = self.kv_fallbacks = self.kv_bytes_in = 0

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        config: EngineConfig,
        vision: bool = True,
        ec: ECConfig | None = None,
        model_id: str = "",
        on_wake=None,
        role: PDRole = "both",
        kv: ECConfig | None = None,
    ) -> EngineCore:
        from epdserve.common.dtypes import torch_dtype
        from epdserve.engine.memory import plan_engine
        from epdserve.models.loader import load_model
        from epdserve.transfer.factory import producer_bytes

        connector = producer_bytes(kv) if role == "prefill" and kv is not None else 0
        memory = plan_engine(model_dir, config, role, vision, connector)  # refuses before any weight is read
        log.info("%s", memory.line())
        config = dataclasses.replace(config, num_kv_blocks=memory.kv_blocks)
        parts = frozenset({"vision", "language"} if vision else {"language"})
        model, _ = load_model(
            model_dir, parts=parts, dtype=torch_dtype(config.dtype), device=config.device, kernels=config.kernels
        )
        core = cls(model, config, ec, model_id or Path(model_dir).name, on_wake, role, kv)
        core.memory = memory
        return core

    def ready(self) -> CoreReady:
        """What this core runs, for its front end (``CoreReady``): sent once it is loaded."""
        return CoreReady(
            pid=os.getpid(),
            vision=self.vision,
            num_kv_blocks=self.config.num_kv_blocks,
            kernels=self.runner.kernels,
            kv_bytes=self.runner.kv_bytes,
            threads=self.threads,
            lends=self.lender is not None,
            memory=self.memory.parts() if self.memory is not None else {},
        )

    @property
    def vision(self) -> bool:
        """A media encoder is loaded here (the vision tower, or an audio model's audio tower)."""
        return self.runner.has_encoder

    # ---- requests ----------------------------------------------------------------------------
    def add(self, msg: AddRequest, received: float = 0.0) -> list[EngineOutput]:
        """Admit a request; returns its error output at once if it cannot run at all. ``received``:
        when the core read it (perf_counter; 0: now), while a step may have been running."""
        if msg.request_id in self.requests:
            return [_error(msg.request_id, f"duplicate request id {msg.request_id}", "invalid_request")]
        try:
            req = request_from(msg)
        except ValueError as e:
            self.release_handles([m.handle for m in msg.media if m.handle is not None])
            return [_error(msg.request_id, f"malformed request: {e}", "invalid_request")]
        try:
            _check(req, self.config)
            self._check_kv(msg)
        except ValueError as e:
            self._release_handles(req)
            if msg.kv is not None and msg.kv.handle is not None:
                self._release_kv([msg.kv.handle])
            return [_error(req.request_id, str(e), "invalid_request")]
        try:  # every handle must verify, also one never read (its KV cached here): no I/O
            key = self._ec.handle_key if self._ec is not None and self._ec.has_secret else None
            for it in req.mm_items:
                if it.handle is not None:
                    signing.verify_with(it.handle, key)
            if msg.kv is not None and msg.kv.handle is not None:
                self._check_kv_prompt(req, msg.kv.handle)
        except InvalidHandle as e:
            self._release_handles(req)
            return [_error(req.request_id, str(e), "invalid_handle")]
        self.requests[req.request_id] = req
        req.t_added = time.perf_counter()
        req.t_received = min(received, req.t_added) if received else req.t_added
        if msg.kv is not None and msg.kv.handle is not None:
            # the media handles wait: they are needed only if the KV cannot be loaded
            req.pending_fetches += 1
            self._kv_fetcher_get().fetch(
                req.request_id, KV_INDEX, msg.kv.handle, req.prompt_len, self.kv_layout.width, self._kv_identity(req)
            )
        else:
            # an item whose placeholders lie inside the prefix this instance has cached is not
            # needed: its embeddings are fetched only if those blocks are gone at admission
            covered = self.scheduler.blocks.match_prefix(req, count=False).num_tokens
            self._fetch_media(req, covered)
        if req.ready:
            req.t_ready = req.t_added
        self.scheduler.add(req)
        return []

    def _check_kv(self, msg: AddRequest) -> None:
        kv = msg.kv
        if kv is None:
            return
        if kv.produce and self.kv_producer is None:
            raise ValueError("this instance is not a prefill instance: it cannot hand KV on")
        if kv.first_token is not None and self.role != "decode":
            raise ValueError("this instance is not a decode instance: it does not continue requests")
        if kv.handle is not None and kv.first_token is None:
            raise ValueError("a KV handle comes with the first token it was sampled with")
        if kv.first_token is not None and not 0 <= kv.first_token < self.runner.vocab_size:
            raise ValueError(f"first token {kv.first_token} is not in the vocabulary")
        if kv.first_token is not None and len(msg.prompt_token_ids) + 1 >= self.config.max_model_len:
            raise ValueError("the prompt and its first token leave no room to decode")

    def _kv_identity(self, req: Request) -> str:
        """The identity KV for ``req`` carries: this model and layout, and ``req``'s prompt."""
        return self.kv_layout.identity(self._model_id, kv_prompt(req))

    def _check_kv_prompt(self, req: Request, handle: dict) -> None:
        """InvalidHandle when a KV handle this cluster signed was computed for another prompt
        (before any of its bytes is read). A handle that does not verify is left to the fetch,
        which refuses it, and the prefill runs here as for any KV that cannot be loaded."""
        if self._kv_cfg is None or not self._kv_cfg.has_secret:
            return
        try:
            signing.verify(handle, self._kv_cfg.handle_key)
        except InvalidHandle:
            return
        if handle.get("model_id") != self._kv_identity(req):
            raise InvalidHandle("the kv_handle was computed for another prompt (or model) than this request's")

    def _fetch_media(self, req: Request, covered: int = 0, count: bool = True) -> bool:
        """Start fetching the embeddings of every media item by handle (the fetch owns the lease
        now), except items whose placeholders all lie in the first ``covered`` tokens (cached KV);
        True when a fetch started."""
        started = False
        for i, it in enumerate(req.mm_items):
            if it.handle is None or it.embeddings is not None:
                continue
            if it.end <= covered:
                self.fetches_skipped += count
                continue
            req.pending_fetches += 1
            handle, it.handle = it.handle, None
            self._fetcher_for_handles().fetch(req.request_id, i, handle, it.length, self.runner.hidden_size)
            started = True
        return started

    def _media_needed(self, req: Request) -> bool:
        """The scheduler admitted ``req`` with what its prefix cache holds now: fetch the items
        that prefix no longer covers (they were skipped at arrival); True when it must wait."""
        return self._fetch_media(req, req.num_computed_tokens, count=False)

    def add_request(self, req: Request) -> None:
        """Admit an already built request (in-process tools and tests)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        req.t_added = req.t_ready = time.perf_counter()
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self.runner.release(request_id)

    def release_handles(self, handles: list[dict], kv_handles: list[dict] | None = None) -> None:
        """Give back leases of a request that will never run here."""
        for h in handles:
            self._fetcher_for_handles().release(h)
        self._release_kv(kv_handles or [])

    def _release_kv(self, handles: list[dict]) -> None:
        """Give back KV leases: a prefill instance's own, or (through its consumer) a decode
        instance's. An instance without a KV connector can do neither: the leases expire."""
        for h in handles:
            if self.kv_producer is not None:
                try:
                    self.kv_producer.release(h)
                except TransferError as e:
                    log.warning("a KV release was refused: %s", e)
            elif self._kv_cfg is not None:
                self._kv_fetcher_get().release(h)
            else:
                log.warning("a KV lease reached an instance without a KV connector; it expires by TTL")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs = self._apply_fetched()
        plan = self.scheduler.schedule()
        for req in plan.preempted:  # a decode request that loaded its KV recomputes: it needs its media now
            self._fetch_media(req)
        runner = self.runner
        if plan.slice is not None and runner.slicing is None:
            runner.start_slices(*plan.slice)
        self.last_step_idle = not plan.scheduled and runner.slicing is None
        if self.last_step_idle:
            return outputs
        slicing = runner.slicing is not None
        try:
            urgent = plan.holds_decodes or (slicing and plan.decoding)  # decodes wait for the slice too
            lent = self.lender.computing(urgent=urgent) if self.lender is not None else None
            with lent or contextlib.nullcontext():
                result = runner.execute(plan) if plan.scheduled else StepResult({}, {})
                if slicing:  # as much of its forward as a step's vision bound allows (none: the slice bound)
                    failed = runner.advance_slices(self.config.vision_step_s or self.config.vision_slice_s)
                    if failed is not None and failed[0] in self.requests:
                        outputs.append(self._fail(self.requests[failed[0]], failed[1], "media"))
        except Exception as e:  # never let one bad step kill the engine: fail this step's requests
            log.exception("engine step failed")
            return outputs + [self._fail(s.request, f"internal error: {e}", "internal") for s in plan.scheduled]
        if not plan.scheduled:
            return outputs
        self.num_steps += 1
        outputs += [self._fail(self.requests[rid], msg, "media") for rid, msg in result.failed.items()]
        for s in plan.scheduled:
            req = s.request
            if req.request_id in result.failed:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.scheduler.blocks.commit(req)
            sampled = result.sampled.get(req.request_id)
            if sampled is not None:
                outputs.append(self._append(req, sampled))
        return outputs

    def _append(self, req: Request, sampled) -> EngineOutput:
        token, logprob, top = sampled
        req.output_token_ids.append(token)
        p = req.params
        n_out = len(req.output_token_ids)
        reason: FinishReason | None = None
        if token in req.eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
            reason = "stop"
        elif n_out >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        kv_handle = None
        if reason is None and req.kv_produce:
            kv_handle = self._hand_kv_on(req)
            reason = "transferred" if kv_handle is not None else None
        out = EngineOutput(
            req.request_id,
            [token],
            logprobs=[logprob] if p.logprobs else None,
            top_logprobs=[top] if top is not None else None,
            finish_reason=reason,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.num_cached_tokens,
            kv_handle=kv_handle,
            stages=None if req.timed else _stages(req),
        )
        req.timed = True
        if reason is not None:
            self._retire(req, reason)
        return out

    def _hand_kv_on(self, req: Request):
        """Put the prompt's KV to the KV connector; None when it cannot take it (then this instance
        decodes the request itself: slower for it, but nothing is lost)."""
        assert self.kv_producer is not None
        req.kv_produce = False
        try:
            handle = self.kv_producer.put(req.request_id, self.runner.export_kv(req), kv_prompt(req))
        except (TransferError, ValueError) as e:
            log.warning("KV of %s not handed on (%s): decoding it here", req.request_id, e)
            return None
        self.kv_out += 1
        return handle

    def _fail(self, req: Request, message: str, kind: ErrorKind) -> EngineOutput:
        self._retire(req, "error")
        out = _error(req.request_id, message, kind)
        out.prompt_tokens = req.prompt_len
        return out

    def _retire(self, req: Request, reason: str) -> None:
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.runner.release(req.request_id)
        self._release_handles(req)  # leases never read (a decode request whose KV loaded)

    # ---- embeddings by handle ----------------------------------------------------------------
    def _fetcher_for_handles(self) -> EmbeddingFetcher:
        if self._fetcher is None:
            from epdserve.store.consumer import StoreConsumer
            from epdserve.transfer.cached import CACHED_HANDLE
            from epdserve.transfer.config import STORE_HANDLE
            from epdserve.transfer.factory import make_consumer

            ec = self._ec or ECConfig()
            # a cached handle is read only when its KV was evicted meanwhile: the store may have it
            store = {STORE_HANDLE: lambda: StoreConsumer(ec), CACHED_HANDLE: lambda: StoreConsumer(ec)}
            self._fetcher = EmbeddingFetcher(
                lambda: make_consumer(ec, store), self._model_id, self._fetch_done, levels=self.runner.feature_levels
            )
        return self._fetcher

    def _kv_fetcher_get(self) -> EmbeddingFetcher:
        if self._kv_fetcher is None:
            from epdserve.transfer.factory import make_consumer

            if self._kv_cfg is None:
                raise ValueError("this instance has no KV connector")
            cfg = self._kv_cfg
            identity = self.kv_layout.identity(self._model_id)
            self._kv_fetcher = EmbeddingFetcher(
                lambda: make_consumer(cfg), identity, self._fetch_done, what="KV", unavailable="The KV is unavailable."
            )
        return self._kv_fetcher

    def _fetch_done(self, f: Fetched) -> None:  # on the fetcher's thread
        with self._fetch_lock:
            self._fetched.append(f)
        if self._on_wake is not None:
            self._on_wake()

    def _apply_fetched(self) -> list[EngineOutput]:
        with self._fetch_lock:
            done, self._fetched = list(self._fetched), deque()
        outputs = []
        for f in done:
            req = self.requests.get(f.request_id)
            if req is None:
                continue  # aborted or failed meanwhile; the fetch has released its lease
            req.pending_fetches -= 1
            if req.ready:
                req.t_ready = req.t_ready or time.perf_counter()
            if f.index == KV_INDEX:
                self._apply_kv(req, f)
                continue
            item = req.mm_items[f.index]
            item.handle = None  # consumed (read and released)
            if f.embeddings is None:
                outputs.append(self._fail(req, f.error or "embeddings unavailable", f.kind or "internal"))
            else:
                item.embeddings = f.embeddings
        return outputs

    def _apply_kv(self, req: Request, f: Fetched) -> None:
        if f.embeddings is None:  # P died, the transfer failed or the KV did not validate
            self.kv_fallbacks += 1
            log.warning("KV of %s could not be loaded (%s): computing its prefill here", req.request_id, f.error)
            self._fetch_media(req)
            return
        self.kv_in += 1
        self.kv_bytes_in += f.embeddings.numel() * f.embeddings.element_size()
        req.kv_rows = f.embeddings

    def _release_handles(self, req: Request) -> None:
        """Give back the handles of a request refused before its fetches began. (Once begun, each
        fetch releases its own lease when it ends, whatever happened to the request meanwhile.)"""
        for it in req.mm_items:
            if it.handle is not None:
                self._fetcher_for_handles().release(it.handle)
                it.handle = None

    # ---- observability -----------------------------------------------------------------------
    def stats(self, digest: bool = False) -> EngineStats:
        sch, enc, f = self.scheduler, self.runner.encoder_cache, self._fetcher
        return EngineStats(
            block_size=sch.blocks.block_size,
            ec_fetches_skipped=self.fetches_skipped,
            kv_digest=sch.blocks.digest() if digest else b"",
            running=len(sch.running),
            waiting=len(sch.waiting),
            kv_blocks_free=sch.blocks.num_free,
            kv_blocks_total=sch.blocks.num_blocks,
            kv_blocks_touched=sch.blocks.touched,
            kv_block_bytes=self.runner.kv.nbytes // sch.blocks.num_blocks,
            prefix_cache_hit_tokens=sch.blocks.hits,
            prefix_cache_query_tokens=sch.blocks.queries,
            preemptions=sch.num_preemptions,
            steps=self.num_steps,
            encoder_cache_hits=enc.hits,
            encoder_cache_bytes=enc.nbytes,
            ec_bytes=f.bytes if f else 0,
            ec_seconds=f.seconds if f else 0.0,
            ec_failures=f.failures if f else 0,
            ec_invalid_handles=f.invalid if f else 0,
            kv_transfers_out=self.kv_out,
            kv_transfers_in=self.kv_in,
            kv_fallbacks=self.kv_fallbacks,
            kv_bytes_in=self.kv_bytes_in,
            kv_live_handles=self.kv_producer.live_handles if self.kv_producer is not None else 0,
            vision=self.vision,
            vision_patches=self.runner.vision_patches,
            vision_seconds=self.runner.vision_seconds,
            vision_sliced_items=self.runner.sliced_items,
        )

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()
        if self._kv_fetcher is not None:
            self._kv_fetcher.close()
        if self.kv_producer is not None:
            self.kv_producer.close()
        if self.lender is not None:
            self.lender.close()


def kv_prompt(req: Request) -> str:
    """The digest a KV handle of ``req``'s prompt is bound to (``transfer.kv.prompt_digest``)."""
    return prompt_digest(req.prompt_token_ids, [(it.uuid, it.offset, it.length) for it in req.mm_items])


def request_from(msg: AddRequest) -> Request:
    """The engine's request for an ``AddRequest`` (tensors made from the wire bytes)."""
    items = [
        MediaItem(
            m.uuid,
            m.modality,
            m.offset,
            m.length,
            m.grid_thw,
            m.pixels.to_torch() if m.pixels is not None else None,
            m.embeddings.to_torch() if m.embeddings is not None else None,
            m.handle,
            tuple((int(o), int(k)) for o, k in m.runs),
        )
        for m in msg.media
    ]
    req = Request(
        msg.request_id,
        list(msg.prompt_token_ids),
        msg.params,
        items,
        msg.mrope_positions.to_torch() if msg.mrope_positions is not None else None,
        msg.mrope_delta,
        arrival=msg.arrival,
        eos_token_ids=frozenset(msg.eos_token_ids),
    )
    if msg.kv is not None:
        req.kv_produce = msg.kv.produce
        if msg.kv.first_token is not None:  # sampled by the prefill instance: decoding continues after it
            req.output_token_ids.append(msg.kv.first_token)
    return req


def _stages(req: Request) -> StageTimes:
    """Where the request's time went until now, its first output."""
    now = time.perf_counter()
    ready = req.t_ready or req.t_added
    admitted = req.t_admitted or now
    waited = req.t_added - (req.t_received or req.t_added)  # for the step that ran when it came
    return StageTimes(
        fetch=max(0.0, ready - req.t_added), queue=max(0.0, admitted - ready) + waited, prefill=now - admitted
    )


def _error(request_id: str, message: str, kind: ErrorKind) -> EngineOutput:
    return EngineOutput(request_id, [], finish_reason="error", error=message, error_kind=kind)


def _check(req: Request, config: EngineConfig) -> None:
    """What the front end already validated, checked again: the core trusts no channel blindly."""
    n = req.prompt_len
    if n < 1:
        raise ValueError("empty prompt")
    if n >= config.max_model_len:
        raise ValueError(f"prompt of {n} tokens does not fit max_model_len {config.max_model_len}")
    for it in req.mm_items:
        if it.offset < 0 or it.end > n or it.length < 1:
            raise ValueError(f"media item {it.uuid} lies outside the prompt")
        if it.runs and not _runs_valid(it.runs, it.offset, it.length):
            raise ValueError(f"media item {it.uuid} has placeholder runs that do not tile its {it.length} rows")
        if it.embeddings is not None and it.embeddings.shape[0] != it.length:
            raise ValueError(f"media item {it.uuid} has {it.embeddings.shape[0]} rows, not {it.length}")
        if it.pixel_values is None and it.embeddings is None and it.handle is None:
            raise ValueError(f"media item {it.uuid} has no pixels, embeddings or handle")
    pos = req.mrope_positions
    if pos is not None and (tuple(pos.shape) != (3, n) or pos.dtype != torch.long):
        raise ValueError("M-RoPE positions do not match the prompt")


def _runs_valid(runs: tuple[tuple[int, int], ...], offset: int, length: int) -> bool:
    """Runs in prompt order, none empty or overlapping the next, the first at the item's offset,
    one row per placeholder."""
    ends = [o + k for o, k in runs]
    return (
        runs[0][0] == offset
        and all(k >= 1 for _, k in runs)
        and all(end <= o for end, (o, _) in zip(ends, runs[1:], strict=False))
        and sum(k for _, k in runs) == length
    )
