"""The analytic model: what one topology does under one workload, predicted from a profile.

Each role is a pool of servers; a server is a core (roles are pinned as ``up --pin-cores`` pins
them, ``topology.plan_cores``), so replicas that share a core add no capacity. How fast each runs,
sharing cores or borrowing idle ones, is ``cores``'s; the speeds are solved here together with
the loads they give.

    encoders   M/D/c: a request's images are split across the encoders, its work is
               encode_call + images × (encode_image + encode_mpx × Mpx)
    engines    one per language-model worker, requests spread evenly. An engine alternates prefills
               (work P per request) and decode steps of every running sequence (step(b) = d0 + d1·b).
               With load L = λ·E[P] + λ·out·d1 < 1 a sequence's gap between tokens is
                   ITL = (d0 + d1) / (1 − L)   (prefills preempt steps; each other sequence adds d1)
               and the batch follows from Little's law: b = λ·out·ITL (at most max_num_seqs).
               A prefill waits as in M/G/1 (Pollaczek–Khinchine) at load L, plus half a decode step;
               a request whose vision forward in the engine is past the step's vision bound waits
               behind the others' prompts (the scheduler holds it while a prompt is in progress:
               a non-preemptive priority), and the others wait for less.
    split P/D  prefill workers only prefill; decode workers only decode (the same step law, L = λ·out·d1).

    TTFT = overhead + [encode wait + encode] + prefill wait + prefill         (per request kind)
    E2E  = TTFT + (out − 1) × ITL

Waiting times are taken as 0 with probability 1 − π and exponential otherwise (π: the chance that
some station is busy on arrival), which gives TTFT quantiles and the share of requests within an
SLO; goodput = throughput × that share. A closed loop of N clients is solved for the λ at which
N = λ × E2E; its requests meet the other N − 1 clients' requests only (the arrival theorem), so
their waits are those of the load λ·(N − 1)/N, and their speeds those of that load's busy shares
as a request away from a role meets them (``others_busy``): one client never waits, and while it
encodes the engine idles. A closed loop of a given number of requests (``Load.requests``) starts
with all its clients sending at once: that first wave goes through the stages one request after
another (``burst``), and the run's TTFT mixes its first tokens with the steady loop's for the
other requests; its throughput is the requests over the time to its last answer. At or beyond a
role's capacity the prediction is *unstable*: no latency is given.

What it leaves out (see docs/plan.md): the router's and front ends' CPU (taken as latency, not
as load on the cores), prefix and encoder cache hits, chunked prefill, the variance of a closed
loop being lower than Poisson's beyond what the arrival theorem gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from epdserve.bench.report import SLO
from epdserve.bench.sweep import topology_name
from epdserve.bench.workload import WorkloadConfig
from epdserve.config_flags import config_defaults
from epdserve.encoder.config import EncoderConfig
from epdserve.engine.config import EngineConfig
from epdserve.plan.burst import WaveJob, first_wave, quantile, run_percentile, run_time, wave_order
from epdserve.plan.cores import Layout, Pool, Speeds, Unsupported, Urgent, layout, speeds, stands_aside
from epdserve.plan.profile import PathCosts, Profile, ProfileError
from epdserve.plan.queues import Station, encoder_station, priority_waits
from epdserve.topology import Topology

MAX_BATCH = EngineConfig().max_num_seqs  # an engine never decodes more sequences at once
VISION_STEP_S = EngineConfig().vision_step_s  # an engine's vision work that holds media behind prompts
MEDIA_MAX_WAIT_S = EngineConfig().media_max_wait_s  # how long at most media is held behind text
YIELDS = config_defaults(EncoderConfig)["yield_to_decodes"]  # lending encoders stand aside for prompts


@dataclass(frozen=True)
class Load:
    """The workload and how it arrives."""

    workload: WorkloadConfig  # what each request looks like (video and reused media are not modelled)
    request_rate: float = 0.0  # Poisson arrivals in req/s (0: a closed loop instead)
    concurrency: int = 0  # closed loop: requests in flight, each client sending again when its answer ends
    slo: SLO = field(default_factory=SLO)  # bounds for goodput; none: no goodput
    requests: int = 0  # closed loop: the run's length, its first wave sent at once (0: a run long enough not to tell)

    def __post_init__(self) -> None:
        if self.request_rate < 0:
            raise ValueError(f"request_rate must be >= 0, got {self.request_rate}")
        if self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")
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
    throughput_rps: float  # completed req/s (the arrival rate when stable, the capacity otherwise;
    # a closed loop of a given number of requests: those over the time to its last answer)
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


# ---- one topology ----------------------------------------------------------------------------------


def path_of(topology: Topology) -> str:
    if topology.aggregated:
        return "aggregated"
    if not topology.encoders:
        raise Unsupported("topologies without encoders (<P>p+<D>d) are not modelled")
    return "split" if topology.split else "epd"


@dataclass(frozen=True)
class _Engine:
    """An engine pool at one load."""

    load: float  # L: prefill work plus the decode steps' per-sequence growth, per second of engine time
    itl_s: float  # wall time of a decode step
    batch: float  # mean sequences per decode step
    prefill_wait_s: dict[str, float]  # request kind -> mean wait of its prefill (queue, step in progress)
    busy: float  # share of time it wants its core (prefilling, or any sequence decoding)
    speed: Speeds  # its speeds against a core of its own
    urgent: Urgent  # its prompts that hold running decodes

    @property
    def stable(self) -> bool:
        return self.load < 1 and self.batch <= MAX_BATCH


def held_behind_prompts(c: PathCosts, k: Kind, prefill_speed: float) -> bool:
    """Whether an engine that encodes its requests' images holds a request of kind ``k`` while
    another prompt is in progress: its vision forward is past the step's bound. Such a request
    waits behind the others' prompts; one within the bound shares their step."""
    vision = c.prefill(k.prompt_tokens, k.images, k.pixels) - c.prefill(k.prompt_tokens, 0, 0.0)
    return k.images > 0 and vision / prefill_speed > VISION_STEP_S


