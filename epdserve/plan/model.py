"""The analytic model: what one topology does under one workload, predicted from a profile.

Each role is a pool of servers; a server is a core (roles are pinned as ``up --pin-cores`` pins
them, ``up.plan_cores``), so replicas that share a core add no capacity and each runs slower.

    encoders   M/D/c: a request's images are split across the encoders, its work is
               encode_call + images × (encode_image + encode_mpx × Mpx)
    engines    one per language-model worker, requests spread evenly. An engine alternates prefills
               (work P per request) and decode steps of every running sequence (step(b) = d0 + d1·b).
               With load L = λ·E[P] + λ·out·d1 < 1 the decode step's wall time is
                   ITL = d0 / (1 − L)          (prefills preempt steps; each sequence adds d1)
               and the batch follows from Little's law: b = λ·out·ITL (at most max_num_seqs).
               A prefill waits as in M/G/1 (Pollaczek–Khinchine) at load L, plus half a decode step.
    split P/D  prefill workers only prefill; decode workers only decode (the same step law, L = λ·out·d1).

    TTFT = overhead + [encode wait + encode] + prefill wait + prefill         (per request kind)
    E2E  = TTFT + (out − 1) × ITL

Waiting times are taken as 0 with probability 1 − π and exponential otherwise (π: the chance that
some station is busy on arrival), which gives TTFT quantiles and the share of requests within an
SLO; goodput = throughput × that share. A closed loop of N clients is solved for the λ at which
N = λ × E2E. At or beyond a role's capacity the prediction is *unstable*: no latency is given.

What it leaves out (see docs/plan.md): the router's and front ends' CPU (taken as latency, not
as load on the cores), prefix and encoder cache hits, chunked prefill, the variance of a closed
loop being lower than Poisson's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from epdserve.bench.report import SLO
from epdserve.bench.sweep import topology_name
from epdserve.bench.workload import WorkloadConfig
from epdserve.engine.config import EngineConfig
from epdserve.plan.profile import PathCosts, Profile, ProfileError
from epdserve.up import Topology, plan_cores

MAX_BATCH = EngineConfig().max_num_seqs  # an engine never decodes more sequences at once


class Unsupported(ValueError):
    """A topology the model cannot predict (no costs for its path, or too few cores to pin it)."""


@dataclass(frozen=True)
class Load:
    """The workload and how it arrives."""

    workload: WorkloadConfig  # what each request looks like (video and reused media are not modelled)
    request_rate: float = 0.0  # Poisson arrivals in req/s (0: a closed loop instead)
    concurrency: int = 0  # closed loop: requests in flight, each client sending again when its answer ends
    slo: SLO = field(default_factory=SLO)  # bounds for goodput; none: no goodput

    def __post_init__(self) -> None:
        if self.request_rate < 0:
            raise ValueError(f"request_rate must be >= 0, got {self.request_rate}")
        if self.request_rate == 0 and self.concurrency < 1:
            raise ValueError("give an arrival rate (req/s) or a closed-loop concurrency")
        if self.workload.video_fraction > 0 or self.workload.repeated_fraction > 0:
            raise ValueError("the model covers text and image requests only (no video, no reused media)")


@dataclass(frozen=True)
class Kind:
    """One kind of request of the workload (text, or with images) and what it costs."""

    name: str  # "text" or "image"
    share: float  # fraction of the requests
    images: int
    pixels: float  # per image
    prompt_tokens: float  # text and visual


def request_kinds(profile: Profile, w: WorkloadConfig) -> list[Kind]:
    text_tokens = profile.text_prompt_tokens(w.prompt_tokens)
    kinds = []
    image_share = 0.0 if w.images_per_request == 0 else 1.0 - w.text_fraction
    if image_share < 1.0:
        kinds.append(Kind("text", 1.0 - image_share, 0, 0.0, text_tokens))
    if image_share > 0.0:
        k = w.images_per_request
        tokens = text_tokens + k * profile.tokens_per_image(w.image_size)
        kinds.append(Kind("image", image_share, k, profile.pixels(w.image_size), tokens))
    return kinds


@dataclass(frozen=True)
class Prediction:
    """What the model expects of one topology under one load."""

    topology: str  # canonical name, e.g. "1e+1pd"
    path: str  # serving path whose costs were used
    cores: int  # cores it was planned on
    capacity_rps: float  # the most req/s it sustains: its bottleneck's limit
    bottleneck: str  # the role that sets the capacity
    stable: bool  # the load is below capacity (otherwise no latency is predicted)
    request_rate: float  # the arrival rate predicted for (closed loop: the solved one)
    utilization: dict[str, float]  # role -> share of its servers' time busy at this load
    throughput_rps: float  # completed req/s (the arrival rate when stable, the capacity otherwise)
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_by_kind_s: dict[str, float] = field(default_factory=dict)  # mean TTFT of each request kind
    itl_s: float | None = None  # mean gap between tokens
    e2e_mean_s: float | None = None
    decode_batch: float | None = None  # mean sequences per decode step of an engine
    slo_fraction: float | None = None  # share of requests within the SLO (None: no SLO)
    goodput_rps: float | None = None  # throughput × slo_fraction

    @property
    def replicas(self) -> int:
        t = Topology.parse(self.topology)
        return t.encoders + t.pds + t.prefills + t.decodes


# ---- queueing pieces -------------------------------------------------------------------------------


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
    p_wait = erlang_c(servers, offered)
    return Station(rho, 0.5 * p_wait * work_s / (servers * (1 - rho)), p_wait)


# ---- one topology ----------------------------------------------------------------------------------


def path_of(topology: Topology) -> str:
    if topology.aggregated:
        return "aggregated"
    if not topology.encoders:
        raise Unsupported("topologies without encoders (<P>p+<D>d) are not modelled")
    return "split" if topology.split else "epd"


def core_shares(topology: Topology, cores: int) -> tuple[int, float, float, float]:
    """(encoder servers, speed of each worker engine, of each prefill engine, of each decode engine) with
    the roles pinned to ``cores`` as ``up --pin-cores`` pins them; a speed below 1 means engines
    share cores."""
    if topology.aggregated:
        return 0, 1.0, 1.0, 1.0  # one engine core process (one torch thread); the front end takes another
    if cores < 2:
        raise Unsupported("separate roles need at least 2 cores to be pinned apart")
    plan = plan_cores(topology, list(range(cores)))
    enc_cores = {c for name, cs in plan.roles.items() if name.startswith("encoder") for c in cs}
    n_enc = min(topology.encoders, len(enc_cores))

    # an engine core runs one torch thread: it gets the share of one core that the engines pinned
    # with it leave it, summed over its cores, at most 1
    sharing: dict[int, int] = {}
    for cs in plan.engines.values():
        for core in cs:
            sharing[core] = sharing.get(core, 0) + 1
    speeds = {name: min(1.0, sum(1 / sharing[core] for core in cs)) for name, cs in plan.engines.items()}

    def speed(prefix: str, n: int) -> float:
        pool = [s for name, s in speeds.items() if name.startswith(prefix)]
        return sum(pool) / len(pool) if n and pool else 1.0

    return n_enc, speed("pd", topology.pds), speed("prefill", topology.prefills), speed("decode", topology.decodes)


@dataclass(frozen=True)
class _Engine:
    """An engine pool at one load."""

    load: float  # L: prefill work plus the decode steps' per-sequence growth, per second of engine time
    itl_s: float  # wall time of a decode step
    batch: float  # mean sequences per decode step
    prefill_wait_s: float  # mean wait of a prefill (queue and the step in progress)
    busy_prob: float


def engine(
    c: PathCosts, rate: float, kinds: list[Kind], out: int, speed: float, prefill: bool, decode: bool
) -> _Engine:
    """One engine receiving ``rate`` req/s, prefilling and/or decoding them at ``speed`` (1: a core of its own)."""
    p = [c.prefill(k.prompt_tokens, k.images) / speed for k in kinds] if prefill else [0.0] * len(kinds)
    p_mean = sum(k.share * x for k, x in zip(kinds, p, strict=True))
    p_sq = sum(k.share * x * x for k, x in zip(kinds, p, strict=True))
    d0, d1 = c.decode_step_s / speed, c.decode_seq_s / speed
    load = rate * p_mean + (rate * out * d1 if decode else 0.0)
    if load >= 1:
        return _Engine(load, math.inf, math.inf, math.inf, 1.0)
    itl = d0 / (1 - load) if decode else 0.0
    batch = rate * out * itl if decode else 0.0
    step = d0 + d1 * batch
    residual = min(1.0, batch) * step / 2  # a prefill arriving during a decode step waits for its end
    wait = (rate * p_sq / (2 * (1 - load)) if prefill else 0.0) + (residual if prefill else 0.0)
    return _Engine(load, itl, batch, wait, min(1.0, load + min(1.0, batch) * (1 - load)) if prefill else 0.0)


class Pool(NamedTuple):
    """The language-model instances of one role."""

    role: str  # "engines" (prefill and decode), "prefill workers" or "decode workers"
    n: int  # instances
    speed: float  # each one's share of a core (1: a core of its own)
    prefill: bool  # it prefills
    decode: bool  # it decodes


def pools(topology: Topology, cores: int) -> tuple[int, list[Pool]]:
    """(encoder servers, the language-model pools) of ``topology`` pinned to ``cores`` cores."""
    n_enc, pd_speed, p_speed, d_speed = core_shares(topology, cores)
    if not topology.split:
        return n_enc, [Pool("engines", topology.pds or 1, pd_speed, True, True)]
    return n_enc, [
        Pool("prefill workers", topology.prefills, p_speed, True, False),
        Pool("decode workers", topology.decodes, d_speed, False, True),
    ]


def capacity(c: PathCosts, kinds: list[Kind], out: int, pool: Pool) -> float:
    """The most req/s ``pool`` sustains: its prefill and per-sequence decode work fill its engines,
    or its decode batch reaches MAX_BATCH (b = λ·out·ITL with ITL = d0 / (1 − λ·work), solved for λ)."""
    p_mean = sum(k.share * c.prefill(k.prompt_tokens, k.images) for k in kinds) / pool.speed if pool.prefill else 0.0
    work = p_mean + (out * c.decode_seq_s / pool.speed if pool.decode else 0.0)
    cap = pool.n / work if work > 0 else math.inf
    if pool.decode:
        cap = min(cap, pool.n * MAX_BATCH / (out * c.decode_step_s / pool.speed + MAX_BATCH * work))
    return cap


# (share of the requests, latency without waiting, mean wait, chance to wait) of one request kind
Dist = tuple[float, float, float, float]


def slo_fraction(slo: SLO, dists: list[Dist], itl: float, decode_time: float, gap: Callable[[float], float]) -> float:
    """The share of requests within every bound of ``slo``, taking TTFT and decode as independent.
    ``gap(bound)``: the rate at which prefills that would stretch one decode gap past ``bound``
    arrive at the engine (0 where decode engines never prefill)."""
    if (slo.tpot is not None and itl > slo.tpot) or (slo.itl is not None and itl > slo.itl):
        return 0.0
    bounds = [(slo.ttft, 0.0)] if slo.ttft is not None else []
    bounds += [(slo.e2e, decode_time)] if slo.e2e is not None else []
    within = min((_mix_cdf(dists, b - shift) for b, shift in bounds), default=1.0)
    if slo.itl is not None:  # no such prefill during this request's decode
        within *= math.exp(-gap(slo.itl) * decode_time)
    return within


def _evaluate(profile: Profile, topology: Topology, name: str, cores: int, load: Load, rate: float) -> Prediction:
    path = path_of(topology)
    try:
        c = profile.costs(path)
    except ProfileError as e:
        raise Unsupported(str(e)) from None
    kinds = request_kinds(profile, load.workload)
    out = load.workload.output_len
    n_enc, lm_pools = pools(topology, cores)
    media_share = sum(k.share for k in kinds if k.images)
    enc_work = max((c.encode(k.images, k.pixels) for k in kinds), default=0.0)

    caps = {pool.role: capacity(c, kinds, out, pool) for pool in lm_pools}
    if n_enc:
        caps["encoders"] = n_enc / (media_share * enc_work) if media_share * enc_work > 0 else math.inf
    bottleneck = min(caps, key=lambda r: caps[r])
    enc = encoder_station(rate * media_share, enc_work, n_enc) if n_enc else Station(0.0, 0.0, 0.0)
    engines = {p.role: engine(c, rate / p.n, kinds, out, p.speed, p.prefill, p.decode) for p in lm_pools}
    base = Prediction(
        topology=name,
        path=path,
        cores=cores,
        capacity_rps=caps[bottleneck],
        bottleneck=bottleneck,
        stable=rate < caps[bottleneck],
        request_rate=rate,
        utilization={**({"encoders": enc.utilization} if n_enc else {}), **{r: e.load for r, e in engines.items()}},
        throughput_rps=min(rate, caps[bottleneck]),
    )
    if not base.stable:
        return base
    first_pool = lm_pools[0]  # the pool that prefills
    first, decoder = engines[first_pool.role], engines[lm_pools[-1].role]
    dists: list[Dist] = []
    for k in kinds:
        fixed = c.overhead(k.images) + c.prefill(k.prompt_tokens, k.images) / first_pool.speed
        wait, busy = first.prefill_wait_s, first.busy_prob
        if k.images and n_enc:
            # the images are split across the encoders: each encodes its share in parallel
            per_image = (c.encode(k.images, k.pixels) - c.encode_call_s) / k.images
            fixed += c.encode_call_s + per_image * math.ceil(k.images / n_enc)
            wait += enc.wait_s
            busy = 1 - (1 - busy) * (1 - enc.wait_prob)
        dists.append((k.share, fixed, wait, busy))
    ttft_mean = sum(s * (f + m) for s, f, m, _ in dists)
    decode_time = (out - 1) * decoder.itl_s

    def gap(bound: float) -> float:
        if topology.split:
            return 0.0  # decode workers never prefill
        step = decoder.itl_s * (1 - decoder.load)  # a decode step's own time, no prefill in it
        long = [k for k in kinds if step + c.prefill(k.prompt_tokens, k.images) / first_pool.speed > bound]
        return rate / first_pool.n * sum(k.share for k in long)

    fraction = slo_fraction(load.slo, dists, decoder.itl_s, decode_time, gap) if load.slo.given else None
    return dataclasses.replace(
        base,
        ttft_mean_s=ttft_mean,
        ttft_p50_s=_quantile(lambda t: _mix_cdf(dists, t), 0.5),
        ttft_p90_s=_quantile(lambda t: _mix_cdf(dists, t), 0.9),
        ttft_by_kind_s={k.name: f + m for k, (_, f, m, _) in zip(kinds, dists, strict=True)},
        itl_s=decoder.itl_s,
        e2e_mean_s=ttft_mean + decode_time,
        decode_batch=decoder.batch,
        slo_fraction=fraction,
        goodput_rps=None if fraction is None else rate * fraction,
    )


def _mix_cdf(dists: list[Dist], t: float) -> float:
    """P(TTFT ≤ t) over the request kinds."""
    return sum(share * _wait_cdf(t - fixed, mean, prob) for share, fixed, mean, prob in dists)


def _wait_cdf(t: float, mean: float, prob: float) -> float:
    """P(wait ≤ t): 0 with probability 1 − prob, else exponential of mean ``mean / prob``."""
    if t < 0:
        return 0.0
    if prob <= 0 or mean <= 0:
        return 1.0
    return 1.0 - prob * math.exp(-t * prob / mean)


def _quantile(cdf: Callable[[float], float], q: float) -> float:
    """The smallest t with cdf(t) ≥ q, by bisection."""
    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cdf(mid) >= q else (mid, hi)
    return hi


def predict(profile: Profile, topology: str, cores: int, load: Load) -> Prediction:
    """The prediction for ``topology`` pinned to ``cores`` cores under ``load``; ``Unsupported`` when
    the profile or the cores cannot serve it. A closed loop is solved for its arrival rate."""
    topo = Topology.parse(topology)
    name = topology_name(topo)
    if load.request_rate > 0:
        return _evaluate(profile, topo, name, cores, load, load.request_rate)
    # closed loop: N clients, each sending again when its answer ends, so N = λ × E2E(λ); E2E grows
    # with λ and without bound at capacity, so the root lies below capacity
    capacity = _evaluate(profile, topo, name, cores, load, 0.0).capacity_rps
    lo, hi = 0.0, capacity
    for _ in range(80):
        mid = (lo + hi) / 2
        p = _evaluate(profile, topo, name, cores, load, mid)
        in_flight = mid * p.e2e_mean_s if p.stable and p.e2e_mean_s is not None else math.inf
        lo, hi = (mid, hi) if in_flight < load.concurrency else (lo, mid)
    return _evaluate(profile, topo, name, cores, load, lo)
