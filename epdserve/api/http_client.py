"""A lean HTTP/1.1 client for the calls on every request's path: the router's POSTs to encoders
and language-model workers, their answers read whole or relayed as they stream.

aiohttp's client spends more of a request's CPU time than the rest of the router's handler
(request objects, timers, tracing hooks, cookies, header processing); this client does only what
a call between the roles needs. Connections are kept alive, one pool per worker address, and a
reused connection the worker had closed while idle is replaced once before anything was read
from it. The body is read by ``Content-Length``, by chunks (a chunk's data passed on as it
arrives, not held until the chunk is whole), or to the close; while more than
``HIGH_WATER_BYTES`` of it wait unread, reading pauses, so a slow reader holds the worker back
instead of the router buffering for it. A response read to its end gives its connection back
to the pool; one left unread closes it, so that the worker sees its client leave and aborts the
request.

Errors reading the worker's answer are ``UpstreamError`` (an ``OSError``, never a
``ConnectionResetError``, which the router keeps for its own client leaving); a request past its
deadline is ``TimeoutError``. Header names and values are the caller's, checked for line breaks.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import cast

MAX_HEAD_BYTES = 64 << 10  # a response's status line and headers
HIGH_WATER_BYTES = 1 << 20  # of an answer received and not yet read; past it reading pauses
MAX_IDLE_PER_WORKER = 64  # idle connections kept to one address; more are closed when given back
KEEPALIVE_IDLE_S = 4.0  # an idle connection is dropped before a worker's keep-alive (uvicorn: 5 s) ends it
NO_BODY_STATUSES = frozenset((204, 304))
DEFAULT_PORTS = {"http": 80, "https": 443}


class UpstreamError(OSError):
    """The worker's answer could not be read: refused, reset, closed early or malformed."""


class Headers:
    """A response's headers by case-insensitive name (the last value of a repeated one)."""

    def __init__(self, items: Mapping[str, str]) -> None:
        self._items = dict(items)  # lower-case name -> value

    def get(self, name: str, default: str = "") -> str:
        return self._items.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items


@dataclass(frozen=True)
class _Address:
    scheme: str
    host: str
    port: int

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: what arrived and not yet read, and a waiter for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.received = 0  # bytes of answers read from this connection, in all
        self.closed = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False  # reading paused: the buffer holds HIGH_WATER_BYTES not yet read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received += len(data)
        if len(self.buffer) > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True  # until the reader wants more: a slow reader holds the worker back
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = self.error or exc
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """End the connection, the current wait raising ``exc``."""
        self.error = exc
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def resume(self) -> None:
        """Read again if reading was paused."""
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self) -> None:
        """Until more bytes arrived; ``UpstreamError`` (or the failure set) when none will."""
        if self.closed:
            raise self._why("the worker closed the connection")
        self.resume()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if isinstance(self.error, TimeoutError | UpstreamError):
            raise self.error
        if self.closed and not self.buffer:
            raise self._why("the worker closed the connection")

    def _why(self, what: str) -> BaseException:
        if isinstance(self.error, TimeoutError | UpstreamError):
            return self.error
        return UpstreamError(f"{what}: {self.error}" if self.error else what)


