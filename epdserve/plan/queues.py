"""Queueing pieces of the planner's model: an encoder pool as M/D/c, and the prefill wait of an
engine's two request classes as M/G/1 with a non-preemptive priority."""

from __future__ import annotations

import math
from dataclasses import dataclass


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c with ``offered`` = λ·S Erlangs (< servers)."""
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)
    return last / (total + last)


@dataclass(frozen=True)
class Station:
    """A pool's state at one load: busy share, mean wait, chance to wait."""

    utilization: float
    wait_s: float
    wait_prob: float


def encoder_station(rate: float, work_s: float, servers: int) -> Station:
    """M/D/c: Erlang C's wait, halved for deterministic service (the Allen–Cunneen correction)."""
    offered = rate * work_s
    rho = offered / servers
    if rate == 0 or work_s == 0:
        return Station(0.0, 0.0, 0.0)
    if rho >= 1:  # saturated: the queue grows without bound
        return Station(rho, math.inf, 1.0)
    p_wait = erlang_c(servers, offered)
    return Station(rho, 0.5 * p_wait * work_s / (servers * (1 - rho)), p_wait)


def priority_waits(
    residual: float, growth: float, first: float, load: float, max_defer: float = math.inf
) -> tuple[float, float]:
    """Mean waits (first class, held class) of an engine's prefills: M/G/1 at ``load`` (its
    prefill work per second plus the decode steps' ``growth``), ``residual`` = λ·E[P²]/2 the work
    in progress met on arrival, and the first class (``first``: its prefill work per second)
    admitted before the held one (Cobham's non-preemptive priority, the decode steps' growth
    stretching both classes alike). Without a held class both are Pollaczek–Khinchine's
    ``residual / (1 − load)``; the work-weighted mean of the two is that whatever the split
    (work conservation). A held request that has waited ``max_defer`` joins the first class, so
    the held class waits at most that much longer than in arrival order, and the first class
    gains only what the held one gives up."""
    fifo = residual / (1 - load)
    ahead = 1 - growth - first
    held_work = load - growth - first
    if held_work <= 0 or first <= 0:
        return fifo, fifo
    held = min(residual * (1 - growth) / (ahead * (1 - load)), fifo + max_defer)
    return fifo - held_work * (held - fifo) / first, held
