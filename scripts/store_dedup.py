"""The reuse benchmark in relative form: two encoders, a workload of repeated images (every
image drawn from a pool of distinct ones, shuffled, concurrent), with and without the shared store
(Redis, or Mooncake with ``--backend mooncake``: a master started per deployment), under the
chosen encoder policies. Counts the vision forwards (duplicates = forwards beyond the first of
each distinct image), the router's directory hits, and TTFT. ``--no-encoder-cache`` turns the
encoders' own caches off, as in the seeds' setup (there every request was encoded without the store).

    python scripts/store_dedup.py --requests 512 --pool 64 --concurrency 16 --output-len 16
    python scripts/store_dedup.py --backend mooncake --policies round_robin --no-encoder-cache --image-size 448
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import urllib.request

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.workload import WorkloadConfig, build_workload
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology
from tests.redis_server import redis_server

MODEL = "shapes-qwen2vl"


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^epd_{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m[1]) if m else 0.0


def distinct_images(workload: WorkloadConfig, n: int, seed: int) -> int:
    urls = set()
    for req in build_workload(workload, MODEL, n, seed):
        body = json.loads(req.body)
        for part in body["messages"][0]["content"]:
            if isinstance(part, dict) and part.get("type") == "image_url":
                urls.add(part["image_url"]["url"])
    return len(urls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=0)
    ap.add_argument("--backend", choices=("redis", "mooncake"), default="redis")
    ap.add_argument("--policies", nargs="+", default=["round_robin", "affinity"], help="encoder policies to run")
    ap.add_argument("--no-encoder-cache", action="store_true", help="encoders keep no cache of their own")
    args = ap.parse_args()
    workload = WorkloadConfig(
        images_per_request=1,
        image_size=args.image_size,
        output_len=args.output_len,
        repeated_fraction=1.0,
        pool_size=args.pool,
    )
    distinct = distinct_images(workload, args.requests, seed=0)
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server(maxmemory="512mb")) if args.backend == "redis" else None
        if server is not None:
            os.environ["EPD_STORE_PASSWORD"] = server.password
        own_cache = ["--encoder-cache-bytes", "0"] if args.no_encoder_cache else []
        for policy in args.policies:
            for store in (False, True):
                extra = ["--store-url", server.url] if store and server is not None else []
                d = Deployment(
                    Topology.parse("2e+1pd"),
                    None,
                    port=free_port(),
                    extra_pd_args=["--max-model-len", "2048", *extra],
                    extra_encoder_args=[*extra, *own_cache],
                    extra_router_args=["--encoder-policy", policy],
                    mooncake_master=store and args.backend == "mooncake",
                )
                d.start()
                try:
                    cfg = BenchConfig(d.url, "", workload, args.requests, warmup=0, concurrency=args.concurrency)
                    s = asyncio.run(run_bench(cfg)).summary
                    encoders = [r.url for r in d.roles if r.name.startswith("encoder")]
                    forwards = sum(counter(u, "encoder_batch_items_total") for u in encoders)
                    calls = sum(counter(u, "encode_requests_total") for u in encoders)
                    hits = counter(d.url, "router_directory_hits_total")
                    rows.append((policy, store, s.completed, forwards, forwards - distinct, calls, hits, s))
                finally:
                    d.stop()
                    if store and server is not None:
                        import redis

                        redis.Redis.from_url(server.url, password=server.password).flushall()
    cache = "no encoder cache" if args.no_encoder_cache else "encoder caches on"
    print(
        f"{args.requests} requests over {distinct} distinct images, 2e+1pd, concurrency {args.concurrency}, {cache}\n"
    )
    print(
        "| encoder policy | store | ok | vision forwards | duplicates | encode calls | directory hits | TTFT p50 ms | TTFT p99 ms | req/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for policy, store, ok, fw, dup, calls, hits, s in rows:
        base.setdefault(policy, s.ttft.p50)
        ratio = f" ({s.ttft.p50 / base[policy]:.2f}x)" if store else ""
        print(
            f"| {policy} | {args.backend if store else 'none'} | {ok} | {fw:.0f} | {dup:.0f} | {calls:.0f} | {hits:.0f} "
            f"| {1e3 * s.ttft.p50:.0f}{ratio} | {1e3 * s.ttft.p99:.0f} | {s.request_throughput:.2f} |"
        )


if __name__ == "__main__":
    main()
