"""The EC connector interface: the encoder (producer) puts embeddings, the LM instance (consumer)
gets them by handle and releases them.

A handle is plain JSON (it travels inside the metadata-only request as ``ec_handle``)::

    {"connector": "shm" | "tcp" | "fs", "version": 1, "key": "<uuid>", "model_id": "...",
     "dtype": "float32", "shape": [rows, width], "nbytes": N, "checksum": "<xxh3-64 hex>",
     ...connector-specific location fields...}

The consumer validates everything against what it expects (rows = placeholder count, width = the
model's embedding width, dtype, checksum, model identity, protocol version) before the tensor is
used; any mismatch or transfer failure raises ``TransferError`` and fails only that request.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

PROTOCOL_VERSION = 1

Handle = dict[str, Any]


class TransferError(RuntimeError):
    """Embeddings could not be fetched or failed validation (the request fails with 503)."""


class ECProducer(Protocol):
    """Encoder side. ``put`` copies the tensor out, so the caller may reuse its memory."""

    name: str

    def put(self, key: str, tensor: torch.Tensor, model_id: str) -> Handle: ...

    def close(self) -> None: ...


class ECConsumer(Protocol):
    """Language-model side. ``get`` validates and returns the tensor (a private copy);
    ``release`` tells the producer the handle's memory can be reused (idempotent)."""

    async def get(self, handle: Handle, rows: int, width: int, model_id: str) -> torch.Tensor: ...

    async def release(self, handle: Handle) -> None: ...

    async def close(self) -> None: ...
