"""The dispatch sweep: one E+PD deployment whose workers hold a vision tower, run with each
``--dispatch`` policy (always: every image to the encoder; never: every image raw to the worker;
adaptive: per request, by measured cost) over images per request × output length × load. The
policies take turns cell by cell within each round (the same requests for each, in an order that
rotates from round to round), and the rounds repeat, so drift on a shared machine hits all three alike; the table shows per cell the median
over rounds of each policy's TTFT p50 and req/s, and adaptive's ratio to the better fixed policy.
Load is a closed loop (``--concurrency``) or, for ``--poisson`` cells (``IMAGES:OUTPUT:RATE``),
open-loop Poisson arrivals, whose load comes and goes.

    python scripts/dispatch_sweep.py --images 1,10 --output-lens 16,256 --concurrency 1,8 \\
        --poisson 4:64:5 --requests 16 --rounds 3 --pin-cores
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import urllib.request
from dataclasses import dataclass

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.sweep import MEDIA_LIMIT_ARGS
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port
from epdserve.router.dispatch import Dispatch
from epdserve.up import Deployment, Topology

POLICIES: tuple[Dispatch, ...] = ("always", "never", "adaptive")


@dataclass(frozen=True)
class Cell:
    images: int
    output_len: int
    concurrency: int = 1  # closed loop (when rate is 0)
    rate: float = 0.0  # Poisson arrivals per second

    @property
    def label(self) -> str:
        load = f"Poisson {self.rate:g}/s" if self.rate else f"c{self.concurrency}"
        return f"{self.images} img × {self.output_len} tok, {load}"


def poisson_cell(text: str) -> Cell:
    images, output_len, rate = text.split(":")
    return Cell(int(images), int(output_len), rate=float(rate))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def dispatched(url: str) -> tuple[float, float]:
    """The router's media requests so far: (sent raw, encoded remotely)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    n = {p: float(v) for p, v in re.findall(r'^epd_router_dispatch_total\{path="(\w+)"\} (\S+)$', text, re.M)}
    return n.get("local", 0.0), n.get("remote", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="1e+1pd")
    ap.add_argument("--images", type=ints, default=[1, 10])
    ap.add_argument("--output-lens", type=ints, default=[16, 256])
    ap.add_argument("--concurrency", type=ints, default=[1, 8])
    ap.add_argument("--poisson", type=poisson_cell, action="append", default=[], help="IMAGES:OUTPUT:RATE")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pin-cores", action="store_true")
    ap.add_argument(
        "--dispatch-interference", type=float, default=None, help="adaptive's weight of a decoding request's stall"
    )
    args = ap.parse_args()
    cells = [Cell(i, o, c) for i in args.images for o in args.output_lens for c in args.concurrency]
    cells += args.poisson
    deployments = {}
    interference = (
        [] if args.dispatch_interference is None else ["--dispatch-interference", str(args.dispatch_interference)]
    )
    for policy in POLICIES:  # all three up at once: the idle two cost nothing but memory
        d = Deployment(
            Topology.parse(args.topology),
            None,
            port=free_port(),
            pin=args.pin_cores,
            dispatch=policy,
            extra_args=list(MEDIA_LIMIT_ARGS),
            extra_router_args=interference if policy == "adaptive" else [],
        )
        d.start()
        deployments[policy] = d
    ttft: dict[tuple[Cell, str], list[float]] = {}
    rps: dict[tuple[Cell, str], list[float]] = {}
    share: dict[Cell, list[float]] = {}
    try:
        for rnd in range(args.rounds):
            for k, cell in enumerate(cells):
                workload = WorkloadConfig(
                    images_per_request=cell.images, image_size=args.image_size, output_len=cell.output_len
                )
                seed = 1000 * rnd + 10 * k  # new images per cell and round: no cache carries over
                # the order rotates round by round: no policy always runs first (or last) in a cell
                for policy in POLICIES[rnd % 3 :] + POLICIES[: rnd % 3]:
                    d = deployments[policy]
                    before = dispatched(d.url)
                    cfg = BenchConfig(
                        d.url,
                        "",
                        workload,
                        args.requests,
                        warmup=args.warmup,
                        concurrency=cell.concurrency,
                        request_rate=cell.rate,
                        seed=seed,
                    )
                    s = asyncio.run(run_bench(cfg)).summary
                    if s.errors:
                        raise SystemExit(f"{policy}, {cell.label}: failed requests {s.errors}")
                    ttft.setdefault((cell, policy), []).append(s.ttft.p50)
                    rps.setdefault((cell, policy), []).append(s.request_throughput)
                    if policy == "adaptive":
                        local, remote = (a - b for a, b in zip(dispatched(d.url), before, strict=True))
                        share.setdefault(cell, []).append(local / max(1.0, local + remote))
                print(f"round {rnd + 1}: {cell.label} done", flush=True)
    finally:
        for d in deployments.values():
            d.stop()

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(
        f"\n{args.topology}, workers with a vision tower; {args.requests} requests per cell, {args.image_size} px "
        f"images; median of {args.rounds} rounds\n"
    )
    print(
        "| cell | TTFT p50 ms always / never / adaptive | adaptive ÷ best fixed | req/s always / never / adaptive "
        "| adaptive ÷ best fixed |"
    )
    print("|---|---|---|---|---|")
    for cell in cells:
        t = {p: 1e3 * med(ttft[(cell, p)]) for p in POLICIES}
        r = {p: med(rps[(cell, p)]) for p in POLICIES}
        print(
            f"| {cell.label} | {t['always']:.1f} / {t['never']:.1f} / {t['adaptive']:.1f} "
            f"| {t['adaptive'] / min(t['always'], t['never']):.2f}x "
            f"| {r['always']:.2f} / {r['never']:.2f} / {r['adaptive']:.2f} "
            f"| {r['adaptive'] / max(r['always'], r['never']):.2f}x |"
        )
    print("\nAll rounds (TTFT p50 ms, req/s):")
    for cell in cells:
        runs = "; ".join(
            f"{p} " + ", ".join(f"{1e3 * a:.0f}/{b:.2f}" for a, b in zip(ttft[(cell, p)], rps[(cell, p)], strict=True))
            for p in POLICIES
        )
        print(f"- {cell.label}: {runs}; adaptive sent raw: {', '.join(f'{x:.0%}' for x in share[cell])}")


if __name__ == "__main__":
    main()
