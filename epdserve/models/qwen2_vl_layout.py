"""Qwen2-VL's prompt rules without torch: placeholder counts and M-RoPE positions.

The front end builds every prompt with these (it never imports torch; the registry names this
class beside the model's), and the engine turns the positions into a tensor when a request arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from epdserve.models.base import Grid
from epdserve.models.config import ModelConfig


class MediaPlaceholderError(ValueError):
    """The placeholder tokens of a prompt do not match the media grids or embeddings given."""


def grid_list(grid: Any) -> list[Grid]:
    """Grids as (t, h, w) int tuples, from rows of three ints (a list, an array or a tensor)."""
    if grid is None:
        return []
    rows: Iterable[Sequence[int]] = grid.tolist() if hasattr(grid, "tolist") else grid
    out = []
    for row in rows:
        if len(row) != 3:
            raise MediaPlaceholderError(f"a grid is (t, h, w), got {list(row)}")
        t, h, w = (int(x) for x in row)
        out.append((t, h, w))
    return out


def _run(n: int, start: int) -> np.ndarray:
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (3, n))


def mrope_positions(
    input_ids: Any,
    image_grid_thw: Any,
    video_grid_thw: Any,
    config: ModelConfig,
    video_time_steps: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt whose placeholder runs are expanded, from ids and grids alone.

    Text tokens get one running index on all three rows. The run of an item with grid (t, h, w)
    gets (start + t_i, start + h_i, start + w_i) over the merged grid (t, h/m, w/m) in token order,
    and the text after it continues at max(positions so far) + 1.

    ``video_time_steps`` (Qwen2.5-VL), one per video: the temporal index of the video's frame
    group i is int(i * step) instead of i, computed in float32 like transformers.

    Returns (positions int64 [3, L], delta) with delta = max position + 1 - L: the token at
    absolute index i >= L (decode) has position i + delta on all three rows.

    Note: transformers 5.x continues after a run at start + max(h, w)/m, ignoring t; the two agree
    unless a video has more temporal patches than merged rows and columns, where we follow the
    original Qwen2-VL (and vLLM).
    """
    ids = np.asarray(input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids, dtype=np.int64).reshape(-1)
    # a model without a video token (audio-language) never matches here
    image_id = config.placeholder("image")
    video_id = -1 if config.video_token_id is None else config.video_token_id
    merge = config.vision_config.spatial_merge_size
    grids = {image_id: iter(grid_list(image_grid_thw)), video_id: iter(grid_list(video_grid_thw))}
    steps = iter(video_time_steps) if video_time_steps is not None else None
    names = {image_id: "image", video_id: "video"}

    placeholder_idx = np.flatnonzero((ids == image_id) | (ids == video_id)).tolist()
    pieces: list[np.ndarray] = []
    next_pos, cursor, k = 0, 0, 0
    while k < len(placeholder_idx):
        start = placeholder_idx[k]
        token = int(ids[start])
        grid = next(grids[token], None)
        if grid is None:
            raise MediaPlaceholderError(f"more {names[token]} placeholder runs than {names[token]} grids")
        t, h, w = grid
        if h % merge or w % merge:
            raise MediaPlaceholderError(f"grid {grid} is not a multiple of the merge size {merge}")
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        # a run is consumed by its grid's length, so adjacent items of one kind are handled too
        if start + count > len(ids) or not bool((ids[start : start + count] == token).all()):
            raise MediaPlaceholderError(f"{names[token]} at token {start} needs {count} placeholders in a row")
        pieces.append(_run(start - cursor, next_pos))
        next_pos += start - cursor
        times = np.arange(t, dtype=np.int64)
        if token == video_id and steps is not None:
            step = next(steps, None)
            if step is None:
                raise MediaPlaceholderError("more video placeholder runs than video time steps")
            times = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack((tt.reshape(-1), hh.reshape(-1), ww.reshape(-1))).astype(np.int64) + next_pos)
        next_pos += max(int(times[-1]), gh - 1, gw - 1) + 1
        cursor, k = start + count, k + count
    for token, rest in grids.items():
        if next(rest, None) is not None:
            raise MediaPlaceholderError(f"more {names[token]} grids than {names[token]} placeholder runs")
    if steps is not None and next(steps, None) is not None:
        raise MediaPlaceholderError("more video time steps than video placeholder runs")
    pieces.append(_run(len(ids) - cursor, next_pos))
    next_pos += len(ids) - cursor
    return np.ascontiguousarray(np.concatenate(pieces, axis=1)), next_pos - len(ids)


class Qwen2VLLayout:
    """Qwen2-VL's prompt rules: t*h*w / merge² placeholders per item, 3-row M-RoPE positions."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.merge = config.vision_config.spatial_merge_size

    def num_placeholders(self, grid_thw: Grid) -> int:
        t, h, w = grid_thw
        if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
            raise ValueError(f"h and w must be positive multiples of {self.merge}")
        return t * h * w // (self.merge * self.merge)

    def smallest_grid(self, modality: str) -> Grid:
        return (1, self.merge, self.merge)

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        # Qwen2-VL's temporal index counts frame groups, whatever their duration
        if not image_grids and not video_grids:
            return None, 0
        return mrope_positions(token_ids, image_grids, video_grids, self.config)
