"""The tcp EC connector: the producer keeps put payloads in memory and serves them from a small
data server (asyncio, on its own thread); consumers on any host fetch them over pooled, mutually
authenticated connections.

Wire protocol (integers big-endian; k = the cluster's "ec-tcp" key; sn, cn = 32 random bytes)::

    on connect    server -> client  "EPDEC" | version u8 | sn
                  client -> server  cn | HMAC(k, "client" | sn | cn)
                  server -> client  AUTH_OK u8 | HMAC(k, "server" | cn | sn), or the server closes
                  both sides        s = HMAC(k, "session" | sn | cn)
    then, one request at a time on a connection (n = 0, 1, 2, ... per connection):
                  client -> server  op u8 (GET | RELEASE) | token_len u16 | token | HMAC(s, n | op | token_len | token)
      GET         server -> client  OK u8 | header_len u32 | wire header | payload (nbytes)
                                    or MISSING u8 (released, expired or never leased)
      RELEASE     server -> client  OK u8
    a request whose MAC does not verify makes the server drop the connection.

The secret never crosses the wire and both nonces are fresh, so neither side can be impersonated by
replaying a recorded handshake. Each side proves the secret to the other, and every request is
bound to the connection's session key and its position on it: a party that relays a handshake
between a real producer and a real consumer ends up holding a connection it cannot issue a single
request on, nor replay one. The token is a handle's lease; a handle is signed, so a consumer only
dials producers of its own cluster. Integrity of the payload does not rest on the connection: the
consumer checks it against the checksum in the handle.
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
from epdserve.transfer import signing
from epdserve.transfer.base import PROTOCOL_VERSION, Handle, InvalidHandle, ProducerFull, TransferError
from epdserve.transfer.config import TCP_PURPOSE, ECConfig

log = logging.getLogger(__name__)

HELLO = b"EPDEC" + bytes([PROTOCOL_VERSION])
NONCE_BYTES = 32
MAC_BYTES = 32
AUTH_OK = b"\x01"
OP_GET, OP_RELEASE = 1, 2
STATUS_OK, STATUS_MISSING = 0, 1
REQUEST = struct.Struct(">BH")  # op, token length
COUNTER = struct.Struct(">Q")
REPLY = struct.Struct(">BI")  # status, wire-header length
MAX_TOKEN_BYTES = 256
# Reading into a preallocated buffer a few MiB at a time avoids the repeated buffer growth and
# joins of StreamReader.readexactly, which is several times slower on large payloads.
RECV_CHUNK = 4 << 20
MAX_IDLE_PER_PEER = 8
MAX_SWEEP_S = 10.0
_GONE = "the embeddings of this EC handle were released or have expired"

CacheKey = tuple[str, str, str, tuple[int, ...]]  # key, model_id, dtype, shape


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def client_proof(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return _mac(key, b"epd-ec/client", sn, cn)


def server_proof(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return _mac(key, b"epd-ec/server", cn, sn)


def session_key(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return _mac(key, b"epd-ec/session", sn, cn)


def request_bytes(session: bytes, counter: int, op: int, token: str) -> bytes:
    """One request, authenticated by the session key and its position on the connection."""
    encoded = token.encode("ascii", "replace")
    if len(encoded) > MAX_TOKEN_BYTES:
        raise TransferError(f"tcp EC handle token is longer than {MAX_TOKEN_BYTES} bytes")
    head = REQUEST.pack(op, len(encoded))
    return head + encoded + _mac(session, COUNTER.pack(counter), head, encoded)


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
    """The tcp fields of a handle (the lease token names the payload on that server)."""

    host: str  # the producer's data server
    port: int


@dataclass
class _Entry:
    header: wire.WireHeader
    encoded: bytes  # the wire header as sent
    payload: wire.Bytes
    leases: int = 0  # live leases on this payload

    @property
    def cache_key(self) -> CacheKey:
        return (self.header.key, self.header.model_id, self.header.dtype, self.header.shape)


@dataclass(frozen=True)
class _Lease:
    entry: _Entry
    deadline: float  # time.monotonic() after which the lease has expired


class _Store:
    """Payloads and their leases, bounded by payload bytes; shared by the put callers and the
    server thread, hence the lock."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._entries: dict[CacheKey, _Entry] = {}
        self._leases: OrderedDict[str, _Lease] = OrderedDict()  # in issue order = expiry order
        self._bytes = 0
        self._lock = threading.Lock()

    def lease(self, cache_key: CacheKey, token: str) -> _Entry | None:
        """A new lease on the stored payload of ``cache_key``, if there is one."""
        with self._lock:
            self._expire()
            entry = self._entries.get(cache_key)
            if entry is not None:
                self._add_lease(token, entry)
            return entry

    def add(self, token: str, entry: _Entry) -> _Entry:
        """Store ``entry`` with one lease (or lease an equal one another put stored meanwhile)."""
        with self._lock:
            self._expire()
            existing = self._entries.get(entry.cache_key)
            if existing is not None:
                self._add_lease(token, existing)
                return existing
            nbytes = entry.payload.nbytes
            if nbytes > self._capacity:
                raise TransferError(
                    f"{nbytes} bytes of embeddings exceed the tcp EC producer's tcp_bytes={self._capacity}"
                )
            if self._bytes + nbytes > self._capacity:
                raise ProducerFull(
                    f"the tcp EC producer holds {self._bytes} bytes of {len(self._entries)} stored embeddings "
                    f"and cannot take {nbytes} more (tcp_bytes={self._capacity})"
                )
            self._entries[entry.cache_key] = entry
            self._bytes += nbytes
            self._add_lease(token, entry)
            return entry

    def _add_lease(self, token: str, entry: _Entry) -> None:
        entry.leases += 1
        self._leases[token] = _Lease(entry, time.monotonic() + self._ttl_s)

    def get(self, token: str) -> _Entry | None:
        with self._lock:
            self._expire()
            lease = self._leases.get(token)
            return lease.entry if lease is not None else None

    def release(self, token: str) -> bool:
        with self._lock:
            lease = self._leases.pop(token, None)
            if lease is not None:
                self._unref(lease.entry)
            return lease is not None

    def _unref(self, entry: _Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            del self._entries[entry.cache_key]
            self._bytes -= entry.payload.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._leases.clear()
            self._bytes = 0

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._leases:
            token, lease = next(iter(self._leases.items()))
            if lease.deadline >= now:
                break
            del self._leases[token]
            self._unref(lease.entry)

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


class TcpProducer:
    """Holds put payloads in memory and serves them on ``cfg.tcp_host:port``. Thread-safe."""

    name = "tcp"

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key
        self._tcp_key = cfg.key(TCP_PURPOSE)
        self._cfg = cfg
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

    def put(self, key: str, tensor: torch.Tensor, model_id: str, levels: int = 1) -> Handle:
        if self._closed:
            raise TransferError("the tcp EC producer is closed")
        src = wire.raw_bytes(tensor)
        draft = wire.make_header(key, model_id, tensor, "0" * 16, levels)
        lease = signing.new_lease()
        entry = self._store.lease((key, model_id, draft.dtype, draft.shape), lease)
        if entry is None:  # not stored yet: copy (outside the lock, it is the slow part)
            payload = wire.new_buffer(src.nbytes)
            header = wire.make_header(key, model_id, tensor, wire.copy_and_checksum(payload, src), levels)
            entry = self._store.add(lease, _Entry(header, wire.encode(header), payload))
        handle = wire.to_handle(entry.header, self.name, host=self.host, port=self.port)
        return signing.issue(handle, self._key, self._cfg.ttl_s, lease)

    def release(self, handle: Handle) -> bool:
        handle = signing.verify(handle, self._key)
        loc = wire.location_of(handle, TcpLocation)
        if handle.get("connector") != self.name or (loc.host, loc.port) != (self.host, self.port):
            return False
        return self._store.release(handle["lease"])

    @property
    def live_handles(self) -> int:
        self._store.expire()
        return self._store.leases

    @property
    def live_entries(self) -> int:
        self._store.expire()
        return self._store.entries

    @property
    def held_bytes(self) -> int:
        self._store.expire()
        return self._store.nbytes

    @property
    def capacity_bytes(self) -> int:
        return self._cfg.tcp_bytes

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
        """Drop expired leases even when no put comes along to do it."""
        while True:
            await asyncio.sleep(min(self._cfg.ttl_s / 4, MAX_SWEEP_S))
            self._store.expire()

    async def _handshake(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
        """The session key, once the client proved the secret (None: drop the connection)."""
        sn = secrets.token_bytes(NONCE_BYTES)
        await loop.sock_sendall(conn, HELLO + sn)
        answer = await asyncio.wait_for(_recv_exactly(loop, conn, NONCE_BYTES + MAC_BYTES), self._cfg.timeout_s)
        cn, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, client_proof(self._tcp_key, sn, cn)):
            log.warning("refused an EC consumer that does not hold the cluster secret")
            return None
        await loop.sock_sendall(conn, AUTH_OK + server_proof(self._tcp_key, sn, cn))
        return session_key(self._tcp_key, sn, cn)

    async def _session(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = await self._handshake(loop, conn)
                if session is None:
                    return
                counter = 0
                while True:
                    head = await _recv_exactly(loop, conn, REQUEST.size)
                    op, token_len = REQUEST.unpack(head)
                    if token_len > MAX_TOKEN_BYTES:
                        return  # not our client: drop it
                    token = await _recv_exactly(loop, conn, token_len)
                    mac = await _recv_exactly(loop, conn, MAC_BYTES)
                    if not hmac.compare_digest(mac, _mac(session, COUNTER.pack(counter), head, token)):
                        log.warning("dropped an EC connection on a request that is not the session's")
                        return
                    counter += 1
                    lease = token.decode("ascii", "replace")
                    if op == OP_GET:
                        await self._send(loop, conn, lease)
                    elif op == OP_RELEASE:
                        self._store.release(lease)
                        await loop.sock_sendall(conn, bytes([STATUS_OK]))
                    else:
                        return
            except (OSError, TimeoutError):
                return  # the consumer went away or stalled; its leases expire by TTL

    async def _send(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, token: str) -> None:
        entry = self._store.get(token)
        if entry is None:
            await loop.sock_sendall(conn, bytes([STATUS_MISSING]))
            return
        await loop.sock_sendall(conn, REPLY.pack(STATUS_OK, len(entry.encoded)) + entry.encoded)
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


@dataclass
class _Conn:
    """An authenticated connection and its request counter."""

    sock: socket.socket
    session: bytes
    sent: int = 0

    def request(self, op: int, token: str) -> bytes:
        data = request_bytes(self.session, self.sent, op, token)
        self.sent += 1
        return data


class TcpConsumer:
    """Fetches tcp handles from producers of its cluster; keeps idle authenticated connections per peer."""

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key if cfg.has_secret else None
        self._tcp_key = cfg.key(TCP_PURPOSE) if cfg.has_secret else b""
        self._dtypes = cfg.dtypes
        self._timeout_s = cfg.timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes, levels)
        loc = wire.location_of(handle, TcpLocation)
        try:
            return await asyncio.wait_for(self._fetch(header, loc, handle["lease"]), self._timeout_s)
        except TimeoutError as e:
            raise TransferError(
                f"fetching embeddings for key {header.key!r} from {loc.host}:{loc.port} timed out"
            ) from e

    async def _fetch(self, header: wire.WireHeader, loc: TcpLocation, token: str) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        conn = await self._checkout(loc.host, loc.port)
        sock = conn.sock
        in_sync = False  # whether the connection may serve another request
        try:
            await loop.sock_sendall(sock, conn.request(OP_GET, token))
            status = (await _recv_exactly(loop, sock, 1))[0]
            if status == STATUS_MISSING:
                in_sync = True
                raise InvalidHandle(_GONE)
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
                self._checkin(loc.host, loc.port, conn)
            else:
                sock.close()
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    async def release(self, handle: Handle) -> None:
        """Release this handle's lease; best effort once the handle verified (if the producer
        cannot be reached, its TTL reclaims the lease)."""
        handle = signing.verify_with(handle, self._key)
        loc = wire.location_of(handle, TcpLocation)
        try:
            await asyncio.wait_for(self._release(loc, handle["lease"]), self._timeout_s)
        except (TransferError, OSError, TimeoutError) as e:
            log.warning("could not release an EC handle at %s:%s: %s", loc.host, loc.port, e)

    async def _release(self, loc: TcpLocation, token: str) -> None:
        loop = asyncio.get_running_loop()
        conn = await self._checkout(loc.host, loc.port)
        try:
            await loop.sock_sendall(conn.sock, conn.request(OP_RELEASE, token))
            await _recv_exactly(loop, conn.sock, 1)
        except BaseException:
            conn.sock.close()
            raise
        self._checkin(loc.host, loc.port, conn)

    async def _checkout(self, host: str, port: int) -> _Conn:
        idle = self._idle.get((host, port), [])
        while idle:
            conn = idle.pop()
            if _still_open(conn.sock):
                return conn
            conn.sock.close()
        return await self._connect(host, port)

    def _checkin(self, host: str, port: int, conn: _Conn) -> None:
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < MAX_IDLE_PER_PEER:
            idle.append(conn)
        else:
            conn.sock.close()

    async def _connect(self, host: str, port: int) -> _Conn:
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
            hello = await _recv_exactly(loop, sock, len(HELLO) + NONCE_BYTES)
            if hello[: len(HELLO)] != HELLO:
                raise TransferError(f"{where} is not an EC data server speaking protocol version {PROTOCOL_VERSION}")
            sn, cn = hello[len(HELLO) :], secrets.token_bytes(NONCE_BYTES)
            await loop.sock_sendall(sock, cn + client_proof(self._tcp_key, sn, cn))
            try:
                reply = await _recv_exactly(loop, sock, len(AUTH_OK) + MAC_BYTES)
            except ConnectionError:
                reply = b""
            if reply[:1] != AUTH_OK:
                raise TransferError(
                    f"the EC data server at {where} refused authentication (is the cluster secret the same on both sides?)"
                )
            if not hmac.compare_digest(reply[1:], server_proof(self._tcp_key, sn, cn)):
                raise TransferError(f"the EC data server at {where} could not prove it holds the cluster secret")
        except OSError as e:
            sock.close()
            raise TransferError(f"cannot connect to the EC data server at {where}: {e}") from e
        except BaseException:
            sock.close()
            raise
        return _Conn(sock, session_key(self._tcp_key, sn, cn))

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.sock.close()
        self._idle.clear()


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