def engine(
    c: PathCosts, rate: float, kinds: list[Kind], out: int, speed: Speeds, pool: Pool, encodes: bool = True
) -> _Engine:
    """One engine of ``pool`` receiving ``rate`` req/s at ``speed``; ``encodes``: it runs the
    vision forward of its requests' images (no encoders in front of it)."""
    p = [c.prefill(k.prompt_tokens, k.images, k.pixels) / speed.prefill if pool.prefill else 0.0 for k in kinds]
    held = [pool.prefill and encodes and held_behind_prompts(c, k, speed.prefill) for k in kinds]
    p_mean = sum(k.share * x for k, x in zip(kinds, p, strict=True))
    p_sq = sum(k.share * x * x for k, x in zip(kinds, p, strict=True))
    d0, d1 = c.decode_step_s / speed.decode, c.decode_seq_s / speed.decode
    growth = rate * out * d1 if pool.decode else 0.0
    load = rate * p_mean + growth
    if load >= 1:
        never = dict.fromkeys((k.name for k in kinds), math.inf)
        return _Engine(load, math.inf, math.inf, never, 1.0, speed, Urgent(0.0, 0.0))
    # a sequence's own growth of the step, d1, comes on top of what the others' load stretches
    itl = (d0 + d1) / (1 - load) if pool.decode else 0.0
    batch = rate * out * itl
    # idle only with no prefill running and no sequence decoding (their number taken as Poisson)
    busy = 1 - (1 - load) * math.exp(-batch)
    beside = 1 - math.exp(-batch) if pool.prefill and pool.decode else 0.0  # a prompt meets decodes
    urgent = Urgent(beside, rate * p_mean * beside)
    wait = dict.fromkeys((k.name for k in kinds), 0.0)
    if pool.prefill:
        # held requests wait behind the others' prompts, the others for less (a non-preemptive
        # priority); each also for the decode step in progress (its residual: half a step)
        step = (1 - math.exp(-batch)) * (d0 + d1 * batch) / 2
        first = sum(k.share * x for k, x, h in zip(kinds, p, held, strict=True) if not h)
        waits = priority_waits(rate * p_sq / 2, growth, rate * first, load, MEDIA_MAX_WAIT_S)
        wait = {k.name: step + waits[h] for k, h in zip(kinds, held, strict=True)}
    return _Engine(load, itl, batch, wait, busy, speed, urgent)


FIXED_POINT_ROUNDS = 60  # speeds ↔ busy shares; they converge in a few dozen rounds


@dataclass(frozen=True)
class _State:
    """Every role of a topology at one arrival rate."""

    encoders: Station
    encode_speed: float  # the encoders' speed against a core of their own
    engines: dict[str, _Engine]  # pool role -> its engine

    @property
    def stable(self) -> bool:
        return self.encoders.utilization < 1 and all(e.stable for e in self.engines.values())


