"""A request forwarded to a language-model worker and its answer relayed to the client: the
response bytes pass through untouched (SSE included); a worker that fails before the first byte
is retryable elsewhere, one that dies mid-stream ends the client's stream with an error event.
Shared by the PD path and the P/D path (``router.split``)."""

from __future__ import annotations

import contextlib
import logging
import time

from aiohttp import web

from epdserve.api.errors import EMBEDS_UNAVAILABLE, Timeout, WorkerFailed
from epdserve.api.http_client import Response
from epdserve.api.responses import SSE_DONE, sse_error
from epdserve.api.timing import SERVER_TIMING
from epdserve.api.tracing import Tracing
from epdserve.router.admission import AutoLimit
from epdserve.router.config import RouterConfig
from epdserve.router.metrics import RouterMetrics
from epdserve.router.pool import Worker, WorkerPool
from epdserve.router.trail import Trail
from epdserve.router.upstream import RetryableWorker, about_media, error_code, error_response
from epdserve.router.workers import WorkerPools

log = logging.getLogger(__name__)

_TAIL = len(SSE_DONE)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class Forwarder:
    """Calls to language-model workers and the relay of their answers."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        workers: WorkerPools,
        tracing: Tracing,
        auto_limit: AutoLimit | None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self.tracing = tracing
        self.auto_limit = auto_limit

    async def forward(
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
        assert self.workers.session is not None
        pool = pool or self.workers.pds
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
                        with contextlib.suppress(TimeoutError, OSError):
                            raw = b""
                            raw = await upstream.read()
                        if about_media(raw):  # the request's own media failed there: the client's error
                            first_byte()
                            return trail.stamp(error_response(upstream, raw)), False
                        raise RetryableWorker(pd.url, f"HTTP {upstream.status}")
                    if upstream.status != 200 or not stream:
                        try:
                            raw = await upstream.read()
                        except (TimeoutError, OSError) as e:
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
        self.metrics.ttfb_hist.observe(from_worker_call)
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
    ) -> Response:
        """POST a chat request to a worker, response unread. One that cannot be reached is marked
        failed and the call is retryable elsewhere."""
        url = worker.url + path
        headers = {"Content-Type": "application/json", **trail.ask()}
        if self.config.pd_engine != "vllm":  # vLLM reads no peer proof: it is reached on a private address
            headers.update(self.workers.signed("POST", url, body))
        try:
            return await self.workers.http.post(url, body, {**headers, **(trace or {})}, self.config.request_timeout_s)
        except TimeoutError:
            raise Timeout(f"The {pool.role} worker did not answer in time.") from None
        except OSError as e:
            pool.mark_failed(worker)
            raise RetryableWorker(worker.url, str(e)) from None

    async def _relay_stream(
        self, request: web.Request, upstream: Response, pd: Worker, trail: Trail, pool: WorkerPool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        for h in ("Content-Type", "Cache-Control"):
            if h in upstream.headers:
                resp.headers[h] = upstream.headers[h]
        trail.stamp(resp)
        await resp.prepare(request)
        await self.relay(resp, upstream, pd, pool)
        return resp

    async def relay(self, resp: web.StreamResponse, upstream: Response, worker: Worker, pool: WorkerPool) -> None:
        """Pass a worker's SSE stream on to a client's prepared response, to its end. A worker
        that breaks off mid-stream is marked failed, and the stream ends with an error event."""
        tail = b""
        failure: str | None = None
        try:
            async for chunk in upstream.iter_chunks():
                await resp.write(chunk)
                tail = (tail + chunk)[-_TAIL:]
            if tail != SSE_DONE:
                failure = "the stream ended early"
        except ConnectionResetError:
            return  # the client left: closing upstream makes the worker abort the request
        except (TimeoutError, OSError) as e:
            failure = str(e) or type(e).__name__
        if failure is not None:
            # a worker that died mid-stream: say so in the stream, then end it cleanly
            log.warning("%s %s failed mid-stream: %s", pool.role, worker.url, failure)
            pool.mark_failed(worker)
            self.metrics.streams_failed.inc()
            err = WorkerFailed("The worker failed while streaming; the answer is incomplete.")
            try:
                await resp.write(sse_error(err) + SSE_DONE)
            except ConnectionResetError:
                return
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
