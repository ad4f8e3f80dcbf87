"""Building connectors from config: a producer of the configured kind, and a consumer that reads
handles of every kind (the handle says which backend made it)."""

from __future__ import annotations

import torch

from epdserve.transfer.base import ECConsumer, ECProducer, Handle, TransferError
from epdserve.transfer.config import CONNECTORS, ECConfig
from epdserve.transfer.fs import FsConsumer, FsProducer
from epdserve.transfer.shm import ShmConsumer, ShmProducer
from epdserve.transfer.tcp import TcpConsumer, TcpProducer


def make_producer(cfg: ECConfig) -> ECProducer:
    """The producer of ``cfg.connector``; it acquires its slab, port or directory now."""
    if cfg.connector == "shm":
        return ShmProducer(cfg)
    if cfg.connector == "tcp":
        return TcpProducer(cfg)
    return FsProducer(cfg)


def make_consumer(cfg: ECConfig) -> ECConsumer:
    return RoutingConsumer(cfg)


class RoutingConsumer:
    """Sends each handle to the consumer of its ``connector``, built on first use, so one LM
    instance can take embeddings from shm, tcp and fs producers at once."""

    def __init__(self, cfg: ECConfig) -> None:
        self._cfg = cfg
        self._consumers: dict[str, ECConsumer] = {}

    def _consumer(self, handle: Handle) -> ECConsumer:
        kind = handle.get("connector") if isinstance(handle, dict) else None
        if kind not in CONNECTORS:
            raise TransferError(f"EC handle names an unknown connector {kind!r}")
        consumer = self._consumers.get(kind)
        if consumer is None:
            consumer = self._consumers[kind] = _new_consumer(kind, self._cfg)
        return consumer

    async def get(self, handle: Handle, rows: int, width: int, model_id: str) -> torch.Tensor:
        return await self._consumer(handle).get(handle, rows, width, model_id)

    async def release(self, handle: Handle) -> None:
        await self._consumer(handle).release(handle)

    async def close(self) -> None:
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            await consumer.close()


def _new_consumer(kind: str, cfg: ECConfig) -> ECConsumer:
    if kind == "shm":
        return ShmConsumer(cfg)
    if kind == "tcp":
        return TcpConsumer(cfg)
    return FsConsumer(cfg)