def state_at(
    c: PathCosts,
    kinds: list[Kind],
    out: int,
    lay: Layout,
    rate: float,
    media_share: float,
    enc_work: float,
    clients: int = 0,
) -> _State:
    """Every role at ``rate``: speeds and busy shares solved together, starting from roles that
    never compute (busy 0). The busier a role, the slower the others (a shared core, fewer cores
    to lend) and so the busier they are: the shares rise from 0 to the least fixed point.
    ``clients``: ``rate`` is what the other clients of a closed loop of that many bring, and the
    speeds are those a request of it meets (``others_busy``)."""
    busy = dict.fromkeys((p.role for p in lay.pools), 0.0) | ({"encoders": 0.0} if lay.encoders else {})
    urgent = {p.role: Urgent(0.0, 0.0) for p in lay.pools}
    for _ in range(FIXED_POINT_ROUNDS):
        pool_speeds, enc_speed = speeds(c, lay, others_busy(busy, clients), urgent)
        enc = (
            encoder_station(rate * media_share, enc_work / enc_speed, lay.encoders)
            if lay.encoders
            else Station(0.0, 0.0, 0.0)
        )
        engines = {
            p.role: engine(c, rate / p.n, kinds, out, pool_speeds[p.role], p, not lay.encoders) for p in lay.pools
        }
        state = _State(enc, enc_speed, engines)
        new = {role: e.busy for role, e in engines.items()} | (
            {"encoders": min(1.0, enc.utilization)} if lay.encoders else {}
        )
        new_urgent = {role: e.urgent for role, e in engines.items()}
        moved = [abs(x - y) for r in urgent for x, y in zip(new_urgent[r], urgent[r], strict=True)]
        if max([abs(new[r] - busy[r]) for r in busy] + moved) < 1e-9:
            break
        busy, urgent = new, new_urgent
    return state


def others_busy(busy: dict[str, float], clients: int) -> dict[str, float]:
    """Each role's busy share as a request of a closed loop of ``clients`` meets it while it is
    elsewhere, from ``busy``, the shares the other clients' load gives. A role serves the loop's
    requests one at a time (an engine's batch overlaps some: for it this is an upper bound), so
    the others keep it busy while this request is not there: their ``b`` falls into the
    1 − b / (clients − 1) of the time this request spends away from it (its own share of the
    role's time is one client's, b / (clients − 1)). So the cores a role lends are idle less
    often than the others' load alone says: in a loop of two whose encoder is busy 92 % of the
    time, a prompt finds it idle 15 % of its time, not 54 %. Open arrivals (``clients`` below 2):
    ``busy`` as it is."""
    if clients < 2:
        return busy
    return {role: min(1.0, b / max(1e-9, 1 - b / (clients - 1))) for role, b in busy.items()}


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


def _media(profile: Profile, load: Load, c: PathCosts) -> tuple[list[Kind], float, float]:
    """(request kinds, share of requests with images, encoder work of one)."""
    kinds = request_kinds(profile, load.workload)
    media_share = sum(k.share for k in kinds if k.images)
    return kinds, media_share, max((c.encode(k.images, k.pixels) for k in kinds), default=0.0)


def capacity(
    c: PathCosts, kinds: list[Kind], out: int, lay: Layout, media_share: float, enc_work: float
) -> tuple[float, str]:
    """(the most req/s the topology sustains, the role that limits it): the rate at which the
    encoders' utilisation or an engine's load reaches 1, or an engine's batch MAX_BATCH, found by
    bisection (roles sharing or lending cores speed up or slow down each other with the load)."""
    fastest, enc_fastest = speeds(c, lay, dict.fromkeys(lay.own_cores, 0.0))
    hi = math.inf
    if lay.encoders and media_share * enc_work > 0:
        hi = lay.encoders * enc_fastest / (media_share * enc_work)
    for pool in lay.pools:  # each pool alone at its fastest: an upper bound
        per_request = engine(c, 1.0, kinds, out, fastest[pool.role], pool).load
        if per_request > 0:
            hi = min(hi, pool.n / per_request)
    if not math.isfinite(hi):
        return math.inf, "none"
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        ok = state_at(c, kinds, out, lay, mid, media_share, enc_work).stable
        lo, hi = (mid, hi) if ok else (lo, mid)
    near = state_at(c, kinds, out, lay, lo, media_share, enc_work)
    pressure = {role: max(e.load, e.batch / MAX_BATCH) for role, e in near.engines.items()}
    if lay.encoders:
        pressure["encoders"] = near.encoders.utilization
    return lo, max(pressure, key=lambda r: pressure[r])


