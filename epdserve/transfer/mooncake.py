"""The mooncake EC connector: embeddings read point to point with Mooncake's transfer engine (TCP,
or RDMA with ``mooncake_protocol="rdma"`` where the hardware has it; only TCP has run here), from
the same slab layout as ``shm``.

The producer is an shm producer whose slab is also registered with a transfer engine; its handles
carry, instead of the slab's path, the engine's session (``host:port``) and the slab's address in
the producer's memory. A consumer on any host reads the region (header, then payload) with one
engine read into a buffer of its own, checks it exactly as an shm consumer checks a mapped region
(generation, lease word, stored header, then the checksum of its private copy, and the region
again after the copy), and releases its lease by writing the lease word into the region's slot
with one 8-byte engine write: no RPC of ours, the producer's reclaim sees it like an shm release.

The transfer engine authenticates nobody and listens on every interface: its network must be
trusted-only (docs/security.md). What keeps a consumer safe is ours: it acts only on handles whose
MAC verifies (a producer of this cluster issued them), reads only within the slab the handle names,
and trusts no byte it read before the header, generation and checksum checks pass.
"""

from __future__ import annotations

import asyncio
import ctypes
import re
import threading
from typing import Any

import msgspec
import numpy as np
import torch

from epdserve.transfer import header as wire
from epdserve.transfer import signing
from epdserve.transfer.base import Handle, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.shm import ShmProducer
from epdserve.transfer.shm_slab import (
    ALIGN,
    REGION_HEADER_BYTES,
    SLAB_HEADER_BYTES,
    WORD,
    SlabPlace,
    align,
    check_region,
    lease_word,
    slot_at,
)

_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-\[\]:]{1,255}:\d{1,5}")
MIN_SCRATCH_BYTES = 1 << 20


class MooncakeLocation(SlabPlace, kw_only=True):
    """The mooncake fields of a handle."""

    session: str  # the producer's transfer engine, host:port
    base: int  # the slab's address in the producer's memory
    size: int  # the slab's size: nothing outside [base, base + size) is ever read or written


def _engine(host: str, protocol: str, device: str) -> Any:
    try:
        from mooncake.engine import TransferEngine  # the optional extra
    except ImportError as e:
        raise TransferError(f"the mooncake EC connector needs Mooncake (pip install 'epdserve[mooncake]'): {e}") from e
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
        raise TransferError(f"could not start Mooncake's transfer engine on {host} ({protocol})")
    return engine


class MooncakeProducer(ShmProducer):
    name = "mooncake"

    def __init__(self, cfg: ECConfig) -> None:
        super().__init__(cfg)
        mm = self._mapped()
        try:
            self._engine = _engine(cfg.advertise_host, cfg.mooncake_protocol, cfg.mooncake_device)
            self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(mm)
            self._base = ctypes.addressof(self._anchor)
            if self._engine.register_memory(self._base, self._size) != 0:
                raise TransferError("could not register the EC slab with Mooncake's transfer engine")
        except BaseException:
            self._anchor = None
            super().close()
            raise
        self.session = f"{cfg.advertise_host}:{self._engine.get_rpc_port()}"

    def _location(self, place: SlabPlace) -> dict[str, object]:
        return {**msgspec.structs.asdict(place), "session": self.session, "base": self._base, "size": self._size}

    def close(self) -> None:
        if self._anchor is not None:
            self._engine.unregister_memory(self._base)
            self._anchor = None  # the slab's mapping may close now
        super().close()


