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
every sample to ``--json``. Beside them, each router's CPU time (user and system, from /proc)
over the measured requests, divided by their number (its health probes included).

``--images N`` puts N images (one PNG, the same each time) in every request instead: the router
then also calls the encoder, and the language-model instance is not asked directly (it would
encode the images itself); each router's CPU time a request and, with ``--compare-tree``, the
paired difference between the two routers say what the media path costs.

``--compare-tree DIR`` also starts the router of another checkout (DIR, e.g. a ``git worktree``
of an earlier commit) beside the deployment's, with the same arguments in front of the same
workers, and sends each round of requests to all three paths in turn: the two routers' overheads
side by side in one run, on the same workers at the same moment.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.security.credentials import ClusterCredential
from epdserve.security.peers import sign
from epdserve.supervisor import Role
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
    ap.add_argument("--compare-tree", type=Path, default=None, help="another checkout whose router runs beside")
    ap.add_argument("--no-access-log", action="store_true", help="the roles write no access lines")
    ap.add_argument("--images", type=int, default=0, help="images per request (0: text requests)")
    ap.add_argument("--image-size", type=int, default=224)
    args = ap.parse_args(argv)
    extra: dict = {}
    if args.lm_engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        extra = {
            "lm_engine": "vllm",
            "vllm_args": ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"],
        }
    if args.no_access_log:
        extra["extra_args"] = ["--no-access-log"]
    d = Deployment(Topology.parse("1e+1pd"), None, port=free_port(), **extra)
    d.start()
    other = None
    try:
        worker = next(r.url for r in d.roles if r.name.startswith("pd"))
        router = next(r for r in d.roles if r.name == "router")
        paths = {"through the router": Client(d.url)}
        if not args.images:
            paths["straight to the worker"] = Client(worker)
        pids = {"through the router": router.proc.pid}
        if args.compare_tree:
            other, url = start_router_of(args.compare_tree, router)
            paths[f"through the router of {args.compare_tree}"] = Client(url)
            pids[f"through the router of {args.compare_tree}"] = other.pid
        model = paths["through the router"].get("/v1/models")["data"][0]["id"]
        question: dict = {"role": "user", "content": "How many shapes are there?"}
        if args.images:
            image = {"type": "image_url", "image_url": {"url": png_data_url(args.image_size)}}
            question["content"] = [*[image] * args.images, {"type": "text", "text": question["content"]}]
        body = json.dumps({"model": model, "messages": [question], "max_tokens": 1, "temperature": 0}).encode()
        cluster = d.cluster if args.lm_engine == "epdserve" else None  # vLLM asks for no credential here
        names = list(paths)
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, float] = {}
        for i in range(args.warmup + args.requests):  # each path goes first in turn
            if i == args.warmup:
                cpu = {name: -cpu_seconds(pid) for name, pid in pids.items()}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                elapsed = paths[name].post(body, cluster if name.startswith("straight") else None)
                if i >= args.warmup:
                    times[name].append(elapsed)
        cpu = {name: (t + cpu_seconds(pids[name])) / args.requests for name, t in cpu.items()}
    finally:
        if other is not None:
            stop(other)
        d.stop()
    base = names[1] if len(names) > 1 and not args.images else names[0]  # straight, or this router
    ms = lambda v: f"{1e3 * v:.2f}"  # noqa: E731
    kind = f"requests of {args.images} {args.image_size}-px images" if args.images else "text requests"
    print(f"lm engine: {args.lm_engine}, {args.requests} {kind} per path, 1 output token, one at a time")
    print(f"| path | p50 ms | p90 ms | median of paired differences from '{base}', ms | router CPU ms a request |")
    print("|---|---|---|---|---|")
    for name in names:
        diff = statistics.median(a - b for a, b in zip(times[name], times[base], strict=True))
        overhead = "" if name == base else ms(diff)
        used = ms(cpu[name]) if name in cpu else ""
        print(f"| {name} | {ms(pct(times[name], 0.5))} | {ms(pct(times[name], 0.9))} | {overhead} | {used} |")
    if args.json:
        record = {"args": {**vars(args), "json": str(args.json)}, "times": times, "router_cpu_s": cpu}
        args.json.write_text(json.dumps(record, default=str))


def png_data_url(size: int) -> str:
    """One noisy square PNG as a data: URL."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_router_of(tree: Path, router: Role) -> tuple[subprocess.Popen, str]:
    """The router of the checkout ``tree``, started as ``router`` was but on a port of its own."""
    argv = list(router.args)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    env = {**router.env, "PYTHONPATH": str(tree.resolve())}
    proc = start_role(argv, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 120)
    return proc, url


if __name__ == "__main__":
    main()
