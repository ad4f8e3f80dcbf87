"""The router's memory account (``epdserve.memory``'s ``RoleMemory``): it loads no model, and
holds the request bodies of the requests it serves (``api.bodies``) and, decoding media itself
(``--frontend-decode``), what its decode threads hold at once (each at most the largest item's
decoding, ``media.processor.largest_footprint``) and its pixel slab in /dev/shm. The router states
it at start-up, and ``up`` counts it with the other roles. Torch-free, as the whole router.
"""

from __future__ import annotations

from pathlib import Path

from epdserve.memory import RoleMemory, largest_item
from epdserve.models.config import ModelConfig
from epdserve.router.frontend_decode import FrontendDecodeConfig
from epdserve.transfer.config import ECConfig
from epdserve.transfer.pixels import pixel_config
from epdserve.transfer.shm_slab import slab_bytes


def account_router(model_dir: Path, request_bodies: int, frontend: FrontendDecodeConfig) -> RoleMemory:
    """What a router holds at most: ``request_bodies`` (the bound), and with ``frontend`` on, its
    decode threads' items and pixel slab for media of ``model_dir``'s processor (TransferError
    where the slab would not fit /dev/shm, as the router itself raises)."""
    if not frontend.enabled:
        return RoleMemory(role="router", weights=0, request_bodies=request_bodies)
    _, item_bytes = largest_item(model_dir, ModelConfig.from_pretrained(model_dir))
    return RoleMemory(
        role="router",
        weights=0,
        pending_media=frontend.workers * item_bytes,
        request_bodies=request_bodies,
        connector=slab_bytes(pixel_config(ECConfig(shm_bytes=frontend.shm_bytes))),
    )
