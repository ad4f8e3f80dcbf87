"""The encoder service in-process, with faults injected into the tower and the real shm producer."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from epdserve.api.auth import AuthConfig
from epdserve.encoder.app import build_app
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION
from epdserve.encoder.server import EncoderConfig, EncoderService
from epdserve.launcher import free_port
from epdserve.security.credentials import ClusterCredential
from epdserve.shapes import ShapesWorld
from epdserve.transfer.base import TransferError
from epdserve.transfer.config import ECConfig
from tests.held_media import HeldImages
from tests.server_utils import signed_headers

torch.set_num_threads(1)

MODEL = "shapes-qwen2vl"


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    ShapesWorld(seed).scene().render().save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(seed: int) -> dict:
    return {
        "version": ENCODER_PROTOCOL_VERSION,
        "model": MODEL,
        "items": [{"modality": "image", "url": image_url(seed)}],
    }


Scenario = Callable[[EncoderService, Callable[[dict], Awaitable[tuple[int, dict]]]], Awaitable[None]]


def run(model_dir: Path, scenario: Scenario, **config: object) -> None:
    """Serve an ``EncoderService`` on loopback and run ``scenario(service, post)`` against it."""

    async def main() -> None:
        ec = ECConfig(shm_bytes=1 << 20, instance="test-encoder-service")
        auth = AuthConfig(cluster=ClusterCredential.load())
        service = EncoderService(EncoderConfig(model=model_dir, threads=1, ec=ec, auth=auth, **config))  # type: ignore[arg-type]
        runner = web.AppRunner(build_app(service), handler_cancellation=True)  # as a role runs it
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:

                async def post(payload: dict) -> tuple[int, dict]:
                    url = f"http://127.0.0.1:{port}/v1/encode"
                    body = json.dumps(payload).encode()
                    headers = {"Content-Type": "application/json", **signed_headers("POST", url, body)}
                    async with session.post(url, data=body, headers=headers) as r:
                        return r.status, {**await r.json(), "retry_after": r.headers.get("Retry-After")}

                await scenario(service, post)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_failing_forward_is_a_500_for_its_request_only(model_dir: Path) -> None:
    async def scenario(service: EncoderService, post) -> None:
        real = service.batcher.visual
        calls = 0

        def flaky(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("injected fault")
            return real(pixels, grid)

        service.batcher.visual = flaky
        status, err = await post(body(1))
        assert status == 500
        assert "vision forward failed: RuntimeError: injected fault" in err["error"]["message"]
        assert err["error"]["code"] == "encode_failed"
        status, ok = await post(body(1))  # same item: not poisoned in the cache, recomputed
        assert status == 200 and ok["items"][0]["status"] == "computed"
        assert service.batcher.alive

    run(model_dir, scenario)


def test_a_failing_put_is_a_503_and_the_next_request_works(model_dir: Path) -> None:
    async def scenario(service: EncoderService, post) -> None:
        real = service.producer.put
        calls = 0

        def flaky(key: str, tensor: torch.Tensor, model_id: str, levels: int = 1):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise TransferError("injected transfer fault")
            return real(key, tensor, model_id, levels)

        service.producer.put = flaky  # type: ignore[method-assign]
        status, err = await post(body(2))
        assert status == 503 and "injected transfer fault" in err["error"]["message"]
        status, ok = await post(body(2))
        assert status == 200 and ok["items"][0]["status"] == "cache_hit"  # the forward's result was kept

    run(model_dir, scenario)


def test_a_full_shm_slab_is_a_429_not_a_crash(model_dir: Path) -> None:
    """Handles nobody releases fill the real slab; the encoder says "retry later" and keeps serving."""

    async def scenario(service: EncoderService, post) -> None:
        statuses = []
        for seed in range(300):  # ~13 KiB per put, 1 MiB slab
            status, resp = await post(body(1000 + seed))
            statuses.append(status)
            if status != 200:
                break
        assert statuses[-1] == 429 and set(statuses[:-1]) == {200}
        assert resp["error"]["type"] == "rate_limit_error" and resp["retry_after"] == "1"
        assert "/dev/shm" not in resp["error"]["message"]
        assert service.batcher.alive
        # a repeat of a stored item leases the stored copy: it still fits
        status, ok = await post(body(1000))
        assert status == 200 and ok["items"][0]["status"] == "cache_hit"

    run(model_dir, scenario)


async def running_held(
    service: EncoderService, request: Awaitable[tuple[int, dict]]
) -> tuple[asyncio.Event, asyncio.Future]:
    """``request`` sent and its forward started, held until the returned event is set (as is every
    forward after it)."""
    real = service.batcher.visual
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def held(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        return real(pixels, grid)

    service.batcher.visual = held
    warm_up = service.batcher.batches  # the service's own warm-up forward
    first = asyncio.ensure_future(request)
    while service.batcher.batches == warm_up:
        await asyncio.sleep(0.01)
    return gate, first


def test_an_overloaded_queue_is_a_429(model_dir: Path) -> None:
    async def scenario(service: EncoderService, post) -> None:
        gate, first = await running_held(service, post(body(4)))
        second = asyncio.ensure_future(post(body(5)))  # queued: the queue is full
        while service.batcher.queue_depth == 0:
            await asyncio.sleep(0.01)
        status, err = await post(body(6))
        assert status == 429 and err["error"]["type"] == "rate_limit_error"
        gate.set()
        assert (await first)[0] == 200 and (await second)[0] == 200

    run(model_dir, scenario, max_queued_items=1)


def test_media_past_the_pending_bound_is_a_429_and_given_back(model_dir: Path) -> None:
    """Bounded at one byte, an encoder holds one item's pixels at a time: another item waits at its
    client (429) while the first is in the tower, and each item's bytes are given back however its
    call ends."""

    async def scenario(service: EncoderService, post) -> None:
        real = service.batcher.visual

        def failing(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("injected fault")

        gate, first = await running_held(service, post(body(7)))
        assert service.pending.held > 0
        status, err = await post(body(8))
        assert status == 429 and err["error"]["type"] == "rate_limit_error" and err["retry_after"] == "1"
        assert "wait for the vision tower" in err["error"]["message"]
        gate.set()
        assert (await first)[0] == 200 and service.pending.held == 0
        service.batcher.visual = failing
        assert (await post(body(8)))[0] == 500 and service.pending.held == 0
        service.batcher.visual = real
        status, ok = await post(body(8))
        assert status == 200 and ok["items"][0]["status"] == "computed" and service.pending.held == 0
        assert service.pending.refused == 1

    run(model_dir, scenario, max_pending_media_bytes=1)


def test_an_item_counts_from_its_header_and_one_past_the_bound_is_never_decoded(model_dir: Path) -> None:
    """An item in preprocessing holds what its preprocessing will hold from before its pixels are
    decoded; another is refused (429) without being decoded; a caller that leaves during the
    preprocessing gives its bytes back."""

    async def scenario(service: EncoderService, post) -> None:
        assert service.resolver is not None
        processor = service.resolver.processor
        with HeldImages(processor) as held:
            first = asyncio.ensure_future(post(body(30)))
            await held.wait_entered()
            assert service.pending.held == processor.footprint("image", 1, *held.sizes[0])
            status, err = await post(body(31))
            assert status == 429 and "wait for the vision tower" in err["error"]["message"]
            assert len(held.sizes) == 1  # not decoded, not preprocessed
            held.gate.set()
            assert (await first)[0] == 200 and service.pending.held == 0
            held.hold_again()
            left = asyncio.ensure_future(post(body(32)))
            await held.wait_entered()
            left.cancel()  # the caller closes its connection
            await until(lambda: service.pending.held == 0)
        assert (await post(body(33)))[0] == 200 and service.pending.held == 0

    run(model_dir, scenario, max_pending_media_bytes=1)


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_caller_that_leaves_costs_no_forward_and_no_lease(model_dir: Path) -> None:
    """An item whose caller left while it was queued is never encoded and its pixels are given
    back; a put its caller left during gives its leases back once done."""

    async def scenario(service: EncoderService, post) -> None:
        gate, first = await running_held(service, post(body(20)))
        held_by_first = service.pending.held
        left = asyncio.ensure_future(post(body(21)))
        await until(lambda: service.batcher.queue_depth == 1)
        left.cancel()  # the caller closes its connection
        await until(lambda: service.pending.held == held_by_first)
        gate.set()
        assert (await first)[0] == 200
        forwards = service.batcher.batches
        await until(lambda: service.batcher.queue_depth == 0)
        await asyncio.sleep(0.2)
        assert service.batcher.batches == forwards and service.pending.held == 0

        real_put, putting, release = service.producer.put, threading.Event(), threading.Event()

        def slow_put(key: str, tensor: torch.Tensor, model_id: str, levels: int = 1):
            putting.set()
            release.wait(10)
            return real_put(key, tensor, model_id, levels)

        service.producer.put = slow_put  # type: ignore[method-assign]
        live = service.producer.live_handles
        left = asyncio.ensure_future(post(body(22)))
        await until(putting.is_set)
        left.cancel()
        await asyncio.sleep(0.2)  # the handler is cancelled while the put goes on
        release.set()
        await until(lambda: service.producer.live_handles == live)
        service.producer.put = real_put  # type: ignore[method-assign]
        assert (await post(body(23)))[0] == 200 and service.producer.live_handles == live + 1

    run(model_dir, scenario)


def test_a_forward_every_caller_left_stops_at_its_next_layer(model_dir: Path) -> None:
    async def scenario(service: EncoderService, post) -> None:
        gate, left = await running_held(service, post(body(40)))
        left.cancel()  # its only caller leaves while its forward is under way
        await until(lambda: service.pending.held == 0)
        gate.set()
        await until(lambda: service.batcher.abandoned == 1)
        assert service.batcher.alive
        status, ok = await post(body(40))  # nothing of the stopped forward was kept
        assert status == 200 and ok["items"][0]["status"] == "computed"
        assert service.batcher.abandoned == 1

    run(model_dir, scenario)
