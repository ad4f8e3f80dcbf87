"""Qwen2.5-VL's prompt rules without torch: Qwen2-VL's placeholders, and M-RoPE whose time axis
follows seconds of video.

A video's frame group i sits at temporal index int(i * second_per_grid * tokens_per_second), where
second_per_grid = temporal_patch_size / fps is the time one temporal patch spans, fps the sampled
frames' rate from the clip's own timing (``media.decode.Video``; the processor's fps for a file
without one) (transformers' ``get_rope_index``, and the processor's ``second_per_grid_ts``). Images have one frame group, so
only videos differ from Qwen2-VL.

The text after a run continues at the run's largest position + 1, as the original implementation
and vLLM do. transformers 5 continues at start + max(h, w) / merge instead; the two agree unless a
video's last temporal index reaches its merged height and width (long or sparsely sampled videos),
where we keep the rule the model was trained with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epdserve.models.base import Grid
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, Qwen2VLLayout, mrope_positions

# transformers' get_rope_index without second_per_grid_ts: one second per temporal patch
DEFAULT_SECOND_PER_GRID = 1.0
# Qwen2_5_VLVisionConfig's default, for a config.json that does not say
DEFAULT_TOKENS_PER_SECOND = 4.0


class Qwen2_5_VLLayout(Qwen2VLLayout):
    """Qwen2-VL's placeholder counts; temporal positions scaled by each video's seconds per grid."""

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        if not image_grids and not video_grids:
            return None, 0
        seconds = list(video_second_per_grid) if video_second_per_grid is not None else [None] * len(video_grids)
        if len(seconds) != len(video_grids):
            raise MediaPlaceholderError(f"{len(video_grids)} videos but {len(seconds)} seconds-per-grid values")
        per_second = self.config.vision_config.tokens_per_second or DEFAULT_TOKENS_PER_SECOND
        steps = []
        for s in seconds:
            s = DEFAULT_SECOND_PER_GRID if s is None else s
            if not np.isfinite(s) or s <= 0:
                raise MediaPlaceholderError(f"seconds per temporal patch must be positive, got {s}")
            # float32 like transformers: tokens_per_second * second_per_grid_ts[i] (a float32 tensor)
            steps.append(float(np.float32(per_second) * np.float32(s)))
        return mrope_positions(token_ids, image_grids, video_grids, self.config, video_time_steps=steps)
