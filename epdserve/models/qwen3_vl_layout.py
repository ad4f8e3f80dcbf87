"""Qwen3-VL's prompt rules without torch (the front end asks for them through the registry).

Images follow Qwen2-VL: t*h*w / merge² placeholders in one run, the merged grid as positions. A
video is written out per temporal patch (frame group), as transformers' ``Qwen3VLProcessor`` does::

    <|vision_start|>  <0.2 seconds><|vision_start|>▢▢▢▢▢▢<|vision_end|>  <1.2 seconds>...  <|vision_end|>
    (the template's)  \\_______________ frame group 0 ________________/  group 1 ...     (the template's)

with h*w / merge² placeholders per group. The vision tower still encodes the video as one item of
grid (t, h, w); its output rows are the groups' rows in order, so group i takes rows
[i*h*w/merge², (i+1)*h*w/merge²). Positions follow transformers' ``get_rope_index``: every group
is an image-like run of grid (1, h, w) and the timestamp text between them counts as text.

Timestamps: a group's time is the mean of its first and last frame's, frame k at k / fps
(``_calculate_timestamps``), with fps the sampled frames' rate: temporal_patch_size /
``second_per_grid``, as for Qwen2.5-VL's time axis. ``second_per_grid`` comes from the clip's own
timing (``media.decode.Video``; the processor's fps for a file without one) and travels with
metadata-only parts, so pixels and metadata-only parts make the same prompt. A last
group padded with a repeated frame counts that frame as the next one (transformers would repeat the
last index there; it cannot be told from the grid). Without a ``second_per_grid``, transformers'
own fallback of 24 fps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from epdserve.models.base import Expansion, Grid
from epdserve.models.qwen2_vl_layout import Qwen2VLLayout, mrope_positions

# transformers' frame rate for a video whose metadata has none
DEFAULT_FPS = 24.0


def frame_group_seconds(groups: int, temporal_patch_size: int, fps: float) -> list[float]:
    """Each frame group's time in seconds: frames 0 .. groups*temporal_patch_size - 1 at ``fps``,
    averaged over each group's first and last frame (in transformers' float arithmetic)."""
    seconds = [k / fps for k in range(groups * temporal_patch_size)]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


class Qwen3VLLayout(Qwen2VLLayout):
    """Qwen2-VL's rules for images; a video is a timestamped run per frame group."""

    def expand(
        self, modality: str, grid_thw: Grid, encode: Callable[[str], list[int]], second_per_grid: float | None = None
    ) -> Expansion:
        n = self.num_placeholders(grid_thw)
        token = self.config.placeholder(modality)
        if modality != "video":
            return Expansion([token] * n, [(0, n)])
        start, end = self.config.vision_start_token_id, self.config.vision_end_token_id
        if start is None or end is None:
            raise ValueError("the model's config names no vision_start/vision_end tokens")
        tp = self.config.vision_config.temporal_patch_size
        if second_per_grid is None:
            fps = DEFAULT_FPS
        elif np.isfinite(second_per_grid) and second_per_grid > 0:
            fps = tp / second_per_grid
        else:
            raise ValueError(f"seconds per temporal patch must be positive, got {second_per_grid}")
        t = grid_thw[0]
        per_group = n // t
        ids: list[int] = []
        runs: list[tuple[int, int]] = []
        for seconds in frame_group_seconds(t, tp, fps):
            ids += encode(f"<{seconds:.1f} seconds>")
            ids.append(start)
            runs.append((len(ids), per_group))
            ids += [token] * per_group
            ids.append(end)
        return Expansion(ids, runs)

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        # the time is in the prompt's text: each frame group is an image-like run of grid (1, h, w)
        if not image_grids and not video_grids:
            return None, 0
        groups = [(1, h, w) for t, h, w in video_grids for _ in range(t)]
        return mrope_positions(token_ids, image_grids, groups, self.config)
