"""Closed-loop load for the side-by-side benchmarks: N clients, each sending its next request when
the previous one ends (``loadgen``'s loop), and one flat row of numbers per run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from epdserve.bench import loadgen, report
from epdserve.bench.client import RequestResult, encode_request


@dataclass(frozen=True)
class _Request:
    kind: str
    body: bytes


async def closed_loop(
    url: str, payloads: list[tuple[str, dict]], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Send (kind, payload) pairs with ``concurrency`` clients; returns results and wall seconds."""
    requests = [_Request(kind, encode_request(body)) for kind, body in payloads]  # encoded before the clock
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        results = await loadgen.closed_loop(session, url, requests, concurrency, lambda _r: None)
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    """The row the side-by-side tables print: counts, throughput and latency percentiles in ms."""
    s = report.summarize(results, wall)
    return {
        "ok": s.completed,
        "errors": s.requests - s.completed,
        "req_per_s": s.request_throughput,
        "out_tok_per_s": s.output_token_throughput,
        "ttft_p50_ms": 1e3 * s.ttft.p50,
        "ttft_p99_ms": 1e3 * s.ttft.p99,
        "tpot_p50_ms": 1e3 * s.tpot.p50,
        "e2e_p50_ms": 1e3 * s.e2e.p50,
    }
