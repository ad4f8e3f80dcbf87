"""The bound on preprocessed media a role holds for its vision tower."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from epdserve.api.errors import Overloaded
from epdserve.engine.config import EngineConfig
from epdserve.launcher import free_port
from epdserve.media.pending import PendingFull, PendingMedia, Reservation, ReservationClosed
from epdserve.pd.config import ServerConfig
from epdserve.pd.generation import Generation
from epdserve.pd.server import build_app
from epdserve.pd.service import ChatService
from epdserve.shapes import ShapesWorld
from tests.held_media import HeldImages


def test_items_are_held_up_to_the_bound_and_given_back() -> None:
    pending = PendingMedia(100)
    a = pending.take(60)
    b = pending.take(40)
    assert pending.held == 100
    with pytest.raises(PendingFull, match="100 B of media already wait"):
        pending.take(1)
    pending.take(0).release()  # a request without pixels is never refused
    assert pending.held == 100 and pending.refused == 1  # a refused take counts nothing
    a.release()
    a.release()  # once only
    assert pending.held == 40
    with pending.take(60):
        assert pending.held == 100
    assert pending.held == 40
    b.release()
    assert pending.held == 0


def test_one_item_is_always_let_through_however_large() -> None:
    pending = PendingMedia(10)
    big = pending.take(1000)  # nothing held: the largest item the processor allows is served
    with pytest.raises(PendingFull):
        pending.take(1)
    big.release()
    pending.take(1).release()
    with pytest.raises(ValueError):
        PendingMedia(0)
    with pytest.raises(ValueError):
        pending.take(-1)


def test_a_reservation_is_settled_to_its_pixels_or_given_back() -> None:
    pending = PendingMedia(100)
    r = Reservation(pending)
    r.take(60)
    r.take(30)  # a second item of the same request
    with pytest.raises(PendingFull):
        Reservation(pending).take(20)
    held = r.settle(50)  # the patches made: less than their preprocessing held
    assert pending.held == 50 and held.nbytes == 50
    with pytest.raises(ReservationClosed):
        r.take(1)  # a thread still preprocessing for a request that was settled or left
    r.close()  # once settled, closing gives nothing back twice
    assert pending.held == 50
    left = Reservation(pending)
    left.take(40)
    left.close()  # its request failed or was abandoned
    assert pending.held == 50
    with pytest.raises(ReservationClosed):
        left.take(1)
    held.release()
    # nothing taken before the pixels were made (a size the header did not give): a bounded take
    first, unknown = pending.take(90), Reservation(pending)
    with pytest.raises(PendingFull):
        unknown.settle(20)
    first.release()
    assert pending.held == 0 and unknown.settle(20).nbytes == 20 and pending.held == 20


def test_takes_from_many_threads_keep_the_count() -> None:
    pending = PendingMedia(1 << 40)

    def work(_: int) -> None:
        for _ in range(500):
            r = Reservation(pending)
            r.take(7)
            r.settle(3).release()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert pending.held == 0


def chat(seed: int | None) -> bytes:
    content: list[dict] = [{"type": "text", "text": "What is in the picture?"}]
    if seed is not None:
        buf = io.BytesIO()
        ShapesWorld(seed).scene().render().save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()


def test_a_server_holds_its_requests_pixels_until_their_first_token_within_its_bound(model_dir: Path) -> None:
    async def main() -> None:
        engine = EngineConfig(max_pending_media_bytes=1, num_kv_blocks=256, max_model_len=1024)
        service = ChatService(ServerConfig(model=model_dir, engine_core="thread", warmup=False, engine=engine))
        runner = web.AppRunner(build_app(service))  # its start-up starts the service
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            _, _, first = await service.prepare(chat(1))
            assert service.pending.held > 0
            with pytest.raises(Overloaded, match="wait for the vision tower") as refused:
                await service.prepare(chat(2))
            assert refused.value.status == 429 and refused.value.headers["Retry-After"]
            _, _, text = await service.prepare(chat(None))  # no pixels: never refused
            text.release()
            first.release()
            _, add, second = await service.prepare(chat(2))
            with second:
                gen, _ = await Generation.started(service, add)
                await gen.aclose()
            # once the core has the request, the front end keeps it without its pixels
            assert add.media[0].pixels is not None and gen.add.media[0].pixels is None
            assert gen.add.prompt_token_ids == add.prompt_token_ids and gen.add.params == add.params
            assert service.pending.held == 0 and service.pending.refused == 1
            # through the HTTP handler: an answered request and a failed one give their bytes back
            async with aiohttp.ClientSession() as session:
                async with session.post(url, data=chat(3)) as r:
                    assert r.status == 200, await r.text()
                assert service.pending.held == 0
                too_long = json.loads(chat(4)) | {"max_tokens": 5000}  # past max_model_len: a 400
                async with session.post(url, json=too_long) as r:
                    assert r.status == 400
                assert service.pending.held == 0
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    scraped = await r.text()
                assert "epd_pending_media_bytes 0.0" in scraped and "epd_pending_media_refused_total 1.0" in scraped
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_media_in_preprocessing_count_from_their_header_and_a_refused_item_is_never_decoded(
    model_dir: Path,
) -> None:
    """An image is counted against the bound from before its pixels are decoded, at what its
    preprocessing will hold; another request past the bound is refused before its pixels are
    decoded or preprocessed, and a request abandoned while its image is preprocessed gives its
    bytes back."""

    async def main() -> None:
        engine = EngineConfig(max_pending_media_bytes=1, num_kv_blocks=256, max_model_len=1024)
        service = ChatService(ServerConfig(model=model_dir, engine_core="thread", warmup=False, engine=engine))
        await service.start()
        processor = service.resolver.processor
        try:
            with HeldImages(processor) as held:
                first = asyncio.ensure_future(service.prepare(chat(1)))
                await held.wait_entered()
                width, height = held.sizes[0]
                assert service.pending.held == processor.footprint("image", 1, width, height)
                with pytest.raises(Overloaded, match="wait for the vision tower"):
                    await service.prepare(chat(2))
                assert len(held.sizes) == 1  # the refused image was not decoded, let alone preprocessed
                held.gate.set()
                _, add, first_held = await first
                pixels = add.media[0].pixels
                assert pixels is not None and service.pending.held == first_held.nbytes == len(pixels.data)
                assert processor.footprint("image", 1, width, height) > first_held.nbytes
                first_held.release()

                held.hold_again()
                left = asyncio.ensure_future(service.prepare(chat(3)))
                await held.wait_entered()
                assert service.pending.held > 0
                left.cancel()  # its client left while its image was preprocessed
                with pytest.raises(asyncio.CancelledError):
                    await left
                assert service.pending.held == 0
                held.gate.set()
                _, _, again = await service.prepare(chat(4))  # the bound is free again
                again.release()
                assert service.pending.held == 0 and service.pending.refused == 1
        finally:
            await service.close()

    asyncio.run(main())
