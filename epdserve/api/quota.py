"""Per-client fairness at the public endpoint: how many requests one client has in flight, and how
many tokens it may reserve per minute, so that no caller holds the deployment for itself.

A client is its API key (the Bearer token it presents, hashed) or, without one, its address.
Requests that proved the cluster credential (a router calling its workers) are not counted: the
router already counted them, per client.

Tokens are a bucket of ``max_tokens_per_minute_per_key`` refilled continuously. A request reserves
its prompt plus its ``max_tokens`` up front (a request larger than the bucket takes all of it), and
what it did not use comes back when it ends (all of it when it failed). A request that finds too
little is answered 429 with ``Retry-After``: the seconds until the bucket holds enough.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
from aiohttp import web

from epdserve.api.auth import is_internal
from epdserve.api.errors import BadRequest, Overloaded
from epdserve.api.protocol import SamplingRequest
from epdserve.security.credentials import bearer

MAX_CLIENTS = 1 << 16  # token buckets remembered; full ones are forgotten beyond this


@dataclass(frozen=True)
class QuotaConfig:
    max_inflight_per_key: int = 0  # requests one API key (or client address) may have in flight (0: no limit)
    max_tokens_per_minute_per_key: int = 0  # prompt + max_tokens one key may reserve per minute (0: no limit)
    max_tokens_limit: int = 0  # the most tokens one request may ask to generate (0: up to the context length)

    def __post_init__(self) -> None:
        if min(self.max_inflight_per_key, self.max_tokens_per_minute_per_key, self.max_tokens_limit) < 0:
            raise ValueError("per-key limits and max_tokens_limit must be >= 0 (0: no limit)")


class Ticket:
    """One admitted request's place: its in-flight slot and its reserved tokens."""

    def __init__(self, quotas: Quotas, client: str) -> None:
        self.q, self.client, self.reserved = quotas, client, 0
        self._done = False

    def reserve(self, tokens: int) -> None:
        """Take ``tokens`` from the client's bucket, or answer 429 with the wait until they are there."""
        self.reserved += self.q._take(self.client, tokens)

    def done(self, used: int | None = None) -> None:
        """The request ended: its slot frees, and the tokens it reserved but did not use return
        (``used`` None: keep what was reserved, e.g. a stream whose length is not known here)."""
        if self._done:
            return
        self._done = True
        self.q._release(self.client)
        if used is not None:
            self.q._give_back(self.client, self.reserved - used)

    def failed(self) -> None:
        """The request was not served: everything it reserved returns."""
        self.done(0)


class Quotas:
    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)
        self.rejected = 0

    @staticmethod
    def client(request: web.Request) -> str:
        """Who the request counts against: its Bearer token (hashed: no key is held here), else
        the address it came from."""
        token = bearer(request.headers.get("Authorization"))
        if token:
            return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
        return "addr:" + (request.remote or "")

    @contextlib.contextmanager
    def share(self, request: web.Request, tokens: int) -> Iterator[Callable[[web.StreamResponse], None]]:
        """Hold the request's place and ``tokens`` for the body (429 when its client has used its
        share); the body reports the answer (``settle(resp)``): what its usage shows unused comes
        back, everything when it failed. A request with the cluster credential is not counted."""
        if is_internal(request):
            yield lambda resp: None
            return
        ticket = self.admit(self.client(request))
        counted = bool(self.config.max_tokens_per_minute_per_key)  # else an answer's usage is not read
        try:
            ticket.reserve(tokens)
            yield lambda resp: ticket.done(used_by(resp) if counted else None)
        except BaseException:
            ticket.failed()
            raise
        finally:
            ticket.done()

    def admit(self, client: str) -> Ticket:
        """A place for one more request of ``client``, or 429 when it has its share in flight."""
        limit = self.config.max_inflight_per_key
        if limit and self.in_flight.get(client, 0) >= limit:
            self.rejected += 1
            raise Overloaded(
                f"Too many requests in flight for this API key (at most {limit} at once); retry when one ends.",
                code="rate_limit_exceeded",
                retry_after_s=1,
            )
        self.in_flight[client] = self.in_flight.get(client, 0) + 1
        return Ticket(self, client)

    def _release(self, client: str) -> None:
        n = self.in_flight.get(client, 0) - 1
        if n > 0:
            self.in_flight[client] = n
        else:
            self.in_flight.pop(client, None)

    def _level(self, client: str) -> float:
        per_min = self.config.max_tokens_per_minute_per_key
        tokens, at = self._buckets.get(client, (float(per_min), self.clock()))
        return min(float(per_min), tokens + (self.clock() - at) * per_min / 60.0)

    def _take(self, client: str, tokens: int) -> int:
        per_min = self.config.max_tokens_per_minute_per_key
        if not per_min:
            return 0
        cost = min(tokens, per_min)  # a request larger than the bucket waits for all of it
        level = self._level(client)
        if level < cost:
            self.rejected += 1
            wait = math.ceil((cost - level) * 60.0 / per_min)
            raise Overloaded(
                f"This API key used its {per_min} tokens per minute (prompt plus max_tokens); retry in {wait} s.",
                code="rate_limit_exceeded",
                retry_after_s=max(1, wait),
            )
        self._set(client, level - cost)
        return cost

    def _give_back(self, client: str, tokens: int) -> None:
        """Return unused tokens (negative: a request used more than it reserved, e.g. a prompt the
        router could only estimate)."""
        per_min = self.config.max_tokens_per_minute_per_key
        if per_min and tokens:
            self._set(client, max(-float(per_min), self._level(client) + tokens))

    def _set(self, client: str, tokens: float) -> None:
        self._buckets[client] = (tokens, self.clock())
        if len(self._buckets) > MAX_CLIENTS:  # forget the clients whose bucket is full again
            per_min = self.config.max_tokens_per_minute_per_key
            self._buckets = {c: v for c, v in self._buckets.items() if self._level(c) < per_min}


def used_by(resp: web.StreamResponse) -> int | None:
    """The tokens an answer used: a whole JSON answer says (its ``usage``), a failed one used
    none; a stream's length is not read here (None: it keeps what it reserved)."""
    if resp.status != 200:
        return 0
    if isinstance(resp, web.Response) and isinstance(resp.body, bytes):
        try:
            return int(msgspec.json.decode(resp.body)["usage"]["total_tokens"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            return None
    return None


def requested_max_tokens(req: SamplingRequest) -> int | None:
    """The completion length the request asks for (None: the server's default)."""
    chat = getattr(req, "max_completion_tokens", None)
    return chat if chat is not None else req.max_tokens


def check_max_tokens(req: SamplingRequest, limit: int) -> None:
    """400 when the request asks for more than the server's ``max_tokens_limit`` (0: no cap)."""
    asked = requested_max_tokens(req)
    if limit and asked is not None and asked > limit:
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise BadRequest(f"{param} may be at most {limit} on this server, got {asked}.", param=param)
