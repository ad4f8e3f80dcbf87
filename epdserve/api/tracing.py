"""OpenTelemetry traces across the roles (``--otlp-traces-endpoint``, as vLLM names it).

Each role exports its spans over OTLP/HTTP to the endpoint, under its own service name
(``epdserve-router``, ``epdserve-encoder``, ``epdserve-pd`` ...). The trace context travels in the
W3C ``traceparent`` header on every internal call, so one request is one trace: the router's
server span, its client spans for each encode call and the worker call, the encoder's and the
worker's server spans under them, and under the worker's its stages (``preprocess``, ``fetch``,
``queue``, ``prefill``, ``decode``) as child spans. A client's own ``traceparent`` is honoured
(its span becomes the parent of the router's).

Without an endpoint nothing is imported and every call here is a no-op. The SDK and exporter are
the optional extra ``epdserve[tracing]``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any


class Tracing:
    def __init__(self, service: str, endpoint: str) -> None:
        self.enabled = bool(endpoint)
        self._tracer: Any = None
        self._provider: Any = None
        if not endpoint:
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ValueError(
                f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'epdserve[tracing]' ({e})"
            ) from e
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("epdserve")

    @contextlib.contextmanager
    def server_span(self, name: str, headers: Mapping[str, str], **attrs: Any) -> Iterator[Any]:
        """A span for a request this role serves, under the caller's (``traceparent`` in ``headers``);
        yields the span (None when tracing is off)."""
        if not self.enabled:
            yield None
            return
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=dict(headers))
        with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs) as span:
            yield span

    @contextlib.contextmanager
    def client_span(self, name: str, **attrs: Any) -> Iterator[dict[str, str]]:
        """A span for a call this role makes; yields the headers that carry it to the callee."""
        if not self.enabled:
            yield {}
            return
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        with self._tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attrs):
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier)
            yield carrier

    def stages(self, start_ns: int, stages: Mapping[str, float]) -> None:
        """Child spans of the current span, one per stage, laid end to end from ``start_ns``."""
        if not self.enabled:
            return
        at = start_ns
        for name, seconds in stages.items():
            end = at + int(seconds * 1e9)
            self._tracer.start_span(name, start_time=at).end(end_time=end)
            at = end

    @staticmethod
    def set(span: Any, **attrs: Any) -> None:
        if span is not None:
            for key, value in attrs.items():
                span.set_attribute(key, value)

    def shutdown(self) -> None:
        """Export what is pending (role shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()


def wall_ns(perf_t: float) -> int:
    """The wall-clock time in ns of a ``time.perf_counter()`` reading taken a moment ago."""
    return time.time_ns() - int((time.perf_counter() - perf_t) * 1e9)
