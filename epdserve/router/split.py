"""E → P → D: one chat request through the encoders, a prefill worker and a decode worker.

The prefill worker computes the prompt and samples the first token, and hands the prompt's KV to
its KV connector; the router sends that token to the client at once (the client's TTFT is the
prefill worker's), then relays the decode worker's stream, which continues after it under the
same completion id. Text-only requests skip the encoders. Prefill and decode workers are chosen
independently (the pools' policy).

The decode worker gets leases of its own on the media's embeddings (the encoders issue two per
item): it reads them only when the KV cannot be loaded (the prefill worker died, the transfer or
its validation failed) and then computes the prefill itself, continuing after the token already
sent, so the client sees one answer either way. Every lease and KV handle is given back on every
path: read, refused, or abandoned by the router.

Failures before the client saw a byte are retried like the PD path's (another prefill worker, with
fresh encodes). A decode worker that fails before its first byte is replaced: the KV lease goes
back to the prefill worker, the media are encoded afresh and another decode worker computes the
prefill from the metadata and continues. A decode worker that dies mid-stream ends the stream with
an error event.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from epdserve.api.errors import EMBEDS_UNAVAILABLE, ApiError, Unavailable, WorkerFailed
from epdserve.api.http_client import Response
from epdserve.api.protocol import ChatRequest
from epdserve.api.responses import (
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    PrefillCompletion,
    encode_json,
    sse_error,
    sse_event,
)
from epdserve.api.timing import SERVER_TIMING
from epdserve.router.pool import NoWorker, Worker, WorkerPool
from epdserve.router.refs import MediaRef, media_refs, with_parts
from epdserve.router.trail import Trail
from epdserve.router.upstream import RetryableWorker, about_media, error_code, passthrough_error

if TYPE_CHECKING:
    from epdserve.api.tracing import Tracing
    from epdserve.router.config import RouterConfig
    from epdserve.router.encode import Encodes
    from epdserve.router.forward import Forwarder
    from epdserve.router.metrics import RouterMetrics
    from epdserve.router.placement import Placement
    from epdserve.router.workers import WorkerPools

log = logging.getLogger(__name__)


class SplitChat:
    """The E → P → D path of a ``Router``, over its parts."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        workers: WorkerPools,
        encodes: Encodes,
        placement: Placement,
        forwarder: Forwarder,
        tracing: Tracing,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.encodes = encodes
        self.placement = placement
        self.forwarder = forwarder
        self.tracing = tracing

    async def chat(
        self, request: web.Request, req: ChatRequest, body: dict[str, Any], trail: Trail
    ) -> web.StreamResponse:
        self.metrics.split_requests.inc()
        refs = [] if self.config.dispatch == "never" else media_refs(body)
        try:
            first, prefill = await self._prefill(req, body, refs, trail)
            self.forwarder.note_first_token(trail)
            kv = first.kv_transfer_params
            if kv is None:  # the answer ended with its first token (or the prefill worker decoded it all)
                return await self._finished(request, req, first, trail)
            handoff = _Handoff(first, prefill, kv)
            try:
                if req.stream:
                    return await self._stream(request, req, body, refs, handoff, trail)
                return await self._complete(req, body, refs, handoff, trail)
            finally:
                if not handoff.delivered:  # no decode worker took the KV: give it back
                    self.encodes.spawn(self._release_kv(prefill, kv.get("kv_handle")))
        finally:
            self.encodes.release(self.encodes.take_leases(refs))  # the decode worker's leases, unless it took them

    # ---- prefill -----------------------------------------------------------------------------
    async def _prefill(
        self, req: ChatRequest, body: dict[str, Any], refs: list[MediaRef], trail: Trail
    ) -> tuple[PrefillCompletion, Worker]:
        exclude: set[str] = set()
        for attempt in (1, 2):
            try:
                try:
                    # after a failure nothing is skipped: the worker may have lost the KV it held
                    worker = await self.placement.place(
                        self.workers.prefills, req, refs, exclude, attempt == 1, 2, trail
                    )
                except NoWorker:
                    raise Unavailable("No healthy prefill worker is available.") from None
                kv = {"do_remote_decode": True}
                raw = _body(body, refs, stream=False, kv_transfer_params=kv)
                answer = await self._read(self.workers.prefills, worker, raw, trail)
                _take_first_leases(refs)  # the prefill worker read them
                try:
                    return msgspec.json.decode(answer, type=PrefillCompletion), worker
                except msgspec.DecodeError as e:
                    raise WorkerFailed(f"The prefill worker answered malformed JSON: {e}") from None
            except RetryableWorker as e:
                self.encodes.forget_directory_hits(refs)
                self.encodes.release(self.encodes.take_leases(refs))
                if not e.worker_ok:
                    exclude.add(e.url)
                self.metrics.prefill_retries.inc()
                if attempt == 2:
                    raise WorkerFailed(f"The prefill worker failed: {e}") from None
        raise AssertionError("unreachable")

    # ---- decode ------------------------------------------------------------------------------
    async def _decode(
        self, req: ChatRequest, body: dict[str, Any], refs: list[MediaRef], handoff: _Handoff, trail: Trail
    ) -> tuple[Response, Worker]:
        """A decode worker's open 200 response, continuing after the first token: from the KV,
        or, when that worker fails before answering, another one computing the prefill."""
        first_token = handoff.kv.get("first_token_id")
        params: dict[str, Any] = {
            "first_token_id": first_token,
            "kv_handle": handoff.kv.get("kv_handle"),
            "completion_id": handoff.id,
        }
        exclude: set[str] = set()
        for attempt in (1, 2):
            try:
                try:
                    worker = self.workers.decodes.pick(exclude=exclude)
                except NoWorker:
                    try:  # the one that failed (if still healthy) is all there is: it recomputes
                        worker = self.workers.decodes.pick()
                    except NoWorker:
                        raise Unavailable("No healthy decode worker is available.") from None
                raw = _body(body, refs, stream=bool(req.stream), kv_transfer_params=params)
                upstream = await self._open(self.workers.decodes, worker, raw, trail)
                handoff.delivered = True  # the decode worker took (or gave back) the KV lease
                _take_first_leases(refs)
                return upstream, worker
            except RetryableWorker as e:
                if attempt == 2:
                    raise WorkerFailed(f"The decode worker failed: {e}") from None
                # give the KV back and recompute the prefill on another decode worker
                self.metrics.decode_retries.inc()
                self.encodes.spawn(self._release_kv(handoff.prefill, params.pop("kv_handle")))
                handoff.delivered = True
                self.encodes.forget_directory_hits(refs)
                self.encodes.release(self.encodes.take_leases(refs))
                if not e.worker_ok:
                    exclude.add(e.url)
                if refs:
                    await self.encodes.encode_for(req, refs, 1, trail.request_id)
        raise AssertionError("unreachable")

    async def _stream(
        self,
        request: web.Request,
        req: ChatRequest,
        body: dict[str, Any],
        refs: list[MediaRef],
        handoff: _Handoff,
        trail: Trail,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await trail.stamp(resp).prepare(request)  # the decode worker's stages come too late for it
        first = handoff.first
        choice = first.choices[0]
        try:
            await resp.write(_chunk(first, Delta(role="assistant", content="")))
            text = choice.message.content or ""
            await resp.write(_chunk(first, Delta(content=text) if text else Delta(), choice.logprobs))
        except ConnectionResetError:
            return resp
        try:
            upstream, worker = await self._decode(req, body, refs, handoff, trail)
        except ApiError as e:
            log.warning("no decode worker continued %s: %s", handoff.id, e.message)
            try:
                await resp.write(sse_error(e) + SSE_DONE)
                await resp.write_eof()
            except ConnectionResetError:
                pass
            return resp
        async with upstream:
            await self.forwarder.relay(resp, upstream, worker, self.workers.decodes)
        return resp

    async def _complete(
        self, req: ChatRequest, body: dict[str, Any], refs: list[MediaRef], handoff: _Handoff, trail: Trail
    ) -> web.Response:
        upstream, worker = await self._decode(req, body, refs, handoff, trail)
        async with upstream:
            try:
                raw = await upstream.read()
                rest = msgspec.json.decode(raw, type=ChatCompletion)
            except (TimeoutError, OSError, msgspec.DecodeError) as e:
                self.workers.decodes.mark_failed(worker)
                raise WorkerFailed(f"The decode worker failed mid-response: {e}") from None
        first, last = handoff.first.choices[0], rest.choices[0]
        last.message.content = (first.message.content or "") + (last.message.content or "")
        if first.logprobs is not None and last.logprobs is not None:
            last.logprobs.content = [*(first.logprobs.content or []), *(last.logprobs.content or [])]
        rest.id = handoff.id
        return trail.stamp(web.Response(body=encode_json(rest), content_type="application/json"))

    async def _finished(
        self, request: web.Request, req: ChatRequest, first: PrefillCompletion, trail: Trail
    ) -> web.StreamResponse:
        """The prefill worker's answer is the whole answer: as the client asked for it."""
        done = ChatCompletion(
            id=first.id, created=first.created, model=first.model, choices=first.choices, usage=first.usage
        )
        if not req.stream:
            return trail.stamp(web.Response(body=encode_json(done), content_type="application/json"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await trail.stamp(resp).prepare(request)
        choice = done.choices[0]
        text = choice.message.content or ""
        events = [
            _chunk(first, Delta(role="assistant", content="")),
            _chunk(first, Delta(content=text) if text else Delta(), choice.logprobs, choice.finish_reason),
        ]
        if req.include_usage:
            usage = ChatCompletionChunk(id=first.id, created=first.created, model=first.model, choices=[])
            usage.usage = first.usage
            events.append(sse_event(usage))
        try:
            await resp.write(b"".join(events) + SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    # ---- calls -------------------------------------------------------------------------------
    async def _open(self, pool: WorkerPool, worker: Worker, raw: bytes, trail: Trail) -> Response:
        """POST a chat request; the open response when it is a 200. A worker that cannot be
        reached, answers 5xx or lost the embeddings is retryable; a 4xx is the client's error."""
        worker.outstanding += 1
        try:
            # the span covers the call up to the worker's answer (a decode worker's stream follows)
            with self.tracing.client_span(
                f"POST /v1/chat/completions ({pool.role})", **{"epd.worker": worker.url}
            ) as trace:
                upstream = await self.forwarder.post_chat(pool, worker, raw, trail, trace=trace)
        finally:
            worker.outstanding -= 1
        if upstream.status == 200:
            trail.workers.append(upstream.headers.get(SERVER_TIMING, ""))
            trail.ran_on.append(worker.url)
            return upstream
        async with upstream:
            answer = await upstream.read()
        if error_code(answer) == EMBEDS_UNAVAILABLE:
            raise RetryableWorker(worker.url, "embeddings unavailable", worker_ok=True)
        if upstream.status >= 500 and not about_media(answer):
            raise RetryableWorker(worker.url, f"HTTP {upstream.status}")
        raise passthrough_error(upstream.status, answer)

    async def _read(self, pool: WorkerPool, worker: Worker, raw: bytes, trail: Trail) -> bytes:
        """``_open``, read to the end."""
        upstream = await self._open(pool, worker, raw, trail)
        async with upstream:
            try:
                return await upstream.read()
            except (TimeoutError, OSError) as e:
                pool.mark_failed(worker)
                raise RetryableWorker(worker.url, f"failed mid-response: {e}") from None

    async def _release_kv(self, prefill: Worker, handle: dict | None) -> None:
        """Give a KV lease no decode worker will read back to the prefill worker that holds it
        (it expires by TTL if the worker cannot be reached)."""
        if handle is None:
            return
        body = msgspec.json.encode({"handles": [handle]})
        if await self.workers.release(prefill.url + "/v1/kv/release", body, "give a KV lease back"):
            self.metrics.kv_released.inc()


class _Handoff:
    """The prefill worker's answer and the KV it holds for the decode worker."""

    def __init__(self, first: PrefillCompletion, prefill: Worker, kv: dict[str, Any]) -> None:
        self.first = first
        self.prefill = prefill
        self.kv = kv
        self.delivered = False  # a decode worker took the KV lease (or it was given back)

    @property
    def id(self) -> str:
        return self.first.id


def _take_first_leases(refs: list[MediaRef]) -> None:
    """A worker took each item's first lease: the next one (if any) becomes the item's handle."""
    for ref in refs:
        if ref.result is None:
            continue
        if ref.result.more_handles:
            ref.result.ec_handle = ref.result.more_handles.pop(0)
        else:
            ref.result = None


def _body(body: dict[str, Any], refs: list[MediaRef], **fields: Any) -> bytes:
    """The request for a worker: media parts as metadata with each item's current handle."""
    out = with_parts(body, refs)
    out.update(fields)
    if not out.get("stream"):
        out.pop("stream_options", None)
    return msgspec.json.encode(out)


def _chunk(first: ChatCompletion, delta: Delta, logprobs=None, finish_reason=None) -> bytes:
    choice = ChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return sse_event(ChatCompletionChunk(id=first.id, created=first.created, model=first.model, choices=[choice]))
