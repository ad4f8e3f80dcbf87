"""The shm EC connector: one /dev/shm slab per producer, created once at start and mapped by every
consumer on the host, so a handoff is two memcpys and no system call.

Slab layout (every region starts 64-byte aligned)::

    0             64
    | slab header | region | region |  free  | region |  free ...  | shm_bytes
                  |
                  +-> | region header (64 B) | wire header JSON, padded to 64 | payload |

    slab header:   magic "EPDECSLB" | layout u32 | pad u32 | nonce u64 | size u64 | owner pid u64
    region header: magic "EPDR" | header_len u32 | generation u64 | released u64 | unused

Invariants that make a handle safe to read and release without any RPC:

- ``generation`` is non-zero exactly while the region is live; generations are never reused
  within a slab, and the producer writes 0 *before* any byte of a reclaimed region is reused.
  A consumer checks the generation before and after copying, so a reclaimed region is reported
  as such (and the checksum catches anything that slips between the checks).
- A consumer releases by writing the generation it read into ``released``; the producer frees a
  region only when ``released == generation``. One aligned 8-byte store, no lock: a late release
  of a reclaimed region writes a stale generation and frees nothing.
- The producer holds an exclusive flock on its slab for its lifetime. A slab is stale when the
  pid in its name is gone and nobody holds its lock; the next producer start removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import time
from bisect import insort
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import msgspec
import numpy as np
import torch

from epdserve.transfer import header as wire
from epdserve.transfer.base import Handle, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.owners import pid_alive

ALIGN = 64
SLAB_MAGIC = b"EPDECSLB"
SLAB_LAYOUT = 1
SLAB_HEADER = struct.Struct("<8sIIQQQ")  # magic, layout, pad, nonce, size, pid
SLAB_HEADER_BYTES = 64
REGION_MAGIC = b"EPDR"
REGION_PREFIX = struct.Struct("<4sI")  # magic, header_len
WORD = struct.Struct("@Q")  # native order: one aligned store, never torn byte by byte
GENERATION_AT = 8
RELEASED_AT = 16
REGION_HEADER_BYTES = 64
SLAB_RE = re.compile(r"epd-ec-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-(?P<nonce>[0-9a-f]{16})")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def slab_name(instance: str, pid: int, nonce: int) -> str:
    return f"epd-ec-{instance}-{pid}-{nonce:016x}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def remove_stale_slabs(shm_dir: Path) -> list[Path]:
    """Unlink the slabs of producers that died without closing; returns what was removed."""
    removed = []
    for path in shm_dir.glob("epd-ec-*"):
        m = SLAB_RE.fullmatch(path.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            # The pid may have been recycled or live in another pid namespace; the lock is the
            # authority on whether the owner is still running.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class _FreeList:
    """First-fit allocator over ``[start, end)`` that coalesces neighbours on free."""

    def __init__(self, start: int, end: int) -> None:
        self._extents: list[tuple[int, int]] = [(start, end - start)]  # (offset, size), sorted

    def alloc(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._extents):
            if free >= size:
                if free == size:
                    del self._extents[i]
                else:
                    self._extents[i] = (offset + size, free - size)
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        insort(self._extents, (offset, size))
        merged: list[tuple[int, int]] = []
        for off, sz in self._extents:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._extents = merged

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._extents)

    @property
    def largest(self) -> int:
        return max((size for _, size in self._extents), default=0)


@dataclass(frozen=True)
class _Region:
    offset: int
    size: int
    generation: int
    put_at: float  # time.monotonic() of the put, for the TTL


class ShmLocation(msgspec.Struct):
    """The shm fields of a handle."""

    path: str  # the slab file
    slab: str  # the slab's nonce (hex), so a handle never reads another producer's slab
    offset: int  # where the region starts in the slab
    generation: int  # the region's generation when it was put


class ShmProducer:
    """Owns one slab; ``put`` copies a tensor into a free region. Thread-safe."""

    name = "shm"

    def __init__(self, cfg: ECConfig) -> None:
        self._cfg = cfg
        shm_dir = Path(cfg.shm_dir)
        remove_stale_slabs(shm_dir)
        self._nonce = secrets.randbits(64)
        self.path = shm_dir / slab_name(cfg.instance, os.getpid(), self._nonce)
        self._size = cfg.shm_bytes // ALIGN * ALIGN
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise TransferError(f"cannot create the EC slab {self.path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Reserve the memory now: a tmpfs that runs out under a sparse file answers a write with
            # SIGBUS, which would kill the encoder instead of failing one request.
            os.posix_fallocate(fd, 0, self._size)
            mm = mmap.mmap(fd, self._size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise TransferError(f"cannot allocate the {self._size}-byte EC slab {self.path}: {e}") from e
        SLAB_HEADER.pack_into(mm, 0, SLAB_MAGIC, SLAB_LAYOUT, 0, self._nonce, self._size, os.getpid())
        self._fd = fd  # kept open for the lifetime lock
        self._mm: mmap.mmap | None = mm
        self._free = _FreeList(SLAB_HEADER_BYTES, self._size)
        self._live: dict[int, _Region] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def put(self, key: str, tensor: torch.Tensor, model_id: str) -> Handle:
        src = wire.raw_bytes(tensor)
        # Checksums are fixed-length hex, so the header's size is known before the payload is hashed.
        header_len = len(wire.encode(wire.make_header(key, model_id, tensor, "0" * 16)))
        data_at = REGION_HEADER_BYTES + _align(header_len)
        size = _align(data_at + src.nbytes)
        with self._lock:
            mm = self._mm
            if mm is None:
                raise TransferError("the shm EC producer is closed")
            offset = self._allocate(size)
            self._generation += 1
            generation = self._generation
            try:
                dst = np.frombuffer(mm, np.uint8, src.nbytes, offset + data_at)
                header = wire.make_header(key, model_id, tensor, wire.copy_and_checksum(dst, src))
                del dst  # a live numpy view would keep the mapping from closing
            except BaseException:
                self._free.free(offset, size)
                raise
            encoded = wire.encode(header)
            mm[offset + REGION_HEADER_BYTES : offset + REGION_HEADER_BYTES + len(encoded)] = encoded
            REGION_PREFIX.pack_into(mm, offset, REGION_MAGIC, len(encoded))
            WORD.pack_into(mm, offset + RELEASED_AT, 0)
            WORD.pack_into(mm, offset + GENERATION_AT, generation)  # last: publishes the region
            self._live[offset] = _Region(offset, size, generation, time.monotonic())
        location = ShmLocation(str(self.path), f"{self._nonce:016x}", offset, generation)
        return wire.to_handle(header, self.name, **msgspec.structs.asdict(location))

    def _allocate(self, size: int) -> int:
        if size > self._size - SLAB_HEADER_BYTES:
            raise TransferError(
                f"{size} bytes of embeddings do not fit in the {self._size}-byte EC slab (raise shm_bytes)"
            )
        self._reclaim()
        offset = self._free.alloc(size)
        if offset is None:
            raise TransferError(
                f"the EC slab is full: {len(self._live)} unreleased embeddings hold "
                f"{self._size - self._free.free_bytes} of {self._size} bytes, {size} more needed "
                f"(consumers are not releasing, or shm_bytes is too small)"
            )
        return offset

    def _reclaim(self) -> None:
        """Free released regions and regions older than the TTL (their consumers crashed or hung)."""
        mm = self._mm
        if mm is None:
            return
        deadline = time.monotonic() - self._cfg.ttl_s
        for region in list(self._live.values()):
            (released,) = WORD.unpack_from(mm, region.offset + RELEASED_AT)
            if released == region.generation or region.put_at < deadline:
                WORD.pack_into(mm, region.offset + GENERATION_AT, 0)  # invalidate before reuse
                del self._live[region.offset]
                self._free.free(region.offset, region.size)

    @property
    def live_handles(self) -> int:
        """Regions put and not yet reclaimed (reclaiming happens lazily, at the next put)."""
        return len(self._live)

    @property
    def slab_bytes(self) -> int:
        return self._size

    @property
    def free_bytes(self) -> int:
        return self._free.free_bytes

    def close(self) -> None:
        with self._lock:
            mm, self._mm = self._mm, None
            if mm is None:
                return
            with contextlib.suppress(BufferError):  # a caller still holds a view; GC unmaps it
                mm.close()
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._live.clear()

    def __enter__(self) -> ShmProducer:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class _Mapping:
    mm: mmap.mmap
    nonce: str
    inode: int


class ShmConsumer:
    """Reads shm handles of any producer on the host; keeps one mapping per slab."""

    def __init__(self, cfg: ECConfig) -> None:
        self._dir = os.path.realpath(cfg.shm_dir)
        self._dtypes = cfg.dtypes
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    async def get(self, handle: Handle, rows: int, width: int, model_id: str) -> torch.Tensor:
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes)
        location = wire.location_of(handle, ShmLocation)
        if header.nbytes >= wire.THREAD_BYTES:
            return await asyncio.to_thread(self._read, header, location)
        return self._read(header, location)

    def _read(self, header: wire.WireHeader, loc: ShmLocation) -> torch.Tensor:
        mm = self._mapping(loc.path, loc.slab)
        header_len = self._check_region(mm, loc, header.key)
        stored_at = loc.offset + REGION_HEADER_BYTES
        wire.check_same(header, wire.decode(mm[stored_at : stored_at + header_len]), f"{loc.path}@{loc.offset}")
        data_at = stored_at + _align(header_len)
        if data_at + header.nbytes > len(mm):
            raise TransferError(f"shm handle for key {header.key!r} points past the end of its slab")
        out = wire.new_buffer(header.nbytes)
        src = np.frombuffer(mm, np.uint8, header.nbytes, data_at)
        digest = wire.copy_and_checksum(out, src)
        del src
        self._check_region(mm, loc, header.key)  # reclaimed while we copied?
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    @staticmethod
    def _check_region(mm: mmap.mmap, loc: ShmLocation, key: str) -> int:
        """The region's wire-header length, if the region is still the one the handle names."""
        if loc.offset < SLAB_HEADER_BYTES or loc.offset % ALIGN or loc.offset + REGION_HEADER_BYTES > len(mm):
            raise TransferError(f"shm handle for key {key!r} has an invalid offset {loc.offset}")
        magic, header_len = REGION_PREFIX.unpack_from(mm, loc.offset)
        (generation,) = WORD.unpack_from(mm, loc.offset + GENERATION_AT)
        (released,) = WORD.unpack_from(mm, loc.offset + RELEASED_AT)
        if magic != REGION_MAGIC or generation != loc.generation or released == generation:
            raise TransferError(
                f"embeddings for key {key!r} were reclaimed before they were read "
                f"(already released, or older than the producer's ttl_s)"
            )
        if header_len > wire.MAX_WIRE_HEADER or loc.offset + REGION_HEADER_BYTES + header_len > len(mm):
            raise TransferError(f"shm region for key {key!r} has a corrupt header length {header_len}")
        return int(header_len)

    def _mapping(self, path: str, nonce: str) -> mmap.mmap:
        with self._lock:
            # Keyed by the handle's own spelling of the path, which was checked when it was cached.
            cached = self._maps.get(path)
            if cached is not None and cached.nonce == nonce:
                return cached.mm
            real = os.path.realpath(path)
            if os.path.dirname(real) != self._dir or not SLAB_RE.fullmatch(os.path.basename(real)):
                raise TransferError(f"shm handle path {path!r} is not an EC slab under {self._dir}")
            self._prune()
            mapping = self._open(real, nonce)
            self._maps[path] = mapping
            return mapping.mm

    @staticmethod
    def _open(path: str, nonce: str) -> _Mapping:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as e:
            raise TransferError(f"the EC slab {path} is gone (its producer exited)") from e
        except OSError as e:
            raise TransferError(f"cannot open the EC slab {path}: {e}") from e
        try:
            st = os.fstat(fd)
            if st.st_size < SLAB_HEADER_BYTES:
                raise TransferError(f"{path} is not an EC slab")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as e:
            raise TransferError(f"cannot map the EC slab {path}: {e}") from e
        finally:
            os.close(fd)
        magic, layout, _, slab_nonce, _, _ = SLAB_HEADER.unpack_from(mm, 0)
        if magic != SLAB_MAGIC or layout != SLAB_LAYOUT or f"{slab_nonce:016x}" != nonce:
            mm.close()
            raise TransferError(f"the EC slab {path} is not the one the handle was made for")
        return _Mapping(mm, nonce, st.st_ino)

    def _prune(self) -> None:
        """Drop mappings of slabs whose producers are gone, so their memory can be freed."""
        for path, mapping in list(self._maps.items()):
            try:
                alive = os.stat(path).st_ino == mapping.inode
            except FileNotFoundError:
                alive = False
            if not alive:
                del self._maps[path]
                with contextlib.suppress(BufferError):
                    mapping.mm.close()

    async def release(self, handle: Handle) -> None:
        loc = wire.location_of(handle, ShmLocation)
        try:
            mm = self._mapping(loc.path, loc.slab)
            self._check_region(mm, loc, str(handle.get("key")))
        except TransferError:
            return  # slab gone or region already reclaimed: nothing left to release
        WORD.pack_into(mm, loc.offset + RELEASED_AT, loc.generation)

    async def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                with contextlib.suppress(BufferError):
                    mapping.mm.close()
            self._maps.clear()
