"""``epdserve plan``: the topologies a core budget allows, predicted under a workload and ranked.

``plan(profile, PlanConfig)`` predicts every candidate (``model.predict``) and ranks them:

    1. stable before unstable (an unstable one cannot keep up with the arrivals at all)
    2. goodput, when an SLO is given (within 2 %: a tie — the model is not that precise)
    3. throughput in a closed loop; TTFT p90 under Poisson arrivals (within 2 %: a tie)
    4. fewer processes

Candidates: ``aggregated``, ``<N>e+<M>pd`` and, when the profile has costs of the split path,
``<N>e+<P>p+<D>d``, with at most ``max_replicas`` instances, all pinned to ``cores`` cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdserve.bench.report import SLO
from epdserve.bench.sweep import parse_topologies
from epdserve.bench.workload import WorkloadConfig
from epdserve.config_flags import Flag, add_flags, values
from epdserve.engine.config import EngineConfig
from epdserve.memory import format_bytes
from epdserve.plan import host
from epdserve.plan.cores import Unsupported
from epdserve.plan.model import YIELDS, Load, Prediction, predict
from epdserve.plan.profile import Profile, ProfileError, load_profile, save_profile
from epdserve.topology import Topology

TIE = 0.02  # relative difference below which two predictions rank as equal


@dataclass(frozen=True)
class PlanConfig:
    """What to plan for and within which budget."""

    load: Load  # the workload, its arrivals and the SLO
    cores: int = 0  # cores the deployment may use (0: those of the profiled machine)
    max_replicas: int = 4  # most encoder and worker instances together in a candidate
    lend_cores: bool = True  # roles lend each other idle cores, as up --pin-cores starts them (the profile's speed-ups)
    yield_to_decodes: bool = YIELDS  # lending encoders stand aside for prompts that hold decodes, as up runs them
    topologies: tuple[str, ...] = ()  # predict only these (names as ``epdserve up --topology`` reads them)

    def __post_init__(self) -> None:
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0, got {self.cores}")
        if self.max_replicas < 2:
            raise ValueError(f"max_replicas must be >= 2 (one encoder and one worker), got {self.max_replicas}")


def candidates(max_replicas: int, split: bool) -> list[str]:
    """Every topology with at most ``max_replicas`` instances, aggregated first."""
    out = ["aggregated"]
    out += [f"{e}e+{m}pd" for e in range(1, max_replicas) for m in range(1, max_replicas - e + 1)]
    if split:
        out += [
            f"{e}e+{p}p+{d}d"
            for e in range(1, max_replicas)
            for p in range(1, max_replicas - e)
            for d in range(1, max_replicas - e - p + 1)
        ]
    return out


@dataclass(frozen=True)
class Plan:
    """The ranked predictions, the recommendation, why, and what could not be predicted."""

    config: PlanConfig
    cores: int  # cores planned on
    ranked: list[Prediction]  # best first
    skipped: dict[str, str] = field(default_factory=dict)  # topology -> why it was not predicted

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked and self.ranked[0].stable else None


def _bucket(value: float) -> float:
    """``value`` on a logarithmic grid of TIE-wide steps, so that near-equal values sort as equal."""
    return round(math.log(value) / math.log1p(TIE)) if value > 0 else -math.inf


def rank_key(p: Prediction, slo: bool, closed: bool) -> tuple:
    if not p.stable:
        return (1, -_bucket(p.capacity_rps), p.replicas)
    goodput = -_bucket(p.goodput_rps or 0.0) if slo else 0
    speed = -_bucket(p.throughput_rps) if closed else _bucket(p.ttft_p90_s or 0.0)
    return (0, goodput, speed, p.replicas)


def plan(profile: Profile, config: PlanConfig) -> Plan:
    cores = config.cores or profile.nproc
    names = config.topologies or tuple(candidates(config.max_replicas, "split" in profile.paths))
    predictions, skipped = [], {}
    for name in names:
        try:
            predictions.append(predict(profile, name, cores, config.load, config.lend_cores, config.yield_to_decodes))
        except Unsupported as e:
            skipped[name] = str(e)
    closed = config.load.request_rate == 0
    predictions.sort(key=lambda p: rank_key(p, bool(config.load.slo.given), closed))
    return Plan(config, cores, predictions, skipped)


# ---- text and JSON ---------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def why(result: Plan) -> str:
    """The recommendation in words: what it predicts, what limits it, what it beats."""
    best = result.best
    if best is None:
        top = result.ranked[0] if result.ranked else None
        if top is None:
            return "no topology could be predicted: " + "; ".join(f"{k}: {v}" for k, v in result.skipped.items())
        return (
            f"no candidate keeps up with {result.config.load.request_rate:g} req/s on {result.cores} cores; the "
            f"largest capacity is {top.topology}'s {top.capacity_rps:.1f} req/s (bottleneck: {top.bottleneck})"
        )
    busy = ", ".join(f"{role} {100 * u:.0f}%" for role, u in best.utilization.items())
    lines = [
        f"recommendation: {best.topology}  (epdserve up --topology {best.topology} --pin-cores"
        + ("" if result.config.lend_cores else " --no-lend-cores")
        + ("" if result.config.yield_to_decodes or not result.config.lend_cores else " --no-yield-to-decodes")
        + ")",
        f"  expected: TTFT p50 {_ms(best.ttft_p50_s)} ms, p90 {_ms(best.ttft_p90_s)} ms, ITL {_ms(best.itl_s)} ms, "
        f"{best.throughput_rps:.2f} req/s"
        + (
            f", goodput {best.goodput_rps:.2f} req/s ({100 * (best.slo_fraction or 0):.0f}% within SLO)"
            if best.goodput_rps is not None
            else ""
        ),
        f"  capacity {best.capacity_rps:.1f} req/s, set by its {best.bottleneck}; busy at this load: {busy}",
    ]
    agg = next((p for p in result.ranked if p.topology == "aggregated"), None)
    if agg is not None and agg is not best:
        if agg.stable:
            lines.append(
                f"  vs aggregated: TTFT p90 {_ms(agg.ttft_p90_s)} ms, capacity {agg.capacity_rps:.1f} req/s "
                f"(bottleneck {agg.bottleneck})"
            )
        else:
            lines.append(f"  aggregated cannot keep up: capacity {agg.capacity_rps:.1f} req/s ({agg.bottleneck})")
    return "\n".join(lines)


def format_plan(result: Plan, profile: Profile) -> str:
    load = result.config.load
    w = load.workload
    arrival = (
        f"Poisson {load.request_rate:g} req/s"
        if load.request_rate > 0
        else f"closed loop, concurrency {load.concurrency}"
    )
    head = [
        f"epdserve plan: {w.images_per_request} img × {w.image_size or 'own size'} px, prompt {w.prompt_tokens or 'short'}, "
        f"{w.output_len} output tokens, text {100 * w.text_fraction:.0f}%, {arrival}, SLO {load.slo}",
        f"profile: {profile.source} ({profile.nproc} CPUs, {profile.cpu_model}); planned on {result.cores} cores",
        lending_line(profile, result.config.lend_cores, result.config.yield_to_decodes),
        "",
        f"{'#':>2} {'topology':<11}{'cap req/s':>10}  {'bottleneck':<16}{'TTFT p50':>9}{'p90':>8}{'ITL':>7}"
        f"{'E2E':>8}{'req/s':>8}{'SLO %':>7}{'goodput':>9}",
    ]
    rows = []
    for i, p in enumerate(result.ranked, 1):
        slo = "-" if p.slo_fraction is None else f"{100 * p.slo_fraction:.0f}"
        good = "-" if p.goodput_rps is None else f"{p.goodput_rps:.2f}"
        if not p.stable:
            tail = "  unstable: arrivals exceed capacity"
            rows.append(f"{i:>2} {p.topology:<11}{p.capacity_rps:>10.2f}  {p.bottleneck:<16}{tail}")
            continue
        rows.append(
            f"{i:>2} {p.topology:<11}{p.capacity_rps:>10.2f}  {p.bottleneck:<16}{_ms(p.ttft_p50_s):>9}"
            f"{_ms(p.ttft_p90_s):>8}{_ms(p.itl_s):>7}{_ms(p.e2e_mean_s):>8}{p.throughput_rps:>8.2f}{slo:>7}{good:>9}"
        )
    skipped = [f"not predicted: {k}: {v}" for k, v in result.skipped.items()]
    return "\n".join([*head, *rows, *(["", *skipped] if skipped else []), "", why(result)])


def lending_line(profile: Profile, lend: bool, yields: bool) -> str:
    """What the predictions assume of core lending, the speed-ups they use, and whether encoders
    stand aside for the prompts that hold decodes."""
    if not lend:
        return "roles on their own cores only (up --no-lend-cores)"
    lent = {name: c for name, c in profile.paths.items() if c.lends}
    if not lent:
        return "roles lend idle cores, but the profile measured no speed-up from it: predicted on their own cores"
    aside = "stand aside for them" if yields else "compute through them (up --no-yield-to-decodes)"
    return (
        "roles lend idle cores; speed-up of a role computing alone: "
        + "; ".join(
            f"{name} encode {c.lend_encode_x:.2f}x, prefill {c.lend_prefill_x:.2f}x, decode {c.lend_decode_x:.2f}x"
            for name, c in lent.items()
        )
        + f"; for prompts that hold decodes, encoders {aside}"
    )


def _finite(v: Any) -> Any:
    """JSON has no infinity: an unbounded capacity is written as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def plan_json(result: Plan, profile: Profile) -> dict[str, Any]:
    best = result.best
    return _finite(
        {
            "workload": dataclasses.asdict(result.config.load),
            "cores": result.cores,
            "profile_source": profile.source,
            "lend_cores": result.config.lend_cores,
            "yield_to_decodes": result.config.yield_to_decodes,
            "recommendation": best.topology if best else None,
            "why": why(result),
            "ranked": [dataclasses.asdict(p) for p in result.ranked],
            "skipped": result.skipped,
        }
    )


