"""Adaptive dispatch: where a request's media is encoded — on an encoder (the E+PD path:
"remote") or by the language-model worker itself, from the raw media (the aggregated path:
"local") — chosen per request from costs measured while serving.

For ``P`` patches of media that need a vision forward::

    remote = encoder wait + P × (preprocess + forward)  + hop + P × bytes/patch × worker fetch
    local  =                P × (preprocess + forward_w) × (1 + waiting + interference × decoding)

- *encoder wait*: the patches already in flight on the least busy encoder × its forward cost;
- *forward*, *preprocess*: the encoder's seconds per patch of vision forward and CPU seconds per
  patch of decoding and resizing (its ``/v1/load`` report, else learnt from the timings its
  encode results carry); the worker's preprocessing is taken to cost what the encoder's does;
  *forward_w*: the worker's own forward (its report, once it has encoded raw media; until then
  the encoder's, the same model);
- *hop*: what an encode call costs beyond the encoder's own work (HTTP, the put), learnt from the
  calls' durations against the timings the encoder returns — a low quantile of recent calls, not
  their mean: under load the excess also holds waits on busy event loops and cores, which raw
  media would meet as well; the worker's fetch cost per byte comes from its report;
- *waiting*, *decoding*: the requests in flight on the worker, before and after their first
  token. Its engine runs a vision forward inside a step, and on a CPU host the worker's own
  decoding and resizing of the media takes the cores its engine runs on, so every request in its
  batch waits that long too. One still waiting for its first token pays that wait in its TTFT, in
  full — counting those whose media is still on an encoder: they reach the worker's queue as soon
  as it is encoded. One already decoding pays one longer gap between tokens: no TTFT, so by
  default (``interference`` 0) it does not count; an operator who weighs the time between tokens
  against the first one sets the weight (the router knows which is which: it has seen their first
  bytes or not). Measured on the sweep in docs/benchmarks.md.

Items the router already holds a result for (its directory, a cached handle) cost nothing
remote, and are never sent raw. A worker without a vision tower only takes the remote path;
with no healthy encoder, media goes raw to a worker that has one.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

from PIL import Image

from epdserve.api.load import LoadReport
from epdserve.encoder.protocol import EncodedItem
from epdserve.media.budget import PILLOW_NAMES, sniff
from epdserve.media.processor import ProcessorConfig, smart_resize

Dispatch = Literal["always", "never", "adaptive"]
DATA_URL_HEAD = 1 << 16  # base64 characters read to find an image's size (headers sit at the front)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Average:
    """An exponential average (0 until the first sample)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.value = 0.0
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if not self.samples else (1 - self.weight) * self.value + self.weight * x
        self.samples += 1


class LowQuantile:
    """A low quantile of the last ``size`` samples (0 until the first)."""

    def __init__(self, q: float = 0.2, size: int = 64) -> None:
        self.q = q
        self._xs: deque[float] = deque(maxlen=size)

    def add(self, x: float) -> None:
        self._xs.append(x)

    @property
    def value(self) -> float:
        if not self._xs:
            return 0.0
        xs = sorted(self._xs)
        return xs[int(self.q * (len(xs) - 1))]


class Choice(NamedTuple):
    local: bool  # send the raw media to the worker
    remote_s: float  # the predicted cost of each path, in seconds
    local_s: float


@dataclass
class Side:
    """What the router knows of one path's parties when it decides."""

    encoder: LoadReport | None  # the least busy healthy encoder's report (None: no healthy encoder)
    encoder_patches: int  # patches in flight on that encoder
    worker: LoadReport  # the chosen language-model worker's report
    worker_waiting: int  # requests in flight on that worker still waiting for their first token
    worker_decoding: int = 0  # and those past it


