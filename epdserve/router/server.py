"""The router: public OpenAI endpoint of an E+PD deployment.

Per chat request: validate; extract the media parts; assign each item an encoder (the pool's
policy) and send the items of one encoder in one ``/v1/encode`` call, all encoders concurrently;
rewrite the parts to metadata-only ``image_embeds`` / ``video_embeds``; forward to a PD worker and
pass its response bytes through untouched (SSE included). Text-only requests skip the encoders.

Failures: an encoder that fails (connection, 5xx) gets its items retried on another encoder; a PD
worker that fails before the first byte is retried once on another (with a fresh encode, since
the first worker may have consumed the handles); otherwise the client gets 502/503/504 JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from epdserve.api.errors import ApiError, BadRequest, PayloadTooLarge, Timeout, Unavailable, WorkerFailed
from epdserve.api.http import Route, json_response, role_app, run_app
from epdserve.api.metrics import Metrics
from epdserve.api.protocol import decode_chat_request
from epdserve.encoder.protocol import EncodedItem, EncodeItem, EncodeRequest, decode_response, encode_request
from epdserve.media.limits import MediaLimits
from epdserve.router.pool import NoWorker, Worker, WorkerPool

log = logging.getLogger(__name__)

MEDIA_TYPES = {"image_url": "image", "video_url": "video"}


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port
    encoders: tuple[str, ...] = ()  # encoder base URLs (more can register at run time)
    pds: tuple[str, ...] = ()  # prefill+decode worker base URLs
    policy: str = "least_outstanding"  # PD worker selection: round_robin | least_outstanding
    encoder_policy: str = "affinity"  # encoder selection: affinity (cache-aware) | round_robin | least_outstanding
    probe_interval_s: float = 2.0  # health probe period
    encode_timeout_s: float = 120.0  # one /v1/encode call
    request_timeout_s: float = 600.0  # one forwarded chat request, end to end
    max_request_bytes: int = 64 << 20  # largest request body
    limits: MediaLimits = field(default_factory=MediaLimits)  # same validation as the PD workers
    forward_raw_media: bool = False  # skip the encoders: PD workers decode and encode media themselves
    max_items_per_encode: int = 32  # items per /v1/encode call (larger groups are split into calls)


@dataclass
class MediaRef:
    """Where a media part sits in the request body, and its encode result."""

    message: int
    part: int
    modality: str
    url: str
    result: EncodedItem | None = None


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.encoders = WorkerPool("encoder", list(config.encoders), config.encoder_policy)
        self.pds = WorkerPool("pd", list(config.pds), config.policy)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        m = self.metrics
        m.gauge("router_encoders_healthy", "healthy encoder workers", lambda: len(self.encoders.healthy))
        m.gauge("router_pds_healthy", "healthy PD workers", lambda: len(self.pds.healthy))
        self.encode_hist = m.histogram("router_encode_seconds", "time to encode a request's media")
        self.ttfb_hist = m.histogram("router_first_byte_seconds", "time to the PD worker's first byte")

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))
        self._probe_task = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probe_task:
            self._probe_task.cancel()
        if self.session:
            await self.session.close()

    async def _probe_loop(self) -> None:
        assert self.session is not None
        while True:
            try:
                await asyncio.gather(self.encoders.probe(self.session), self.pds.probe(self.session))
            except Exception:  # a probe round must never end the loop
                log.exception("health probe round failed")
            await asyncio.sleep(self.config.probe_interval_s)

    # ---- encode ------------------------------------------------------------------------------
    async def encode(self, model: str, refs: list[MediaRef]) -> None:
        """Fill ``ref.result`` for every ref, grouping items per encoder, retrying failed groups."""
        pending = list(refs)
        tried: set[str] = set()
        while pending:
            try:
                groups: dict[str, tuple[Worker, list[MediaRef]]] = {}
                for r in pending:
                    w = self.encoders.pick(exclude=tried, key=r.url)
                    groups.setdefault(w.url, (w, []))[1].append(r)
            except NoWorker:
                raise Unavailable("No healthy encoder worker is available.") from None
            n = self.config.max_items_per_encode
            calls = [(w, rs[i : i + n]) for w, rs in groups.values() for i in range(0, len(rs), n)]
            results = await asyncio.gather(*(self._encode_on(model, w, rs) for w, rs in calls))
            pending = []
            for (w, rs), ok in zip(calls, results, strict=True):
                if not ok:
                    tried.add(w.url)
                    self.metrics.inc("router_encoder_retries_total", help_text="encoder calls retried elsewhere")
                    pending += rs

    async def _encode_on(self, model: str, w: Worker, refs: list[MediaRef]) -> bool:
        """True when the items were encoded; False when the worker failed (retry elsewhere)."""
        assert self.session is not None
        body = encode_request(EncodeRequest(model=model, items=[EncodeItem(r.modality, r.url) for r in refs]))  # type: ignore[arg-type]
        w.outstanding += 1
        try:
            async with self.session.post(
                w.url + "/v1/encode",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.config.encode_timeout_s),
            ) as resp:
                raw = await resp.read()
                if 400 <= resp.status < 500:  # the media itself is bad: the client's error
                    raise _passthrough_error(resp.status, raw)
                if resp.status != 200:
                    self.encoders.mark_failed(w)
                    return False
                out = decode_response(raw)
        except TimeoutError:
            raise Timeout("An encoder did not answer in time.") from None
        except (aiohttp.ClientError, OSError):
            self.encoders.mark_failed(w)
            return False
        finally:
            w.outstanding -= 1
        if len(out.items) != len(refs):
            raise WorkerFailed("An encoder returned a different number of items than requested.")
        for r, item in zip(refs, out.items, strict=True):
            r.result = item
        return True

    # ---- chat --------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.metrics.inc("router_requests_total", help_text="chat requests received")
        req = decode_chat_request(raw, self.config.limits)  # same 400s as the workers would give
        body: dict[str, Any] = msgspec.json.decode(raw)
        refs = [] if self.config.forward_raw_media else _media_refs(body)
        attempts_left = 2
        exclude: set[str] = set()
        while True:
            attempts_left -= 1
            if refs:
                t0 = time.perf_counter()
                await self.encode(req.model, refs)
                self.encode_hist.observe(time.perf_counter() - t0)
                for r in refs:
                    assert r.result is not None
                    body["messages"][r.message]["content"][r.part] = r.result.embeds_part()
            try:
                pd = self.pds.pick(exclude=exclude)
            except NoWorker:
                raise Unavailable("No healthy prefill/decode worker is available.") from None
            try:
                return await self._forward(request, pd, msgspec.json.encode(body))
            except _RetryablePD as e:
                exclude.add(pd.url)
                self.metrics.inc("router_pd_retries_total", help_text="PD calls retried before the first byte")
                if attempts_left <= 0:
                    raise WorkerFailed(f"The prefill/decode worker failed: {e}") from None

    async def _forward(self, request: web.Request, pd: Worker, body: bytes) -> web.StreamResponse:
        assert self.session is not None
        t0 = time.perf_counter()
        pd.outstanding += 1
        try:
            try:
                upstream = await self.session.post(
                    pd.url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
                )
            except TimeoutError:
                raise Timeout("The prefill/decode worker did not answer in time.") from None
            except (aiohttp.ClientError, OSError) as e:
                self.pds.mark_failed(pd)
                raise _RetryablePD(str(e)) from None
            async with upstream:
                if upstream.status >= 500 and upstream.status != 503:
                    raise _RetryablePD(f"HTTP {upstream.status}")
                self.ttfb_hist.observe(time.perf_counter() - t0)
                resp = web.StreamResponse(status=upstream.status)
                for h in ("Content-Type", "Cache-Control"):
                    if h in upstream.headers:
                        resp.headers[h] = upstream.headers[h]
                await resp.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                except ConnectionResetError:
                    pass  # the client left: closing upstream makes the PD worker abort the request
                except (aiohttp.ClientError, TimeoutError) as e:
                    log.warning("PD %s failed mid-response: %s", pd.url, e)  # bytes already sent: just end
                return resp
        finally:
            pd.outstanding -= 1

    # ---- admin -------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        info = await _json_body(request)
        pool = self._pool(info.get("role"))
        url = info.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise BadRequest("url must be an http(s) URL", param="url")
        if request.method == "DELETE":
            return web.json_response({"removed": pool.remove(url)})
        pool.add(url)
        return web.json_response({"registered": url, "role": pool.role})

    def _pool(self, role: object) -> WorkerPool:
        if role == "encoder":
            return self.encoders
        if role == "pd":
            return self.pds
        raise BadRequest("role must be 'encoder' or 'pd'", param="role")

    async def workers(self, request: web.Request) -> web.Response:
        def rows(p: WorkerPool) -> list[dict]:
            return [{"url": w.url, "healthy": w.healthy, "outstanding": w.outstanding} for w in p.workers.values()]

        return web.json_response({"encoders": rows(self.encoders), "pds": rows(self.pds)})

    async def models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for pd in self.pds.healthy:
            try:
                async with self.session.get(pd.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return json_response(await r.read(), r.status)
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        raise Unavailable("No healthy prefill/decode worker is available.")

    async def health(self, request: web.Request) -> web.Response:
        if not self.pds.healthy:
            raise Unavailable("no healthy prefill/decode worker")
        return web.json_response({"status": "ok", "encoders": len(self.encoders.healthy), "pds": len(self.pds.healthy)})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")


class _RetryablePD(Exception):
    pass


def _passthrough_error(status: int, raw: bytes) -> ApiError:
    try:
        err = msgspec.json.decode(raw)["error"]
        message = str(err.get("message"))
    except Exception:
        message = raw[:200].decode(errors="replace")
    if status == 413:
        return PayloadTooLarge(message)
    if status == 504:
        return Timeout(message)
    return BadRequest(message)


async def _json_body(request: web.Request) -> dict:
    try:
        info = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(info, dict):
        raise BadRequest("body must be a JSON object")
    return info


def _media_refs(body: dict[str, Any]) -> list[MediaRef]:
    refs = []
    for mi, m in enumerate(body.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for pi, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_TYPES:
                refs.append(MediaRef(mi, pi, MEDIA_TYPES[kind], part[kind]["url"]))
    return refs


def build_app(router: Router) -> web.Application:
    routes: list[Route] = [
        ("POST", "/v1/chat/completions", router.chat),
        ("GET", "/v1/models", router.models),
        ("GET", "/health", router.health),
        ("GET", "/metrics", router.metrics_text),
        ("GET", "/v1/workers", router.workers),
        ("POST", "/v1/workers", router.register),
        ("DELETE", "/v1/workers", router.register),
    ]
    return role_app(router.config.max_request_bytes, routes, router.start, router.close)


def serve_router(config: RouterConfig) -> None:
    run_app(build_app(Router(config)), config.host, config.port)
