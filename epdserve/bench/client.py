"""An async streaming client that measures one chat request: TTFT, inter-token gaps, E2E.

It reads the SSE stream as raw lines and only parses the JSON of each event, so the client costs
little next to the server it measures. A request body may be passed pre-encoded (``encode_request``)
so that JSON and data-URL encoding happen before the benchmark clock starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import msgspec

from epdserve.api.timing import SERVER_TIMING, TIMING_HEADER, parse_server_timing
from epdserve.security.credentials import CLUSTER_SECRET_ENV, ClusterCredential, CredentialError
from epdserve.security.peers import sign


def server_url(url: str) -> str:
    """The server's base URL as every client-side command uses it (``/v1`` added per request), from
    what a user types: with or without ``/v1``, with or without a trailing slash."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# every request asks for its stage timing (Server-Timing): a header's worth of cost
_JSON_HEADERS = {"Content-Type": "application/json", TIMING_HEADER: "1"}


@dataclass
class RequestResult:
    ok: bool
    status: int  # HTTP status; 0 when no response arrived (connection error, timeout)
    ttft: float = 0.0  # seconds to the first content token
    e2e: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""
    kind: str = ""  # request type label (e.g. "text", "image")
    start: float = 0.0  # time.perf_counter() when the request was sent
    stages: dict[str, float] = field(default_factory=dict)  # the server's stage timing (seconds), if any

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def max_itl(self) -> float:
        """The longest gap between two content chunks (0 with fewer than two chunks)."""
        return max(self.itl, default=0.0)


def encode_request(payload: dict) -> bytes:
    """The JSON body of a streaming request that reports usage in its last event."""
    return json.dumps(dict(payload, stream=True, stream_options={"include_usage": True})).encode()


@contextlib.contextmanager
def as_operator(cluster: ClusterCredential) -> Iterator[None]:
    """While inside, this process's load clients prove ``cluster``, the credential of a deployment
    it started itself (as an operator's shell that exports ``EPD_CLUSTER_SECRET`` does), so that
    they are told the router's and encoders' stages; a credential already in the environment wins."""
    if os.environ.get(CLUSTER_SECRET_ENV, "").strip():
        yield
        return
    os.environ[CLUSTER_SECRET_ENV] = cluster.secret.decode()
    try:
        yield
    finally:
        os.environ.pop(CLUSTER_SECRET_ENV, None)


def _headers(url: str, body: bytes) -> dict[str, str]:
    """A request's headers: the stage timing asked for, and a proof of the deployment's cluster
    credential for this one request when this process holds it (``EPD_CLUSTER_SECRET``): only the
    operator is told the router's and encoders' stages (``api.exposure``)."""
    try:
        cred = ClusterCredential.load()
    except CredentialError:
        cred = None
    return {**_JSON_HEADERS, **(sign(cred, "POST", url, body) if cred is not None else {})}


async def stream_chat(session: aiohttp.ClientSession, url: str, payload: dict | bytes, kind: str = "") -> RequestResult:
    """Send one chat request and time its stream; ``payload`` bytes come from ``encode_request``."""
    body = payload if isinstance(payload, bytes) else encode_request(payload)
    res = RequestResult(ok=False, status=0, kind=kind)
    last = None
    parts: list[str] = []
    t0 = res.start = time.perf_counter()
    try:
        target = url + "/v1/chat/completions"
        async with session.post(target, data=body, headers=_headers(target, body)) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = (await resp.text())[:300]
                return res
            res.stages = parse_server_timing(resp.headers.get(SERVER_TIMING, ""))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = msgspec.json.decode(data)  # ~5x faster than json.loads: the per-token cost
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
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        # ValueError (msgspec.DecodeError): a malformed event fails the request instead of ending the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = True
    if res.ttft == 0.0:
        res.ttft = res.e2e
    return res


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0–100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
