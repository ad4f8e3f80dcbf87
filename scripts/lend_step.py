"""Wall time of a decode step that runs on a borrowed core when the role lending it starts
computing mid-step, as an encoder does when an image arrives while the language model decodes.

The engine owns one core and borrows another's through a core board (as ``up --pin-cores`` runs
the roles); a second process holds that core's seat. In each timed step of the ``reclaimed``
cases the lender marks itself computing ``--after-ms`` into the step and keeps its core busy past
the step's end; with the whole decoder stack in one kernel call, the step either hands the core
back at its next layer (``hand back``) or keeps both threads to its end (``keep``, sharing the
lender's core). ``idle`` (the lender idle throughout: two threads) and ``own`` (the lender busy
throughout: one thread) bound them. Interleaved rounds in one process.

    python scripts/lend_step.py --model DIR --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from profile_engine import requests

from epdserve.assets import default_model_dir
from epdserve.common.core_board import make_board
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.kernels.lending import GRACE_S

# the lender: on "start MS" waits MS, marks itself computing and keeps a core busy until "stop"
LENDER = """
import sys, threading, time
import torch
from epdserve.kernels.lending import CoreLender
lender = CoreLender(sys.argv[1], 1)
stop = threading.Event()
a = torch.randn(512, 1536, dtype=torch.bfloat16)  # an encoder's work: matmuls on its one thread
w = torch.randn(1536, 1536, dtype=torch.bfloat16)
def burn(after):
    torch.set_num_threads(1)  # this thread's count: its matmuls on the one core lent
    time.sleep(after)
    lender.board.mark(1, True, time.monotonic())
    while not stop.is_set():
        a @ w
    lender.board.mark(1, False, time.monotonic())
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "start":
        stop.clear()
        t = threading.Thread(target=burn, args=(float(cmd[1]) / 1e3,))
        t.start()
    else:
        stop.set()
        t.join()
        print("stopped", flush=True)
"""


class Lender:
    def __init__(self, board: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LENDER, str(board)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if self.stdout.readline().strip() != "ready":
            raise SystemExit("the lender process did not start")

    def start(self, after_ms: float) -> None:
        self.stdin.write(f"start {after_ms}\n")
        self.stdin.flush()

    def stop(self) -> None:
        self.stdin.write("stop\n")
        self.stdin.flush()
        self.stdout.readline()
        time.sleep(2 * GRACE_S)  # idle again, as the board reads it

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=10)


def timed(engine: EngineCore, lender: Lender, case: str, after_ms: float) -> float:
    """Seconds of one decode step in ``case``."""
    if case == "own":
        lender.start(0)
        time.sleep(0.05)
    elif case != "idle":
        lender.start(after_ms)
    t0 = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t0
    if case != "idle":
        lender.stop()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each case in a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after-ms", type=float, default=5.0, help="when the lender starts, into the step")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = args.model or default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        board = make_board(tmp)
        lender = Lender(board)
        cfg = EngineConfig(num_kv_blocks=1024, dtype=args.dtype, threads=1, core_board=str(board))
        engine = EngineCore.from_pretrained(model_dir, cfg)
        stack = engine.runner.decode.fused
        if engine.lender is None or stack is None:
            raise SystemExit(f"no borrowing here: lender {engine.lender}, decode path {engine.runner.decode.name}")
        out_len = args.rounds * 4 * args.steps + 20
        for r in requests(model_dir, tok, args.batch, out_len):
            engine.add_request(r)
        for _ in range(5):  # the prefills, then decode only
            engine.step()
        cases = ("idle", "hand back", "keep", "own")
        times: dict[str, list[float]] = {c: [] for c in cases}
        for i in range(args.rounds):
            for case in cases if i % 2 == 0 else cases[::-1]:
                stack.lender = None if case == "keep" else engine.lender
                times[case] += [timed(engine, lender, case, args.after_ms) * 1e3 for _ in range(args.steps)]
        stack.lender = engine.lender
        lender.close()
    print(
        f"{model_dir.name} {args.dtype} batch {args.batch}, one core of its own and one borrowed; "
        f"the lender starts {args.after_ms:g} ms into the step; ms per decode step "
        f"(median, [min, max]) over {args.rounds} rounds of {args.steps}:"
    )
    for case in cases:
        t = times[case]
        print(f"  {case:9s} {statistics.median(t):8.1f} [{min(t):.1f}, {max(t):.1f}]")


if __name__ == "__main__":
    main()
