"""Does P/D isolation pay here? Decode latency of running streams while long prompts arrive.

For each topology, two loads run at once against the same endpoint: a closed loop of short
text prompts each decoding ``--decode-len`` tokens (the streams whose inter-token latency we
watch), and open-loop arrivals of long text prompts (``--long-prompt`` tokens, one output token:
pure prefill). Each topology is also measured with the decode load alone. Reports, per
topology, the decode streams' ITL p50/p99 and TPOT p50 with and without the long prompts, and the
long prompts' TTFT.

    python scripts/pd_isolation.py [--topologies aggregated,1p+1d] [--json out.json]

The aggregated server gets every core (``--threads`` = cores); in ``<P>p+<D>d`` each worker is
pinned to its own core(s) and runs one thread per core, so both use the same hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig, Summary
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology


def _row(s: Summary) -> dict[str, float]:
    return {
        "ok": s.completed,
        "sent": s.requests,
        "req_per_s": s.request_throughput,
        "ttft_p50_ms": 1e3 * s.ttft.p50,
        "ttft_p99_ms": 1e3 * s.ttft.p99,
        "tpot_p50_ms": 1e3 * s.tpot.p50,
        "itl_p50_ms": 1e3 * s.itl.p50,
        "itl_p99_ms": 1e3 * s.itl.p99,
    }


async def _measure(url: str, args: argparse.Namespace, with_long: bool) -> dict[str, dict[str, float]]:
    decode = BenchConfig(
        url=url,
        workload=WorkloadConfig(images_per_request=0, output_len=args.decode_len),
        num_requests=args.decode_requests,
        warmup=2,
        concurrency=args.decode_concurrency,
        seed=1,
    )
    runs = [run_bench(decode)]
    if with_long:
        long = BenchConfig(
            url=url,
            workload=WorkloadConfig(images_per_request=0, prompt_tokens=args.long_prompt, output_len=1),
            num_requests=args.long_requests,
            warmup=0,
            request_rate=args.long_rate,
            seed=2,
        )
        runs.append(run_bench(long))
    results = await asyncio.gather(*runs)
    out = {"decode": _row(results[0].summary)}
    if with_long:
        out["long_prompts"] = _row(results[1].summary)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topologies", default="aggregated,1p+1d")
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--decode-requests", type=int, default=16)
    ap.add_argument("--decode-concurrency", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=1500, help="text tokens of each long prompt")
    ap.add_argument("--long-requests", type=int, default=12)
    ap.add_argument("--long-rate", type=float, default=1.0, help="long prompts per second (Poisson)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    lm_args = ["--max-model-len", "2048"]
    table = {}
    for name in args.topologies.split(","):
        topo = Topology.parse(name)
        threads = ["--threads", str(cores)] if topo.aggregated else []
        d = Deployment(topo, None, port=free_port(), pin=not topo.aggregated, extra_pd_args=[*lm_args, *threads])
        d.start()
        try:
            table[name] = {
                "alone": asyncio.run(_measure(d.url, args, with_long=False)),
                "with_long_prompts": asyncio.run(_measure(d.url, args, with_long=True)),
            }
        finally:
            d.stop()
        print(json.dumps({name: table[name]}), flush=True)
    print(
        f"\ndecode streams: {args.decode_concurrency} × {args.decode_len} tokens; long prompts: "
        f"{args.long_prompt} tokens at {args.long_rate}/s\n"
    )
    print(
        "| topology | decode ITL p50 / p99 ms, alone | with long prompts | decode TPOT p50 ms, alone / with | long-prompt TTFT p50 / p99 ms |"
    )
    print("|---|---|---|---|---|")
    for name, t in table.items():
        a, w = t["alone"]["decode"], t["with_long_prompts"]["decode"]
        lp = t["with_long_prompts"]["long_prompts"]
        print(
            f"| {name} | {a['itl_p50_ms']:.1f} / {a['itl_p99_ms']:.1f} | {w['itl_p50_ms']:.1f} / {w['itl_p99_ms']:.1f} "
            f"| {a['tpot_p50_ms']:.1f} / {w['tpot_p50_ms']:.1f} | {lp['ttft_p50_ms']:.0f} / {lp['ttft_p99_ms']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": table}, indent=2))


if __name__ == "__main__":
    main()
