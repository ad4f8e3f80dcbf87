"""Frontend media decoding, measured both ways: two 1e+1pd deployments, one whose
router fetches and decodes media itself (``--frontend-decode``: encoders get pixels through its
shm slab) and one whose encoders do, run interleaved (off, on, off, on, ...) on the same requests.
Each round sends fresh images (its own seed), and the encoders' caches are off, so every item is
decoded and encoded in every run.

Reports per deployment, over all rounds: req/s, TTFT p50/p99, and the CPU time each role spent
per media item (read from /proc: the encoder's is what the flag should take away, the router's
what it adds), with ratios on/off.

    python scripts/frontend_decode_bench.py --requests 128 --rounds 3 --concurrency 8 --image-size 768
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import urllib.request

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig, BenchResult
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology

CASES = (("off", []), ("on", ["--frontend-decode"]))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def items(encoder_url: str) -> float:
    """Media items the encoder has answered (every status)."""
    with urllib.request.urlopen(encoder_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m[1]) for m in re.finditer(r"^epd_encoder_items_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def pid_of(d: Deployment, name: str) -> tuple[int, str]:
    role = next(r for r in d.roles if r.name.startswith(name))
    return role.proc.pid, role.url


def run(d: Deployment, cfg: BenchConfig) -> tuple[BenchResult, float, float]:
    """One run: its result, and the encoder's and the router's CPU ms per media item."""
    (enc, enc_url), (router, _) = pid_of(d, "encoder"), pid_of(d, "router")
    before = cpu_s(enc), cpu_s(router), items(enc_url)
    result = asyncio.run(run_bench(cfg))
    n = max(1.0, items(enc_url) - before[2])
    return result, 1e3 * (cpu_s(enc) - before[0]) / n, 1e3 * (cpu_s(router) - before[1]) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128, help="measured requests per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each deployment, interleaved")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--images", type=int, default=2, help="images per request")
    ap.add_argument("--image-size", type=int, default=768, help="square side of each image in px")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--decode-workers", type=int, default=2, help="--frontend-decode-workers")
    args = ap.parse_args()
    workload = WorkloadConfig(images_per_request=args.images, image_size=args.image_size, output_len=args.output_len)
    deployments = {}
    try:
        for label, router_args in CASES:
            extra = [*router_args, "--frontend-decode-workers", str(args.decode_workers)] if router_args else []
            d = Deployment(
                Topology.parse("1e+1pd"),
                None,
                port=free_port(),
                extra_router_args=extra,
                extra_encoder_args=["--encoder-cache-bytes", "0"],  # every item decoded and encoded
            )
            d.start()
            deployments[label] = d
        runs: dict[str, list[tuple[BenchResult, float, float]]] = {label: [] for label, _ in CASES}
        for r in range(args.rounds):
            for label, _ in CASES:
                cfg = BenchConfig(
                    deployments[label].url, "", workload, args.requests, warmup=4,
                    concurrency=args.concurrency, seed=1000 * r,
                )  # fmt: skip
                runs[label].append(run(deployments[label], cfg))
                s = runs[label][-1][0].summary
                print(f"round {r} {label}: {s.request_throughput:.2f} req/s, {s.completed}/{s.requests} completed")
    finally:
        for d in deployments.values():
            d.stop()

    def row(label: str) -> dict[str, float]:
        rs = runs[label]
        ttfts = sorted(x.ttft for res, _, _ in rs for x in res.results if x.ok)
        q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
        return {
            "req/s": statistics.mean(res.summary.request_throughput for res, _, _ in rs),
            "TTFT p50 ms": 1e3 * q[49],
            "TTFT p99 ms": 1e3 * q[98],
            "encoder CPU ms/item": statistics.mean(e for _, e, _ in rs),
            "router CPU ms/item": statistics.mean(rt for _, _, rt in rs),
        }

    off, on = row("off"), row("on")
    print(
        f"\n{args.rounds} rounds x {args.requests} requests, {args.images} images of {args.image_size}px each, "
        f"{args.output_len} output tokens, concurrency {args.concurrency}, encoder cache off\n"
    )
    print("| metric | flag off | flag on | on/off |")
    print("|---|---|---|---|")
    for k in off:
        ratio = on[k] / off[k] if off[k] else float("nan")
        print(f"| {k} | {off[k]:.2f} | {on[k]:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
