"""P/D at low load: one request at a time (text, and one image; 16 output tokens) through each
topology, to show what the extra hop and the KV transfer cost when nothing queues.

    python scripts/pd_low_load.py [--topologies aggregated,1e+1pd,1e+1p+1d]
"""

from __future__ import annotations

import argparse
import asyncio

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topologies", default="aggregated,1e+1pd,1e+1p+1d")
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    rows = []
    for name in args.topologies.split(","):
        d = Deployment(Topology.parse(name), None, port=free_port(), extra_pd_args=["--max-model-len", "2048"])
        d.start()
        try:
            for images in (0, 1):
                workload = WorkloadConfig(images_per_request=images, output_len=16)
                cfg = BenchConfig(d.url, "", workload, args.requests, warmup=2, concurrency=1, seed=5 + images)
                s = asyncio.run(run_bench(cfg)).summary
                rows.append((name, images, 1e3 * s.ttft.p50, 1e3 * s.tpot.p50, 1e3 * s.e2e.p50))
        finally:
            d.stop()
    print("| topology | images | TTFT p50 ms | TPOT p50 ms | E2E p50 ms |")
    print("|---|---|---|---|---|")
    for name, images, ttft, tpot, e2e in rows:
        print(f"| {name} | {images} | {ttft:.1f} | {tpot:.1f} | {e2e:.1f} |")


if __name__ == "__main__":
    main()
