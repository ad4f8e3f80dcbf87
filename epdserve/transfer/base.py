"""The EC connector interface: the encoder (producer) puts embeddings, the LM instance (consumer)
gets them by handle and releases them.

A handle is plain JSON (it travels inside the metadata-only request as ``ec_handle``), signed by the
producer with a key derived from the cluster secret (``signing``)::

    {"connector": "shm" | "tcp" | "fs", "version": 3, "key": "<content id>", "model_id": "...",
     "dtype": "float32", "shape": [rows, width], "levels": L, "nbytes": N, "checksum": "<xxh3-64 hex>",
     "issued_at": <unix s>, "expires_at": <unix s>, "lease": "<32 hex>",
     ...connector-specific location fields..., "mac": "<HMAC-SHA256 hex of every other field>"}

A handle is a *lease* on a stored payload: putting the same key again issues a new lease on the same
payload (no copy), and the payload is freed when all its leases are released or expired.

The consumer verifies the MAC before any I/O, so it only ever acts on handles a producer holding the
cluster secret issued; then it validates everything against what it expects (rows = placeholder
count, width = levels x the model's hidden size, the model's feature levels, dtype, checksum, model
identity, protocol version).

Feature levels: a DeepStack model (Qwen3-VL) puts several feature vectors per placeholder row side
by side in one payload (``levels``, 1 for every other model); the producer writes its model's count
and a consumer accepts only its own model's, so a payload of another tower never reaches the LM.
Errors are typed so that each side can answer the client correctly (see the classes below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # only annotations: ``ECConfig`` (and the flags built from it) load without torch
    import torch

# 3: the header says how many feature levels each row holds (``levels``)
PROTOCOL_VERSION = 3

Handle = dict[str, Any]


class TransferError(RuntimeError):
    """Embeddings could not be fetched or failed validation (the request fails with 503)."""


class InvalidHandle(TransferError):
    """The handle is malformed, forged, tampered with, signed by another cluster, expired, or its lease
    was already released (the client sent something wrong: 400). Messages never name paths, hosts or
    ports, since they go back to whoever sent the handle."""


class ProducerFull(TransferError):
    """A put does not fit until consumers release what the producer holds (the encoder answers 429)."""


class ECProducer(Protocol):
    """Encoder side. ``put`` copies the tensor out (or leases an identical stored payload), so the
    caller may reuse its memory."""

    name: str

    def put(self, key: str, tensor: torch.Tensor, model_id: str, levels: int = 1) -> Handle:
        """``tensor`` [rows, levels * hidden]; ``levels`` from the producing model's config."""
        ...

    def release(self, handle: Handle) -> bool:
        """Release one lease this producer issued (e.g. the router abandoned the request); True when
        a live lease was released, False for a foreign, unknown or already released one."""
        ...

    @property
    def live_handles(self) -> int:
        """Leases issued and neither released nor expired."""
        ...

    @property
    def live_entries(self) -> int:
        """Payloads stored (one per distinct key with live leases)."""
        ...

    @property
    def held_bytes(self) -> int:
        """Payload bytes of the stored entries."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """What the producer can hold at most (slab size, tcp_bytes, or the fs free space)."""
        ...

    def close(self) -> None: ...


class ECConsumer(Protocol):
    """Language-model side. ``get`` validates and returns the tensor (a private copy);
    ``release`` gives up the handle's lease (idempotent)."""

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        """The payload [rows, levels * width] (``width``: one level's, the LM hidden size), validated."""
        ...

    async def release(self, handle: Handle) -> None: ...

    async def close(self) -> None: ...
