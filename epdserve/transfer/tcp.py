"""The tcp EC connector: the producer keeps put payloads in memory and serves them from a small
data server (asyncio, on its own thread); consumers on any host fetch them over pooled,
authenticated connections.

Wire protocol (integers big-endian)::

    on connect    server -> client  "EPDEC" | version u8 | challenge (32 random bytes)
                  client -> server  HMAC-SHA256(secret, "epd-ec-auth" | challenge)   (32 bytes)
                  server -> client  AUTH_OK (1 byte), or the server closes the connection
    then, one request at a time on a connection:
                  client -> server  op u8 (GET | RELEASE) | token_len u16 | token
      GET         server -> client  OK u8 | header_len u32 | wire header | payload (nbytes)
                                    or MISSING u8 (released, expired or never put)
      RELEASE     server -> client  OK u8

The secret never crosses the wire, and every challenge is fresh, so a recorded handshake cannot
be replayed. Integrity of the payload does not rest on the connection: the consumer checks it
against the checksum in the handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType

import msgspec
import torch
import xxhash

from epdserve.transfer import header as wire
from epdserve.transfer.base import PROTOCOL_VERSION, Handle, TransferError
from epdserve.transfer.config import SECRET_ENV, ECConfig

log = logging.getLogger(__name__)

HELLO = b"EPDEC" + bytes([PROTOCOL_VERSION])
CHALLENGE_BYTES = 32
AUTH_CONTEXT = b"epd-ec-auth"
AUTH_OK = b"\x01"
OP_GET, OP_RELEASE = 1, 2
STATUS_OK, STATUS_MISSING = 0, 1
REQUEST = struct.Struct(">BH")  # op, token length
REPLY = struct.Struct(">BI")  # status, wire-header length
MAX_TOKEN_BYTES = 256
# Reading into a preallocated buffer a few MiB at a time avoids the repeated buffer growth and
# joins of StreamReader.readexactly, which is several times slower on large payloads.
RECV_CHUNK = 4 << 20
MAX_IDLE_PER_PEER = 8
MAX_SWEEP_S = 10.0


def _proof(secret: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, AUTH_CONTEXT + challenge, hashlib.sha256).digest()


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


class TcpLocation(msgspec.Struct):
    """The tcp fields of a handle."""

    host: str  # the producer's data server
    port: int
    token: str  # names this one put on that server (unique per put, unlike the key)


@dataclass(frozen=True)
class _Entry:
    header: bytes  # encoded wire header
    payload: wire.Bytes
    put_at: float  # time.monotonic() of the put, for the TTL


class _Store:
    """Payloads waiting to be fetched, bounded by bytes; shared by the put callers and the server
    thread, hence the lock."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # in put order, for expiry
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, token: str, entry: _Entry) -> None:
        with self._lock:
            self._expire()
            if self._bytes + entry.payload.nbytes > self._capacity:
                raise TransferError(
                    f"the tcp EC producer holds {self._bytes} bytes of {len(self._entries)} unreleased embeddings "
                    f"and cannot take {entry.payload.nbytes} more (tcp_bytes={self._capacity})"
                )
            self._entries[token] = entry
            self._bytes += entry.payload.nbytes

    def get(self, token: str) -> _Entry | None:
        with self._lock:
            self._expire()
            return self._entries.get(token)

    def pop(self, token: str) -> None:
        with self._lock:
            entry = self._entries.pop(token, None)
            if entry is not None:
                self._bytes -= entry.payload.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        deadline = time.monotonic() - self._ttl_s
        while self._entries:
            token, entry = next(iter(self._entries.items()))
            if entry.put_at >= deadline:
                break
            del self._entries[token]
            self._bytes -= entry.payload.nbytes

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


