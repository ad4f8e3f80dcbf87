"""Where a deployment's time goes under load: the Server-Timing stages (p50, p90) of every
request, and each role's CPU seconds (its process and children, from /proc) over the run.

Starts the topology with ``up``'s ``Deployment`` (cores pinned), sends one closed-loop benchmark
of fresh images, prints, stops. A development tool for A/B runs, not part of the package:

    python scripts/stage_times.py --topology 1e+1pd --concurrency 16 --seed 7
    python scripts/stage_times.py --topology 1e+1pd --encoder-arg=--threads --encoder-arg=1
    python scripts/stage_times.py --model DIR --topology aggregated --concurrency 1 --requests 4 \
        --warmup 1 --image-size 224
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port, process_tree
from epdserve.up import Deployment, Topology

CLOCK_TICKS = 100  # /proc/<pid>/stat times are in these (USER_HZ)


def cpu_seconds(d: Deployment) -> dict[str, float]:
    """CPU seconds so far of each role's process tree."""
    out = {}
    for role in d.roles:
        total = 0.0
        for pid in process_tree([role.proc.pid]):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            except (OSError, IndexError, ValueError):
                pass
        out[role.name] = total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="1e+1pd")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="a new seed per run: images a server has cached are faster")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--encoder-arg", action="append", default=[], help="an extra encoder flag (repeat)")
    ap.add_argument("--pd-arg", action="append", default=[], help="an extra PD/aggregated flag (repeat)")
    args = ap.parse_args()
    topo = Topology.parse(args.topology)
    models = ["--dtype", args.dtype]
    d = Deployment(
        topo,
        args.model,
        port=free_port(),
        pin=True,
        extra_pd_args=[*models, *args.pd_arg],
        extra_encoder_args=[*models, *args.encoder_arg],
    )
    d.start()
    try:
        workload = WorkloadConfig(image_size=args.image_size, output_len=64)
        cfg = BenchConfig(
            url=d.url,
            model="",
            workload=workload,
            num_requests=args.requests,
            warmup=args.warmup,
            concurrency=args.concurrency,
            seed=args.seed,
        )
        before, t0 = cpu_seconds(d), time.time()
        s = asyncio.run(run_bench(cfg)).summary
        wall, after = time.time() - t0, cpu_seconds(d)
        print(
            f"{args.topology} c{args.concurrency}: {s.request_throughput:.2f} req/s, TTFT p50 "
            f"{s.ttft.p50 * 1e3:.1f} ms, TPOT p50 {s.tpot.p50 * 1e3:.2f} ms, {wall:.1f} s"
        )
        for name, st in s.stages.items():
            print(f"  stage {name:22s} p50 {st.p50 * 1e3:7.2f} ms   p90 {st.p90 * 1e3:7.2f} ms")
        for name, secs in after.items():
            used = secs - before.get(name, 0.0)
            print(f"  cpu   {name:22s} {used:6.2f} s   {used / wall * 100:5.1f}% of a core")
    finally:
        d.stop()


if __name__ == "__main__":
    main()
