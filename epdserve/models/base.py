"""Interfaces between model code and the engine.

The model never sees paging: each attention layer hands its projected q/k/v to an
``AttentionBackend`` supplied per step by the engine's model runner, which writes k/v into the
paged cache and attends over each sequence's context.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import numpy as np
    import torch

    from epdserve.kernels.fused import RowWise

Grid = tuple[int, int, int]  # (t, h, w) in patches

# a media encoder's forward that pauses after each of its layers and returns the embeddings, so
# that an engine can spread one large item's forward over several steps (``engine.vision_slices``)
Stages = Generator[None, None, "torch.Tensor"]


def run_stages(stages: Stages) -> torch.Tensor:
    """Run a forward written as ``Stages`` to its end, without pausing."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


class DeepStack(NamedTuple):
    """Vision features a DeepStack model (Qwen3-VL) adds to the hidden states of its first layers:
    after layer l, ``features[l]`` is added at ``rows`` of the step's token batch."""

    rows: torch.Tensor  # long [M]: the visual placeholder rows of this step
    features: torch.Tensor  # [levels - 1, M, H]: one level per early layer


class AttentionBackend(Protocol):
    # set when every new token of the step attends row by row over the paged cache: a fused
    # decoder stack (kernels.fused) may then run all layers in one call instead
    row_wise: RowWise | None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] for the N new tokens of this step (all sequences
        concatenated, in scheduling order, positional rotation already applied).
        Returns the attention output [N, Hq, D] (causal within each sequence, over its cached
        context plus the new tokens)."""
        ...


class PromptLayout(Protocol):
    """A model's rules for media in the prompt, owned by the model file (the engine, the encoder
    and the front end ask it; none of them knows a formula of its own)."""

    def num_placeholders(self, grid_thw: Grid) -> int:
        """Placeholder tokens (= embedding rows) of one media item; ValueError for a grid the
        model cannot take."""
        ...

    def smallest_grid(self, modality: str) -> Grid:
        """The smallest grid an item of ``modality`` may have (a stand-in for an item whose grid is
        not known yet)."""
        ...

    def positions(
        self,
        token_ids: list[int],
        image_grids: list[Grid],
        video_grids: list[Grid],
        video_second_per_grid: Sequence[float | None] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        """Rotary positions of an expanded prompt (int64 [rows, N], None when plain 1-D positions do)
        and the offset that positions of generated tokens continue from (position = index + delta).

        ``video_second_per_grid``: per video, the seconds of video one temporal patch spans
        (temporal_patch_size / sampled fps; None, or no list: the model's default), for models
        whose temporal positions follow time (Qwen2.5-VL)."""
        ...


class Expansion(NamedTuple):
    """What the chat template's one placeholder token of a media item becomes in the prompt."""

    token_ids: list[int]
    runs: list[tuple[int, int]]  # (index in token_ids, length) of each placeholder run, in embedding-row order


@runtime_checkable
class ExpandsMedia(Protocol):
    """A layout whose media items are not one run of placeholders: a Qwen3-VL video is a run per
    frame group, each behind its own timestamp text. (Without ``expand``, an item is one run of
    ``num_placeholders`` tokens.)"""

    def expand(
        self, modality: str, grid_thw: Grid, encode: Callable[[str], list[int]], second_per_grid: float | None = None
    ) -> Expansion:
        """The item's tokens; ``encode`` tokenizes text with the model's tokenizer (no special
        tokens added), ``second_per_grid`` is a video's seconds per temporal patch (None: the
        model's default). ValueError for a grid the model cannot take."""
        ...
