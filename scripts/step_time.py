"""Wall time of one engine decode step at a batch size, no profiler: B image requests are
prefilled, stepped a few times, then 100 decode steps are timed (contexts grow from ~50 to ~150
tokens). Runs on this tree, or on another one given first on PYTHONPATH, so two trees compare
in one sitting (A/B).

    python scripts/step_time.py --batch 16 --dtype bfloat16
    PYTHONPATH=/tmp/before python scripts/step_time.py --batch 16   # a worktree of an older commit
    python scripts/step_time.py --batch 16 --kernels torch            # PyTorch ops instead of the kernels
"""

from __future__ import annotations

import argparse
import time

import torch
from profile_engine import requests

from epdserve.assets import default_model_dir
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--kernels", default="", choices=["", "auto", "torch"], help="EngineConfig.kernels (unset: default)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    model_dir = default_model_dir()
    extra = {"kernels": args.kernels} if args.kernels else {}  # an older tree has no such field
    engine = EngineCore.from_pretrained(model_dir, EngineConfig(num_kv_blocks=1024, dtype=args.dtype, **extra))
    for r in requests(model_dir, AutoTokenizer.from_pretrained(model_dir), args.batch, args.steps + 10):
        engine.add_request(r)
    for _ in range(5):  # the prefills, then decode only
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"{args.dtype} batch {args.batch} {args.kernels or 'default'}: {ms:.2f} ms per decode step")


if __name__ == "__main__":
    main()