@dataclass(frozen=True)
class _Case:
    """One topology under one workload: what every arrival rate shares."""

    name: str
    path: str
    cores: int
    lay: Layout
    costs: PathCosts
    kinds: list[Kind]
    media_share: float  # share of requests with images
    enc_work: float  # encoder work of one request with images
    capacity: float
    bottleneck: str


def _case(profile: Profile, topology: str, cores: int, load: Load, lend: bool, yields: bool) -> _Case:
    topo = Topology.parse(topology)
    path = path_of(topo)
    try:
        c = profile.costs(path)
    except ProfileError as e:
        raise Unsupported(str(e)) from None
    lay = layout(topo, cores, lend, yields)
    kinds, media_share, enc_work = _media(profile, load, c)
    cap, bottleneck = capacity(c, kinds, load.workload.output_len, lay, media_share, enc_work)
    return _Case(topology_name(topo), path, cores, lay, c, kinds, media_share, enc_work, cap, bottleneck)


def _encoder_work(c: PathCosts, k: Kind, lay: Layout) -> float:
    """The encoders' time for one request of kind ``k`` at speed 1: its images are split across
    the encoders, each encoding its share in parallel."""
    per_image = (c.encode(k.images, k.pixels) - c.encode_call_s) / k.images
    return c.encode_call_s + per_image * math.ceil(k.images / lay.encoders)


def _evaluate(case: _Case, load: Load, rate: float) -> Prediction:
    c, lay, kinds, cap = case.costs, case.lay, case.kinds, case.capacity
    media_share, enc_work = case.media_share, case.enc_work
    out = load.workload.output_len
    state = state_at(c, kinds, out, lay, rate, media_share, enc_work)
    enc, engines = state.encoders, state.engines
    stable = rate < cap and state.stable
    base = Prediction(
        topology=case.name,
        path=case.path,
        cores=case.cores,
        capacity_rps=cap,
        bottleneck=case.bottleneck,
        stable=stable,
        request_rate=rate,
        utilization={
            **({"encoders": enc.utilization} if lay.encoders else {}),
            **{r: e.load for r, e in engines.items()},
        },
        throughput_rps=min(rate, cap),
    )
    if not stable:
        return base
    if load.request_rate == 0:  # a closed loop: a request meets the other clients' load only
        seen = rate * (load.concurrency - 1) / load.concurrency
        state = state_at(c, kinds, out, lay, seen, media_share, enc_work, load.concurrency)
        enc, engines = state.encoders, state.engines
    first_pool = lay.pools[0]  # the pool that prefills
    first, decoder = engines[first_pool.role], engines[lay.pools[-1].role]
    dists: list[Dist] = []
    for k in kinds:
        fixed = c.overhead(k.images) + c.prefill(k.prompt_tokens, k.images, k.pixels) / first.speed.prefill
        wait, busy = first.prefill_wait_s[k.name], first.busy
        if k.images and lay.encoders:
            fixed += _encoder_work(c, k, lay) / state.encode_speed
            wait += enc.wait_s
            busy = 1 - (1 - busy) * (1 - enc.wait_prob)
        dists.append((k.share, fixed, wait, busy))
    ttft_mean = sum(s * (f + m) for s, f, m, _ in dists)
    by_kind = {k.name: f + m for k, (_, f, m, _) in zip(kinds, dists, strict=True)}

    def steady(t: float) -> float:
        return _mix_cdf(dists, t)

    decode_time = (out - 1) * decoder.itl_s
    throughput = base.throughput_rps
    if load.request_rate == 0 and load.requests:
        steady_e2e = ttft_mean + decode_time
        ttft_mean, by_kind, wave = _with_first_wave(case, load, ttft_mean, by_kind)
        rest = load.requests - len(wave)
        p50, p90 = (run_percentile(wave, rest, steady, p) for p in (50, 90))
        throughput = load.requests / run_time([t + decode_time for t in wave], load.requests, steady_e2e)
    else:
        p50, p90 = quantile(steady, 0.5), quantile(steady, 0.9)

    def gap(bound: float) -> float:
        if not first_pool.decode:
            return 0.0  # decode workers never prefill
        step = decoder.itl_s * (1 - decoder.load)  # a decode step's own time, no prefill in it
        long = [k for k in kinds if step + c.prefill(k.prompt_tokens, k.images, k.pixels) / first.speed.prefill > bound]
        return rate / first_pool.n * sum(k.share for k in long)

    fraction = slo_fraction(load.slo, dists, decoder.itl_s, decode_time, gap) if load.slo.given else None
    return dataclasses.replace(
        base,
        ttft_mean_s=ttft_mean,
        ttft_p50_s=p50,
        ttft_p90_s=p90,
        ttft_by_kind_s=by_kind,
        throughput_rps=throughput,
        itl_s=decoder.itl_s,
        e2e_mean_s=ttft_mean + decode_time,
        decode_batch=rate / lay.pools[-1].n * out * decoder.itl_s,  # Little's law
        slo_fraction=fraction,
        goodput_rps=None if fraction is None else rate * fraction,
    )


