"""The bound on request bodies a role holds at once (``api.bodies``), on a real aiohttp app."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from epdserve.api.auth import AuthConfig
from epdserve.api.bodies import BODY_COPIES, RequestBodies
from epdserve.api.http import Handler
from epdserve.api.role_app import role_app
from epdserve.launcher import free_port


@asynccontextmanager
async def serving(bodies: RequestBodies, path: str, handler: Handler) -> AsyncIterator[str]:
    """A role app with one open POST route (and ``/version``) on loopback; yields its base URL."""

    async def nothing() -> None:
        return None

    app = role_app(1 << 20, [("POST", path, handler, "open")], nothing, nothing, AuthConfig(), bodies)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_a_body_past_the_bound_is_refused_unparsed_and_every_body_is_given_back() -> None:
    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 150_000)
        gate, entered, read = asyncio.Event(), asyncio.Event(), []

        async def hold(request: web.Request) -> web.StreamResponse:
            read.append(len(await request.read()))
            entered.set()
            await gate.wait()
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"data: done\n\n")  # a streamed answer holds its body to its end
            return response

        async with serving(bodies, "/hold", hold) as base, aiohttp.ClientSession() as session:
            first = asyncio.ensure_future(session.post(f"{base}/hold", data=b"x" * 100_000))
            await entered.wait()
            assert bodies.held == BODY_COPIES * 100_000
            async with session.post(f"{base}/hold", data=b"y" * 60_000) as r:
                assert r.status == 429 and r.headers["Retry-After"]
                err = await r.json()
            assert err["error"]["code"] == "overloaded" and "request bodies are held" in err["error"]["message"]
            assert read == [100_000]  # the refused request never reached its handler
            async with session.get(f"{base}/version") as r:  # no body: nothing taken, never refused
                assert r.status == 200
            gate.set()
            async with await first as r:
                assert r.status == 200 and await r.read() == b"data: done\n\n"
            assert bodies.held == 0 and bodies.refused == 1
            async with session.post(f"{base}/hold", data=json.dumps({"a": 1})) as r:
                assert r.status == 200 and bodies.held == 0

    asyncio.run(main())


def test_one_body_is_always_let_through_and_the_bound_is_positive() -> None:
    bodies = RequestBodies(10)
    with bodies.take(BODY_COPIES * 1000):  # nothing held: however large
        assert bodies.held == 4000
    assert bodies.held == 0
    with pytest.raises(ValueError):
        RequestBodies(0)


def test_a_client_that_sends_its_body_slowly_holds_none_of_the_bound() -> None:
    """A body counts once it has arrived: a client that declares a large body and sends it slowly
    (or never) keeps no one else out."""

    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 1000)

        async def echo(request: web.Request) -> web.Response:
            return web.json_response({"bytes": len(await request.read())})

        async with serving(bodies, "/echo", echo) as base:
            port = int(base.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:  # declares 500,000 bytes, sends 10
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500000\r\n\r\n" + b"x" * 10)
                await writer.drain()
                await asyncio.sleep(0.2)
                assert bodies.held == 0
                async with aiohttp.ClientSession() as session, session.post(f"{base}/echo", data=b"y" * 900) as r:
                    assert r.status == 200 and (await r.json())["bytes"] == 900
                assert bodies.held == 0
            finally:
                writer.close()

    asyncio.run(main())
