"""A pool of workers of one role: selection policy, outstanding counts, health.

Selection: ``round_robin`` keeps one persistent cursor across requests; ``least_outstanding``
picks the healthy worker with the fewest requests in flight (ties broken by the cursor);
``affinity`` sends the same key (a media item) to the same worker by rendezvous hashing, so a
repeated image hits that encoder's cache, and falls back to the least loaded worker when the
preferred one is ``AFFINITY_SLACK`` calls busier. Health probes evict workers that stop answering
and re-admit them when they answer again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Literal, get_args

import aiohttp

from epdserve.api.load import LoadReport
from epdserve.common.health import MAX_HEALTH_BYTES, is_other_role

log = logging.getLogger(__name__)

Policy = Literal["round_robin", "least_outstanding", "affinity"]
PDPolicy = Literal["round_robin", "least_outstanding", "kv_aware"]  # affinity needs a key per call: encoders only
POLICIES: tuple[Policy, ...] = get_args(Policy)
AFFINITY_SLACK = 4  # extra in-flight calls tolerated on the preferred worker before spilling over


@dataclass
class Worker:
    url: str
    healthy: bool = True
    outstanding: int = 0
    failures: int = 0  # consecutive failed probes or calls
    report: LoadReport = field(default_factory=LoadReport)  # its load and costs at the last probe
    patches: int = 0  # patches of the encode calls in flight on it (encoders)
    awaiting: int = 0  # of its outstanding requests, those still waiting for their first byte (encoding included)
    seen: bool = False  # it has answered a health probe: not merely named, it was up

    @property
    def load(self) -> float:
        """Its load ratio at the last probe (api.load)."""
        return self.report.load_ratio


class NoWorker(RuntimeError):
    """No healthy worker of the role is available."""


class WorkerPool:
    def __init__(self, role: str, urls: list[str], policy: Policy = "least_outstanding") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.role = role
        self.policy = policy
        self.workers: dict[str, Worker] = {}
        self._cursor = 0
        for u in urls:
            self.add(u)

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url not in self.workers:
            self.workers[url] = Worker(url)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    @property
    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    @property
    def ready(self) -> list[Worker]:
        """Healthy workers that have answered a probe (a named worker counts as healthy until its
        first probe says otherwise)."""
        return [w for w in self.workers.values() if w.healthy and w.seen]

    def pick(self, exclude: set[str] | None = None, key: str | None = None) -> Worker:
        candidates = [w for w in self.workers.values() if w.healthy and w.url not in (exclude or set())]
        if not candidates:
            raise NoWorker(f"no healthy {self.role} worker")
        n = len(candidates)
        start = self._cursor % n
        self._cursor += 1
        ordered = candidates[start:] + candidates[:start]
        if self.policy == "round_robin":
            return ordered[0]
        least = min(ordered, key=lambda w: w.outstanding)
        if self.policy == "affinity" and key is not None and n > 1:
            # rendezvous hashing: a worker joining or leaving only moves the keys it wins or held.
            # The key (a whole data: URL) is hashed once, each worker's score from its digest.
            digest = b"|" + hashlib.blake2b(key.encode(), digest_size=16).digest()
            preferred = max(candidates, key=lambda w: hashlib.blake2b(w.url.encode() + digest, digest_size=8).digest())
            if preferred.outstanding <= least.outstanding + AFFINITY_SLACK:
                return preferred
        return least

    def mark_failed(self, worker: Worker) -> None:
        worker.failures += 1
        worker.healthy = False
        log.warning("%s %s marked unhealthy", self.role, worker.url)

    async def probe(self, session: aiohttp.ClientSession, timeout: float = 2.0) -> None:
        async def one(w: Worker) -> None:
            other = None
            try:
                async with session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    ok = r.status == 200
                    if ok:  # the role at that address must be this pool's (vLLM names none)
                        other = is_other_role(await r.content.read(MAX_HEALTH_BYTES + 1), self.role)
            except (aiohttp.ClientError, TimeoutError, OSError):
                ok = False
            if other is not None:
                ok = False
                if w.healthy or not w.failures:  # once, not every probe
                    log.warning("%s %s answers as a %s: another role holds its address", self.role, w.url, other)
            if ok and not w.seen:
                log.info("%s %s is up", self.role, w.url)
            elif ok and not w.healthy:
                log.info("%s %s is healthy again", self.role, w.url)
            if not ok and w.healthy and w.seen:  # one still starting has not failed anything
                log.warning("%s %s failed its health probe", self.role, w.url)
            w.seen = w.seen or ok
            w.healthy = ok
            w.failures = 0 if ok else w.failures + 1

        await asyncio.gather(*(one(w) for w in list(self.workers.values())))
