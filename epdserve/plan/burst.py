"""The first wave of a finite closed loop: clients that all send at the same instant.

A run of R requests from N clients starts with min(N, R) requests at once. They queue behind one
another at the encoders and at the engines' prefills: a transient the steady model (``model``)
does not have, and in a run of a few requests per client most of its first tokens. Here each
request of the wave goes through the stages in order at its deterministic cost: the encoders
(one request after another, a request's images split across them), then the prefill of its engine
(requests spread round-robin over the engines, one prefill after another, a waiting request the
scheduler holds behind prompts after the others; a request whose inputs arrive while its engine
only decodes waits half a decode step). A prefill beside the decodes of requests prefilled before
it may run faster, on the cores of encoders that stand aside for it, and they encode that much
later (``WaveJob.urgent_prefill_s``). ``model.predict`` mixes these
first tokens with the steady loop's for the rest of the run, and gives the run's percentiles as
the benchmark computes them over so few values (``run_percentile``) and its request rate as the
benchmark measures it: the requests over the time to the last answer (``run_time``), which in a
run of a few requests per client includes the wait for its last, partial round.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import NamedTuple


class WaveJob(NamedTuple):
    """One request of the wave and what it costs at the speeds of a busy deployment."""

    kind: str  # its request kind ("text", "image")
    held: bool  # its engine holds it while another prompt is in progress (vision past the step's bound)
    encode_s: float  # its encoders' work (0: no images, or no encoders: the engine encodes)
    prefill_s: float  # its prefill on its engine
    overhead_s: float  # front end, router and transfers: latency that occupies no stage
    urgent_prefill_s: float | None = None  # its prefill beside decodes, encoders standing aside (None: no such)


def wave_order(shares: dict[str, float], n: int) -> list[str]:
    """``n`` request kinds in proportion to ``shares`` (kind -> share of the requests), as evenly
    interleaved as the counts allow: each next request is the kind furthest behind its share."""
    taken = dict.fromkeys(shares, 0)
    order = []
    for i in range(1, n + 1):
        kind = max(shares, key=lambda k: (shares[k] * i - taken[k], shares[k]))
        taken[kind] += 1
        order.append(kind)
    return order


def first_wave(jobs: list[WaveJob], engines: int, step_s: float) -> list[float]:
    """The first-token times of ``jobs``, all sent at t = 0 in this order, through the encoders
    and then ``engines`` engines whose decode step in progress takes ``step_s`` (0: engines that
    never decode)."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    pauses: list[tuple[float, float]] = []  # when encoders stand aside for a prefill beside decodes
    for _ in range(len(jobs) + 1):  # the pauses move the encodes, which move the prefills
        ttfts, stood = _through(jobs, engines, step_s, pauses)
        if stood == pauses:
            break
        pauses = stood
    return ttfts


def _through(
    jobs: list[WaveJob], engines: int, step_s: float, pauses: list[tuple[float, float]]
) -> tuple[list[float], list[tuple[float, float]]]:
    """``first_wave``'s first tokens with the encoders standing aside during ``pauses``, and the
    pauses those prefills ask for."""
    encoders_free = 0.0
    ready = []
    for job in jobs:
        if job.encode_s > 0:
            encoders_free = _after(encoders_free, job.encode_s, pauses)
        ready.append(encoders_free if job.encode_s > 0 else 0.0)
    ttfts = [0.0] * len(jobs)
    stood = []
    for e in range(engines):
        queue = list(range(e, len(jobs), engines))
        free = 0.0  # when its last prefill ends
        while queue:
            now = max(free, min(ready[i] for i in queue))  # when it takes its next prefill
            i = min((i for i in queue if ready[i] <= now), key=lambda i: (jobs[i].held, ready[i], i))
            queue.remove(i)
            start = max(ready[i], free)
            if ready[i] > free > 0:  # its engine went on to decode the requests it had prefilled
                start += step_s / 2
            prefill, urgent = jobs[i].prefill_s, jobs[i].urgent_prefill_s
            if free > 0 and urgent is not None:  # beside the decodes of those it prefilled
                prefill = urgent
                stood.append((start, start + prefill))
            free = start + prefill
            ttfts[i] = jobs[i].overhead_s + free
    return ttfts, sorted(stood)


def _after(start: float, work: float, pauses: list[tuple[float, float]]) -> float:
    """When ``work`` seconds of encoding begun at ``start`` end, none done during ``pauses``."""
    for a, b in pauses:
        if b <= start:
            continue
        if a >= start + work:
            break
        work -= max(0.0, a - start)
        start = b
    return start + work


def quantile(cdf: Callable[[float], float], q: float, hi: float = 1.0) -> float:
    """The smallest t ≥ 0 with ``cdf(t) ≥ q`` (``cdf`` non-decreasing), by bisection from
    [0, ``hi``], ``hi`` doubled until it holds."""
    lo = 0.0
    while cdf(hi) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cdf(mid) >= q else (mid, hi)
    return hi


def run_percentile(wave: list[float], rest: int, steady: Callable[[float], float], p: float) -> float:
    """The ``p``-th percentile (0–100), interpolated as the benchmark interpolates its own
    (``bench.client.percentile``), of a run's TTFTs: the first wave's ``wave`` and ``rest`` more
    drawn from the steady distribution ``steady`` (its CDF), taken at its evenly spaced quantiles
    (the i-th at (i + 1/2) / rest)."""
    total = len(wave) + rest
    if total == 0:
        return 0.0

    def count(t: float) -> int:  # values of the run at or below t
        return sum(1 for x in wave if x <= t) + min(rest, math.floor(steady(t) * rest + 0.5))

    def smallest(j: int) -> float:  # the j-th smallest value (1-based)
        return quantile(count, j, max([1.0, *wave]))

    k = (total - 1) * p / 100
    below = int(k)
    lo_v = smallest(below + 1)
    hi_v = smallest(min(below + 2, total))
    return lo_v + (hi_v - lo_v) * (k - below)


def run_time(first: list[float], requests: int, e2e_s: float) -> float:
    """How long a closed loop of ``requests`` requests takes to its last answer: one client per
    value of ``first``, when its first answer ends; each client sends again at once, each later
    request taking the steady loop's ``e2e_s``, until all are sent."""
    ends = list(first)
    heapq.heapify(ends)
    for _ in range(requests - len(first)):
        heapq.heappush(ends, heapq.heappop(ends) + e2e_s)
    return max(ends, default=0.0)
