"""An encoder's warm-up: one small image of its own decoded, preprocessed and encoded through
the batcher before ``/health`` answers, so that what first use costs (lazily built state, thread
pools, allocator growth) is not paid by the first request. Nothing is put into the EC connector
or the store; the embeddings stay in the local cache under a name no content hash takes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch

from epdserve.media.warmup import warmup_png

if TYPE_CHECKING:
    from epdserve.encoder.server import EncoderService

log = logging.getLogger(__name__)

WARMUP_UUID = "epd-warmup"  # not hex: no item's content hash is this


async def warm_up(service: EncoderService) -> None:
    """Encode the warm-up image and log how long it took (an audio model's encoder has none to
    encode). A failure is logged, not raised."""
    if "image" not in service.model_config.modalities:
        return
    start = time.perf_counter()
    resolver = service.resolver
    assert resolver is not None  # start() made it
    try:
        media = await asyncio.get_running_loop().run_in_executor(
            service.executor, resolver.process_bytes, "image", warmup_png()
        )
        if media.pixel_values is None:
            raise ValueError("preprocessing produced no pixels")
        await service.batcher.encode(WARMUP_UUID, media.grid_thw, torch.from_numpy(media.pixel_values))
    except Exception as e:  # reported; serving goes on
        log.warning("warm-up encode failed (%s: %s); the first request pays first-use costs", type(e).__name__, e)
        return
    log.info("warmed up in %.2f s (an image decoded, preprocessed and encoded)", time.perf_counter() - start)
