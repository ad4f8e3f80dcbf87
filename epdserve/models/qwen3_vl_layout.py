"""Qwen3-VL's prompt rules without torch (the front end asks for them through the registry)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epdserve.models.base import Grid
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, Qwen2VLLayout


class Qwen3VLLayout(Qwen2VLLayout):
    """For images, Qwen2-VL's rules: t*h*w / merge² placeholders, the merged grid as positions, the
    text after an image continuing past its larger side. Video is refused: Qwen3-VL's video prompt
    wraps every frame in a timestamp and its own vision_start/end, with positions that follow them,
    which is not implemented (``ModelConfig.takes_video`` is False, so the prompt builder refuses a
    video part before it gets here)."""

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        if video_grids:
            raise MediaPlaceholderError("video is not supported for this architecture")
        return super().positions(token_ids, image_grids, [])
