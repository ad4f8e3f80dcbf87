"""The KV-aware routing benchmark: multi-turn image conversations over several PD workers,
routed by cached prefix (``--policy kv_aware``) vs by load alone (``least_outstanding``). Each
conversation opens with an image and asks follow-ups whose prompts repeat the whole history;
conversations run concurrently, turns within one in order; with ``--min-turns`` below ``--turns``
their lengths are uneven (drawn per conversation, the same draw for both policies). Reports the
workers' prefix-cache hit rate, TTFT over all turns after the first, and the encoder calls made:
a kv_aware router does not encode an image whose KV its chosen worker already holds.

    python scripts/kv_routing_bench.py --pds 3 --conversations 24 --min-turns 2 --turns 6 --concurrency 6
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from epdserve.bench.workload import image_data_url
from epdserve.launcher import free_port
from epdserve.shapes import ShapesWorld
from epdserve.up import Deployment, Topology

FOLLOW_UPS = ["What else is there?", "Where is it?", "What colour is it?", "Describe it again.", "How many are there?"]


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = re.search(rf"^epd_{re.escape(name)} (\S+)$", r.read().decode(), re.MULTILINE)
    return float(m[1]) if m else 0.0


def conversation(url: str, seed: int, turns: int, output_len: int) -> list[float]:
    """One conversation's turns in order; the TTFT of each turn after the first."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    image = image_data_url(ShapesWorld(seed).scene().render().resize((448, 448)))
    messages: list[dict] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": "Describe the image."},
            ],
        }
    ]
    ttfts = []
    for turn in range(turns):
        t0 = time.perf_counter()
        first, text = None, []
        stream = client.chat.completions.create(
            model="shapes-qwen2vl", messages=messages, max_tokens=output_len, temperature=0, stream=True,
            extra_body={"min_tokens": output_len, "ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
        if turn:
            ttfts.append((first or time.perf_counter()) - t0)
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (the most, with --min-turns)")
    ap.add_argument("--min-turns", type=int, default=0, help="uneven conversations: at least this many turns")
    ap.add_argument("--pds", type=int, default=2, help="PD workers")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-load-tokens", type=int, default=256, help="the router's trade-off (its --kv-load-tokens)")
    args = ap.parse_args()
    rng = random.Random(7)
    turns = [rng.randint(args.min_turns or args.turns, args.turns) for _ in range(args.conversations)]
    rows = []
    for policy in ("least_outstanding", "kv_aware"):
        d = Deployment(
            Topology.parse(f"1e+{args.pds}pd"),
            None,
            port=free_port(),
            extra_pd_args=["--max-model-len", "4096"],
            extra_router_args=[
                "--policy",
                policy,
                "--probe-interval",
                "0.5",
                "--kv-load-tokens",
                str(args.kv_load_tokens),
            ],
        )
        d.start()
        try:
            time.sleep(1.5)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                url = d.url
                per = list(
                    pool.map(
                        conversation,
                        [url] * args.conversations,
                        range(1000, 1000 + args.conversations),
                        turns,
                        [args.output_len] * args.conversations,
                    )
                )
            wall = time.perf_counter() - t0
            pds = [r.url for r in d.roles if r.name.startswith("pd")]
            hit = sum(counter(u, "prefix_cache_hits_total") for u in pds)
            query = sum(counter(u, "prefix_cache_queries_total") for u in pds)
            ttfts = sorted(t for ts in per for t in ts)
            p50, p99 = statistics.median(ttfts), ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
            routed = counter(d.url, "router_kv_routed_total")
            encoder = next(r.url for r in d.roles if r.name.startswith("encoder"))
            calls = counter(encoder, "encode_requests_total")
            skipped = counter(d.url, "router_encodes_skipped_total")
            rows.append((policy, hit / query if query else 0.0, p50, p99, sum(turns) / wall, routed, calls, skipped))
        finally:
            d.stop()
    print(
        f"1e+{args.pds}pd, {args.conversations} conversations, {sum(turns)} turns ({min(turns)}-{max(turns)} each), "
        f"{args.concurrency} at a time, {args.output_len} output tokens\n"
    )
    print(
        "| PD routing | prefix-cache hit rate | TTFT p50 ms (turns 2+) | TTFT p99 ms | turns/s | routed by prefix "
        "| encode calls | images not encoded |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0][2]
    for policy, rate, p50, p99, tps, routed, calls, skipped in rows:
        print(
            f"| {policy} | {rate:.1%} | {1e3 * p50:.0f} ({p50 / base:.2f}x) | {1e3 * p99:.0f} | {tps:.2f} | {routed:.0f} "
            f"| {calls:.0f} | {skipped:.0f} |"
        )


if __name__ == "__main__":
    main()
