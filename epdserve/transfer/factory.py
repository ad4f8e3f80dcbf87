"""Building connectors from config: a producer of the configured kind, and a consumer that reads
handles of every kind (the handle says which backend made it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from epdserve.transfer import signing
from epdserve.transfer.base import ECConsumer, ECProducer, Handle, InvalidHandle
from epdserve.transfer.config import CONNECTORS, ECConfig
from epdserve.transfer.fs import FsConsumer, FsProducer
from epdserve.transfer.shm import ShmConsumer, ShmProducer
from epdserve.transfer.shm_slab import slab_bytes
from epdserve.transfer.tcp import TcpConsumer, TcpProducer


def make_producer(cfg: ECConfig) -> ECProducer:
    """The producer of ``cfg.connector``; it acquires its slab, port or directory now. Raises
    TransferError without a cluster secret: handles must be signed."""
    cfg.key(cfg.handle_purpose)  # raises without a secret
    if cfg.connector == "shm":
        return ShmProducer(cfg)
    if cfg.connector == "tcp":
        return TcpProducer(cfg)
    if cfg.connector == "mooncake":
        from epdserve.transfer.mooncake import MooncakeProducer  # the optional extra, only when asked for

        return MooncakeProducer(cfg)
    return FsProducer(cfg)


def producer_bytes(cfg: ECConfig) -> int:
    """The memory a producer of ``cfg`` holds at most for handles not yet released: its /dev/shm
    slab (shm and mooncake: tmpfs pages are memory), the tcp producer's ``tcp_bytes``; none for
    fs (files). TransferError where the slab would not fit, as the producer itself raises."""
    if cfg.connector in ("shm", "mooncake"):
        return slab_bytes(cfg)
    return cfg.tcp_bytes if cfg.connector == "tcp" else 0


def make_consumer(cfg: ECConfig, more: Mapping[str, Callable[[], ECConsumer]] | None = None) -> ECConsumer:
    """A consumer of every connector's handles; ``more``: consumers of further handle kinds
    (e.g. the shared store's), built on first use."""
    return RoutingConsumer(cfg, more)


class RoutingConsumer:
    """Verifies each handle's signature, then sends it to the consumer of its ``connector``, built on
    first use, so one LM instance can take embeddings from shm, tcp and fs producers at once.
    Nothing of a handle is acted on before its MAC verifies (no slab mapped, no socket dialed, no
    file touched), so a client cannot steer this instance anywhere with a handle of its own."""

    def __init__(self, cfg: ECConfig, more: Mapping[str, Callable[[], ECConsumer]] | None = None) -> None:
        self._cfg = cfg
        self._key = cfg.handle_key if cfg.has_secret else None
        self._consumers: dict[str, ECConsumer] = {}
        self._more = dict(more or {})

    def _consumer(self, handle: object) -> tuple[Handle, ECConsumer]:
        verified = signing.verify_with(handle, self._key)
        kind = verified.get("connector")
        if kind not in CONNECTORS and kind not in self._more:
            raise InvalidHandle(f"the EC handle names an unknown connector {str(kind)[:32]!r}")
        consumer = self._consumers.get(kind)
        if consumer is None:
            build = self._more.get(kind)
            consumer = self._consumers[kind] = build() if build is not None else _new_consumer(kind, self._cfg)
        return verified, consumer

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        verified, consumer = self._consumer(handle)
        return await consumer.get(verified, rows, width, model_id, levels)

    async def release(self, handle: Handle) -> None:
        verified, consumer = self._consumer(handle)
        await consumer.release(verified)

    async def close(self) -> None:
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            await consumer.close()


def _new_consumer(kind: str, cfg: ECConfig) -> ECConsumer:
    if kind == "shm":
        return ShmConsumer(cfg)
    if kind == "tcp":
        return TcpConsumer(cfg)
    if kind == "mooncake":
        from epdserve.transfer.mooncake import MooncakeConsumer

        return MooncakeConsumer(cfg)
    return FsConsumer(cfg)
