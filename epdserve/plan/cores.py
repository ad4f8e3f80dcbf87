"""Where a topology's processes run and how fast: pinned cores, cores shared, cores lent.

Each role is a pool of servers pinned as ``up --pin-cores`` pins them (``topology.plan_cores``).
Engines pinned to one core share it as the kernel does, equally among those that want it: each
runs at 1 / (1 + the others' busy shares). Roles that lend each other idle cores (``up``'s default)
run faster while the others idle: 1 + (x − 1) × the idle share of the others' cores, x the speed-up
the calibration measured with every other role idle. Encoders that stand aside for a prompt that
holds running decodes (the encoders' default where roles lend) hand their cores to it even while
they encode, and lose that time, half of it at most (``kernels.lending.YIELD_SHARE``). ``model``
solves these speeds together with the loads they give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from epdserve.kernels.lending import YIELD_SHARE
from epdserve.plan.profile import PathCosts
from epdserve.topology import Topology, plan_cores


class Unsupported(ValueError):
    """A topology the model cannot predict (no costs for its path, or too few cores to pin it)."""


class Pool(NamedTuple):
    """The language-model instances of one role."""

    role: str  # "engines" (prefill and decode), "prefill workers" or "decode workers"
    prefix: str  # their process names' prefix in ``topology.plan_cores``: "pd", "prefill", "decode"
    n: int  # instances
    prefill: bool  # they prefill
    decode: bool  # they decode


@dataclass(frozen=True)
class Layout:
    """Where a topology's processes run, pinned to some cores as ``up --pin-cores`` pins them."""

    encoders: int  # encoder servers: encoders with a core of their own (those sharing one count once)
    pools: tuple[Pool, ...]  # the language-model pools; the first one prefills, the last one decodes
    engine_cores: dict[str, list[int]]  # each engine process ("pd0", "prefill0", ...) -> its cores
    own_cores: dict[str, frozenset[int]] = field(default_factory=dict)  # role ("encoders", a pool's) -> its cores
    lend: bool = False  # a computing role borrows the cores of idle roles (``up``'s default when pinned)
    yields: bool = False  # lending encoders stand aside while an engine's prompt holds its running decodes


def layout(topology: Topology, cores: int, lend: bool = False, yields: bool = False) -> Layout:
    if topology.aggregated:
        # one engine core process (one torch thread) with a core to itself; its front end takes another
        return Layout(0, (Pool("engines", "pd", 1, True, True),), {"pd0": [0]})
    if cores < 2:
        raise Unsupported("separate roles need at least 2 cores to be pinned apart")
    plan = plan_cores(topology, list(range(cores)))
    enc_cores = {c for name, cs in plan.roles.items() if name.startswith("encoder") for c in cs}
    pools: tuple[Pool, ...]
    if topology.split:
        pools = (
            Pool("prefill workers", "prefill", topology.prefills, True, False),
            Pool("decode workers", "decode", topology.decodes, False, True),
        )
    else:
        pools = (Pool("engines", "pd", topology.pds, True, True),)
    own = {"encoders": frozenset(enc_cores)} | {
        p.role: frozenset(c for name, cs in plan.engines.items() if name.startswith(p.prefix) for c in cs)
        for p in pools
    }
    return Layout(min(topology.encoders, len(enc_cores)), pools, dict(plan.engines), own, lend, lend and yields)


def shares(lay: Layout, busy: dict[str, float]) -> dict[str, float]:
    """Each pool's mean share of a core (1: a core of its own) when its engines share cores with
    engines busy ``busy[role]`` of the time. The kernel shares a core equally between the processes
    that want it, so a core gives an engine 1 / (1 + the others expected to be running on it); an
    engine's own cores never give it more than one core's speed (lending is apart: ``Speeds``)."""
    role_of = {name: p.role for name in lay.engine_cores for p in lay.pools if name.startswith(p.prefix)}
    on_core: dict[int, list[str]] = {}
    for name, cs in lay.engine_cores.items():
        for c in cs:
            on_core.setdefault(c, []).append(name)
    speed = {
        name: min(1.0, sum(1 / (1 + sum(busy[role_of[o]] for o in on_core[c] if o != name)) for c in cs))
        for name, cs in lay.engine_cores.items()
    }
    return {p.role: sum(speed[n] for n in speed if role_of[n] == p.role) / p.n for p in lay.pools}


def idle_lent(lay: Layout, busy: dict[str, float], role: str) -> float:
    """The share of the cores of other roles, not ``role``'s own, that is idle (every role on it
    idle) and so lent to ``role`` while it computes: 0 where roles do not lend."""
    if not lay.lend:
        return 0.0
    mine = lay.own_cores.get(role, frozenset())
    others = {c for r, cs in lay.own_cores.items() if r != role for c in cs} - mine
    if not others:
        return 0.0
    idle = [math.prod(1 - busy.get(r, 0.0) for r, cs in lay.own_cores.items() if r != role and c in cs) for c in others]
    return sum(idle) / len(others)


class Speeds(NamedTuple):
    """How fast a pool's engines run against a core of their own: speeds of 1 are the profile's costs."""

    prefill: float
    decode: float


class Urgent(NamedTuple):
    """An engine's prompts that hold its running decodes, for which lending encoders stand aside."""

    share: float  # of its prefills: those that run beside decoding sequences
    busy: float  # share of its time spent on them


def stands_aside(c: PathCosts, lay: Layout) -> bool:
    """Whether ``lay``'s encoders hand their cores to the prompts that hold decodes: they yield,
    and the profile measured a speed-up from lent cores."""
    return lay.yields and lay.encoders > 0 and c.lends


def speeds(
    c: PathCosts, lay: Layout, busy: dict[str, float], urgent: dict[str, Urgent] | None = None
) -> tuple[dict[str, Speeds], float]:
    """(each pool's speeds, the encoders' speed) at the busy shares ``busy`` (role -> share of its
    time computing). Sharing a core slows an engine (``shares``); lent cores speed a role up by
    its calibrated speed-up (``PathCosts.lend_*_x``, measured with every other role idle) times the
    share of the others' cores that is idle: a role that starts computing takes its cores back.
    ``urgent`` (pool role -> its prompts that hold decodes): encoders that yield lend their cores
    to those prompts even while they encode, and lose that time (``YIELD_SHARE`` at most)."""
    holding = (urgent or {}) if stands_aside(c, lay) else {}
    handed = {role: u.share for role, u in holding.items()}  # of its prefills: the encoders' cores lent

    def lent(x: float, role: str, given: float = 0.0) -> float:
        return 1 + (x - 1) * (given + (1 - given) * idle_lent(lay, busy, role))

    pools = {
        role: Speeds(share * lent(c.lend_prefill_x, role, handed.get(role, 0.0)), share * lent(c.lend_decode_x, role))
        for role, share in shares(lay, busy).items()
    }
    paused = min(YIELD_SHARE, sum(u.busy for u in holding.values()))
    return pools, lent(c.lend_encode_x, "encoders") * (1 - paused)
