"""A request of the worker's own before it takes any: a short prompt, with a small image where
the vision tower is loaded, through every stage a client's request takes (media decoding and
preprocessing, the prompt's template, the engine core's vision forward, prefill and decode
steps, detokenization). What the first use of each costs (lazily built state, thread pools,
allocator growth) is paid there, before ``/health`` answers, instead of by the first client.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from epdserve.media.warmup import warmup_data_url
from epdserve.pd.generation import Generation

if TYPE_CHECKING:
    from epdserve.pd.service import ChatService

log = logging.getLogger(__name__)

OUTPUT_TOKENS = 2  # a prefill step and a decode step


def warmup_body(model: str, image: bool) -> bytes:
    """The warm-up's chat request (OpenAI's format, greedy, ``OUTPUT_TOKENS`` tokens)."""
    content: list[dict[str, object]] = [{"type": "text", "text": "Describe the picture."}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": warmup_data_url()}})
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()


async def warm_up(service: ChatService) -> None:
    """Run the warm-up request to its end and log how long it took. A failure is logged, not raised:
    the worker then starts as it would without a warm-up, and a real request meets the fault."""
    start = time.perf_counter()
    image = service.core.vision and "image" in service.model_config.modalities
    try:
        _, add, held = await service.prepare(warmup_body(service.config.model_name, image))
        with held:
            gen, _ = await Generation.started(service, add)
        try:
            async for _ in gen.rest():
                pass
        finally:
            await gen.aclose()
    except Exception as e:  # reported; serving goes on
        log.warning("warm-up request failed (%s: %s); the first request pays first-use costs", type(e).__name__, e)
        return
    seconds = time.perf_counter() - start
    log.info("warmed up in %.2f s (a %s request through every stage)", seconds, "text and image" if image else "text")
