"""An async streaming client that measures one chat request: TTFT, inter-token gaps, E2E.

It reads the SSE stream as raw lines and only parses the JSON of each event, so the client costs
little next to the server it measures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ok: bool
    status: int
    ttft: float = 0.0  # seconds to the first content token
    e2e: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""
    kind: str = ""  # request type label (e.g. "text", "image")

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def stream_chat(session: aiohttp.ClientSession, url: str, payload: dict, kind: str = "") -> RequestResult:
    body = dict(payload, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    res = RequestResult(ok=False, status=0, kind=kind)
    last = None
    parts: list[str] = []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = (await resp.text())[:300]
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    return res
                if ev.get("usage"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                for ch in ev.get("choices") or []:
                    content = (ch.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        parts.append(content)
    except (aiohttp.ClientError, TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = True
    if res.ttft == 0.0:
        res.ttft = res.e2e
    return res


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
