"""Topologies: what a deployment is made of (``1e+1pd``, ``1e+1p+1d``, ...) and where its roles
run when pinned to cores (``up --pin-cores``)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

TOPOLOGY = re.compile(
    r"^(?:(?P<agg>aggregated)|(?P<e>\d+)e\+(?P<pd>\d+)pd|(?:(?P<pe>\d+)e\+)?(?P<p>\d+)p\+(?P<d>\d+)d)$"
)
TOPOLOGIES_HELP = "aggregated | <N>e+<M>pd | <N>e+<P>p+<D>d | <P>p+<D>d"


@dataclass(frozen=True)
class Topology:
    encoders: int  # 0 for aggregated (and for <P>p+<D>d)
    pds: int
    prefills: int = 0
    decodes: int = 0

    @property
    def aggregated(self) -> bool:
        return self.encoders == 0 and self.prefills == 0

    @property
    def split(self) -> bool:
        """Prefill and decode in separate instances."""
        return self.prefills > 0

    @property
    def workers(self) -> list[str]:
        """Names of the language-model instances behind the router."""
        return [
            *(f"pd{i}" for i in range(self.pds)),
            *(f"prefill{i}" for i in range(self.prefills)),
            *(f"decode{i}" for i in range(self.decodes)),
        ]

    @classmethod
    def parse(cls, text: str) -> Topology:
        m = TOPOLOGY.match(text.strip().lower())
        if not m:
            raise ValueError(f"topology must be one of {TOPOLOGIES_HELP} (e.g. 1e+1pd, 1e+1p+1d), got {text!r}")
        if m["agg"]:
            return cls(0, 1)
        if m["p"] is not None:
            e, p, d = int(m["pe"] or 0), int(m["p"]), int(m["d"])
            if p < 1 or d < 1 or (m["pe"] is not None and e < 1):
                raise ValueError("a prefill/decode topology needs at least one of each (and of encoders, if named)")
            return cls(e, 0, p, d)
        e, pd = int(m["e"]), int(m["pd"])
        if e < 1 or pd < 1:
            raise ValueError("a disaggregated topology needs at least one encoder and one pd instance")
        return cls(e, pd)


def topology_arg(text: str) -> Topology:
    """``Topology.parse`` as an argparse ``type=``: a bad value is a usage error, not a traceback."""
    try:
        return Topology.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class CorePlan:
    """Where each role runs when pinned (a role that is absent is not pinned)."""

    roles: dict[str, list[int]]  # role -> cores of its process
    engines: dict[str, list[int]]  # language-model worker -> cores of its engine core process

    def by_process(self) -> dict[str, list[int]]:
        """Every pinned process (a worker's engine core as "<worker> engine") and its cores."""
        return {**self.roles, **{f"{name} engine": cores for name, cores in self.engines.items()}}


def plan_cores(topo: Topology, cores: list[int]) -> CorePlan:
    """Split the cores between roles. Behind encoders, each language-model worker's engine core
    gets cores of its own (one each where possible), and the encoders share the rest with the
    workers' HTTP front ends, which are light: decode steps then never wait for a front end that
    streams, nor for an encode. Without encoders each worker (front end and core) gets its share.
    The router and an aggregated server use every core."""
    workers = topo.workers
    if topo.aggregated or len(cores) < 2:
        return CorePlan({}, {})
    if not topo.encoders:
        return CorePlan(_spread(workers, cores), {})
    n_enc = max(1, len(cores) * topo.encoders // (topo.encoders + len(workers)))
    n_enc = min(n_enc, len(cores) - 1)
    shared = cores[:n_enc]
    encoders = _spread([f"encoder{i}" for i in range(topo.encoders)], shared)
    return CorePlan({**encoders, **dict.fromkeys(workers, shared)}, _spread(workers, cores[n_enc:]))


def cpu_spec(cores: list[int]) -> str:
    """``cores`` as taskset and ``--engine-cpus`` write them."""
    return ",".join(map(str, cores))


def _spread(names: list[str], cores: list[int]) -> dict[str, list[int]]:
    """Each name a share of ``cores``: one core each (round robin) when there are fewer cores."""
    n = len(names)
    return {name: [cores[i % len(cores)]] if n >= len(cores) else cores[i::n] for i, name in enumerate(names)}


def describe(t: Topology) -> str:
    if t.aggregated:
        return "aggregated"
    if t.split:
        return f"{t.encoders} encoder(s) + {t.prefills} prefill + {t.decodes} decode worker(s) + router"
    return f"{t.encoders} encoder(s) + {t.pds} prefill/decode worker(s) + router"
