"""What preprocessing one image holds at its peak and how long it takes, under a checkpoint's
processor bounds.

    python scripts/preprocess_peak.py --model DIR --side 4096 --runs 5

The image is ``side`` x ``side`` of random RGB (so the resize does real work), decoded once before
timing. Each run preprocesses it (resize, normalize, patchify) and reads the traced peak of the
arrays it made (``tracemalloc``: numpy's buffers; Pillow's resize buffer is not traced) and its
wall time. Prints one JSON line: the patches' bytes, the median peak, its ratio to the patches and
the median time. Run it under two trees (``PYTHONPATH=...``) in turn to compare them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np
from PIL import Image

from epdserve.media.processor import ProcessorConfig, VisionProcessor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (its preprocessor_config.json)")
    ap.add_argument("--side", type=int, default=4096, help="the source image's width and height, in pixels")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    processor = VisionProcessor(ProcessorConfig.from_pretrained(args.model))
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))
    peaks, seconds, patches = [], [], 0
    for _ in range(args.runs):
        tracemalloc.start()
        t = time.perf_counter()
        out = processor.image(img)
        seconds.append(time.perf_counter() - t)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        patches = out.pixel_values.nbytes
        del out
    peak = statistics.median(peaks)
    print(
        json.dumps(
            {
                "side": args.side,
                "grid": list(processor.image(img).grid_thw),
                "patches_mib": round(patches / 2**20, 1),
                "peak_mib": round(peak / 2**20, 1),
                "peak_over_patches": round(peak / patches, 3),
                "seconds_p50": round(statistics.median(seconds), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