class Response:
    """A worker's answer: status and headers read, the body still on the connection."""

    def __init__(self, client: HttpClient, address: _Address, conn: _Connection, deadline: float | None) -> None:
        self._client, self._address, self._conn = client, address, conn
        self._timer = None if deadline is None else asyncio.get_running_loop().call_at(deadline, self._expire)
        self.status = 0
        self.headers = Headers({})
        self._keep_alive = True
        self._remaining = -1  # body bytes still to read by length; -1 chunked or to the close
        self._chunked = False
        self._chunk_left = 0  # chunked: data bytes of the current chunk still to read
        self._chunk_end = False  # chunked: the CRLF closing a chunk's data is next
        self._done = False  # the body was read to its end

    def _expire(self) -> None:
        self._conn.fail(TimeoutError("the worker did not answer in time"))

    async def start(self) -> None:
        """Read the status line and headers."""
        conn = self._conn
        while (end := conn.buffer.find(b"\r\n\r\n")) < 0:
            if len(conn.buffer) > MAX_HEAD_BYTES:
                raise UpstreamError("the worker's response headers are too long")
            await conn.more()
        head = bytes(conn.buffer[:end]).decode("latin-1")
        del conn.buffer[: end + 4]
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise UpstreamError(f"not an HTTP/1 response: {status_line[:80]!r}")
        items: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise UpstreamError(f"a malformed response header: {line[:80]!r}")
            items[name.lower()] = value.strip()
        self.status, self.headers = int(code), Headers(items)
        connection = items.get("connection", "").lower()
        self._keep_alive = version == "HTTP/1.1" and "close" not in connection
        if self.status < 200 or self.status in NO_BODY_STATUSES:
            self._remaining = 0
        elif "chunked" in items.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in items:
            length = items["content-length"]
            if not length.isdigit():
                raise UpstreamError(f"a malformed Content-Length: {length[:40]!r}")
            self._remaining = int(length)
        else:
            self._keep_alive = False  # the body ends when the worker closes the connection
        self._done = self._remaining == 0

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; ``UpstreamError`` past ``limit`` bytes (the connection is then closed)."""
        pieces, size = [], 0
        async for piece in self.iter_chunks():
            size += len(piece)
            if limit is not None and size > limit:
                self._keep_alive = False
                raise UpstreamError(f"the worker's answer is larger than {limit} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked transfer decoded)."""
        conn = self._conn
        while not self._done:
            if self._chunked:
                piece = await self._next_chunked()
            elif self._remaining >= 0:
                if not conn.buffer:
                    await conn.more()
                piece = bytes(conn.buffer[: self._remaining])
                del conn.buffer[: len(piece)]
                self._remaining -= len(piece)
                self._done = self._remaining == 0
            else:  # to the close
                if not conn.buffer:
                    try:
                        await conn.more()
                    except UpstreamError:
                        if conn.error is not None:
                            raise
                        self._done = True
                        return
                piece = bytes(conn.buffer)
                conn.buffer.clear()
            if piece:
                yield piece

    async def _next_chunked(self) -> bytes:
        """What the buffer holds of the body now (at least a byte, or ``b""`` at its end), chunk
        framing removed: a chunk's data is passed on as it arrives, not held until it is whole."""
        conn, out = self._conn, bytearray()
        while True:
            if self._chunk_left > 0:  # inside a chunk's data
                if conn.buffer:
                    piece = conn.buffer[: self._chunk_left]
                    out += piece
                    del conn.buffer[: len(piece)]
                    self._chunk_left -= len(piece)
                    self._chunk_end = self._chunk_left == 0
                    continue
            elif self._chunk_end:  # the CRLF after a chunk's data
                if len(conn.buffer) >= 2:
                    if conn.buffer[:2] != b"\r\n":
                        raise UpstreamError("a malformed chunk")
                    del conn.buffer[:2]
                    self._chunk_end = False
                    continue
            elif (line_end := conn.buffer.find(b"\r\n")) >= 0:  # a chunk's size line
                size = self._chunk_size(conn.buffer[:line_end])
                del conn.buffer[: line_end + 2]
                if size == 0:
                    return bytes(out) + await self._trailers()
                self._chunk_left = size
                continue
            elif len(conn.buffer) > MAX_HEAD_BYTES:
                raise UpstreamError("a malformed chunk")
            if out:  # all the buffer held; the rest when it is asked for
                return bytes(out)
            await conn.more()

    async def _trailers(self) -> bytes:
        """After the last chunk's line: the trailers, up to the empty line."""
        conn = self._conn
        while True:
            end = conn.buffer.find(b"\r\n")
            if end < 0:
                if len(conn.buffer) > MAX_HEAD_BYTES:
                    raise UpstreamError("the worker's trailers are too long")
                await conn.more()
                continue
            del conn.buffer[: end + 2]
            if end == 0:
                self._done = True
                return b""

    @staticmethod
    def _chunk_size(line: bytearray) -> int:
        text = bytes(line).split(b";", 1)[0].strip()
        try:
            size = int(text, 16)
        except ValueError:
            raise UpstreamError(f"a malformed chunk size: {text[:20]!r}") from None
        if size < 0:
            raise UpstreamError("a malformed chunk size")
        return size

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool when its body was read to
        the end and it may be kept, else it is closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        if self._done and self._keep_alive and not conn.closed and not conn.buffer and conn.error is None:
            conn.resume()  # an idle connection must see the worker close it
            self._client.give_back(self._address, conn)
        else:
            conn.close()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class HttpClient:
    """Kept-alive connections to the workers, one idle pool per address."""

    def __init__(self, keepalive_idle_s: float = KEEPALIVE_IDLE_S) -> None:
        self.keepalive_idle_s = keepalive_idle_s
        self._idle: dict[_Address, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float | None = None) -> Response:
        """POST ``body`` to ``url``; the answer with its status and headers read. A reused
        connection that fails before any byte of the answer is tried once more on a new one."""
        address, path = _split(url)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        request = [self._head(address, path, len(body), headers), body]
        conn = self._take_idle(address)
        if conn is not None:
            before = conn.received
            try:
                return await self._send(address, conn, request, deadline)
            except UpstreamError:
                if conn.received != before:  # part of an answer arrived: the worker saw the request
                    raise
        return await self._send(address, await self._connect(address, deadline), request, deadline)

    async def _send(
        self, address: _Address, conn: _Connection, request: list[bytes], deadline: float | None
    ) -> Response:
        response = Response(self, address, conn, deadline)
        try:
            assert conn.transport is not None
            conn.transport.writelines(request)  # the body is not copied into one buffer with the head
            await response.start()
        except BaseException:
            response.release()
            raise
        return response

    async def _connect(self, address: _Address, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if address.scheme == "https":
            self._tls = self._tls or ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(_Connection, address.host, address.port, ssl=tls)
        except OSError as e:
            raise UpstreamError(f"cannot connect to {address.authority}: {e.strerror or e}") from None
        return conn

    def _take_idle(self, address: _Address) -> _Connection | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_idle_s:
                return conn
            conn.close()
        return None

    def give_back(self, address: _Address, conn: _Connection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) > 8 and idle[0].closed:  # the worker closed some while they waited: drop those
            idle[:] = [c for c in idle if not c.closed]
        if len(idle) >= MAX_IDLE_PER_WORKER:  # after a burst, keep what steady traffic reuses
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    @staticmethod
    def _head(address: _Address, path: str, length: int, headers: Mapping[str, str]) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {address.authority}", f"Content-Length: {length}"]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value:
                raise ValueError(f"a line break or colon in the header {name[:40]!r}")
            lines.append(f"{name}: {value}")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("latin-1")

    def close(self) -> None:
        """Close every idle connection (those in use close when their answers are released)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[_Address, str]:
    """A URL's address and path (a router calls the same few worker URLs, so each is parsed once)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in DEFAULT_PORTS or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return _Address(u.scheme, u.hostname, u.port or DEFAULT_PORTS[u.scheme]), path
