"""Qwen2-Audio's prompt rules without torch: how many placeholders an audio item takes, and how many
log-mel frames its encoder reads.

An audio item's extent travels in the ``grid_thw`` field every media item carries, as
``(1, frames, 1)``: ``frames`` is the number of valid log-mel frames (10 ms each, at most the
encoder's 30 s window). The encoder's two convolutions (the second with stride 2) and its 2x
average pool turn them into ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` embedding rows, as
transformers' ``Qwen2AudioProcessor`` counts them.

The language model has plain 1-D rotary positions, so ``positions`` never builds a table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epdserve.models.base import Grid
from epdserve.models.config import AudioConfig, ModelConfig

# valid frames the convolutions read past: the first convolution (kernel 3) at frame L sees L + 1,
# and the strided second one reads the first's output at L when L is odd (see encoder_frames)
CONV_CONTEXT_FRAMES = 2


MIN_FRAMES = 3  # the fewest log-mel frames that make one embedding row


def audio_grid(frames: int) -> Grid:
    """The ``grid_thw`` an audio item of ``frames`` valid log-mel frames travels with."""
    return (1, frames, 1)


def max_frames(config: AudioConfig) -> int:
    """Log-mel frames of the encoder's window (3000 = 30 s for Whisper's 1500 source positions)."""
    return 2 * config.max_source_positions


def audio_tokens(frames: int) -> int:
    """Embedding rows (= placeholder tokens) of an item with ``frames`` valid log-mel frames."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def encoder_frames(frames: int, config: AudioConfig) -> int:
    """Log-mel frames the encoder reads for an item of ``frames`` valid frames.

    transformers pads every item to the full window and masks the padded frames in attention, but
    its convolutions still read the frames just past the audio (the log-mel of the zero-padded
    tail, not zeros). Those two frames are all of the padding a valid output row depends on, so the
    item carries them and nothing more.
    """
    return min(frames + CONV_CONTEXT_FRAMES, max_frames(config))


def check_grid(grid_thw: Grid, config: AudioConfig) -> int:
    """Valid frames of an audio ``grid_thw``; ValueError unless it is (1, frames, 1) with frames
    making at least one embedding row and fitting the encoder's window."""
    t, frames, w = grid_thw
    if t != 1 or w != 1:
        raise ValueError(f"an audio item's grid is (1, frames, 1), got {list(grid_thw)}")
    if audio_tokens(frames) < 1 or frames > max_frames(config):
        raise ValueError(f"an audio item has 3 to {max_frames(config)} log-mel frames, got {frames}")
    return frames


class Qwen2AudioLayout:
    """Qwen2-Audio's prompt rules: ``audio_tokens(frames)`` placeholders per item, 1-D positions."""

    def __init__(self, config: ModelConfig) -> None:
        if config.audio is None:
            raise ValueError(f"{config.architecture} has no audio encoder config")
        self.config = config
        self.audio = config.audio

    def num_placeholders(self, grid_thw: Grid) -> int:
        return audio_tokens(check_grid(grid_thw, self.audio))

    def smallest_grid(self, modality: str) -> Grid:
        return audio_grid(MIN_FRAMES)

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        if image_grids or video_grids:
            raise ValueError(f"{self.config.architecture} takes no images or videos")
        return None, 0
