"""Soak test: a deployment held at saturation for a while, through ``epdserve up``.

Starts ``epdserve up`` (any topology), keeps ``--concurrency`` requests in flight for ``--minutes``
with a mixed workload (text, fresh images, repeated images, streaming and not), samples the
resident memory of every role and the bytes of its files in ``/dev/shm`` every ``--sample-s`` seconds, and
reports per-status counts, each role's memory at the start of the measured window, at its end and
at its peak, and its slope (a least-squares line through every sample of the window, in MB per
hour, beyond what its bounded caches took: fresh images fill an encoder's embedding cache, and
new blocks an engine core's KV cache, by design). Exits 1 when any request failed, or a role's
memory (or ``/dev/shm``) grew by more than ``--max-growth-mb`` over the window beyond its caches.

    python scripts/soak.py --topology 1e+1pd --minutes 30 --concurrency 8 --out docs/results/soak-1e+1pd.json

Not part of CI (it runs for minutes by design).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

from epdserve.bench.workload import image_data_url
from epdserve.launcher import free_port, process_children
from epdserve.shapes import ShapesWorld

API_KEY = "soak-" + os.urandom(8).hex()


def role_pids(up_pid: int) -> dict[str, int]:
    """Role name (from its command line) → pid, for the children of ``up`` and their own children
    (a language-model worker's engine core is a process of its own: ``<role>:<port>/core``)."""
    out: dict[str, int] = {}
    children = process_children()
    for pid in children.get(up_pid, []):
        try:
            words = [w.decode() for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
        except OSError:
            continue
        role = next((w for w in words if w in ("encoder", "serve", "router")), "?")
        if role == "serve" and "--role" in words:
            role = words[words.index("--role") + 1]
        port = words[words.index("--port") + 1] if "--port" in words else "?"
        out[f"{role}:{port}"] = pid
        for i, child in enumerate(children.get(pid, [])):
            out[f"{role}:{port}/core" + (f"{i}" if i else "")] = child
    return out


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cache_mb(role: str) -> float:
    """What a role holds by design, bounded, from its server's /metrics: an encoder's embedding
    cache (up to --encoder-cache-bytes), a language-model engine core's KV-cache blocks used so far
    (a CPU cache maps a block's pages on its first write, up to the size it planned at start-up)."""
    name, _, port = role.partition(":")
    if name == "encoder":
        metric = "epd_encoder_cache_bytes"
    elif port.endswith("/core"):
        metric, port = "epd_kv_cache_touched_bytes", port.removesuffix("/core")
    else:
        return 0.0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    m = re.search(rf"^{metric} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) / 2**20 if m else float("nan")


def shm_mb(pids: dict[str, int]) -> float:
    """Bytes held by this deployment's files in /dev/shm: those whose name carries the pid of one
    of its processes (slabs are named ``epd-...-<pid>-...``); other work on the machine is left out."""
    total = 0
    marks = {f"-{p}-" for p in pids.values()}
    for f in Path("/dev/shm").iterdir():
        if not any(m in f.name for m in marks):
            continue
        try:
            total += f.stat().st_blocks * 512
        except OSError:
            continue
    return total / 2**20


def sample(t_s: float, pids: dict[str, int]) -> dict:
    return {
        "t_s": round(t_s, 1),
        **{k: rss_mb(p) for k, p in pids.items()},
        "cache": {k: cache_mb(k) for k in pids},
        "shm": shm_mb(pids),
    }


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over ts (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def request_body(rng: random.Random, model: str, pool: list[str], world: ShapesWorld) -> dict:
    kind = rng.random()
    if kind < 0.3:
        content: object = f"Say something about shapes, please ({rng.random():.6f})."
    else:
        n = rng.choice((1, 1, 2, 4))
        urls = [rng.choice(pool) if rng.random() < 0.5 else image_data_url(world.scene().render()) for _ in range(n)]
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        content += [{"type": "text", "text": "Describe the image."}]  # type: ignore[operator]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": rng.choice((8, 32, 64)),
        "temperature": 0,
        "stream": rng.random() < 0.5,
    }


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    try:
        async with session.post(
            url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=aiohttp.ClientTimeout(total=300)
        ) as r:
            raw = await r.read()
            if r.status != 200:
                return str(r.status)
            if body["stream"]:
                text = raw.decode()
                if '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
                    return "stream-error"
            return "200"
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return type(e).__name__


def served_model(url: str) -> str:
    """The id of the model the deployment serves (``--up-args "--model DIR"`` picks it)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(json.load(r)["data"][0]["id"])


async def drive(url: str, model: str, args: argparse.Namespace, pids: dict[str, int]) -> dict:
    rng = random.Random(args.seed)
    world = ShapesWorld(args.seed)
    pool = [image_data_url(world.scene().render()) for _ in range(16)]
    statuses: Counter[str] = Counter()
    samples: list[dict] = []
    deadline = time.monotonic() + args.minutes * 60
    t0 = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            statuses[await one(session, url, request_body(rng, model, pool, world))] += 1

    async def sampler() -> None:
        while time.monotonic() < deadline:
            samples.append(sample(time.monotonic() - t0, pids))
            done = sum(statuses.values())
            print(f"[soak] {samples[-1]['t_s']:>6.0f}s  requests {done}  {dict(statuses)}", file=sys.stderr)
            await asyncio.sleep(args.sample_s)
        samples.append(sample(time.monotonic() - t0, pids))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(sampler(), *(worker(session) for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    return {"statuses": dict(statuses), "elapsed_s": round(elapsed, 1), "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="1e+1pd")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (saturation on 2 cores)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before the memory baseline is taken")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument(
        "--max-growth-mb", type=float, default=50.0, help="allowed RSS growth per role beyond its bounded caches"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--up-args", default="", help="more flags for epdserve up, e.g. '--encoder-cache-bytes 16777216'")
    args = p.parse_args()

    port = free_port()
    env = dict(os.environ, EPD_API_KEY=API_KEY)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epdserve.cli",
            "up",
            "--topology",
            args.topology,
            "--port",
            str(port),
            *args.up_args.split(),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:
            print(line.rstrip(), file=sys.stderr)
            if "ready" in line:
                break
        else:
            print("epdserve up did not become ready", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        pids = role_pids(up.pid)
        model = served_model(f"http://127.0.0.1:{port}/v1/models")
        warm = argparse.Namespace(**{**vars(args), "minutes": args.warmup_s / 60})
        asyncio.run(drive(url, model, warm, pids))
        result = asyncio.run(drive(url, model, args, pids))
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(timeout=60)

    first, last = result["samples"][0], result["samples"][-1]
    growth = {k: round(last[k] - first[k], 1) for k in pids}
    # an encoder's embedding cache and an engine core's KV blocks fill up to their planned bytes by
    # design: growth beyond them is a leak
    cache_growth = {k: round(last["cache"][k] - first["cache"][k], 1) for k in pids}
    other_growth = {k: round(growth[k] - cache_growth[k], 1) for k in pids}
    peak = {k: round(max(s[k] for s in result["samples"]), 1) for k in pids}
    ts = [s["t_s"] for s in result["samples"]]

    def beyond_cache(k: str) -> list[float]:
        return [s[k] - (s["cache"][k] if s["cache"][k] == s["cache"][k] else 0.0) for s in result["samples"]]

    slopes = {k: round(slope_per_hour(ts, beyond_cache(k)), 1) for k in pids}
    half = len(ts) // 2  # the second half: after the lazily touched KV pages and caches have settled
    late = {k: round(slope_per_hour(ts[half:], beyond_cache(k)[half:]), 1) for k in pids}
    shm_growth = round(last["shm"] - first["shm"], 1)
    failed = {k: v for k, v in result["statuses"].items() if k != "200"}
    total = sum(result["statuses"].values())
    summary = {
        "topology": args.topology,
        "up_args": args.up_args,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": total,
        "req_per_s": round(total / result["elapsed_s"], 2),
        "failed": failed,
        "rss_start_mb": {k: round(first[k], 1) for k in pids},
        "rss_end_mb": {k: round(last[k], 1) for k in pids},
        "rss_peak_mb": peak,
        "rss_growth_mb": growth,
        "cache_growth_mb": cache_growth,
        "rss_growth_beyond_cache_mb": other_growth,
        "rss_slope_beyond_cache_mb_per_h": slopes,
        "rss_slope_second_half_mb_per_h": late,
        "shm_start_mb": round(first["shm"], 1),
        "shm_end_mb": round(last["shm"], 1),
        "shm_slope_mb_per_h": round(slope_per_hour(ts, [s["shm"] for s in result["samples"]]), 1),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "samples": result["samples"]}, indent=1) + "\n")
    ok = not failed and all(g <= args.max_growth_mb for g in [*other_growth.values(), shm_growth])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
