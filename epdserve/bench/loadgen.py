"""A load generator for any OpenAI-compatible chat endpoint: closed-loop or Poisson arrivals.

``run_bench(BenchConfig)`` builds every request body first (rendering, data-URL and JSON encoding
are never timed), sends unmeasured warm-up requests, then runs the measured phase and returns a
``BenchResult`` with per-request timings and summaries (``report.summarize``). It also reports its
own CPU time, and ``run_self_test`` runs the same load against ``TrivialServer`` — an in-process
endpoint that answers instantly — to show the client's ceiling.

    closed loop:  C workers, each sends its next request when the previous one ends
    open loop:    request i is sent at t0 + a_i, a_i - a_(i-1) ~ Exp(rate), whatever is in flight
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TextIO

import aiohttp
from aiohttp import web

from epdserve.bench.client import RequestResult, stream_chat
from epdserve.bench.plots import PlottingUnavailable, check_plotting
from epdserve.bench.report import (
    SLO,
    BenchConfig,
    BenchResult,
    SelfTestResult,
    format_result,
    format_self_test,
    result_json,
    self_test_json,
    summarize,
    summarize_by_kind,
    write_json,
    write_plots,
)
from epdserve.bench.workload import BenchRequest, WorkloadConfig, build_workload
from epdserve.config_flags import Flag, add_flags, values

__all__ = ["TrivialServer", "run_bench", "run_self_test", "summarize"]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets in seconds of ``n`` Poisson arrivals at ``rate`` req/s; the first is at 0."""
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Progress:
    """A one-line progress report on a text stream: redrawn in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream: TextIO | None, total: int, label: str) -> None:
        self.stream, self.total, self.label = stream, total, label
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.tty = stream is not None and stream.isatty()
        self._task: asyncio.Task[None] | None = None

    def record(self, r: RequestResult) -> None:
        self.done += 1
        self.failed += not r.ok

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return f"[{self.label}] {self.done}/{self.total} done, {self.failed} failed, {rate:.2f} req/s, {elapsed:.1f} s"

    def _show(self, final: bool = False) -> None:
        if self.stream is None:
            return
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + self._line() + end)
        self.stream.flush()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.5 if self.tty else 5.0)
            self._show()

    def __enter__(self) -> Progress:
        if self.stream is not None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self._show(final=True)


class Sendable(Protocol):
    """What the load loops send: a label and a pre-encoded streaming body (``BenchRequest`` is one)."""

    @property
    def kind(self) -> str: ...

    @property
    def body(self) -> bytes: ...


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[Sendable],
    concurrency: int,
    on_done: Callable[[RequestResult], None],
) -> list[RequestResult]:
    """Send ``requests`` with ``concurrency`` workers; results in send order."""
    results: list[RequestResult | None] = [None] * len(requests)
    order = iter(range(len(requests)))

    async def worker() -> None:
        for i in order:  # the shared iterator hands each index to exactly one worker
            results[i] = r = await stream_chat(session, url, requests[i].body, requests[i].kind)
            on_done(r)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None]


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    requests: list[BenchRequest],
    arrivals: list[float],
    on_done: Callable[[RequestResult], None],
) -> tuple[list[RequestResult], float]:
    """Send request i at ``arrivals[i]`` seconds from now; returns results in send order and the worst send lag."""

    async def send(req: BenchRequest) -> RequestResult:
        r = await stream_chat(session, url, req.body, req.kind)
        on_done(r)
        return r

    t0 = time.perf_counter()
    tasks, lag = [], 0.0
    for req, at in zip(requests, arrivals, strict=True):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, time.perf_counter() - t0 - at)
        tasks.append(asyncio.create_task(send(req)))
    return list(await asyncio.gather(*tasks)), lag


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists."""
    try:
        async with session.get(url + "/v1/models") as resp:
            resp.raise_for_status()
            return str((await resp.json())["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot read the model name from {url}/v1/models ({e}); pass --model") from e


async def run_bench(config: BenchConfig, progress: TextIO | None = None) -> BenchResult:
    """Run one benchmark; a progress line goes to ``progress`` when given (e.g. ``sys.stderr``)."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    # no connection cap: aiohttp's default of 100 would silently limit concurrency and open-loop bursts
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await served_model(session, config.url)
        if progress is not None:
            progress.write(f"[bench] building {config.warmup} + {config.num_requests} requests\n")
        warm = build_workload(config.workload, model, config.warmup, config.seed + 1)
        requests = build_workload(config.workload, model, config.num_requests, config.seed)
        rng = random.Random(config.seed)
        arrivals = poisson_arrivals(len(requests), config.request_rate, rng) if config.open_loop else []
        if warm:
            with Progress(progress, len(warm), "warm-up") as p:
                await closed_loop(session, config.url, warm, config.concurrency, p.record)
        with Progress(progress, len(requests), "bench") as p:
            cpu0, started = time.process_time(), time.perf_counter()
            if arrivals:
                results, lag = await open_loop(session, config.url, requests, arrivals, p.record)
            else:
                results, lag = await closed_loop(session, config.url, requests, config.concurrency, p.record), 0.0
            duration, cpu = time.perf_counter() - started, time.process_time() - cpu0
    return BenchResult(
        config=config,
        model=model,
        results=results,
        started=started,
        duration_s=duration,
        cpu_s=cpu,
        max_send_lag_s=lag,
        summary=summarize(results, duration, config.slo),
        per_kind=summarize_by_kind(results, duration, config.slo),
    )


# ---- self-test: the client's own ceiling -----------------------------------------------------------


class TrivialServer:
    """An OpenAI-style SSE chat endpoint on 127.0.0.1 that answers at once with ``tokens`` one-word chunks.

    It reads the whole body (as a real server must) but does not parse it; usage reports
    ``prompt_tokens`` as body bytes / 4 and ``completion_tokens`` as ``tokens``.
    """

    def __init__(self, tokens: int, model: str = "trivial") -> None:
        self.tokens, self.model = tokens, model
        self._chunk = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
        self._runner: web.AppRunner | None = None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for _ in range(self.tokens):
            await resp.write(self._chunk)
        usage = {"prompt_tokens": len(body) // 4, "completion_tokens": self.tokens}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def __aenter__(self) -> str:
        app = web.Application(client_max_size=1 << 30)  # 50 large images per request exceed the 1 MiB default
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def run_self_test(config: BenchConfig, progress: TextIO | None = None) -> SelfTestResult:
    """``config``'s load (its url and model ignored) against in-process trivial servers on loopback."""
    one = replace(config.workload, output_len=1)
    async with TrivialServer(config.workload.output_len) as url:
        full = await run_bench(replace(config, url=url, model="trivial"), progress)
    async with TrivialServer(1) as url:
        one_token = await run_bench(replace(config, url=url, model="trivial", workload=one), progress)
    return SelfTestResult(full, one_token)


# ---- command line ----------------------------------------------------------------------------------


WORKLOAD_FLAGS = (
    "images_per_request",
    "image_size",
    "prompt_tokens",
    "output_len",
    "exact_output",
    "text_fraction",
    "video_fraction",
    "repeated_fraction",
    Flag("pool_size", "--image-pool"),
)
BENCH_FLAGS = (
    "url",
    "model",
    Flag("num_requests", aliases=("-n",)),
    "warmup",
    "concurrency",
    "request_rate",
    "seed",
    Flag("timeout_s", "--timeout"),
)


def add_cli_flags(s: argparse.ArgumentParser) -> None:
    """The flags of ``epdserve bench``: ``BenchConfig`` and ``WorkloadConfig`` fields, and what to write."""
    add_flags(s, BenchConfig, BENCH_FLAGS)
    s.add_argument(
        "--slo",
        default=None,
        help="goodput SLO, e.g. ttft=500ms,itl=100ms,e2e=2s,tpot=50ms (bare numbers: ms); a request meets "
        "itl when its largest inter-token gap (max ITL) is within the bound",
    )
    add_flags(s.add_argument_group("workload"), WorkloadConfig, WORKLOAD_FLAGS)
    s.add_argument("--out", default=None, help="write config, summaries and per-request timings as JSON here")
    s.add_argument("--plots", default=None, help="write TTFT/TPOT/ITL/E2E histogram+CDF PNGs into this directory")
    s.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    s.add_argument(
        "--self-test",
        action="store_true",
        help="run the load against an in-process instant server on 127.0.0.1 to show the client's own ceiling",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` of ``epdserve bench`` flags (``add_cli_flags``)."""
    given = values(args, BENCH_FLAGS)
    workload = WorkloadConfig(**values(args, WORKLOAD_FLAGS))
    return BenchConfig(**given, workload=workload, slo=SLO.parse(args.slo or ""))


def run_cli(args: argparse.Namespace) -> int:
    """``epdserve bench``: run, print the report, write JSON and plots when asked."""
    try:
        config = config_from_args(args)
        if args.plots:
            check_plotting()  # now, not after the run
    except (ValueError, PlottingUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    progress = None if args.no_progress else sys.stderr
    try:
        if args.self_test:
            st = asyncio.run(run_self_test(config, progress))
            result, text, data = st.full, format_self_test(st), self_test_json(st)
        else:
            result = asyncio.run(run_bench(config, progress))
            text, data = format_result(result), result_json(result)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(text)
    if args.out:
        print(f"wrote {write_json(data, Path(args.out))}")
    if args.plots:
        for path in write_plots(result, Path(args.plots)):
            print(f"wrote {path}")
    return 0 if result.summary.completed else 1
