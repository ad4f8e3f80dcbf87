"""Build a random-weight checkpoint of a real architecture, offline and seeded.

    python scripts/build_checkpoint.py qwen3_vl /tmp/qwen3-vl-tiny --seed 0
    python scripts/build_checkpoint.py qwen2_vl /tmp/qwen2-vl-2b --size 2b
    python scripts/build_checkpoint.py qwen2_5_vl /tmp/qwen2.5-vl-3b --size 3b
    python scripts/build_checkpoint.py qwen3_vl /tmp/qwen3-vl-2b --size 2b
    python scripts/build_checkpoint.py qwen2_vl /tmp/qwen2-vl-2b-l2 --size 2b --layers 2 --vision-depth 2
    python scripts/build_checkpoint.py qwen2_vl /tmp/qwen2-vl-2b-448 --size 2b --max-pixels 200704

``--size tiny`` (the default) is a small model of the family's structure for tests; ``2b``/``3b``
is the published configuration of Qwen2-VL-2B-Instruct, Qwen3-VL-2B-Instruct (2b) or
Qwen2.5-VL-3B-Instruct (3b) with the processor's published pixel bounds, in bfloat16 (see
tests/checkpoints/published.py and docs/memory.md). ``--layers`` / ``--vision-depth`` keep every
width of a published size and cut its depth; ``--max-pixels`` bounds its images' area (200704:
448x448), as a small serving machine wants. The directory then loads with
``epdserve serve --model DIR`` and with transformers.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epdserve.assets import default_model_dir
from tests.checkpoints import FAMILIES, build
from tests.checkpoints.published import SIZES, build_published


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=sorted({*FAMILIES, "qwen2_vl"}))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=("tiny", "2b", "3b"), default="tiny", help="tiny, or the published size")
    ap.add_argument("--layers", type=int, default=0, help="language-model layers of a published size (0: all)")
    ap.add_argument("--vision-depth", type=int, default=0, help="vision blocks of a published size (0: all)")
    ap.add_argument("--max-pixels", type=int, default=0, help="images' largest area in pixels (0: the published bound)")
    args = ap.parse_args()
    if args.size == "tiny":
        if args.layers or args.vision_depth or args.max_pixels:
            ap.error("--layers, --vision-depth and --max-pixels change a published size (--size 2b or 3b)")
        if args.family == "qwen2_vl":  # the embedded model is the tiny Qwen2-VL
            print(shutil.copytree(default_model_dir(), args.out_dir, dirs_exist_ok=True))
            return
        print(build(args.family, args.out_dir, args.seed))
        return
    if SIZES.get(args.family) != args.size:
        sizes = ", ".join(f"{f} {s}" for f, s in SIZES.items())
        ap.error(f"no published {args.size} size of {args.family} (published here: {sizes})")
    try:
        print(build_published(args.family, args.out_dir, args.seed, args.layers, args.vision_depth, args.max_pixels))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
