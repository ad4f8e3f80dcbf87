"""The versioned wire header that travels with every embedding transfer: what it says, its one
encoding (JSON through msgspec), the checksum of the payload, and the consumer-side validation
against what the prompt expects.

The header is also the common part of every handle: a handle is the header's JSON object plus
``connector``, the backend's location fields and the lease fields ``signing`` adds (``issued_at``,
``expires_at``, ``lease``, ``mac``). Validation here runs only after the MAC verified.

Torch is imported on first use of the tensor helpers (``raw_bytes``, ``as_tensor``): the router
writes byte payloads (decoded pixels, ``transfer.pixels``) through the shm slab without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from epdserve.common import dtypes as precision
from epdserve.transfer.base import PROTOCOL_VERSION, Handle, InvalidHandle, TransferError

if TYPE_CHECKING:
    import torch

Bytes = npt.NDArray[np.uint8]

# Copying and hashing chunk by chunk hashes each chunk while it is still in L2, which is roughly
# twice as fast as a full copy followed by a full hash on large payloads.
CHUNK_BYTES = 256 << 10
# Below this, blocking a consumer's event loop for the copy is cheaper than a hop to a thread.
THREAD_BYTES = 4 << 20
MAX_KEY_BYTES = 1024
PROMPT_MARK = "#prompt="  # in a KV header's model identity: the digest of the prompt it covers (transfer.kv)
MAX_WIRE_HEADER = 4096  # bytes; a header is a few hundred bytes plus the key and model id
_CHECKSUM_RE = re.compile(r"[0-9a-f]{16}")

T = TypeVar("T")


class WireHeader(msgspec.Struct, frozen=True):
    """Everything a consumer needs to check a payload before using it."""

    version: int  # PROTOCOL_VERSION of the producer
    key: str  # the producer's name for the payload (e.g. the media item's id)
    model_id: str  # identity of the model whose encoder produced the embeddings
    dtype: str  # one of TORCH_DTYPES
    shape: tuple[int, ...]  # [rows, width] for embeddings
    levels: int  # feature levels side by side in a row (DeepStack; 1: one) — width = levels x hidden
    nbytes: int  # payload size in bytes
    checksum: str  # xxh3-64 hex digest of the raw payload bytes


def encode(header: WireHeader) -> bytes:
    return msgspec.json.encode(header)


def decode(data: bytes | bytearray | memoryview) -> WireHeader:
    try:
        return msgspec.json.decode(data, type=WireHeader)
    except msgspec.DecodeError as e:
        raise TransferError(f"malformed EC wire header: {e}") from e


def to_handle(header: WireHeader, connector: str, **location: Any) -> Handle:
    """The handle for ``header``: plain JSON types only, so it can travel inside a request."""
    handle: Handle = msgspec.json.decode(encode(header))
    handle["connector"] = connector
    handle.update(location)
    return handle


def from_handle(handle: Handle) -> WireHeader:
    try:
        return msgspec.convert(handle, WireHeader)
    except msgspec.ValidationError as e:
        raise TransferError(f"malformed EC handle: {e}") from e


def location_of(handle: Handle, kind: type[T]) -> T:
    """The backend-specific fields of ``handle`` as the typed struct ``kind``."""
    try:
        return msgspec.convert(handle, kind)
    except msgspec.ValidationError as e:
        raise TransferError(f"malformed {handle.get('connector')} EC handle: {e}") from e


def raw_bytes(tensor: torch.Tensor) -> Bytes:
    """The payload bytes of a tensor a producer is about to put, as a flat uint8 array."""
    import torch

    if tensor.dtype not in precision.TORCH_DTYPES.values():
        raise TransferError(f"cannot transfer a {tensor.dtype} tensor (supported: {', '.join(precision.DTYPES)})")
    if tensor.dim() != 2:
        raise TransferError(f"embeddings must be 2-D [rows, width], got shape {list(tensor.shape)}")
    flat = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    return flat.numpy()


def make_header(key: str, model_id: str, tensor: torch.Tensor, checksum: str, levels: int = 1) -> WireHeader:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise TransferError(f"EC key must be 1-{MAX_KEY_BYTES} bytes, got {len(key.encode())}")
    if tensor.dim() != 2:
        raise TransferError(f"embeddings must be 2-D [rows, width], got shape {list(tensor.shape)}")
    if levels < 1 or tensor.shape[1] % levels:
        raise TransferError(f"embeddings of shape {list(tensor.shape)} cannot hold {levels} feature levels")
    return WireHeader(
        version=PROTOCOL_VERSION,
        key=key,
        model_id=model_id,
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(tensor.shape),
        levels=levels,
        nbytes=tensor.numel() * tensor.element_size(),
        checksum=checksum,
    )


def checksum(data: Bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data.data)


def copy_and_checksum(dst: Bytes, src: Bytes) -> str:
    """Copy ``src`` into ``dst`` (same length) and return the checksum of the copied bytes."""
    hasher = xxhash.xxh3_64()
    for start in range(0, len(src), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        np.copyto(dst[start:end], src[start:end])
        hasher.update(dst[start:end].data)
    return hasher.hexdigest()


def validate(header: WireHeader, rows: int, width: int, model_id: str, dtypes: Iterable[str], levels: int = 1) -> None:
    """Check a header against what the consumer expects; runs before any payload byte is read, so
    a bad or hostile header can never make the consumer allocate or read more than it expects.

    ``width`` is one feature level's (the LM hidden size) and ``levels`` the consumer model's
    feature levels: the payload must hold exactly that many, ``levels * width`` values a row."""
    if header.version != PROTOCOL_VERSION:
        raise TransferError(
            f"EC protocol version {header.version} is not supported (this instance speaks {PROTOCOL_VERSION})"
        )
    if header.model_id != model_id:
        produced, _, prompt = header.model_id.partition(PROMPT_MARK)
        if prompt and produced == model_id.partition(PROMPT_MARK)[0]:  # a request's error: nothing to retry
            raise InvalidHandle("the KV was computed for another prompt than this request's")
        raise TransferError(
            f"embeddings were produced for model {header.model_id!r} but this instance serves {model_id!r}"
        )
    allowed = tuple(dtypes)
    if header.dtype not in allowed or header.dtype not in precision.ITEMSIZE:
        raise TransferError(f"embeddings have dtype {header.dtype} (accepted: {', '.join(allowed)})")
    shape = list(header.shape)
    if len(shape) != 2:
        raise TransferError(f"embeddings have shape {shape} but must be 2-D [rows, width]")
    if shape[0] != rows:
        raise TransferError(f"embeddings have shape {shape} but the prompt has {rows} placeholders")
    if header.levels != levels:  # a request's error, not the producer's: no re-encode makes it fit
        raise InvalidHandle(
            f"embeddings carry {header.levels} feature level(s) but this model takes {levels} "
            "(produced by an encoder of another model family?)"
        )
    if shape[1] != levels * width:
        raise TransferError(
            f"embeddings have shape {shape} but the model expects width {levels * width}"
            + (f" ({levels} feature levels of {width})" if levels > 1 else "")
        )
    expected = rows * levels * width * precision.ITEMSIZE[header.dtype]
    if header.nbytes != expected:
        raise TransferError(
            f"embeddings header says {header.nbytes} bytes but shape {shape} of {header.dtype} is {expected}"
        )
    if not _CHECKSUM_RE.fullmatch(header.checksum):
        raise TransferError(f"embeddings header has a malformed checksum {header.checksum!r}")


def check_same(header: WireHeader, stored: WireHeader, where: str) -> None:
    """The header stored with the payload must be the one the handle describes."""
    if stored != header:
        raise TransferError(f"embeddings at {where} are not the ones the handle describes (key {header.key!r})")


def check_checksum(header: WireHeader, actual: str) -> None:
    if actual != header.checksum:
        raise TransferError(f"embeddings for key {header.key!r} are corrupted (checksum {actual} != {header.checksum})")


def as_tensor(header: WireHeader, data: Bytes) -> torch.Tensor:
    """A tensor over ``data`` (validated payload bytes) with the header's dtype and shape."""
    import torch

    dtype = precision.torch_dtype(header.dtype)
    if header.nbytes == 0:  # torch cannot reinterpret an empty byte tensor
        return torch.empty(header.shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(header.shape)


def new_buffer(nbytes: int) -> Bytes:
    """A fresh payload buffer. numpy asks for transparent huge pages on large allocations, so
    first-touching it costs far fewer page faults than a torch.empty of the same size."""
    return np.empty(nbytes, dtype=np.uint8)
