"""The isolation benchmark: the seeds' mixed traffic (half text-only, half 4-image
requests, 16 output tokens) against aggregated, 1e+1pd, and 1e+1pd whose router admits at most
``--media-limit`` image requests at once (``--max-inflight-media``; the rest wait in their own
queue or get 429 after ``--admission-wait-s``), and 1e+1pd whose router finds that limit itself
to keep text TTFT p90 under ``--text-target-ms`` (``--text-ttft-target-ms``). Reports per kind:
TTFT p50/p99 and completed requests; and the image requests turned away.

    python scripts/admission_bench.py --requests 256 --concurrency 16 --media-limit 2 --text-target-ms 40
"""

from __future__ import annotations

import argparse
import asyncio

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig, summarize_by_kind
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--media-limit", type=int, default=2)
    ap.add_argument("--admission-wait-s", type=float, default=30.0)
    ap.add_argument("--text-target-ms", type=float, default=40.0)
    args = ap.parse_args()
    workload = WorkloadConfig(images_per_request=4, output_len=16, text_fraction=0.5)
    cases = [
        ("aggregated", "aggregated", []),
        ("1e+1pd", "1e+1pd", []),
        (
            f"1e+1pd, --max-inflight-media {args.media_limit}",
            "1e+1pd",
            ["--max-inflight-media", str(args.media_limit), "--admission-wait-s", str(args.admission_wait_s)],
        ),
        (
            f"1e+1pd, --text-ttft-target-ms {args.text_target_ms:g}",
            "1e+1pd",
            ["--text-ttft-target-ms", str(args.text_target_ms), "--admission-wait-s", str(args.admission_wait_s)],
        ),
    ]
    rows = []
    for label, topology, router_args in cases:
        d = Deployment(Topology.parse(topology), None, port=free_port(), extra_router_args=router_args)
        d.start()
        try:
            cfg = BenchConfig(d.url, "", workload, args.requests, warmup=8, concurrency=args.concurrency)
            result = asyncio.run(run_bench(cfg))
            kinds = summarize_by_kind(result.results, result.summary.duration_s)
            rows.append((label, result.summary, kinds))
        finally:
            d.stop()
    print(
        f"{args.requests} requests, half text-only, half 4 images; 16 output tokens; concurrency {args.concurrency}\n"
    )
    print(
        "| topology | req/s | text TTFT p50 ms | text TTFT p99 ms | image TTFT p50 ms | image TTFT p99 ms | image 429s |"
    )
    print("|---|---|---|---|---|---|---|")
    base = rows[0][2]["text"].ttft.p99
    for label, s, kinds in rows:
        t, i = kinds["text"], kinds["image"]
        print(
            f"| {label} | {s.request_throughput:.2f} | {1e3 * t.ttft.p50:.1f} | {1e3 * t.ttft.p99:.1f} "
            f"({t.ttft.p99 / base:.2f}x) | {1e3 * i.ttft.p50:.1f} | {1e3 * i.ttft.p99:.1f} | {i.errors.get('429', 0)} |"
        )


if __name__ == "__main__":
    main()
