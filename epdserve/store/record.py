"""What a store entry holds, and how it is checked before use.

An entry is ``<4-byte header length><header JSON><payload>``. The header is the EC contract's wire
header (``transfer.header.WireHeader``: version, key = media uuid, model identity, dtype, shape,
byte count, payload checksum) plus the item's patch grid, signed with a key derived from the
cluster secret. The store's network is not trusted: whatever comes back is read as hostile input,
checked for its MAC, for being the entry asked for (uuid, model), for the shape the model expects
of that grid, and for its checksum, before one byte of it reaches the vision cache.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from epdserve.transfer import header as wire
from epdserve.transfer.base import TransferError

STORE_PURPOSE = "ec-store"  # the subkey that signs store entries (never accepted as a handle key)
_LEN = struct.Struct("<I")
Grid = tuple[int, int, int]


class StoredHeader(msgspec.Struct, frozen=True):
    wire: wire.WireHeader
    grid_thw: Grid
    mac: str = ""


@dataclass(frozen=True)
class EntryCheck:
    """What a reader holds an entry to: the model it is for, the key that signs entries, the
    embedding width of one feature level, the rows the model gives a grid (None: each read says),
    the dtypes accepted, the model's feature levels (also what a writer puts in the header)."""

    model_id: str
    key: bytes
    width: int
    rows_of: Callable[[Grid], int] | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    levels: int = 1


class StoredItem(NamedTuple):
    grid_thw: Grid
    embeddings: torch.Tensor
    header: wire.WireHeader  # what a store handle for the entry says


def _mac(h: StoredHeader, key: bytes) -> str:
    body = msgspec.json.encode(msgspec.structs.replace(h, mac=""))
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def pack(
    uuid: str, model_id: str, grid_thw: Grid, embeddings: torch.Tensor, key: bytes, levels: int = 1
) -> tuple[bytes, wire.WireHeader]:
    """The entry's bytes, and its wire header."""
    data = wire.raw_bytes(embeddings)
    header = wire.make_header(uuid, model_id, embeddings, wire.checksum(data), levels)
    head = StoredHeader(header, tuple(grid_thw))  # type: ignore[arg-type]
    head_json = msgspec.json.encode(msgspec.structs.replace(head, mac=_mac(head, key)))
    return _LEN.pack(len(head_json)) + head_json + data.tobytes(), head.wire


def unpack(
    value: bytes,
    uuid: str,
    model_id: str,
    key: bytes,
    rows_of: Callable[[Grid], int],
    width: int,
    dtypes: Iterable[str],
    levels: int = 1,
) -> StoredItem:
    """The entry, checked; TransferError saying what is wrong otherwise."""
    if len(value) < _LEN.size:
        raise TransferError("store entry is truncated")
    (n,) = _LEN.unpack_from(value)
    if n > wire.MAX_WIRE_HEADER or _LEN.size + n > len(value):
        raise TransferError("store entry has a malformed header length")
    try:
        head = msgspec.json.decode(value[_LEN.size : _LEN.size + n], type=StoredHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TransferError(f"store entry has a malformed header: {e}") from None
    if not hmac.compare_digest(head.mac.encode("utf-8", "replace"), _mac(head, key).encode()):
        raise TransferError("store entry's signature does not verify (written without the cluster secret)")
    if head.wire.key != uuid:
        raise TransferError("store entry is for another media item")
    if any(g < 1 for g in head.grid_thw):
        raise TransferError(f"store entry has an invalid grid {list(head.grid_thw)}")
    wire.validate(head.wire, rows_of(head.grid_thw), width, model_id, dtypes, levels)
    payload = np.frombuffer(value, dtype=np.uint8, offset=_LEN.size + n)
    if len(payload) != head.wire.nbytes:
        raise TransferError(f"store entry has {len(payload)} payload bytes, its header says {head.wire.nbytes}")
    wire.check_checksum(head.wire, wire.checksum(payload))
    return StoredItem(head.grid_thw, wire.as_tensor(head.wire, payload.copy()), head.wire)
