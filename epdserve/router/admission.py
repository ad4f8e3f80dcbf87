"""Admission control at the router: text-only and media requests are admitted through separate
gates, each with its own limit of requests in flight and its own queue, so a burst of image-heavy
requests waits in its queue (or is turned away) while text requests go straight through.

A request over its class's limit waits, first come first served, up to ``wait_s``; then it is
answered 429 with ``Retry-After`` (never a timeout). A limit of 0 admits everything at once.

With a text TTFT target, ``AutoLimit`` moves the media gate's limit so that text requests keep
their first tokens within it, whatever the image traffic: additive increase while text meets the
target (or there is none), multiplicative decrease when it does not — the media requests' own
share of the machine is what gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator

from epdserve.api.errors import Overloaded


class Gate:
    def __init__(self, name: str, limit: int, wait_s: float, retry_after_s: int) -> None:
        self.name, self.limit, self.wait_s, self.retry_after_s = name, limit, wait_s, retry_after_s
        self.in_flight = 0
        self.rejected = 0
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one place for the body; 429 when none frees up within ``wait_s``."""
        if self.limit and (self.in_flight >= self.limit or self._queue):
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append(turn)
            try:
                await asyncio.wait_for(asyncio.shield(turn), self.wait_s)
            except (TimeoutError, asyncio.CancelledError) as e:
                if turn.done() and not turn.cancelled():
                    self._release()  # admitted just as we gave up: pass the place on
                else:
                    turn.cancel()
                    with contextlib.suppress(ValueError):
                        self._queue.remove(turn)
                if isinstance(e, asyncio.CancelledError):
                    raise
                self.rejected += 1
                raise Overloaded(
                    f"Too many {self.name} requests in flight; retry shortly.", retry_after_s=self.retry_after_s
                ) from None
        else:
            self.in_flight += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """A place frees: the next waiter takes it (in_flight stays) unless the limit was lowered
        below what is in flight; else in_flight drops."""
        if not self.limit or self.in_flight <= self.limit:
            while self._queue:
                turn = self._queue.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self.in_flight -= 1

    def set_limit(self, limit: int) -> None:
        """A new limit; waiters it makes room for are admitted now."""
        self.limit = limit
        while self._queue and (not limit or self.in_flight < limit):
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                self.in_flight += 1


class AutoLimit:
    """Keeps a quantile of text TTFT under ``target_s`` by moving ``gate``'s limit (AIMD).

    Each ``window_s`` with at least ``min_samples`` text first tokens, their ``quantile`` is
    compared with the target: over it, the limit halves (from what is in flight when there was
    none; at least 1); under it, the limit grows by one while media requests are waiting, up to
    ``ceiling`` (0: none). A window without text traffic also grows it: nothing to protect."""

    def __init__(
        self,
        gate: Gate,
        target_s: float,
        ceiling: int = 0,
        window_s: float = 1.0,
        quantile: float = 0.9,
        min_samples: int = 4,
    ) -> None:
        self.gate, self.target_s, self.ceiling = gate, target_s, ceiling
        self.window_s, self.quantile, self.min_samples = window_s, quantile, min_samples
        self._samples: list[float] = []
        self._since: float | None = None  # the window's start (the first call's time)
        self.decreases = 0

    def observe(self, ttft_s: float, now: float | None = None) -> None:
        """A text request's first token arrived ``ttft_s`` after the request did."""
        self._samples.append(ttft_s)
        self.tick(now)

    def tick(self, now: float | None = None) -> None:
        """Decide when a window is over (also called without traffic, by the router's probes)."""
        now = time.monotonic() if now is None else now
        if self._since is None:
            self._since = now
        if now - self._since < self.window_s:
            return
        samples, self._samples, self._since = self._samples, [], now
        g = self.gate
        if len(samples) >= self.min_samples:
            samples.sort()
            q = samples[min(len(samples) - 1, math.ceil(self.quantile * len(samples)) - 1)]
            if q > self.target_s:
                g.set_limit(max(1, (g.limit or g.in_flight) // 2))
                self.decreases += 1
                return
        elif samples:
            self._samples = samples  # too few to judge: carry them into the next window
            return
        if g.limit and g.waiting and (not self.ceiling or g.limit < self.ceiling):
            g.set_limit(g.limit + 1)
