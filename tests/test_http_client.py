"""The router's lean HTTP/1.1 client against scripted servers on real sockets: bodies by length,
by chunks and to the close, kept-alive connections and when they are not reused, deadlines, and
the errors a worker's broken answer gives."""

from __future__ import annotations

import asyncio
import socket

import pytest

from epdserve.api.http_client import HIGH_WATER_BYTES, MAX_IDLE_PER_WORKER, HttpClient, UpstreamError
from epdserve.launcher import free_port
from tests.scripted_http import Reply, Server, answer


def sends(raw: bytes, wait_for_close: bool = False) -> Reply:
    """A reply that writes ``raw`` and ends the connection (once the client has, if asked)."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(raw)
        await writer.drain()
        if wait_for_close:
            await reader.read()
        return False

    return reply


async def by_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    writer.write(answer(200, b'{"n": %d}' % n, "Content-Type: application/json", "X-Stage: a=1"))
    await writer.drain()
    return True


def test_a_body_by_length_and_the_connection_kept_for_the_next_call() -> None:
    async def run() -> None:
        server = Server(by_length)
        async with server as url:
            client = HttpClient()
            for n in (1, 2, 3):
                async with await client.post(url + "/v1/chat/completions?x=1", b"{}", {"X-Peer": "p"}, 5) as r:
                    assert r.status == 200 and await r.read() == b'{"n": %d}' % n
                    assert r.headers["content-type"] == "application/json" and r.headers.get("X-STAGE") == "a=1"
                    assert "x-stage" in r.headers and r.headers.get("Missing") == ""
            client.close()
        assert server.connections == 1
        line, headers, body = server.requests[0]
        assert line == "POST /v1/chat/completions?x=1 HTTP/1.1" and body == b"{}"
        assert headers["x-peer"] == "p" and headers["host"] == url.removeprefix("http://")

    asyncio.run(run())


def test_a_large_body_goes_whole() -> None:
    async def run() -> None:
        server = Server(by_length)
        async with server as url:
            body = bytes(range(256)) * (20 << 10)  # 5 MiB
            async with await HttpClient().post(url + "/", body, {}, 30) as r:
                await r.read()
        assert server.requests[0][2] == body

    asyncio.run(run())


HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"


@pytest.mark.parametrize(
    ("first", "rest", "first_piece", "rest_pieces"),
    [
        # whole chunks (one with an extension), then the last chunk and a trailer
        (
            b"6\r\ndata: \r\n1;ext=1\r\na\r\n",
            b"A\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"data: a",
            b"0123456789",
        ),
        # one large chunk's first thousand bytes: passed on before the chunk is whole
        (b"%x\r\n" % 100_000 + b"a" * 1000, b"b" * 99_000 + b"\r\n0\r\n\r\n", b"a" * 1000, b"b" * 99_000),
    ],
)
def test_a_chunked_stream_arrives_as_it_is_sent_and_its_connection_is_kept(
    first: bytes, rest: bytes, first_piece: bytes, rest_pieces: bytes
) -> None:
    async def run() -> None:
        go_on = asyncio.Event()

        async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            writer.write(HEAD + first)
            await writer.drain()
            if n == 1:
                await go_on.wait()  # the client must have the first bytes before the rest is sent
            writer.write(rest)
            await writer.drain()
            return True

        server = Server(chunked)
        async with server as url:
            client = HttpClient()
            async with await client.post(url + "/", b"{}", {}, 5) as r:
                pieces = r.iter_chunks()
                assert await anext(pieces) == first_piece
                go_on.set()
                assert b"".join([p async for p in pieces]) == rest_pieces
            async with await client.post(url + "/", b"{}", {}, 5) as r:
                assert await r.read() == first_piece + rest_pieces
        assert server.connections == 1

    asyncio.run(run())


def test_a_slow_reader_holds_a_fast_worker_back() -> None:
    async def run() -> None:
        size = 8 * HIGH_WATER_BYTES
        server = Server(sends(answer(200, b"z" * size), wait_for_close=True))
        async with server as url, await HttpClient().post(url + "/", b"", {}, 30) as r:
            largest = total = 0
            async for piece in r.iter_chunks():
                largest, total = max(largest, len(piece)), total + len(piece)
                await asyncio.sleep(0.02)  # the worker has sent all it could meanwhile
        assert total == size
        assert largest <= 2 * HIGH_WATER_BYTES  # what was received and not yet read stayed bounded

    asyncio.run(run())


def test_after_a_burst_only_so_many_idle_connections_are_kept() -> None:
    async def run() -> None:
        server = Server(by_length)
        async with server as url:
            client = HttpClient()
            answers = [await client.post(url + "/", b"{}", {}, 5) for _ in range(MAX_IDLE_PER_WORKER + 6)]
            for r in answers:  # all at once: one connection each
                await r.read()
                r.release()
            assert server.connections == MAX_IDLE_PER_WORKER + 6
            for _ in range(MAX_IDLE_PER_WORKER + 1):  # one after another: the kept ones are reused
                async with await client.post(url + "/", b"{}", {}, 5) as r:
                    await r.read()
            assert server.connections == MAX_IDLE_PER_WORKER + 6
            answers = [await client.post(url + "/", b"{}", {}, 5) for _ in range(MAX_IDLE_PER_WORKER + 1)]
            assert server.connections == MAX_IDLE_PER_WORKER + 7  # the rest were closed, not kept
            for r in answers:
                r.release()
            client.close()

    asyncio.run(run())


def test_a_body_to_the_close_is_read_and_its_connection_not_reused() -> None:
    async def run() -> None:
        server = Server(sends(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"))
        async with server as url:
            client = HttpClient()
            for _ in range(2):
                async with await client.post(url + "/", b"", {}, 5) as r:
                    assert await r.read() == b"all of it"
        assert server.connections == 2

    asyncio.run(run())


def test_connection_close_and_http_1_0_answers_are_not_reused() -> None:
    async def run() -> None:
        replies = [answer(200, b"a", "Connection: close"), b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nb"]

        async def scripted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            writer.write(replies[n - 1] if n <= 2 else answer(200, b"c"))
            await writer.drain()
            return True

        server = Server(scripted)
        async with server as url:
            client = HttpClient()
            for want in (b"a", b"b", b"c"):
                async with await client.post(url + "/", b"", {}, 5) as r:
                    assert await r.read() == want
        assert server.connections == 3

    asyncio.run(run())


def test_a_kept_connection_the_worker_closed_is_replaced_before_anything_was_read() -> None:
    """The worker ended an idle kept-alive connection just as it was reused (no byte of an answer
    came): the call goes again on a new connection, once."""

    async def closes_the_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # closed without an answer
        return await by_length(reader, writer, n)

    async def run() -> None:
        server = Server(closes_the_second)
        async with server as url:
            client = HttpClient()
            for want in (b'{"n": 1}', b'{"n": 3}'):
                async with await client.post(url + "/", b"", {}, 5) as r:
                    assert await r.read() == want
        assert server.connections == 2 and len(server.requests) == 3

    asyncio.run(run())


def test_an_answer_broken_off_is_an_upstream_error_and_never_sent_again() -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        reply = by_length if n == 1 else sends(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        return await reply(reader, writer, n)

    async def run() -> None:
        server = Server(breaks)
        async with server as url:
            client = HttpClient()
            async with await client.post(url + "/", b"", {}, 5) as r:
                await r.read()
            async with await client.post(url + "/", b"", {}, 5) as r:
                with pytest.raises(UpstreamError) as e:
                    await r.read()
        assert not isinstance(e.value, ConnectionResetError)  # the router keeps that for its client leaving
        assert len(server.requests) == 2

    asyncio.run(run())


def test_a_worker_that_does_not_answer_in_time_is_a_timeout_and_its_connection_closes() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await reader.read()  # until the client closes
        server.closed_by_client.set()
        return False

    async def run() -> None:
        async with server as url:
            with pytest.raises(TimeoutError):
                await HttpClient().post(url + "/", b"", {}, 0.3)
            await asyncio.wait_for(server.closed_by_client.wait(), 5)

    server = Server(silent)
    asyncio.run(run())


def test_a_stream_past_its_deadline_is_a_timeout() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nfirs\r\n")
        await writer.drain()
        await reader.read()
        return False

    async def run() -> None:
        async with Server(stalls) as url, await HttpClient().post(url + "/", b"", {}, 0.5) as r:
            pieces = r.iter_chunks()
            assert await anext(pieces) == b"firs"
            with pytest.raises(TimeoutError):
                await anext(pieces)

    asyncio.run(run())


def test_an_answer_left_unread_closes_its_connection() -> None:
    """A client that left: the worker sees the connection end, and aborts the request."""

    async def streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nfirs\r\n")
        await writer.drain()
        await reader.read()
        server.closed_by_client.set()
        return False

    async def run() -> None:
        async with server as url:
            async with await HttpClient().post(url + "/", b"", {}, 5) as r:
                assert await anext(r.iter_chunks()) == b"firs"
            await asyncio.wait_for(server.closed_by_client.wait(), 5)

    server = Server(streams)
    asyncio.run(run())


@pytest.mark.parametrize(
    "reply",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"y" * (70 << 10),
    ],
)
def test_a_malformed_answer_is_an_upstream_error(reply: bytes) -> None:
    async def run() -> None:
        async with Server(sends(reply, wait_for_close=True)) as url:
            with pytest.raises(UpstreamError):
                async with await HttpClient().post(url + "/", b"", {}, 5) as r:
                    await r.read()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("reply", "closes"),  # closes: the worker ends the connection itself (a body to the close)
    [
        (answer(200, b"x" * 1001), False),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 3
            + b"0\r\n\r\n",
            False,
        ),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 1001, True),
    ],
)
def test_an_answer_past_the_read_limit_is_an_upstream_error_and_its_connection_closes(
    reply: bytes, closes: bool
) -> None:
    async def run() -> None:
        server = Server(sends(reply, wait_for_close=not closes))  # else it waits for the client to close
        async with server as url:
            client = HttpClient()
            async with await client.post(url + "/", b"", {}, 5) as r:
                with pytest.raises(UpstreamError, match="larger than 1000 bytes"):
                    await r.read(1000)
            async with await client.post(url + "/", b"", {}, 5) as r:  # on a new connection, read in full
                assert len(await r.read()) > 1000
        assert server.connections == 2

    asyncio.run(run())


def test_a_refused_connection_is_an_upstream_error() -> None:
    port = free_port()

    async def run() -> None:
        with pytest.raises(UpstreamError, match="cannot connect"):
            await HttpClient().post(f"http://127.0.0.1:{port}/", b"", {}, 5)

    asyncio.run(run())


@pytest.mark.parametrize("header", [{"X-A": "b\r\nX-Injected: 1"}, {"X-A\r\nX-B": "c"}, {"X: Y": "z"}])
def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(header: dict[str, str]) -> None:
    async def run() -> None:
        server = Server(by_length)
        async with server as url:
            with pytest.raises(ValueError):
                await HttpClient().post(url + "/", b"", header, 5)
        assert not server.requests

    asyncio.run(run())


def test_ipv6_addresses_are_bracketed_in_host() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")

    async def run() -> None:
        server = Server(by_length)
        try:
            srv = await asyncio.start_server(server.handle, "::1", 0)
        except OSError:
            pytest.skip("::1 is not configured here")
        port = srv.sockets[0].getsockname()[1]
        async with await HttpClient().post(f"http://[::1]:{port}/", b"", {}, 5) as r:
            assert r.status == 200
        srv.close()
        assert server.requests[0][1]["host"] == f"[::1]:{port}"

    asyncio.run(run())
