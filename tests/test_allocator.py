"""``allocator.keep_freed_memory``: the buffers of an image's preprocessing (decoded, resized,
normalized), freed and allocated again for the next image, are reused from the heap instead of
being faulted in page by page each time (glibc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import io, resource, sys
import numpy as np
from PIL import Image
from epdserve.allocator import keep_freed_memory
from epdserve.media.decode import decode_image
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
took = keep_freed_memory() if sys.argv[1] == "tuned" else None
buf = io.BytesIO()
Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(buf, "PNG")
data, proc, limits = buf.getvalue(), VisionProcessor(ProcessorConfig()), MediaLimits()
proc.image(decode_image(data, limits))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    proc.image(decode_image(data, limits))
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    took, faults = out.split()
    return took, int(faults)


def test_an_images_buffers_are_reused_without_page_faults() -> None:
    took, tuned = _faults("tuned")
    if took != "True":
        pytest.skip("this C library has no mallopt (not glibc)")
    _, default = _faults("default")
    assert default > 50 * 50  # untuned, every image faults dozens of pages in again
    assert tuned < default / 20