class MooncakeConsumer:
    """Reads mooncake handles of any producer of the cluster through a transfer engine of its own,
    into one registered buffer (grown as needed); transfers run one at a time, off the event loop."""

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key if cfg.has_secret else None
        self._dtypes = cfg.dtypes
        self._engine_args = (cfg.advertise_host, cfg.mooncake_protocol, cfg.mooncake_device)
        self._timeout_s = cfg.timeout_s
        self._engine: Any = None
        self._scratch = np.empty(0, np.uint8)
        self._lock = threading.Lock()

    def _buffer(self, nbytes: int) -> tuple[Any, np.ndarray]:
        """The engine, and a registered buffer of at least ``nbytes`` (under ``_lock``)."""
        if self._engine is None:
            self._engine = _engine(*self._engine_args)
        if len(self._scratch) < nbytes:
            if len(self._scratch):
                self._engine.unregister_memory(self._scratch.ctypes.data)
            scratch = np.empty(max(nbytes, MIN_SCRATCH_BYTES, 2 * len(self._scratch)), np.uint8)
            if self._engine.register_memory(scratch.ctypes.data, len(scratch)) != 0:
                self._scratch = np.empty(0, np.uint8)
                raise TransferError("could not register a buffer with Mooncake's transfer engine")
            self._scratch = scratch
        return self._engine, self._scratch

    @staticmethod
    def _place(handle: Handle, header: wire.WireHeader) -> tuple[MooncakeLocation, int]:
        """The handle's location, checked to lie inside its slab; and where its payload starts."""
        loc = wire.location_of(handle, MooncakeLocation)
        if not _SESSION_RE.fullmatch(loc.session):
            raise TransferError(f"mooncake handle for key {header.key!r} has an invalid session")
        data_at = REGION_HEADER_BYTES + align(len(wire.encode(header)))
        if (
            loc.offset < SLAB_HEADER_BYTES
            or loc.offset % ALIGN
            or loc.base <= 0
            or loc.offset + data_at + header.nbytes > loc.size
        ):
            raise TransferError(f"mooncake handle for key {header.key!r} has an invalid offset")
        return loc, data_at

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes, levels)
        loc, data_at = self._place(handle, header)
        word = lease_word(handle["lease"])
        read = asyncio.to_thread(self._read, header, loc, data_at, word)
        return await asyncio.wait_for(read, self._timeout_s)

    def _read(self, header: wire.WireHeader, loc: MooncakeLocation, data_at: int, word: int) -> torch.Tensor:
        total = data_at + header.nbytes
        with self._lock:
            engine, scratch = self._buffer(total)
            remote = loc.base + loc.offset
            if engine.transfer_sync_read(loc.session, scratch.ctypes.data, remote, total) != 0:
                raise TransferError(f"could not read the embeddings of key {header.key!r} from their producer")
            head = scratch[:data_at].tobytes()
            check_region(head, 0, loc, header, word, "mooncake")
            out = wire.new_buffer(header.nbytes)
            digest = wire.copy_and_checksum(out, scratch[data_at:total])
            # freed and reused while we read? the region header again, after the copy
            if engine.transfer_sync_read(loc.session, scratch.ctypes.data, remote, data_at) != 0:
                raise TransferError(f"could not read the embeddings of key {header.key!r} from their producer")
            check_region(scratch[:data_at].tobytes(), 0, loc, header, word, "mooncake")
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    async def release(self, handle: Handle) -> None:
        """Release this handle's lease only: its word written into its slot in the producer's slab."""
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        loc, _ = self._place(handle, header)
        word = lease_word(handle["lease"])
        await asyncio.wait_for(asyncio.to_thread(self._release, loc, word), self._timeout_s)

    def _release(self, loc: MooncakeLocation, word: int) -> None:
        with self._lock:
            engine, scratch = self._buffer(WORD.size)
            scratch[: WORD.size] = np.frombuffer(WORD.pack(word), np.uint8)
            at = loc.base + slot_at(loc.offset, loc.slot)
            if engine.transfer_sync_write(loc.session, scratch.ctypes.data, at, WORD.size) != 0:
                raise TransferError("could not release the lease at its producer")

    async def close(self) -> None:
        with self._lock:
            if self._engine is not None and len(self._scratch):
                self._engine.unregister_memory(self._scratch.ctypes.data)
            self._scratch = np.empty(0, np.uint8)
            self._engine = None
