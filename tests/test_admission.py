"""Admission control: text-only and media requests have their own limits and queues; a request
that waits too long is answered 429 with Retry-After, never a timeout, and text requests go
through while a burst of image requests waits or is turned away."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from epdserve.api.errors import Overloaded
from epdserve.router.admission import AutoLimit, Gate
from epdserve.up import Deployment, Topology
from tests.server_utils import http
from tests.test_topologies import request_set


def test_a_gate_admits_in_order_up_to_its_limit_and_turns_away_after_its_wait() -> None:
    async def main() -> None:
        gate = Gate("media", limit=2, wait_s=0.3, retry_after_s=2)
        order: list[int] = []
        release = asyncio.Event()

        async def request(i: int) -> str:
            try:
                async with gate.admit():
                    order.append(i)
                    await release.wait()
                return "ok"
            except Overloaded as e:
                assert e.retry_after_s == 2
                return "429"

        tasks = [asyncio.create_task(request(i)) for i in range(4)]
        await asyncio.sleep(0.05)
        assert (gate.in_flight, gate.waiting, order) == (2, 2, [0, 1])
        await asyncio.sleep(0.4)  # the two waiting ones give up
        assert (gate.waiting, gate.rejected) == (0, 2)
        release.set()
        assert await asyncio.gather(*tasks) == ["ok", "ok", "429", "429"]
        assert gate.in_flight == 0
        # places pass on in arrival order; a waiter whose client left is skipped
        release.clear()
        slow = Gate("media", limit=1, wait_s=5, retry_after_s=1)
        tasks = [asyncio.create_task(request_on(slow, i, order, release)) for i in range(3)]
        await asyncio.sleep(0.05)
        tasks[1].cancel()
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0] == results[2] == "ok" and isinstance(results[1], asyncio.CancelledError)
        assert order[-2:] == [10, 12] and slow.in_flight == 0 and slow.waiting == 0
        # no limit: everything at once
        free = Gate("text", limit=0, wait_s=0.1, retry_after_s=1)
        async with free.admit(), free.admit(), free.admit():
            assert free.in_flight == 3

    async def request_on(gate: Gate, i: int, order: list[int], release: asyncio.Event) -> str:
        async with gate.admit():
            order.append(10 + i)
            await release.wait()
        return "ok"

    asyncio.run(main())


def test_a_lowered_limit_holds_back_waiters_and_a_raised_one_admits_them() -> None:
    async def main() -> None:
        gate = Gate("media", limit=3, wait_s=5, retry_after_s=1)
        release = [asyncio.Event() for _ in range(5)]
        admitted: list[int] = []

        async def request(i: int) -> None:
            async with gate.admit():
                admitted.append(i)
                await release[i].wait()

        tasks = [asyncio.create_task(request(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert (admitted, gate.waiting) == ([0, 1, 2], 2)
        gate.set_limit(1)
        release[0].set()
        await asyncio.sleep(0.05)
        assert (admitted, gate.in_flight) == ([0, 1, 2], 2)  # over the new limit: nobody takes the place
        release[1].set()
        await asyncio.sleep(0.05)
        assert (admitted, gate.in_flight) == ([0, 1, 2], 1)
        gate.set_limit(3)
        await asyncio.sleep(0.05)
        assert (admitted, gate.in_flight, gate.waiting) == ([0, 1, 2, 3, 4], 3, 0)
        for e in release:
            e.set()
        await asyncio.gather(*tasks)
        assert gate.in_flight == 0

    asyncio.run(main())


def test_auto_limit_halves_the_media_limit_when_text_misses_its_target_and_regrows() -> None:
    gate = Gate("media", limit=0, wait_s=5, retry_after_s=1)
    gate.in_flight = 8  # eight image requests running, no limit yet
    auto = AutoLimit(gate, target_s=0.1, ceiling=0, window_s=1.0, quantile=0.9, min_samples=4)

    def window(start: float, ttfts: list[float]) -> None:
        for t in ttfts:
            auto.observe(t, now=start)
        auto.tick(now=start + 1.0)

    auto.tick(now=0.0)
    window(0.0, [0.05, 0.06, 0.3, 0.4])  # the 90th percentile misses 0.1 s
    assert gate.limit == 4 and auto.decreases == 1
    window(1.0, [0.3] * 4)
    assert gate.limit == 2
    window(2.0, [0.5] * 3)  # too few samples to judge: carried into the next window
    assert gate.limit == 2
    window(3.0, [0.5])
    assert gate.limit == 1
    window(4.0, [0.5] * 4)
    assert gate.limit == 1  # never below one
    # text meets the target again and media requests wait: the limit grows one per window
    gate._queue.extend(asyncio.Future(loop=asyncio.new_event_loop()) for _ in range(3))
    for i in range(3):
        window(5.0 + i, [0.01] * 4)
        assert gate.limit == 2 + i
    # a ceiling (the configured limit) is never passed; no text at all also lets it grow
    gate.limit = 2
    capped = AutoLimit(gate, target_s=0.1, ceiling=4, window_s=1.0)
    for now in (20.0, 21.0, 22.0, 23.0):
        capped.tick(now=now)
    assert gate.limit == 4


def test_a_burst_of_image_requests_waits_or_is_turned_away_while_text_goes_through() -> None:
    d = Deployment(
        Topology.parse("1e+1pd"),
        None,
        port=0,
        extra_pd_args=["--max-model-len", "1024"],
        extra_router_args=["--max-inflight-media", "1", "--admission-wait-s", "0.3"],
    )
    d.start()
    try:
        image = {"model": "shapes-qwen2vl", "max_tokens": 64, "min_tokens": 64, "ignore_eos": True, **request_set()[2]}
        text = {"model": "shapes-qwen2vl", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}

        def post(body: dict) -> tuple[int, str, float]:
            t0 = time.perf_counter()
            r = urllib.request.Request(
                d.url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(r, timeout=120) as resp:
                    resp.read()
                    return resp.status, "", time.perf_counter() - t0
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After", ""), time.perf_counter() - t0

        with ThreadPoolExecutor(10) as pool:
            images = [pool.submit(post, image) for _ in range(6)]
            time.sleep(0.1)
            texts = [pool.submit(post, text) for _ in range(4)]
            image_results = [f.result() for f in images]
            text_results = [f.result() for f in texts]
        assert all(status == 200 for status, _, _ in text_results), text_results
        statuses = sorted(s for s, _, _ in image_results)
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        assert all(retry == "1" for s, retry, _ in image_results if s == 429)
        assert all(seconds < 5 for s, _, seconds in image_results if s == 429)  # turned away, not timed out
        metrics = urllib.request.urlopen(d.url + "/metrics", timeout=10).read().decode()
        assert 'epd_router_admission_rejected_total{class="media"}' in metrics
    finally:
        d.stop()


def test_a_text_ttft_target_lowers_the_media_limit_of_a_live_router() -> None:
    """Text that misses an (unmeetable) 1 ms target makes the router limit image requests to one
    at a time, and image requests are still served, one after another."""
    d = Deployment(
        Topology.parse("1e+1pd"),
        None,
        port=0,
        extra_pd_args=["--max-model-len", "1024"],
        extra_router_args=["--text-ttft-target-ms", "1", "--admission-wait-s", "60"],
    )
    d.start()
    try:
        image = {"model": "shapes-qwen2vl", "max_tokens": 16, "min_tokens": 16, "ignore_eos": True, **request_set()[2]}
        text = {"model": "shapes-qwen2vl", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}

        def post(body: dict) -> int:
            return http("POST", d.url + "/v1/chat/completions", json.dumps(body).encode(), timeout=120)[0]

        def media_limit() -> float:
            metrics = urllib.request.urlopen(d.url + "/metrics", timeout=10).read().decode()
            m = re.search(r'^epd_router_admission_limit\{class="media"\} (\S+)$', metrics, re.MULTILINE)
            assert m is not None, metrics
            return float(m[1])

        assert media_limit() == 0  # no limit until text misses its target
        deadline = time.monotonic() + 30
        while media_limit() == 0 and time.monotonic() < deadline:
            assert post(text) == 200
        assert media_limit() == 1
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(post, [image] * 4)) == [200] * 4
    finally:
        d.stop()


@pytest.mark.parametrize("flag", ["--max-inflight-text", "--max-inflight-media", "--text-ttft-target-ms"])
def test_admission_flags_reach_the_router(flag: str) -> None:
    from epdserve import cli

    args = cli.build_parser(only="router").parse_args(["router", flag, "3", "--admission-wait-s", "2"])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == 3 and args.admission_wait_s == 2
