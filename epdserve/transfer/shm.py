"""The shm EC connector: one /dev/shm slab per producer, created once at start and mapped by every
consumer on the host, so a handoff is two memcpys and no system call.

This module holds the producer and the consumer; ``transfer.shm_slab`` draws the slab's layout.

A region is one stored payload; every handle issued on it is a lease with its own slot. Putting the
same key (same model, dtype and shape) again issues a new lease on the live region instead of a
copy, until its 8 slots are used up (then the next put stores a new copy).

Invariants that make a handle safe to read and release without any RPC:

- ``generation`` is a random non-zero word while the region is live, and the producer writes 0
  *before* any byte of a freed region is reused. A consumer checks the generation (and that the
  stored wire header is the handle's) before and after copying, so a freed region is reported as
  such, and the checksum catches anything that slips between the checks.
- A lease's token starts with a random non-zero 64-bit word; a consumer releases by writing that
  word into the lease's slot, one aligned 8-byte store, no lock. The producer keeps the issued
  words privately and counts a lease as released only when its slot holds its own word. Slots are
  never reused within a generation, so a replayed release rewrites the word already there and
  cannot touch another lease; a late release of a freed region fails the generation check (or, in
  the race after it, writes a word no lease of the new region has).
- A region is freed when every lease issued on it is released or older than ``ttl_s``.
- Handles are signed (``signing``): a consumer only reads or releases what a producer issued.
- The producer holds an exclusive flock on its slab for its lifetime. A slab is stale when the
  pid in its name is gone and nobody holds its lock; the next producer start removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from epdserve.transfer import header as wire
from epdserve.transfer import signing
from epdserve.transfer.base import Handle, ProducerFull, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.shm_slab import (
    ALIGN,
    GENERATION_AT,
    LEASE_SLOTS,
    REGION_HEADER_BYTES,
    REGION_MAGIC,
    REGION_PREFIX,
    SLAB_HEADER,
    SLAB_HEADER_BYTES,
    SLAB_LAYOUT,
    SLAB_MAGIC,
    SLAB_RE,
    WORD,
    FreeList,
    ShmLocation,
    SlabPlace,
    align,
    check_region,
    lease_word,
    remove_stale_slabs,
    slab_bytes,
    slab_name,
    slot_at,
)

if TYPE_CHECKING:  # torch only for tensors: the router puts raw bytes (``put_bytes``) without it
    import torch

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # the producer's mapping only: it writes everywhere


def _random_word() -> int:
    while True:
        word = secrets.randbits(64)
        if word:
            return word


@dataclass
class _Lease:
    word: int  # what a consumer writes into the lease's slot to release it
    deadline: float  # time.monotonic() after which the lease has expired
    done: bool = False  # released or expired


CacheKey = tuple[str, str, str, tuple[int, ...]]  # key, model_id, dtype, shape


@dataclass
class _Region:
    offset: int
    size: int
    generation: int
    header: wire.WireHeader
    leases: list[_Lease] = field(default_factory=list)  # leases[i] owns slot i

    @property
    def cache_key(self) -> CacheKey:
        return (self.header.key, self.header.model_id, self.header.dtype, self.header.shape)


class ShmProducer:
    """Owns one slab; ``put`` copies a tensor into a free region, or leases an identical live one.
    Thread-safe."""

    name = "shm"

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key
        self._cfg = cfg
        shm_dir = Path(cfg.shm_dir)
        remove_stale_slabs(shm_dir)
        self._size = slab_bytes(cfg)
        self._nonce = _random_word()
        self.path = shm_dir / slab_name(cfg.instance, os.getpid(), self._nonce)
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
            raise TransferError(
                f"cannot allocate the {self._size}-byte EC slab {self.path}: {e} "
                f"(lower --ec-shm-bytes, or give the container a larger /dev/shm, e.g. --shm-size)"
            ) from e
        SLAB_HEADER.pack_into(mm, 0, SLAB_MAGIC, SLAB_LAYOUT, 0, self._nonce, self._size, os.getpid())
        self._fd = fd  # kept open for the lifetime lock
        self._mm: mmap.mmap | None = mm
        self._free = FreeList(SLAB_HEADER_BYTES, self._size)
        self._live: dict[int, _Region] = {}  # by offset
        self._index: dict[CacheKey, int] = {}  # newest region of each key, by offset
        self._lock = threading.Lock()

    def put(self, key: str, tensor: torch.Tensor, model_id: str, levels: int = 1) -> Handle:
        # Checksums are fixed-length hex, so the header's size is known before the payload is hashed.
        return self.put_bytes(wire.make_header(key, model_id, tensor, "0" * 16, levels), wire.raw_bytes(tensor))

    def put_bytes(self, draft: wire.WireHeader, src: wire.Bytes, extra: Mapping[str, object] | None = None) -> Handle:
        """Store ``src`` (flat uint8, ``draft.nbytes`` long) under ``draft`` (its checksum is
        computed here), or lease an identical live payload; ``extra``: more signed handle fields."""
        if src.nbytes != draft.nbytes:
            raise TransferError(f"payload of {src.nbytes} bytes, but its header says {draft.nbytes}")
        with self._lock:
            mm = self._mapped()
            self._reclaim(mm)
            region = self._reusable((draft.key, draft.model_id, draft.dtype, draft.shape))
            if region is None:
                region = self._store(mm, draft, src)
            return self._lease(mm, region, extra or {})

    def _mapped(self) -> mmap.mmap:
        if self._mm is None:
            raise TransferError("the shm EC producer is closed")
        return self._mm

    def _reusable(self, cache_key: CacheKey) -> _Region | None:
        offset = self._index.get(cache_key)
        region = self._live.get(offset) if offset is not None else None
        if region is None or len(region.leases) >= LEASE_SLOTS:
            return None
        return region

    def _store(self, mm: mmap.mmap, draft: wire.WireHeader, src: wire.Bytes) -> _Region:
        header_len = len(wire.encode(draft))
        data_at = REGION_HEADER_BYTES + align(header_len)
        size = align(data_at + src.nbytes)
        offset = self._allocate(size)
        try:
            dst = np.frombuffer(mm, np.uint8, src.nbytes, offset + data_at)
            header = msgspec.structs.replace(draft, checksum=wire.copy_and_checksum(dst, src))
            del dst  # a live numpy view would keep the mapping from closing
        except BaseException:
            self._free.free(offset, size)
            raise
        encoded = wire.encode(header)
        mm[offset + REGION_HEADER_BYTES : offset + REGION_HEADER_BYTES + len(encoded)] = encoded
        REGION_PREFIX.pack_into(mm, offset, REGION_MAGIC, len(encoded))
        mm[slot_at(offset, 0) : slot_at(offset, LEASE_SLOTS)] = bytes(8 * LEASE_SLOTS)
        region = _Region(offset, size, _random_word(), header)
        WORD.pack_into(mm, offset + GENERATION_AT, region.generation)  # last: publishes the region
        self._live[offset] = region
        self._index[region.cache_key] = offset
        return region

    def _lease(self, mm: mmap.mmap, region: _Region, extra: Mapping[str, object]) -> Handle:
        lease = signing.new_lease()
        slot = len(region.leases)
        region.leases.append(_Lease(lease_word(lease), time.monotonic() + self._cfg.ttl_s))
        place = SlabPlace(slab=f"{self._nonce:016x}", offset=region.offset, generation=region.generation, slot=slot)
        handle = wire.to_handle(region.header, self.name, **extra, **self._location(place))
        return signing.issue(handle, self._key, self._cfg.ttl_s, lease)

    def _location(self, place: SlabPlace) -> dict[str, object]:
        """A handle's location fields for a lease at ``place`` (how consumers reach the slab)."""
        return {**msgspec.structs.asdict(place), "path": str(self.path)}

    def _allocate(self, size: int) -> int:
        if size > self._size - SLAB_HEADER_BYTES:
            # Never fits, so not ProducerFull: retrying would not help.
            raise TransferError(
                f"{size} bytes of embeddings do not fit in the {self._size}-byte EC slab (raise --ec-shm-bytes)"
            )
        offset = self._free.alloc(size)
        if offset is None:
            raise ProducerFull(
                f"the EC slab is full: {len(self._live)} stored embeddings hold "
                f"{self._size - self._free.free_bytes} of {self._size} bytes, {size} more needed "
                f"(consumers are not releasing, or --ec-shm-bytes is too small)"
            )
        return offset

    def _reclaim(self, mm: mmap.mmap) -> None:
        """Mark released and expired leases done; free regions with no live lease left."""
        now = time.monotonic()
        for region in list(self._live.values()):
            for slot, lease in enumerate(region.leases):
                if not lease.done and (
                    lease.deadline < now or WORD.unpack_from(mm, slot_at(region.offset, slot))[0] == lease.word
                ):
                    lease.done = True
            if all(lease.done for lease in region.leases):
                self._free_region(mm, region)

    def _free_region(self, mm: mmap.mmap, region: _Region) -> None:
        WORD.pack_into(mm, region.offset + GENERATION_AT, 0)  # invalidate before reuse
        del self._live[region.offset]
        if self._index.get(region.cache_key) == region.offset:
            del self._index[region.cache_key]
        self._free.free(region.offset, region.size)

    def release(self, handle: Handle) -> bool:
        handle = signing.verify(handle, self._key)
        loc = wire.location_of(handle, SlabPlace)
        if handle.get("connector") != self.name or loc.slab != f"{self._nonce:016x}":
            return False
        word = lease_word(handle["lease"])
        with self._lock:
            mm = self._mm
            region = self._live.get(loc.offset)
            if mm is None or region is None or region.generation != loc.generation:
                return False
            if not 0 <= loc.slot < len(region.leases) or region.leases[loc.slot].word != word:
                return False
            lease = region.leases[loc.slot]
            at = slot_at(region.offset, loc.slot)
            was_live = not lease.done and WORD.unpack_from(mm, at)[0] != word
            lease.done = True
            WORD.pack_into(mm, at, word)  # a consumer holding the handle now sees it released
            if all(lease.done for lease in region.leases):
                self._free_region(mm, region)
            return was_live

    def _counted(self) -> list[_Region]:
        """The live regions, after taking the releases consumers wrote into account."""
        if self._mm is not None:
            self._reclaim(self._mm)
        return list(self._live.values())

    @property
    def live_handles(self) -> int:
        with self._lock:
            return sum(not lease.done for region in self._counted() for lease in region.leases)

    @property
    def live_entries(self) -> int:
        with self._lock:
            return len(self._counted())

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(region.header.nbytes for region in self._counted())

    @property
    def capacity_bytes(self) -> int:
        return self._size

    @property
    def free_bytes(self) -> int:
        """Bytes of the slab not taken by regions (headers included), after reclaiming."""
        with self._lock:
            self._counted()
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
            self._index.clear()

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
    """Reads shm handles of any producer of the cluster on the host; keeps one mapping per slab."""

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key if cfg.has_secret else None
        self._dir = os.path.realpath(cfg.shm_dir)
        self._dtypes = cfg.dtypes
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes, levels)
        location = wire.location_of(handle, ShmLocation)
        word = lease_word(handle["lease"])
        if header.nbytes >= wire.THREAD_BYTES:
            return await asyncio.to_thread(self._read, header, location, word)
        return self._read(header, location, word)

    def read_bytes(self, handle: Handle, check: Callable[[Handle, wire.WireHeader], object]) -> wire.Bytes:
        """The payload of a handle of any payload kind (blocking: call it off the event loop), as a
        private flat uint8 copy. ``check`` validates the verified handle and its header before any
        byte is read, so a bad header never makes this instance allocate or read what it did not
        expect."""
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        check(handle, header)
        return self._read_bytes(header, wire.location_of(handle, ShmLocation), lease_word(handle["lease"]))

    def _read(self, header: wire.WireHeader, loc: ShmLocation, word: int) -> torch.Tensor:
        return wire.as_tensor(header, self._read_bytes(header, loc, word))

    def _read_bytes(self, header: wire.WireHeader, loc: ShmLocation, word: int) -> wire.Bytes:
        mm = self._mapping(loc.path, loc.slab)
        data_at = self._check_region(mm, loc, header, word)
        if data_at + header.nbytes > len(mm):
            raise TransferError(f"shm handle for key {header.key!r} points past the end of its slab")
        out = wire.new_buffer(header.nbytes)
        src = np.frombuffer(mm, np.uint8, header.nbytes, data_at)
        digest = wire.copy_and_checksum(out, src)
        del src
        self._check_region(mm, loc, header, word)  # freed while we copied?
        wire.check_checksum(header, digest)
        return out

    @staticmethod
    def _check_region(mm: mmap.mmap, loc: ShmLocation, header: wire.WireHeader, word: int) -> int:
        """Where the payload starts, if the region is still the one the handle names and the
        handle's lease is not released."""
        if loc.offset < SLAB_HEADER_BYTES or loc.offset % ALIGN or loc.offset + REGION_HEADER_BYTES > len(mm):
            raise TransferError(f"shm handle for key {header.key!r} has an invalid offset")
        return loc.offset + check_region(mm, loc.offset, loc, header, word, "shm")

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
            # not populated: a consumer touches only the regions it reads, so only those pages enter
            # its page tables (and its RSS), not the whole slab
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
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
        """Release this handle's lease only; other leases on the same payload keep it alive."""
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        loc = wire.location_of(handle, ShmLocation)
        word = lease_word(handle["lease"])
        try:
            mm = self._mapping(loc.path, loc.slab)
            self._check_region(mm, loc, header, word)
        except TransferError:
            return  # slab gone, region freed, or lease already released: nothing left to release
        WORD.pack_into(mm, slot_at(loc.offset, loc.slot), word)

    async def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                with contextlib.suppress(BufferError):
                    mapping.mm.close()
            self._maps.clear()
