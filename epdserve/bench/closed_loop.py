"""Closed-loop load: N clients, each sending its next request when the previous one ends."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from epdserve.bench.client import RequestResult, percentile, stream_chat


async def closed_loop(
    url: str, payloads: list[tuple[str, dict]], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Send (kind, payload) pairs with ``concurrency`` clients; returns results and wall seconds."""
    queue = list(reversed(payloads))
    results: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while queue:
                kind, body = queue.pop()
                results.append(await stream_chat(session, url, body, kind))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    toks = sum(r.output_tokens for r in ok)
    return {
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "req_per_s": len(ok) / wall if wall else 0.0,
        "out_tok_per_s": toks / wall if wall else 0.0,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in ok], 99),
        "tpot_p50_ms": 1e3 * percentile([r.tpot for r in ok], 50),
        "e2e_p50_ms": 1e3 * percentile([r.e2e for r in ok], 50),
    }
