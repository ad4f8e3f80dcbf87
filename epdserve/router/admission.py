"""Admission control at the router: text-only and media requests are admitted through separate
gates, each with its own limit of requests in flight and its own queue, so a burst of image-heavy
requests waits in its queue (or is turned away) while text requests go straight through.

A request over its class's limit waits, first come first served, up to ``wait_s``; then it is
answered 429 with ``Retry-After`` (never a timeout). A limit of 0 admits everything at once.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        """A place frees: the next waiter takes it (in_flight stays), else in_flight drops."""
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.in_flight -= 1
