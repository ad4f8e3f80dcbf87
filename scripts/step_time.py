"""Wall time of one engine decode step at a batch size, no profiler: B image requests are
prefilled, stepped a few times, then decode steps are timed (contexts grow from ~50 tokens).
Runs on this tree, or on another one given first on PYTHONPATH, so two trees compare in one
sitting (A/B); ``--compare-stack`` compares the whole decoder stack in one kernel call with the
same kernels called layer by layer, in interleaved rounds of one process.

    python scripts/step_time.py --batch 16 --dtype bfloat16
    PYTHONPATH=/tmp/before python scripts/step_time.py --batch 16   # a worktree of an older commit
    python scripts/step_time.py --batch 16 --kernels torch            # PyTorch ops instead of the kernels
    python scripts/step_time.py --model DIR --dtype bfloat16 --threads 2 --batch 1 --compare-stack 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from profile_engine import requests

from epdserve.assets import default_model_dir
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore


def timed_steps(engine: EngineCore, model_dir: Path, tok, batch: int, steps: int) -> float:
    """Seconds per decode step of ``batch`` new requests, after their prefills; drains them."""
    for r in requests(model_dir, tok, batch, steps + 10):
        engine.add_request(r)
    for _ in range(5):  # the prefills, then decode only
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    per_step = (time.perf_counter() - t0) / steps
    while engine.has_work:
        engine.step()
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--kernels", default="", choices=["", "auto", "torch"], help="EngineConfig.kernels (unset: default)"
    )
    ap.add_argument(
        "--compare-stack", type=int, default=0, metavar="ROUNDS", help="the fused stack against layer by layer"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    extra = {"kernels": args.kernels} if args.kernels else {}  # an older tree has no such field
    engine = EngineCore.from_pretrained(model_dir, EngineConfig(num_kv_blocks=1024, dtype=args.dtype, **extra))
    torch.set_num_threads(args.threads)  # the engine sets its own from the config: the one asked for here
    label = f"{model_dir.name} {args.dtype} batch {args.batch}, {args.threads} thread(s)"
    if not args.compare_stack:
        ms = timed_steps(engine, model_dir, tok, args.batch, args.steps) * 1e3
        print(f"{label} {args.kernels or 'default'}: {ms:.2f} ms per decode step")
        return
    lm = engine.runner.model.language_model
    stack = lm.fused
    if stack is None:
        raise SystemExit(f"no fused stack here (decode path: {engine.runner.decode.name})")
    times: dict[str, list[float]] = {"stack": [], "layers": []}
    for i in range(args.compare_stack):
        for name in ("stack", "layers") if i % 2 == 0 else ("layers", "stack"):
            lm.fused = stack if name == "stack" else None
            times[name].append(timed_steps(engine, model_dir, tok, args.batch, args.steps) * 1e3)
    lm.fused = stack
    s, layers = statistics.median(times["stack"]), statistics.median(times["layers"])
    print(f"{label}, {stack.engine} tile engine, ms per decode step, median of {args.compare_stack} rounds:")
    for name, med in (("one call", s), ("layer by layer", layers)):
        print(
            f"  {name}: {med:.2f} [{', '.join(f'{t:.2f}' for t in times['stack' if name == 'one call' else 'layers'])}]"
        )
    print(f"  one call / layer by layer: {s / layers:.3f}x")


if __name__ == "__main__":
    main()
