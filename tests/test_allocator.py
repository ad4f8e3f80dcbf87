"""``allocator.keep_freed_memory``: the buffers of an image's preprocessing (decoded, resized,
normalized), freed and allocated again for the next image, are reused from the heap instead of
being faulted in page by page each time (glibc); and a role's ``FreeMemoryReturner`` gives the
free pages between held buffers back to the kernel, so memory follows what is held."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from epdserve.allocator import FreeMemoryReturner, keep_freed_memory

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


_ACTIVATIONS = """
import resource, sys
import torch
from epdserve.allocator import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "tuned" else None
x = torch.randn(1024, 1280, dtype=torch.bfloat16)
w = torch.randn(5120, 1280, dtype=torch.bfloat16)
torch.nn.functional.gelu(x @ w.t())  # a vision MLP's 10 MiB activations, once before counting
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.nn.functional.gelu(x @ w.t())
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_real_size_models_activations_are_reused_without_page_faults() -> None:
    """A 2B model's tower allocates and frees buffers of ~10 MiB per layer: under the mmap
    threshold they are reused from the heap, not mapped and faulted in page by page each time."""
    out = subprocess.run([sys.executable, "-c", _ACTIVATIONS, "tuned"], capture_output=True, text=True, check=True)
    took, n = out.stdout.split()
    tuned = int(n)
    if took != "True":
        pytest.skip("this C library has no mallopt (not glibc)")
    # mapped afresh, each pass would fault in every page of its 10 MiB buffers (2,560 each)
    assert tuned < 20 * (10 << 20) // 4096 // 4


MB = 1 << 20


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_free_chunks_between_live_ones_are_given_back() -> None:
    if not keep_freed_memory():
        pytest.skip("not glibc: no allocator thresholds to set")
    # 1 MiB buffers come from the heap (under the mmap threshold); every other one freed leaves
    # free chunks between live ones, which no trim at the heap's top can reach
    held = []
    for _ in range(160):
        b = bytearray(MB)
        b[::4096] = b"\x01" * len(range(0, MB, 4096))  # touch every page
        held.append(b)
    del held[::2]
    before = rss_mb()
    returner = FreeMemoryReturner(interval_s=0.05)
    assert returner.start()
    try:
        deadline = time.monotonic() + 30
        while returner.returns < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert returner.returns >= 2
        assert before - rss_mb() > 40, (before, rss_mb())  # of the 80 MiB freed
    finally:
        returner.stop()
    assert len(held) == 80 and all(b[0] == 1 for b in held)  # what was held is intact
