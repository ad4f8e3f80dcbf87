"""The router: public OpenAI endpoint of an E+PD deployment, as its parts wired together.

Per chat request: validate all of it (body and text size, model, sampling parameters, media
limits, who may send metadata-only parts) *before* any encoder spends time on it; extract the
media parts; assign each item an encoder (the pool's policy) and send the items of one encoder in
one ``/v1/encode`` call, all encoders concurrently; rewrite the parts to metadata-only
``image_embeds`` / ``video_embeds``; forward to a PD worker and pass its response bytes through
untouched (SSE included). Text-only requests skip the encoders. Every internal call carries the
cluster credential; the client's own credentials never leave the router.

Failures:

- an encoder that fails (connection, 5xx) gets its items retried on another encoder; one that
  answers 429 (queue or embedding store full) is skipped for this request but stays healthy; when
  every encoder is busy the client gets 429 with ``Retry-After``;
- a PD worker that fails before the first byte (connection, 5xx, or 503 ``embeddings_unavailable``
  because an encoder died) is retried once with a fresh encode on another worker;
- leases on embeddings the PD worker will not consume (it rejected the request, the request was
  retried, the client left) are given back to their encoders at once (``/v1/release``);
- a worker that dies mid-stream ends the client's stream with an OpenAI-style error event and
  ``[DONE]``; a non-streaming request never sees a partial body (502 JSON instead).

The parts, one concept each:

==========================  ====================================================================
``router.config``           ``RouterConfig``, validated when built
``router.metrics``          every counter and histogram, declared once
``router.workers``          the pools: probing, registration, DNS discovery, the HTTP session
``router.encode``           media to encoders, the media directory, leases and their release
``router.placement``        the worker for a request (kv_aware, adaptive dispatch)
``router.forward``          the call to a worker and the relay of its answer
``router.split``            the E → P → D path
``router.app``              the HTTP handlers, ``build_app`` and ``serve_router``
==========================  ====================================================================
"""

from __future__ import annotations

import logging

from epdserve.api.quota import Quotas
from epdserve.api.role_app import RoleBasics
from epdserve.router.admission import AutoLimit, Gate
from epdserve.router.config import RouterConfig
from epdserve.router.encode import Encodes
from epdserve.router.forward import Forwarder
from epdserve.router.metrics import RouterMetrics
from epdserve.router.placement import Placement
from epdserve.router.split import SplitChat
from epdserve.router.workers import WorkerPools

__all__ = ["Router", "RouterConfig"]

log = logging.getLogger(__name__)


class Router:
    """The parts of one router, sharing its config, metrics and tracing."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.role = RoleBasics(
            "epdserve-router",
            config.otlp_traces_endpoint,
            self._stats_fields,
            config.log_stats_interval_s,
            body_bytes=config.max_inflight_body_bytes,
            prefix="router_",
        )
        self.metrics = RouterMetrics.create(self.role.metrics)
        self.tracing = self.role.tracing
        self.quotas = Quotas(config.quota)  # per-key shares of the public endpoint (api.quota)
        self.gates = {
            "text": Gate("text-only", config.max_inflight_text, config.admission_wait_s, config.retry_after_s),
            "media": Gate("image and video", config.max_inflight_media, config.admission_wait_s, config.retry_after_s),
        }
        self.auto_limit: AutoLimit | None = None
        if config.text_ttft_target_ms > 0:
            media = self.gates["media"]
            self.auto_limit = AutoLimit(media, config.text_ttft_target_ms / 1e3, ceiling=config.max_inflight_media)
        gates, m = self.gates, self.metrics.registry
        m.gauge("router_quota_rejected_total", "requests answered 429 for their key's share",
                lambda: self.quotas.rejected, monotonic=True)  # fmt: skip
        m.counts("router_admission_limit", "requests admitted at once, by class (0: no limit)", "class",
                 lambda: {k: g.limit for k, g in gates.items()}, monotonic=False)  # fmt: skip
        m.counts("router_admission_in_flight", "requests admitted and not done, by class", "class",
                 lambda: {k: g.in_flight for k, g in gates.items()}, monotonic=False)  # fmt: skip
        m.counts("router_admission_waiting", "requests waiting for admission, by class", "class",
                 lambda: {k: g.waiting for k, g in gates.items()}, monotonic=False)  # fmt: skip
        m.counts("router_admission_rejected_total", "requests answered 429 after waiting for admission, by class",
                 "class", lambda: {k: g.rejected for k, g in gates.items()})  # fmt: skip
        tick = self.auto_limit.tick if self.auto_limit is not None else None
        self.workers = WorkerPools(config, m, tick)
        self.encodes = Encodes(config, self.metrics, self.workers, self.tracing)
        self.placement = Placement(config, self.metrics, self.workers, self.encodes)
        self.forwarder = Forwarder(config, self.metrics, self.workers, self.tracing, self.auto_limit)
        self.split = SplitChat(
            config, self.metrics, self.workers, self.encodes, self.placement, self.forwarder, self.tracing
        )

    async def start(self) -> None:
        await self.workers.start()
        await self.encodes.start()
        self.role.start()  # no registration: workers register with the router

    def _stats_fields(self, seconds: float) -> dict[str, object]:
        w = self.role.take_window()
        return {
            "req_per_s": w["requests"] / seconds,
            "in_flight": sum(wk.outstanding for wk in self.workers.lm_workers),
            **{f"{pool.role}s_healthy": len(pool.healthy) for pool in self.workers.pools if pool.workers},
        }

    async def close(self) -> None:
        # the RoleBasics steps split around the parts: the tracer goes last, after the last calls
        await self.role.stats_line.stop()
        self.workers.stop_probing()
        await self.encodes.drain()  # lease releases still running need the session
        await self.workers.close()
        await self.encodes.close()
        self.placement.close()
        self.tracing.shutdown()