class DispatchModel:
    def __init__(self, processor: ProcessorConfig, interference: float = 0.0) -> None:
        self.processor = processor
        self.interference = interference
        self.preprocess = Average()  # encoder seconds per patch: decode, resize, patchify
        self.forward = Average()  # encoder seconds per patch of vision forward (from item timings)
        self.hop = LowQuantile()  # seconds an encode call costs beyond the encoder's own work
        self.bytes_per_patch = Average()
        self.patches_per_item = {"image": Average(), "video": Average(), "audio": Average()}  # audio: mel frames

    # ---- learning ----------------------------------------------------------------------------
    def observe(self, items: list[EncodedItem], call_s: float) -> None:
        """One encode call's results and how long the call took, end to end."""
        work = 0.0
        for it in items:
            patches = math.prod(it.grid_thw)
            self.patches_per_item[it.modality].add(patches)
            t = it.timings
            work = max(work, (t.fetch_ms + t.preprocess_ms + t.queue_ms + t.encode_ms) / 1e3)
            if it.status == "computed":
                self.preprocess.add(t.preprocess_ms / 1e3 / patches)
                self.forward.add(t.encode_ms / 1e3 / patches)  # the batch's forward: an upper bound
                rows, width = it.shape
                self.bytes_per_patch.add(rows * width * DTYPE_BYTES.get(it.dtype, 4) / patches)
        self.hop.add(max(0.0, call_s - work))

    def costs(self) -> dict[str, float]:
        """What it has learnt, in seconds (for the metrics)."""
        return {"preprocess_per_patch": self.preprocess.value, "forward_per_patch": self.forward.value,
                "hop": self.hop.value}  # fmt: skip

    # ---- predicting ----------------------------------------------------------------------------
    def patches(self, modality: str, url: str) -> int:
        """The patches an item will have: from an image's size when the data URL says it, else
        the average of the items seen (0 when none was)."""
        if modality == "image" and url.startswith("data:"):
            size = _data_url_image_size(url)
            if size is not None:
                c = self.processor
                try:
                    h, w = smart_resize(size[1], size[0], c.factor, c.min_pixels, c.max_pixels)
                except ValueError:  # an aspect ratio the encoder will refuse: any path answers 400
                    return 0
                return (h // c.patch_size) * (w // c.patch_size)
        return round(self.patches_per_item[modality].value if modality in self.patches_per_item else 0)

    @property
    def measured(self) -> bool:
        """An encode result was seen: the costs have values to compare."""
        return self.forward.samples > 0

    def choose(self, patches: int, side: Side) -> Choice:
        """Local when the worker can encode and its path is predicted cheaper; remote otherwise."""
        w = side.worker
        if not w.vision:
            return Choice(False, 0.0, math.inf)
        if side.encoder is None:
            return Choice(True, math.inf, 0.0)
        forward = side.encoder.s_per_patch or self.forward.value
        # the CPU it costs, as the encoder reports it; the item timings' wall time also holds
        # waits for its preprocessing pool and for a shared core, which raw media would not meet
        pre = side.encoder.preprocess_s_per_patch or self.preprocess.value
        remote = (
            side.encoder_patches * forward
            + patches * (pre + forward)
            + self.hop.value
            + patches * self.bytes_per_patch.value * w.fetch_s_per_byte
        )
        forward_w = w.vision_s_per_patch or forward
        stalled = side.worker_waiting + self.interference * side.worker_decoding
        local = patches * (pre + forward_w) * (1 + stalled)
        return Choice(self.measured and local < remote, remote, local)


def _data_url_image_size(url: str) -> tuple[int, int] | None:
    """(width, height) from the front of a base64 data URL, or None when it does not say."""
    comma = url.find(",", 0, 256)
    if comma < 0 or ";base64" not in url[:comma]:
        return None
    head = url[comma + 1 : comma + 1 + DATA_URL_HEAD]
    head = head[: len(head) // 4 * 4]
    try:
        data = base64.b64decode(head, validate=False)
    except (binascii.Error, ValueError):
        return None
    fmt = sniff(data)
    if fmt not in PILLOW_NAMES:  # only the plugins of accepted formats ever parse client bytes
        return None
    try:
        with Image.open(io.BytesIO(data), formats=(PILLOW_NAMES[fmt],)) as img:
            return img.size
    except Exception:  # a hint from a header, whatever its plugin raises: the decode will judge the item
        return None
