"""The bound on preprocessed media a role holds for its vision tower."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from epdserve.api.errors import Overloaded
from epdserve.engine.config import EngineConfig
from epdserve.launcher import free_port
from epdserve.media.pending import PendingFull, PendingMedia
from epdserve.pd.config import ServerConfig
from epdserve.pd.generation import Generation
from epdserve.pd.server import build_app
from epdserve.pd.service import ChatService
from epdserve.shapes import ShapesWorld


def test_items_are_held_up_to_the_bound_and_given_back() -> None:
    pending = PendingMedia(100)
    a = pending.take(60)
    b = pending.take(40)
    assert pending.held == 100
    with pytest.raises(PendingFull, match="100 B of preprocessed media already wait"):
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
        finally:
            await runner.cleanup()

    asyncio.run(main())
