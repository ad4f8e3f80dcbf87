"""Metadata-only media on the language-model side: a connector handle passed on, or inline data.

The request carries only the grid, the content uuid and either a connector handle (from the
router's authenticated internal call; ``protocol.check_embeds_trust`` has already refused handles
from anyone else) or inline data (a client's own embeddings, where ``--enable-mm-embeds`` allows
them). The placeholder count follows from the grid. A handle is checked here for what the request
itself can show (it names this item's content) and handed to the engine core, which fetches and
validates the embeddings while the request waits in its scheduler; a request rejected before it
reaches the core gives its handles back through the core (``release``). Client-facing messages
name no internal path, host or port.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import EmbedsPart, VideoEmbedsPart, embeds_grid, embeds_of, part_modality
from epdserve.common.dtypes import ITEMSIZE, all_finite
from epdserve.engine.inputs import MediaInput
from epdserve.engine.messages import WireTensor


class MetadataEmbeds:
    """An ``EmbedsResolver``: handles pass through to the engine core, inline data is decoded here."""

    def __init__(
        self,
        model_id: str,
        width: int,
        rows_of: Callable[[tuple[int, int, int]], int],
        second_per_grid: float | None = None,
    ) -> None:
        self.model_id = model_id
        self.width = width
        self.rows_of = rows_of  # the model's placeholder count for a grid (raises ValueError)
        # a video's seconds per temporal patch when its part carries none (a client's, an older
        # encoder's): the processor's fps, as for a video file without timing
        self.second_per_grid = second_per_grid

    async def __call__(self, part: EmbedsPart) -> MediaInput:
        modality, grid = part_modality(part), embeds_grid(part)
        t, h, w = grid
        second = None
        if isinstance(part, VideoEmbedsPart):
            second = part.video_embeds.second_per_grid
            second = self.second_per_grid if second is None else second
        try:
            rows = self.rows_of((t, h, w))
        except ValueError as e:
            raise BadRequest(f"{modality}_grid_thw {list(grid)}: {e}.") from None
        embeds = embeds_of(part)
        if embeds.data is not None:
            emb, uuid = self._inline(modality, grid, embeds.data, embeds.dtype, rows, second)
            return MediaInput(uuid, modality, (t, h, w), embeddings=emb, second_per_grid=second)
        if part.ec_handle is None:
            raise BadRequest(f"A metadata-only {modality} item needs an ec_handle or inline data.")
        if part.ec_handle.get("key") != part.uuid:
            # the uuid keys the prefix cache: it must be the one the producer signed
            raise BadRequest(f"The ec_handle of {modality} {part.uuid} is not valid: it names other content.")
        return MediaInput(part.uuid, modality, (t, h, w), handle=part.ec_handle, second_per_grid=second)

    def _inline(
        self, modality: str, grid: tuple[int, int, int], data: str, dtype: str, rows: int, second: float | None
    ) -> tuple[WireTensor, str]:
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"Inline {modality} embeddings are not valid base64.") from None
        expected = rows * self.width * ITEMSIZE[dtype]
        if len(raw) != expected:
            raise BadRequest(
                f"Inline {modality} embeddings hold {len(raw)} bytes; grid {list(grid)} needs {rows} rows of "
                f"{self.width} {dtype} values ({expected} bytes)."
            )
        if not all_finite(raw, dtype):
            raise BadRequest(f"Inline {modality} embeddings contain NaN or infinite values.")
        # The uuid keys the prefix cache, so it comes from the content, never from the client: a
        # client naming another image's uuid must not share (or poison) that image's cached blocks.
        # A video's timing is part of it: the same embeddings at another pace sit at other positions.
        timing = "" if second is None else f"{second!r}|"
        digest = hashlib.sha256(f"{self.model_id}|{modality}|{list(grid)}|{dtype}|{timing}".encode() + raw).hexdigest()
        return WireTensor(dtype, (rows, self.width), raw), f"inline-{digest}"
