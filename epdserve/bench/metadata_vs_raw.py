"""Benchmark: metadata-only requests vs raw-media forwarding, same 1e+1pd deployment.

Both runs start ``epdserve up``'s 1e+1pd topology on this machine with the same cores. In
"metadata-only" the router sends the media to the encoder and forwards grid + uuid + EC handle,
so the PD worker never touches pixels. In "raw-media" the router forwards the request as it came
and the PD worker decodes, preprocesses and encodes the media itself (what a PD instance does
when it is sent raw media). Same requests, closed loop, streaming.

    python -m epdserve.bench.metadata_vs_raw --requests 48 --images 4 --concurrency 8 --output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import json

from epdserve.bench.closed_loop import closed_loop, summarize
from epdserve.bench.workload import image_payload
from epdserve.launcher import free_port
from epdserve.router.dispatch import Dispatch
from epdserve.shapes import ShapesWorld
from epdserve.topology import Topology
from epdserve.up import Deployment

MODES: dict[str, Dispatch] = {"metadata-only": "always", "raw-media": "never"}


def payloads(n: int, images: int, out_len: int, size: int, seed: int) -> list[tuple[str, dict]]:
    world = ShapesWorld(seed)
    out = []
    for _ in range(n):
        imgs = [world.scene().render().resize((size, size)) if size else world.scene().render() for _ in range(images)]
        out.append(("image", image_payload("shapes-qwen2vl", "Describe the first image.", imgs, out_len)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--images", type=int, default=4, help="images per request")
    ap.add_argument("--image-size", type=int, default=448, help="side of each image in pixels (0: spec sizes)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--topology", default="1e+1pd")
    ap.add_argument("--pin-cores", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    reqs = payloads(args.requests, args.images, args.output_len, args.image_size, args.seed)
    warm = payloads(8, args.images, args.output_len, args.image_size, args.seed + 1)
    stats: dict[str, dict[str, float]] = {}
    for mode, dispatch in MODES.items():
        d = Deployment(Topology.parse(args.topology), None, port=free_port(), pin=args.pin_cores, dispatch=dispatch)
        d.start()
        try:
            asyncio.run(closed_loop(d.url, warm, args.concurrency))
            res, wall = asyncio.run(closed_loop(d.url, reqs, args.concurrency))
        finally:
            d.stop()
        stats[mode] = summarize(res, wall)
        print(json.dumps({"mode": mode, **stats[mode]}), flush=True)
    size = args.image_size or "spec"
    print(
        f"\n{args.topology}, {args.requests} requests x {args.images} images of {size} px, "
        f"{args.output_len} output tokens, concurrency {args.concurrency}\n"
    )
    print("| mode | req/s | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | errors |")
    print("|---|---|---|---|---|---|")
    for mode, r in stats.items():
        print(
            f"| {mode} | {r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['e2e_p50_ms']:.0f} | {r['errors']:.0f} |"
        )
    m, raw = stats["metadata-only"], stats["raw-media"]
    if raw["req_per_s"] and raw["ttft_p50_ms"]:
        speedup = m["req_per_s"] / raw["req_per_s"]
        ttft = m["ttft_p50_ms"] / raw["ttft_p50_ms"]
        print(f"\nmetadata-only vs raw-media: {speedup:.2f}x req/s, {ttft:.2f}x TTFT p50")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": stats}, f, indent=2)


if __name__ == "__main__":
    main()
