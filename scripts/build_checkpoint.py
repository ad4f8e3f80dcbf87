"""Build a small random-weight checkpoint of a real architecture, offline and seeded.

    python scripts/build_checkpoint.py qwen3_vl /tmp/qwen3-vl-tiny --seed 0

The directory then loads with ``epdserve serve --model /tmp/qwen3-vl-tiny`` and with transformers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.checkpoints import FAMILIES, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build(args.family, args.out_dir, args.seed))


if __name__ == "__main__":
    main()
