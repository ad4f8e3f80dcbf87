"""A real OTLP/HTTP trace receiver for tests: what each role's exporter sends, decoded with
OpenTelemetry's own protobuf definitions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from epdserve.launcher import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    attributes: dict[str, object]
    start_ns: int
    end_ns: int


@dataclass
class Collector:
    url: str
    spans: list[ReceivedSpan]


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    spans: list[ReceivedSpan] = []
    lock = threading.Lock()

    def value(v) -> object:  # an AnyValue
        return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            req = ExportTraceServiceRequest.FromString(body)
            got = []
            for rs in req.resource_spans:
                service = next((value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        got.append(
                            ReceivedSpan(
                                str(service),
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.kind,
                                {a.key: value(a.value) for a in s.attributes},
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                            )
                        )
            with lock:
                spans.extend(got)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Collector(f"http://127.0.0.1:{port}/v1/traces", spans)
    finally:
        server.shutdown()
        server.server_close()
