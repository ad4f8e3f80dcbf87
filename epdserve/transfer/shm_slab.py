"""The layout of an EC slab and what every reader and writer of one shares: the layout's constants,
slab names and sizing, the removal of slabs whose producer died, the free list regions are cut
from, where a lease lies (``SlabPlace``) and the check that a region is still the one a handle
names. ``transfer.shm`` builds its producer and consumer on it; Mooncake's reads of a remote
slab use the same layout.

Layout (every region starts 64-byte aligned)::

    0             64
    | slab header | region | region |  free  | region |  free ...  | slab size
                  |
                  +-> | region header (128 B) | wire header JSON, padded to 64 | payload |

    slab header:   magic "EPDECSLB" | layout u32 | pad u32 | nonce u64 | size u64 | owner pid u64
    region header: magic "EPDR" | header_len u32 | generation u64 | released u64 x 8 (lease slots) | unused
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
from bisect import insort
from collections.abc import Collection
from pathlib import Path

import msgspec

from epdserve.common.pids import pid_alive
from epdserve.transfer import header as wire
from epdserve.transfer.base import InvalidHandle, TransferError
from epdserve.transfer.config import ECConfig

ALIGN = 64
SLAB_MAGIC = b"EPDECSLB"
SLAB_LAYOUT = 2
SLAB_HEADER = struct.Struct("<8sIIQQQ")  # magic, layout, pad, nonce, size, pid
SLAB_HEADER_BYTES = 64
REGION_MAGIC = b"EPDR"
REGION_PREFIX = struct.Struct("<4sI")  # magic, header_len
WORD = struct.Struct("@Q")  # native order: one aligned store, never torn byte by byte
GENERATION_AT = 8
RELEASED_AT = 16  # lease slot i's released word is at RELEASED_AT + 8 * i
LEASE_SLOTS = 8
REGION_HEADER_BYTES = 128
MIN_SLAB_BYTES = 1 << 20
MAX_AUTO_SLAB_BYTES = 256 << 20
SLAB_RE = re.compile(r"epd-ec-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-(?P<nonce>[0-9a-f]{16})")
_GONE = "the embeddings of this EC handle were released or have expired"


def slab_name(instance: str, pid: int, nonce: int) -> str:
    return f"epd-ec-{instance}-{pid}-{nonce:016x}"


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def lease_word(lease: object) -> int:
    """The release word of a lease token (its first 64 bits)."""
    try:
        word = int(str(lease)[:16], 16)
    except ValueError:
        word = 0
    if not word:
        raise InvalidHandle("the EC handle has a malformed lease")
    return word


def slot_at(offset: int, slot: int) -> int:
    return offset + RELEASED_AT + 8 * slot


def slab_bytes(cfg: ECConfig) -> int:
    """The slab size for ``cfg``: ``shm_bytes`` when set, else min(256 MiB, half the free space of
    ``shm_dir``) and at least 1 MiB. A container's /dev/shm is 64 MiB by default, so a fixed
    256 MiB slab would not even start there."""
    try:
        st = os.statvfs(cfg.shm_dir)
    except OSError as e:
        raise TransferError(f"cannot inspect {cfg.shm_dir} for the EC slab: {e.strerror or e}") from e
    free = st.f_bavail * st.f_frsize
    advice = "give the container a larger /dev/shm (e.g. docker run --shm-size=1g)"
    if cfg.shm_bytes:
        if cfg.shm_bytes > free:
            raise TransferError(
                f"--ec-shm-bytes {cfg.shm_bytes} does not fit in the {free} bytes free in {cfg.shm_dir}: "
                f"lower --ec-shm-bytes or {advice}"
            )
        return cfg.shm_bytes // ALIGN * ALIGN
    if free < MIN_SLAB_BYTES:
        raise TransferError(
            f"{cfg.shm_dir} has only {free} bytes free, less than the 1 MiB the EC slab needs: {advice}, "
            f"or set --ec-shm-bytes"
        )
    return max(MIN_SLAB_BYTES, min(MAX_AUTO_SLAB_BYTES, free // 2) // ALIGN * ALIGN)


def remove_stale_slabs(
    shm_dir: Path, pids: Collection[int] | None = None, instances: Collection[str] = ()
) -> list[Path]:
    """Unlink the slabs of producers that died without closing; returns what was removed. With
    ``pids``, only slabs named with one of those pids or ``instances`` (a supervisor cleaning up
    after its roles and their child processes)."""
    removed = []
    for path in shm_dir.glob("epd-ec-*") if shm_dir.is_dir() else ():
        m = SLAB_RE.fullmatch(path.name)
        if m is None:
            continue
        ours = int(m["pid"]) in pids or m["instance"] in instances if pids is not None else True
        if not ours or (pids is None and pid_alive(int(m["pid"]))):
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


class FreeList:
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


class SlabPlace(msgspec.Struct, kw_only=True):
    """Where a lease lies in a producer's slab: the fields every slab-backed handle has."""

    slab: str  # the slab's nonce (hex), so a handle never reads another producer's slab
    offset: int  # where the region starts in the slab
    generation: int  # the region's generation when the lease was issued
    slot: int  # the lease's release slot in the region header


class ShmLocation(SlabPlace, kw_only=True):
    """The shm fields of a handle."""

    path: str  # the slab file


def check_region(
    buf: bytes | mmap.mmap, at: int, place: SlabPlace, header: wire.WireHeader, word: int, what: str
) -> int:
    """Where the payload starts after ``at`` (``buf[at:]`` holds the region ``place`` names), if the
    region is still the one the handle names and the handle's lease is not released."""
    if not 0 <= place.slot < LEASE_SLOTS:
        raise TransferError(f"{what} handle for key {header.key!r} has an invalid lease slot")
    magic, header_len = REGION_PREFIX.unpack_from(buf, at)
    (generation,) = WORD.unpack_from(buf, at + GENERATION_AT)
    (released,) = WORD.unpack_from(buf, slot_at(at, place.slot))
    if magic != REGION_MAGIC or generation != place.generation or released == word:
        raise InvalidHandle(_GONE)
    stored_at = at + REGION_HEADER_BYTES
    if header_len > wire.MAX_WIRE_HEADER or stored_at + header_len > len(buf):
        raise TransferError(f"{what} region for key {header.key!r} has a corrupt header length {header_len}")
    wire.check_same(header, wire.decode(buf[stored_at : stored_at + header_len]), f"{what}@{place.offset}")
    return REGION_HEADER_BYTES + align(header_len)