def _with_first_wave(
    case: _Case, load: Load, mean: float, by_kind: dict[str, float]
) -> tuple[float, dict[str, float], list[float]]:
    """TTFT's mean and mean per kind over a finite closed loop's requests, and its first wave's
    TTFTs: the wave by ``burst.first_wave``, the rest of the run as the steady loop (``mean``,
    ``by_kind``)."""
    c, lay, kinds = case.costs, case.lay, case.kinds
    wave_n = min(load.concurrency, load.requests)
    rest = load.requests - wave_n
    first_pool = lay.pools[0]
    # while a wave of several requests goes through, every role has work queued: none idles to
    # lend its cores, and engines sharing a core share it with busy ones
    busy = dict.fromkeys(lay.own_cores, 1.0 if wave_n > 1 else 0.0)
    pool_speeds, encode_speed = speeds(c, lay, busy)
    speed = pool_speeds[first_pool.role]
    # a prefill beside the decodes of those before it, on the cores of encoders that stand aside
    urgent = speeds(c, lay, busy, {first_pool.role: Urgent(1.0, 0.0)})[0][first_pool.role].prefill
    of = {k.name: k for k in kinds}
    jobs = []
    for name in wave_order({k.name: k.share for k in kinds}, wave_n):
        k = of[name]
        encode = _encoder_work(c, k, lay) / encode_speed if k.images and lay.encoders else 0.0
        work = c.prefill(k.prompt_tokens, k.images, k.pixels)
        held = not lay.encoders and held_behind_prompts(c, k, speed.prefill)
        beside = work / urgent if stands_aside(c, lay) and first_pool.decode else None
        jobs.append(WaveJob(name, held, encode, work / speed.prefill, c.overhead(k.images), beside))
    step = (c.decode_step_s + c.decode_seq_s) / speed.decode if first_pool.decode else 0.0
    wave = first_wave(jobs, first_pool.n, step)
    total = load.requests
    new_mean = (sum(wave) + rest * mean) / total
    new_by_kind = {}
    for k in kinds:
        mine = [t for t, job in zip(wave, jobs, strict=True) if job.kind == k.name]
        count = len(mine) + rest * k.share
        new_by_kind[k.name] = (sum(mine) + rest * k.share * by_kind[k.name]) / count if count else by_kind[k.name]

    return new_mean, new_by_kind, wave


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


def predict(
    profile: Profile, topology: str, cores: int, load: Load, lend: bool = True, yields: bool = YIELDS
) -> Prediction:
    """The prediction for ``topology`` pinned to ``cores`` cores under ``load``; ``Unsupported`` when
    the profile or the cores cannot serve it. A closed loop is solved for its arrival rate.
    ``lend``: its roles lend each other idle cores (``up --pin-cores``'s default), as fast as the
    profile's lending speed-ups say (none where it has none); ``yields``: lending encoders stand
    aside for the prompts that hold running decodes (the encoders' default)."""
    case = _case(profile, topology, cores, load, lend, yields)
    if load.request_rate > 0:
        return _evaluate(case, load, load.request_rate)
    # closed loop: N clients, each sending again when its answer ends, so N = λ × E2E(λ); E2E grows
    # with λ and without bound at capacity, so the root lies below capacity
    lo, hi = 0.0, case.capacity
    for _ in range(60):
        mid = (lo + hi) / 2
        p = _evaluate(case, load, mid)
        in_flight = mid * p.e2e_mean_s if p.stable and p.e2e_mean_s is not None else math.inf
        lo, hi = (mid, hi) if in_flight < load.concurrency else (lo, mid)
    return _evaluate(case, load, lo)
