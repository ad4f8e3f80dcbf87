"""Flood a running deployment with concurrent image requests, each a different large image that
compresses to a few KB, and report what its processes held and how it answered.

    python scripts/media_flood.py --url http://127.0.0.1:8000 --model NAME --requests 120 --side 1700

Each request carries one ``side`` x ``side`` PNG of one colour (a pixel apart, so none is a cache
hit; with ``--noise``, of random pixels stored uncompressed: a body as large as its pixels) and
asks for one token. Every second (``--sample-s``) the script sums the resident memory of the
processes whose command line names epdserve, and the machine's MemAvailable; when ``--seconds`` have passed
it cancels what is left, then sends one small image request and times it. With ``--text-every``,
a short text request is sent that often during the flood, each timed to its answer. It prints one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import time
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image


def png(side: int, i: int, noise: bool = False) -> str:
    """A PNG of one colour, a pixel apart from the others (a few KB); ``noise``: of random pixels,
    stored uncompressed (a body as large as its pixels)."""
    if noise:
        im = Image.fromarray(np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8))
    else:
        im = Image.new("RGB", (side, side), (i % 251, (i * 7) % 253, 90))
        im.putpixel((i % side, 0), (255, 0, 0))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=0 if noise else 6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def resident_mib() -> int:
    """Resident memory of every process whose command line names epdserve (not this script)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
            if b"epdserve" not in cmd or b"media_flood" in cmd:
                continue
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            total += int(fields.get("VmRSS", "0 kB").split()[0])
        except (OSError, ValueError):
            continue
    return total // 1024


def available_mib() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(info["MemAvailable"].split()[0]) // 1024


async def main(args: argparse.Namespace) -> dict:
    endpoint = args.url.rstrip("/") + "/v1/chat/completions"
    codes: dict[str, int] = {}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        try:
            async with session.post(endpoint, json=body(args.model, png(args.side, i, args.noise))) as r:
                await r.read()
                key = str(r.status)
        except (TimeoutError, aiohttp.ClientError) as e:
            key = type(e).__name__
        codes[key] = codes.get(key, 0) + 1

    text_seconds: list[float] = []

    async def text(session: aiohttp.ClientSession) -> None:
        t0 = time.monotonic()
        payload = {"model": args.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}]}
        try:
            async with session.post(endpoint, json=payload) as r:
                await r.read()
                if r.status == 200:
                    text_seconds.append(time.monotonic() - t0)
        except (aiohttp.ClientError, TimeoutError):
            pass

    peak, low = resident_mib(), available_mib()
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.seconds)) as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(args.requests)]
        if args.text_every:
            n = int(args.seconds // args.text_every) - 1
            tasks += [asyncio.create_task(after(args.text_every * (k + 1), text(session))) for k in range(n)]
        while time.monotonic() - start < args.seconds and not all(t.done() for t in tasks):
            await asyncio.sleep(args.sample_s)
            peak, low = max(peak, resident_mib()), min(low, available_mib())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    codes["cancelled"] = args.requests - sum(codes.values())  # still waiting when the time was up
    t_after = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.after_timeout)) as session:
        try:
            async with session.post(endpoint, json=body(args.model, png(448, 10**6))) as r:
                await r.read()
                then = r.status
        except (TimeoutError, aiohttp.ClientError) as e:
            then = type(e).__name__
    return {
        "requests": args.requests,
        "side": args.side,
        "answers": {k: v for k, v in codes.items() if v},
        "peak_resident_mib": peak,
        "min_available_mib": low,
        "resident_after_mib": resident_mib(),
        "then_448px_request": then,
        "then_448px_seconds": round(time.monotonic() - t_after, 1),
        **(
            {"text_answered": len(text_seconds), "text_seconds": sorted(round(t, 2) for t in text_seconds)}
            if args.text_every
            else {}
        ),
    }


async def after(delay: float, work: Awaitable[None]) -> None:
    await asyncio.sleep(delay)
    await work


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--side", type=int, default=1700, help="image side in pixels")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the flood's clients wait")
    p.add_argument("--after-timeout", type=float, default=600.0, help="how long the request after it may take")
    p.add_argument("--text-every", type=float, default=0.0, help="seconds between text requests during it (0: none)")
    p.add_argument("--noise", action="store_true", help="images of random pixels, uncompressed (large bodies)")
    p.add_argument("--sample-s", type=float, default=1.0, help="seconds between samples of resident memory")
    print(json.dumps(asyncio.run(main(p.parse_args()))))
