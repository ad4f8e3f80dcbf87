"""The bound on request bodies a role holds at once (``api.bodies``), on a real aiohttp app."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from epdserve.api.auth import Access, AuthConfig
from epdserve.api.bodies import BODY_COPIES, BodiesFull, RequestBodies
from epdserve.api.http import BodyTaken, Handler, read_body
from epdserve.api.role_app import role_app
from epdserve.launcher import free_port


@asynccontextmanager
async def serving(
    bodies: RequestBodies, path: str, handler: Handler, access: Access = "open", auth: AuthConfig | None = None
) -> AsyncIterator[str]:
    """A role app with one POST route (and ``/version``) on loopback; yields its base URL."""

    async def nothing() -> None:
        return None

    app = role_app(1 << 20, [("POST", path, handler, access)], nothing, nothing, auth or AuthConfig(), bodies)
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
            read.append(len(await read_body(request)))
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


def test_a_holder_grows_within_the_bound_and_alone_past_it() -> None:
    bodies = RequestBodies(100)
    a, b = bodies.take(0), bodies.take(0)
    a.grow(60)
    b.grow(30)
    with pytest.raises(BodiesFull):
        b.grow(20)  # a holds bytes: refused, and what b held stays counted
    assert bodies.held == 90 and b.nbytes == 30 and bodies.refused == 1
    a.release()
    b.grow(500)  # alone: let through, however large
    assert bodies.held == 530
    b.release()
    assert bodies.held == 0
    with pytest.raises(ValueError):
        b.grow(1)


def test_one_body_is_always_let_through_and_the_bound_is_positive() -> None:
    bodies = RequestBodies(10)
    with bodies.take(BODY_COPIES * 1000):  # nothing held: however large
        assert bodies.held == 4000
    assert bodies.held == 0
    with pytest.raises(ValueError):
        RequestBodies(0)


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"bytes": len(await read_body(request))})


@asynccontextmanager
async def sending(
    base: str, declared: int, sent: bytes
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw connection to ``base``'s ``/echo`` that declares ``declared`` body bytes and has sent
    ``sent`` of them; closed on exit."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
        await writer.drain()
        yield reader, writer
    finally:
        writer.close()


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_a_client_that_sends_its_body_slowly_holds_only_what_it_sent() -> None:
    """A body counts as it arrives: a client that declares a large body and sends it slowly (or
    never) holds the bytes it has sent, not what it declared, and keeps no one else out."""

    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 1000)
        async with serving(bodies, "/echo", echo) as base, sending(base, 500_000, b"x" * 10):
            await until(lambda: bodies.held == BODY_COPIES * 10)
            async with aiohttp.ClientSession() as session, session.post(f"{base}/echo", data=b"y" * 900) as r:
                assert r.status == 200 and (await r.json())["bytes"] == 900
            assert bodies.held == BODY_COPIES * 10

    asyncio.run(main())


def test_bodies_arriving_at_once_are_bounded_while_they_arrive() -> None:
    """A body that would take the role past its bound while it arrives is refused then (429), its
    bytes given back; the one already arriving is served once it has."""

    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 1000)
        async with serving(bodies, "/echo", echo) as base, sending(base, 800, b"a" * 600) as (_, first):
            await until(lambda: bodies.held == BODY_COPIES * 600)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{base}/echo", data=b"b" * 600) as r:
                    assert r.status == 429 and r.headers["Retry-After"]
                    assert "request bodies are held" in (await r.json())["error"]["message"]
                assert bodies.held == BODY_COPIES * 600 and bodies.refused == 1
                first.write(b"a" * 200)  # the rest of the first body: now it is served
                await until(lambda: bodies.held == 0)
                async with session.post(f"{base}/echo", data=b"c" * 900) as r:
                    assert r.status == 200 and (await r.json())["bytes"] == 900

    asyncio.run(main())


def test_a_body_past_the_largest_size_is_refused_before_or_while_it_arrives() -> None:
    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * (4 << 20))
        async with serving(bodies, "/echo", echo) as base, aiohttp.ClientSession() as session:
            async with sending(base, 2 << 20, b"") as (reader, _):  # declared too large: nothing is read
                assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 413")
                assert bodies.held == 0

            async def chunked() -> AsyncIterator[bytes]:  # no declared length
                for _ in range(40):
                    yield b"z" * 65536

            async with session.post(f"{base}/echo", data=chunked()) as r:
                assert r.status == 413 and "exceeds 1048576 bytes" in (await r.json())["error"]["message"]
            assert bodies.held == 0
            async with session.post(f"{base}/echo", data=b"ok") as r:
                assert r.status == 200 and (await r.json())["bytes"] == 2

    asyncio.run(main())


def test_the_body_is_read_once_and_request_read_says_so() -> None:
    """Handlers parse the body the bound read; ``request.read()`` after it fails loudly instead of
    giving an empty body."""

    async def main() -> None:
        seen: list[object] = []

        async def both(request: web.Request) -> web.Response:
            seen.append(await read_body(request))
            try:
                await request.read()
            except BodyTaken as e:
                seen.append(e)
            return web.json_response({})

        bodies = RequestBodies(1 << 20)
        async with (
            serving(bodies, "/both", both) as base,
            aiohttp.ClientSession() as session,
            session.post(f"{base}/both", data=b"payload") as r,
        ):
            assert r.status == 200
        assert seen[0] == b"payload" and isinstance(seen[1], BodyTaken)

    asyncio.run(main())


def test_a_request_its_credential_refuses_is_refused_before_its_body_is_read() -> None:
    """With an API key, a request without it is answered 401 from its headers: its body is never
    read, so it holds none of the bound and none of the role's memory."""

    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 1000)
        auth = AuthConfig(api_key="the-key")
        async with serving(bodies, "/echo", echo, "public", auth) as base:
            async with sending(base, 500_000, b"x" * 10) as (reader, _):  # no key, most of the body unsent
                assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 401")
                assert bodies.held == 0
            headers = {"Authorization": "Bearer the-key"}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{base}/echo", data=b"y" * 900, headers=headers) as r,
            ):
                assert r.status == 200 and (await r.json())["bytes"] == 900

    asyncio.run(main())


def test_a_body_that_stops_arriving_is_dropped_and_gives_its_share_back() -> None:
    """Nothing of a body for ``idle_s``: 408, and what it held is given back; a body that keeps
    arriving, however slowly, is served."""

    async def main() -> None:
        bodies = RequestBodies(BODY_COPIES * 1000, idle_s=0.3)
        async with serving(bodies, "/echo", echo) as base:
            async with sending(base, 800, b"a" * 600) as (reader, _):
                await until(lambda: bodies.held == BODY_COPIES * 600)
                status = await asyncio.wait_for(reader.readline(), 5)
                assert status.startswith(b"HTTP/1.1 408") and bodies.held == 0
            async with sending(base, 10, b"") as (reader, writer):
                for _ in range(10):  # one byte every 0.1 s: slower than the body, never idle for 0.3 s
                    writer.write(b"b")
                    await writer.drain()
                    await asyncio.sleep(0.1)
                assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")

    asyncio.run(main())
