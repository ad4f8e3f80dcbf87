"""Benchmark: what the router adds to a request, measured against the language-model instance
behind it, asked directly.

    python scripts/router_overhead.py --lm-engine vllm --requests 200
    python scripts/router_overhead.py --lm-engine epdserve --requests 200

Starts ``1e+1pd`` (``--lm-engine vllm``: a ``vllm serve`` behind epdserve's router; it needs a
``vllm`` that can import epdserve, beside this interpreter or on ``PATH``), then sends the same
text request, one at a time, alternately through the router and straight to the language-model
instance on its internal port, and times each answer from the client (non-streamed, 1 output
token, so the answer's wall time is the whole request). A text request takes no encoder, so the
difference is the router's own work: parsing, choosing the worker, the request to it, relaying
its answer. Prints the p50 and p90 of each path, the median of the paired differences, and writes
every sample to ``--json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epdserve.launcher import free_port
from epdserve.security.credentials import ClusterCredential
from epdserve.security.peers import sign
from epdserve.up import Deployment, Topology


class Client:
    """One kept-alive HTTP/1.1 connection to ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)

    def get(self, path: str) -> dict:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        return json.loads(r.read())

    def post(self, body: bytes, cluster: ClusterCredential | None = None) -> float:
        """One chat request's wall time; ``cluster`` signs it as a peer (epdserve's workers ask for that)."""
        url = self.url + "/v1/chat/completions"
        headers = {"Content-Type": "application/json", **(sign(cluster, "POST", url, body) if cluster else {})}
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body, headers)
        r = self.conn.getresponse()
        payload = r.read()
        elapsed = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {payload[:300]!r}")
        return elapsed


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-engine", choices=("epdserve", "vllm"), default="vllm")
    ap.add_argument("--requests", type=int, default=200, help="requests on each path")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    extra: dict = {}
    if args.lm_engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        extra = {
            "lm_engine": "vllm",
            "vllm_args": ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"],
        }
    d = Deployment(Topology.parse("1e+1pd"), None, port=free_port(), **extra)
    d.start()
    try:
        worker = next(r.url for r in d.roles if r.name.startswith("pd"))
        router, direct = Client(d.url), Client(worker)
        model = router.get("/v1/models")["data"][0]["id"]
        question = {"role": "user", "content": "How many shapes are there?"}
        body = json.dumps({"model": model, "messages": [question], "max_tokens": 1, "temperature": 0}).encode()
        cluster = d.cluster if args.lm_engine == "epdserve" else None  # vLLM asks for no credential here
        for _ in range(args.warmup):
            router.post(body)
            direct.post(body, cluster)
        via: list[float] = []
        straight: list[float] = []
        for i in range(args.requests):  # alternate which path goes first
            if i % 2:
                straight.append(direct.post(body, cluster))
                via.append(router.post(body))
            else:
                via.append(router.post(body))
                straight.append(direct.post(body, cluster))
    finally:
        d.stop()
    diffs = [a - b for a, b in zip(via, straight, strict=True)]
    ms = lambda v: f"{1e3 * v:.2f}"  # noqa: E731
    print(f"lm engine: {args.lm_engine}, {args.requests} text requests per path, 1 output token, one at a time")
    print("| path | p50 ms | p90 ms |")
    print("|---|---|---|")
    print(f"| through the router | {ms(pct(via, 0.5))} | {ms(pct(via, 0.9))} |")
    print(f"| straight to the worker | {ms(pct(straight, 0.5))} | {ms(pct(straight, 0.9))} |")
    print(f"router overhead, median of paired differences: {ms(statistics.median(diffs))} ms")
    if args.json:
        args.json.write_text(
            json.dumps({"args": {**vars(args), "json": str(args.json)}, "via": via, "direct": straight})
        )


if __name__ == "__main__":
    main()