class TcpProducer:
    """Holds put payloads in memory and serves them on ``cfg.tcp_host:port``. Thread-safe."""

    name = "tcp"

    def __init__(self, cfg: ECConfig) -> None:
        if cfg.uses_dev_secret:
            log.warning("the tcp EC connector uses the built-in development secret; set %s", SECRET_ENV)
        self._cfg = cfg
        self._secret = cfg.secret.encode()
        self._store = _Store(cfg.tcp_bytes, cfg.ttl_s)
        try:
            self._listener = socket.create_server((cfg.tcp_host, cfg.tcp_port), backlog=128)
        except OSError as e:
            raise TransferError(f"cannot listen on {cfg.tcp_host}:{cfg.tcp_port} for EC transfers: {e}") from e
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.host = cfg.advertise_host
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._main = self._loop.create_task(self._serve())
        self._thread = threading.Thread(target=self._run, name=f"epd-ec-tcp-{self.port}", daemon=True)
        self._thread.start()

    def put(self, key: str, tensor: torch.Tensor, model_id: str) -> Handle:
        if self._closed:
            raise TransferError("the tcp EC producer is closed")
        src = wire.raw_bytes(tensor)
        payload = wire.new_buffer(src.nbytes)
        header = wire.make_header(key, model_id, tensor, wire.copy_and_checksum(payload, src))
        token = secrets.token_hex(16)
        self._store.add(token, _Entry(wire.encode(header), payload, time.monotonic()))
        return wire.to_handle(header, self.name, host=self.host, port=self.port, token=token)

    @property
    def live_handles(self) -> int:
        return self._store.count

    @property
    def held_bytes(self) -> int:
        return self._store.nbytes

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._main)
        self._loop.close()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        sessions: set[asyncio.Task[None]] = set()
        sweeper = asyncio.create_task(self._sweep())
        try:
            while True:
                conn, _ = await loop.sock_accept(self._listener)
                task = asyncio.create_task(self._session(conn))
                sessions.add(task)
                task.add_done_callback(sessions.discard)
        finally:
            sweeper.cancel()
            for task in list(sessions):
                task.cancel()
            await asyncio.gather(sweeper, *sessions, return_exceptions=True)
            self._listener.close()

    async def _sweep(self) -> None:
        """Drop expired payloads even when no put comes along to do it."""
        while True:
            await asyncio.sleep(min(self._cfg.ttl_s / 4, MAX_SWEEP_S))
            self._store.expire()

    async def _session(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                challenge = secrets.token_bytes(CHALLENGE_BYTES)
                await loop.sock_sendall(conn, HELLO + challenge)
                answer = await asyncio.wait_for(_recv_exactly(loop, conn, 32), self._cfg.timeout_s)
                if not hmac.compare_digest(answer, _proof(self._secret, challenge)):
                    log.warning("refused an EC consumer with a wrong secret from %s", conn.getpeername())
                    return
                await loop.sock_sendall(conn, AUTH_OK)
                while True:
                    op, token_len = REQUEST.unpack(await _recv_exactly(loop, conn, REQUEST.size))
                    if token_len > MAX_TOKEN_BYTES:
                        return  # not our client: drop it
                    token = (await _recv_exactly(loop, conn, token_len)).decode("ascii", "replace")
                    if op == OP_GET:
                        await self._send(loop, conn, token)
                    elif op == OP_RELEASE:
                        self._store.pop(token)
                        await loop.sock_sendall(conn, bytes([STATUS_OK]))
                    else:
                        return
            except (OSError, TimeoutError):
                return  # the consumer went away or stalled; its handles expire by TTL

    async def _send(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, token: str) -> None:
        entry = self._store.get(token)
        if entry is None:
            await loop.sock_sendall(conn, bytes([STATUS_MISSING]))
            return
        await loop.sock_sendall(conn, REPLY.pack(STATUS_OK, len(entry.header)) + entry.header)
        # sock_sendall sends from the view as the socket drains, without copying it
        await loop.sock_sendall(conn, entry.payload.data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join()
        self._store.clear()

    def __enter__(self) -> TcpProducer:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


class TcpConsumer:
    """Fetches tcp handles from any producer; keeps idle authenticated connections per peer."""

    def __init__(self, cfg: ECConfig) -> None:
        if cfg.uses_dev_secret:
            log.warning("the tcp EC connector uses the built-in development secret; set %s", SECRET_ENV)
        self._secret = cfg.secret.encode()
        self._dtypes = cfg.dtypes
        self._timeout_s = cfg.timeout_s
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}

    async def get(self, handle: Handle, rows: int, width: int, model_id: str) -> torch.Tensor:
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes)
        loc = wire.location_of(handle, TcpLocation)
        try:
            return await asyncio.wait_for(self._fetch(header, loc), self._timeout_s)
        except TimeoutError as e:
            raise TransferError(
                f"fetching embeddings for key {header.key!r} from {loc.host}:{loc.port} timed out"
            ) from e

    async def _fetch(self, header: wire.WireHeader, loc: TcpLocation) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        sock = await self._checkout(loc.host, loc.port)
        in_sync = False  # whether the connection may serve another request
        try:
            await loop.sock_sendall(sock, _request(OP_GET, loc.token))
            status = (await _recv_exactly(loop, sock, 1))[0]
            if status == STATUS_MISSING:
                in_sync = True
                raise TransferError(
                    f"embeddings for key {header.key!r} are gone from {loc.host}:{loc.port} "
                    f"(already released, or older than the producer's ttl_s)"
                )
            (header_len,) = struct.unpack(">I", await _recv_exactly(loop, sock, 4))
            if status != STATUS_OK or header_len > wire.MAX_WIRE_HEADER:
                raise TransferError(f"the EC data server at {loc.host}:{loc.port} sent a malformed reply")
            stored = wire.decode(await _recv_exactly(loop, sock, header_len))
            wire.check_same(header, stored, f"{loc.host}:{loc.port}")
            out = wire.new_buffer(header.nbytes)
            digest = await _recv_hashed(loop, sock, out.data)
            in_sync = True
        except OSError as e:
            raise TransferError(
                f"fetching embeddings for key {header.key!r} from {loc.host}:{loc.port} failed: {e}"
            ) from e
        finally:
            if in_sync:
                self._checkin(loc.host, loc.port, sock)
            else:
                sock.close()
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    async def release(self, handle: Handle) -> None:
        """Best effort: if the producer cannot be reached, its TTL reclaims the payload."""
        loc = wire.location_of(handle, TcpLocation)
        try:
            await asyncio.wait_for(self._release(loc), self._timeout_s)
        except (TransferError, OSError, TimeoutError) as e:
            log.warning("could not release EC handle at %s:%s: %s", loc.host, loc.port, e)

    async def _release(self, loc: TcpLocation) -> None:
        loop = asyncio.get_running_loop()
        sock = await self._checkout(loc.host, loc.port)
        try:
            await loop.sock_sendall(sock, _request(OP_RELEASE, loc.token))
            await _recv_exactly(loop, sock, 1)
        except BaseException:
            sock.close()
            raise
        self._checkin(loc.host, loc.port, sock)

    async def _checkout(self, host: str, port: int) -> socket.socket:
        idle = self._idle.get((host, port), [])
        while idle:
            sock = idle.pop()
            if _still_open(sock):
                return sock
            sock.close()
        return await self._connect(host, port)

    def _checkin(self, host: str, port: int, sock: socket.socket) -> None:
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < MAX_IDLE_PER_PEER:
            idle.append(sock)
        else:
            sock.close()

    async def _connect(self, host: str, port: int) -> socket.socket:
        loop = asyncio.get_running_loop()
        where = f"{host}:{port}"
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            raise TransferError(f"cannot reach the EC data server at {where}: {e}") from e
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            hello = await _recv_exactly(loop, sock, len(HELLO) + CHALLENGE_BYTES)
            if hello[: len(HELLO)] != HELLO:
                raise TransferError(f"{where} is not an EC data server speaking protocol version {PROTOCOL_VERSION}")
            await loop.sock_sendall(sock, _proof(self._secret, hello[len(HELLO) :]))
            if await loop.sock_recv(sock, 1) != AUTH_OK:
                raise TransferError(
                    f"the EC data server at {where} refused authentication (is {SECRET_ENV} the same on both sides?)"
                )
        except OSError as e:
            sock.close()
            raise TransferError(f"cannot connect to the EC data server at {where}: {e}") from e
        except BaseException:
            sock.close()
            raise
        return sock

    async def close(self) -> None:
        for idle in self._idle.values():
            for sock in idle:
                sock.close()
        self._idle.clear()


def _request(op: int, token: str) -> bytes:
    encoded = token.encode("ascii", "replace")
    if len(encoded) > MAX_TOKEN_BYTES:
        raise TransferError(f"tcp EC handle token is longer than {MAX_TOKEN_BYTES} bytes")
    return REQUEST.pack(op, len(encoded)) + encoded


async def _recv_hashed(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> str:
    """Receive exactly ``len(view)`` bytes into ``view``, hashing each piece while it is in cache."""
    hasher = xxhash.xxh3_64()
    got, n = 0, len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got : got + RECV_CHUNK])
        if k == 0:
            raise ConnectionError("the EC data server closed the connection mid-payload")
        hasher.update(view[got : got + k])
        got += k
    return hasher.hexdigest()


def _still_open(sock: socket.socket) -> bool:
    """An idle pooled connection is usable unless the server closed it (EOF or error pending)."""
    try:
        sock.recv(1, socket.MSG_PEEK)  # EOF, or bytes nobody asked for: either way, unusable
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False