# ---- command line ----------------------------------------------------------------------------------

# the workload fields the model covers (no video, no reused media), flags as epdserve bench has them
PLAN_WORKLOAD_FLAGS = ("images_per_request", "image_size", "prompt_tokens", "output_len", "text_fraction")
LOAD_FLAGS = ("request_rate", "concurrency")
PLAN_FLAGS = ("cores", "max_replicas", "lend_cores", "yield_to_decodes")
# the engine's settings the memory account reads (--memory, --host-memory)
MEMORY_ENGINE_FLAGS = (
    "dtype",
    "kernels",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_kv_blocks",
    "kv_cache_memory",
    "max_pending_media_bytes",  # the engine's and, as up hands it on, the encoders'
    "max_inflight_body_bytes",  # the same
    "vision_slice_s",  # 0: no forward paused between steps
)


def add_cli_flags(s: argparse.ArgumentParser) -> None:
    """The flags of ``epdserve plan``: where the profile comes from, the workload, the budget."""
    from epdserve.plan.calibrate import CalibrationConfig

    src = s.add_argument_group("profile (one of)")
    src.add_argument("--profile", default=None, help="a profile JSON written by --save-profile")
    src.add_argument(
        "--calibrate",
        nargs="+",
        default=None,
        metavar="URL",
        help="calibrate against these live deployments (one per serving path: aggregated, E+PD, E+P+D)",
    )
    src.add_argument(
        "--calibrate-topologies",
        default=None,
        metavar="T,T",
        help="start these topologies here in turn (pinned), calibrate each, stop it, e.g. aggregated,1e+1pd,1e+1p+1d",
    )
    src.add_argument(
        "--sweep",
        default=None,
        metavar="SWEEP_JSON",
        help="fit the profile to the cells of an epdserve sweep (sweep.json with stage timing)",
    )
    src.add_argument(
        "--samples",
        default=None,
        metavar="FILE",
        help="fit the profile to a calibration's samples written by --save-samples (nothing is measured)",
    )
    s.add_argument("--save-profile", default=None, help="write the calibrated profile to this file")
    s.add_argument(
        "--save-samples", default=None, metavar="FILE", help="write a calibration's samples to this file, to fit again"
    )
    s.add_argument("--model", default=None, help="checkpoint of --calibrate-topologies (default: embedded)")
    add_flags(s.add_argument_group("calibration"), CalibrationConfig, [Flag("requests", "--calibration-requests")])
    add_flags(s.add_argument_group("workload"), WorkloadConfig, PLAN_WORKLOAD_FLAGS)
    add_flags(
        s.add_argument_group("arrivals"),
        Load,
        [
            Flag("request_rate", default=None, default_help="none"),
            Flag("concurrency", default=None, default_help="none"),
        ],
    )
    s.add_argument("--slo", default=None, help="SLO of goodput, e.g. ttft=500ms,itl=100ms,e2e=2s")
    add_flags(s, PlanConfig, PLAN_FLAGS)
    s.add_argument("--topologies", default=None, help="predict only these, comma-separated (default: every candidate)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    host.add_cli_flags(s)
    add_flags(s.add_argument_group("engine (memory)"), EngineConfig, MEMORY_ENGINE_FLAGS)


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    arrivals = values(args, LOAD_FLAGS)
    if ("request_rate" in arrivals) == ("concurrency" in arrivals):
        raise ValueError("give one of --request-rate (Poisson req/s) or --concurrency (closed loop)")
    load = Load(WorkloadConfig(**values(args, PLAN_WORKLOAD_FLAGS)), **arrivals, slo=SLO.parse(args.slo or ""))
    topologies = parse_topologies(args.topologies) if args.topologies else ()
    return PlanConfig(load, **values(args, PLAN_FLAGS), topologies=topologies)


def profile_from_args(args: argparse.Namespace) -> Profile:
    from epdserve.plan.calibrate import (
        CalibrationConfig,
        calibrate_topologies,
        calibrate_urls,
        profile_from_sweep,
        refit,
    )
    from epdserve.plan.record import load_samples

    given = [x for x in (args.profile, args.calibrate, args.calibrate_topologies, args.sweep, args.samples) if x]
    if len(given) != 1:
        raise ValueError(
            "give one of --profile FILE, --calibrate URL..., --calibrate-topologies T,T, --sweep FILE, --samples FILE"
        )
    if args.save_samples and not (args.calibrate or args.calibrate_topologies):
        raise ValueError("--save-samples keeps what a calibration measures: give --calibrate or --calibrate-topologies")
    if args.profile:
        return load_profile(Path(args.profile))
    if args.sweep or args.samples:
        profile = (
            profile_from_sweep(Path(args.sweep))
            if args.sweep
            else refit(load_samples(Path(args.samples)), args.samples)
        )
        if args.save_profile:
            save_profile(profile, Path(args.save_profile))
        return profile
    calibration = CalibrationConfig(**values(args, [Flag("requests", "--calibration-requests")]))

    def say(text: str) -> None:
        print(f"[plan] {text}", file=sys.stderr, flush=True)

    samples_out = Path(args.save_samples) if args.save_samples else None
    if args.calibrate:
        profile = calibrate_urls(calibration, [u.rstrip("/") for u in args.calibrate], say, samples_out)
    else:
        profile = calibrate_topologies(
            calibration,
            list(parse_topologies(args.calibrate_topologies)),
            args.model,
            say=say,
            dtype=args.dtype,
            lending=args.lend_cores,
            samples_out=samples_out,
        )
    if args.save_profile:
        say(f"wrote {save_profile(profile, Path(args.save_profile))}")
    return profile


def drop_oversized(result: Plan, args: argparse.Namespace, engine: EngineConfig) -> Plan:
    """``result`` without the candidates whose instances together exceed ``--host-memory``."""
    memory, _ = host.host_of(args)
    accounts = host.roles(Path(args.model), engine)
    kept, skipped = [], dict(result.skipped)
    for p in result.ranked:
        need = host.topology_memory(Topology.parse(p.topology), accounts)
        if need > memory:
            skipped[p.topology] = f"needs {format_bytes(need)} of memory, the host has {format_bytes(memory)}"
        else:
            kept.append(p)
    return dataclasses.replace(result, ranked=kept, skipped=skipped)


def run_cli(args: argparse.Namespace) -> int:
    """``epdserve plan``: read or measure a profile, predict every candidate, print the ranking."""
    if args.memory:
        try:
            return host.run_memory(args, EngineConfig(**values(args, MEMORY_ENGINE_FLAGS)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        config = config_from_args(args)
        profile = profile_from_args(args)
    except ValueError as e:  # ProfileError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a deployment that did not start or answer
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        result = plan(profile, config)
        if args.host_memory and args.model:
            result = drop_oversized(result, args, EngineConfig(**values(args, MEMORY_ENGINE_FLAGS)))
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(result, profile), indent=1) if args.json else format_plan(result, profile))
    return 0 if result.best is not None else 1
