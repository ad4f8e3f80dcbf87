"""One large image encoded a slice of the vision tower's forward at a time, between engine steps.

An engine that encodes media inside its steps makes every request of a step wait for the step's
vision work. One image can take the tower far longer than a decode step (a 2B model's tower spends
over a minute on the largest image its processor allows, on a small CPU), and a forward once
started ran to its end: meanwhile the running requests' decodes stood still, and new prompts,
text ones too, waited.

An image whose forward alone would take longer than ``vision_slice_s`` (at the tower's recent
rate) is encoded here instead, apart from the steps' batches: its request waits, admitted to no
step and holding no KV block, while each step runs as many stages of the item's forward as fit in
the step's vision bound ``vision_step_s`` (judged by the last stage's time; one at least, so that
it always progresses), beside the decodes and prompts of the step. A stage is part of a block:
its q/k/v projection, the attention of a group of its heads, or its MLP over a group of rows
(``models.layers.vision.VisionBlock``), so that even the largest image's blocks are cut into
parts of a bounded cost. Once the last stage has run the item holds its embeddings, and its
request joins a step as one whose media is ready. Its request leaving stops the forward at once.

    step k:   [ decodes, prompt chunks, small images' forward ] [ stages i..j of the large image ]
    step k+1: [ decodes, prompt chunks, small images' forward ] [ stages j+1..  ]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from epdserve.engine.request import MediaItem
from epdserve.models.base import Stages


class SlicedEncode:
    """The forward of one media item for one request (``owner``), paused between its stages."""

    def __init__(
        self, owner: str, item: MediaItem, patches: int, stages: Stages, sync: Callable[[], None] | None = None
    ) -> None:
        self.owner = owner
        self.item = item
        self.patches = patches
        self._stages = stages
        self._sync = sync  # waits for the device's queued work (a GPU's layers are timed as run, not launched)
        self.seconds = 0.0  # the forward's time so far (its slices only)
        self.slices = 0

    def advance(self, budget_s: float) -> torch.Tensor | None:
        """Run stages while another as long as the last fits in ``budget_s`` (one at least); the
        item's embeddings once the last has run, else None. Raises what the forward raises."""
        t0 = last = time.perf_counter()
        self.slices += 1
        try:
            while True:
                next(self._stages)
                if self._sync is not None:
                    self._sync()
                now = time.perf_counter()
                if 2 * now - last - t0 > budget_s:  # spent so far + the stage just run
                    return None
                last = now
        except StopIteration as done:
            out: torch.Tensor = done.value
            if self._sync is not None:
                self._sync()
            return out
        finally:
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the forward; its activations are freed."""
        self._stages.close()
