"""`epdserve plan`'s predictions next to measurements of the same workloads.

Three checks, each printed as a markdown table (prediction | measurement, side by side):

1. ``--measure``: a profile is calibrated here (or read with ``--profile``, or fitted to a
   calibration's samples with ``--samples``), then each topology
   is started pinned (as ``epdserve up --pin-cores``) and each workload is run against it with the
   load generator; every row shows the model's TTFT p50, mean and req/s beside the measured ones.
2. ``--sweep FILE``: every cell of an ``epdserve sweep`` result (closed loop) predicted with the
   profile — no new measurement. A sweep run on another machine or commit is a weaker check: the
   table says where each side was measured.
3. ``--vs-vllm FILE``: every epdserve cell of a ``scripts/vs_vllm.py`` result (its ``--json``),
   the median over its runs, predicted with and without core lending (those runs lend, as ``up``
   does by default) — no new measurement.

Topologies are started, and predicted, with roles lending each other idle cores as ``up`` starts
them (``--no-lend-cores``: each on its own cores only).

    python scripts/plan_validate.py --calibrate-topologies aggregated,1e+1pd,1e+1p+1d \\
        --save-profile docs/results/plan/profile.json --measure aggregated,1e+1pd,2e+1pd,1e+2pd,1e+1p+1d \\
        --workload images=10,out=16,rate=8 --workload images=4,out=16,rate=14 \\
        --workload images=1,out=64,conc=4 --workload images=0,out=256,rate=2 \\
        --workload images=4,out=16,text=0.5,conc=8 --slo ttft=200ms --requests 64 \\
        --sweep docs/results/sweep/sweep.json --sweep docs/results/sweep-mixed/sweep.json \\
        --out docs/results/plan/validation.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.bench.client import as_operator
from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import SLO, BenchConfig, Summary
from epdserve.bench.sweep import Environment, parse_topologies, role_args
from epdserve.bench.workload import WorkloadConfig
from epdserve.common.dtypes import DTYPES
from epdserve.launcher import free_port
from epdserve.plan.calibrate import CalibrationConfig, calibrate_topologies, refit
from epdserve.plan.cores import Unsupported
from epdserve.plan.model import Load, Prediction, predict
from epdserve.plan.profile import Profile, load_profile, save_profile
from epdserve.plan.record import load_samples
from epdserve.up import Deployment, Topology

KEYS = {"images": "images_per_request", "size": "image_size", "prompt": "prompt_tokens", "out": "output_len"}


def parse_workload(text: str, slo: SLO) -> Load:
    """``images=10,out=16,rate=8`` or ``images=4,out=16,text=0.5,conc=8`` as a ``Load``."""
    fields: dict[str, int | float] = {}
    rate, conc = 0.0, 0
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key in KEYS:
            fields[KEYS[key]] = int(value)
        elif key == "text":
            fields["text_fraction"] = float(value)
        elif key == "rate":
            rate = float(value)
        elif key == "conc":
            conc = int(value)
        else:
            raise ValueError(f"bad workload item {item!r}: use images, size, prompt, out, text, rate, conc")
    return Load(WorkloadConfig(**fields), request_rate=rate, concurrency=conc, slo=slo)  # type: ignore[arg-type]


def run_of(load: Load, requests: int) -> Load:
    """``load`` as a run of ``requests`` requests: a closed loop's first wave is then modelled
    (its clients all send at once); an open loop's arrivals are the same whatever the length."""
    return dataclasses.replace(load, requests=requests) if load.request_rate == 0 else load


def describe(load: Load) -> str:
    w = load.workload
    arrival = f"{load.request_rate:g} req/s" if load.request_rate else f"conc {load.concurrency}"
    text = f", {100 * w.text_fraction:.0f}% text" if w.text_fraction else ""
    size = f" × {w.image_size} px" if w.image_size and w.images_per_request else ""
    return f"{w.images_per_request} img{size} × {w.output_len} tok{text}, {arrival}"


@dataclass(frozen=True)
class Row:
    workload: str
    topology: str
    predicted: Prediction | None  # None: the model cannot predict this topology
    measured: Summary | None  # None: not measured (the deployment did not start)
    note: str = ""
    closed: bool = False  # closed loop: its req/s is a prediction (open loop: the arrival rate, when stable)
    per_kind: dict[str, Summary] = field(default_factory=dict)  # mixed traffic: each request kind measured


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def _err(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{100 * (pred - meas) / meas:+.0f}%"


def table(rows: list[Row], goodput: bool) -> str:
    head = "| workload | topology | TTFT p50 ms pred / meas | err | TTFT mean ms pred / meas | req/s pred / meas | err | capacity req/s pred |"
    sep = "|---|---|---|---|---|---|---|---|"
    if goodput:
        head += " goodput pred / meas |"
        sep += "---|"
    lines = [head, sep]
    for r in rows:
        p, m = r.predicted, r.measured
        if p is None or not p.stable:
            pred_ttft = pred_mean = "unstable" if p is not None else "n/a"
            pred_rps = f"{p.throughput_rps:.2f}" if p is not None else "n/a"
        else:
            pred_ttft, pred_mean, pred_rps = _ms(p.ttft_p50_s), _ms(p.ttft_mean_s), f"{p.throughput_rps:.2f}"
        meas_ttft = _ms(m.ttft.p50) if m else "-"
        meas_mean = _ms(m.ttft.mean) if m else "-"
        meas_rps = f"{m.request_throughput:.2f}" if m else "-"
        stable = p is not None and p.stable
        line = (
            f"| {r.workload} | {r.topology} | {pred_ttft} / {meas_ttft} | "
            f"{_err(p.ttft_p50_s if stable and p else None, m.ttft.p50 if m else None)} | {pred_mean} / {meas_mean} | "
            f"{pred_rps} / {meas_rps} | {_err(p.throughput_rps if p else None, m.request_throughput if m else None)} | "
            f"{p.capacity_rps:.2f} ({p.bottleneck}) |"
            if p is not None
            else f"| {r.workload} | {r.topology} | n/a / {meas_ttft} | - | n/a / {meas_mean} | n/a / {meas_rps} | - | {r.note} |"
        )
        if goodput:
            pg = "-" if p is None or p.goodput_rps is None else f"{p.goodput_rps:.2f}"
            mg = "-" if m is None or m.goodput is None else f"{m.goodput:.2f}"
            line += f" {pg} / {mg} |"
        lines.append(line)
    return "\n".join([*lines, "", agreement(rows), *by_kind(rows)])


def by_kind(rows: list[Row]) -> list[str]:
    """Mixed traffic, kind by kind: each kind's TTFT mean predicted and measured (a p50 over two
    kinds falls between them, a weak target)."""
    lines = []
    for r in rows:
        p = r.predicted
        for kind, m in r.per_kind.items():
            pred = p.ttft_by_kind_s.get(kind) if p is not None and p.stable else None
            lines.append(
                f"| {r.workload} | {r.topology} | {kind} | {_ms(pred)} / {_ms(m.ttft.mean)} | {_err(pred, m.ttft.mean)} |"
            )
    if not lines:
        return []
    head = ["", "Mixed traffic by request kind:", "", "| workload | topology | kind | TTFT mean ms pred / meas | err |"]
    return [*head, "|---|---|---|---|---|", *lines]


def agreement(rows: list[Row]) -> str:
    """Median absolute relative error of the stable predictions, and how many were within ±25 %
    (req/s: closed-loop rows only; under Poisson arrivals a stable prediction is the arrival rate)."""
    parts = []
    for name, pick, closed_only in (
        ("TTFT p50", lambda p, m: (p.ttft_p50_s, m.ttft.p50), False),
        ("closed-loop req/s", lambda p, m: (p.throughput_rps, m.request_throughput), True),
    ):
        errs = [
            abs(pv - mv) / mv
            for r in rows
            if r.predicted is not None and r.predicted.stable and r.measured is not None
            if r.closed or not closed_only
            for pv, mv in [pick(r.predicted, r.measured)]
            if pv is not None and mv
        ]
        if errs:
            within = sum(e <= 0.25 for e in errs)
            parts.append(f"{name}: median error {100 * statistics.median(errs):.0f}%, {within}/{len(errs)} within ±25%")
    return "Agreement (stable predictions): " + ("; ".join(parts) or "none to compare")


def _predict(profile: Profile, topology: str, cores: int, load: Load, lend: bool) -> tuple[Prediction | None, str]:
    try:
        return predict(profile, topology, cores, load, lend), ""
    except Unsupported as e:
        return None, str(e)


def measure(profile: Profile, topologies: list[str], loads: list[Load], args: argparse.Namespace) -> list[Row]:
    rows = []
    for name in topologies:
        d = Deployment(
            Topology.parse(name),
            args.model,
            port=free_port(),
            pin=True,
            lend_cores=args.lend_cores,
            log_dir=Path(args.log_dir) / name.replace("+", "_"),
            **role_args(args.dtype),
        )
        print(f"[validate] starting {name}", file=sys.stderr, flush=True)
        try:
            d.start()
            for i, load in enumerate(loads):
                load = run_of(load, args.requests)
                pred, note = _predict(profile, name, args.cores or profile.nproc, load, args.lend_cores)
                bench = BenchConfig(
                    url=d.url,
                    workload=load.workload,
                    num_requests=args.requests,
                    warmup=args.warmup,
                    concurrency=max(1, load.concurrency),
                    request_rate=load.request_rate,
                    seed=1000 + 100 * i,
                    slo=load.slo,
                )
                with as_operator(d.cluster):
                    result = asyncio.run(run_bench(bench))
                summary = result.summary
                rows.append(Row(describe(load), name, pred, summary, note, load.request_rate == 0, result.per_kind))
                print(
                    f"[validate] {name} {describe(load)}: measured TTFT p50 {_ms(summary.ttft.p50)} ms, "
                    f"{summary.request_throughput:.2f} req/s",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            d.stop()
    return rows


def from_sweep(profile: Profile, path: Path, cores: int) -> tuple[list[Row], str]:
    data = json.loads(path.read_text())
    c, env = data["config"], data["environment"]
    slo = SLO(**{k: v for k, v in c["slo"].items() if v is not None})
    rows = []
    for cell in data["cells"]:
        if not cell["clean"]:
            continue
        cc = cell["cell"]
        workload = WorkloadConfig(
            images_per_request=cc["images"],
            image_size=c.get("image_size", 0),
            prompt_tokens=c.get("prompt_tokens", 0),
            output_len=cc["output_len"],
            text_fraction=0.5 if cc["mixed"] else 0.0,
        )
        load = Load(workload, request_rate=c["request_rate"], concurrency=c["concurrency"], slo=slo)
        load = run_of(load, c.get("requests", 0))
        # sweeps from before lending record no setting: their roles kept to their own cores
        pred, note = _predict(profile, cell["topology"], cores or env["nproc"], load, c.get("lend_cores", False))
        measured = Summary(**_summary(cell["summary"]))
        kinds = {k: Summary(**_summary(v)) for k, v in cell.get("per_kind", {}).items()}
        rows.append(Row(describe(load), cell["topology"], pred, measured, note, load.request_rate == 0, kinds))
    where = f"measured {env['date']} on {env['nproc']} × {env['cpu_model']} at commit {env['commit']}"
    return rows, where


def from_vs_vllm(profile: Profile, path: Path, cores: int) -> str:
    """Every epdserve cell of a vs_vllm.py result (median over its runs) beside the predictions
    with and without core lending, as a markdown table."""
    data = json.loads(path.read_text())
    a = data["args"]
    workload = WorkloadConfig(
        images_per_request=a["images_per_request"], image_size=a["image_size"], output_len=a["output_len"]
    )
    cells: dict[tuple[str, int], list[dict]] = {}
    for row in data["rows"]:
        if row["system"] == "epdserve" and row["ok"] == row["sent"]:
            cells.setdefault((row["topology"], row["concurrency"]), []).append(row)
    lines = [
        "| workload | topology | conc | TTFT p50 ms pred lent / own / meas | err lent / own | "
        "req/s pred lent / own / meas | err lent / own |",
        "|---|---|---|---|---|---|---|",
    ]
    errors: dict[bool, list[float]] = {True: [], False: []}
    for (topology, conc), runs in cells.items():
        ttft = statistics.median(r["ttft_p50_ms"] for r in runs) / 1e3
        rps = statistics.median(r["req_per_s"] for r in runs)
        load = run_of(Load(workload, concurrency=conc), a["requests"])
        preds = {lend: _predict(profile, topology, cores or profile.nproc, load, lend)[0] for lend in (True, False)}
        t = {k: (p.ttft_p50_s if p is not None and p.stable else None) for k, p in preds.items()}
        q = {k: (p.throughput_rps if p is not None else None) for k, p in preds.items()}
        burst = conc > 1 and a["requests"] <= conc  # every client sends once, all at the start
        for lend, v in t.items():
            if v is not None:
                errors[lend].append(abs(v - ttft) / ttft)
        lines.append(
            f"| {a['images_per_request']} img × {a['image_size']} px × {a['output_len']} tok | {topology} | "
            f"{conc}{' (burst)' if burst else ''} | "
            f"{_ms(t[True])} / {_ms(t[False])} / {_ms(ttft)} | {_err(t[True], ttft)} / {_err(t[False], ttft)} | "
            f"{_num(q[True])} / {_num(q[False])} / {rps:.3f} | {_err(q[True], rps)} / {_err(q[False], rps)} |"
        )
    summary = "; ".join(
        f"{'lent' if lend else 'own cores'}: TTFT p50 median error {100 * statistics.median(e):.0f}%"
        for lend, e in errors.items()
        if e
    )
    return "\n".join([*lines, "", summary])


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _summary(s: dict) -> dict:
    from epdserve.bench.report import Stats

    out = dict(s)
    for k in ("ttft", "tpot", "itl", "e2e"):
        out[k] = Stats(**s[k])
    out["stages"] = {k: Stats(**v) for k, v in s.get("stages", {}).items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a profile written by epdserve plan --save-profile")
    ap.add_argument("--calibrate-topologies", default=None, help="calibrate these here first, e.g. aggregated,1e+1pd")
    ap.add_argument("--calibration-requests", type=int, default=CalibrationConfig().requests)
    ap.add_argument(
        "--calibration-images",
        default=",".join(map(str, CalibrationConfig().images)),
        help="image counts of the calibration's image runs (fewer: a shorter calibration of a large model)",
    )
    ap.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    ap.add_argument("--samples", default=None, help="fit the profile to a calibration's samples (--save-samples)")
    ap.add_argument("--save-samples", default=None, help="write the calibration's samples here, to fit again")
    ap.add_argument("--measure", default=None, help="topologies to measure, comma-separated")
    ap.add_argument("--workload", action="append", default=[], help="e.g. images=10,out=16,rate=8 (repeatable)")
    ap.add_argument("--slo", default="", help="goodput SLO, e.g. ttft=500ms")
    ap.add_argument("--requests", type=int, default=48, help="measured requests per workload and topology")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--cores", type=int, default=0, help="cores to plan on (default: the profile's machine)")
    ap.add_argument("--model", default=None, help="checkpoint (default: embedded)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="of every encoder and language model")
    ap.add_argument("--sweep", action="append", default=[], help="also predict every cell of this sweep.json")
    ap.add_argument(
        "--vs-vllm", action="append", default=[], help="also predict every epdserve cell of this vs_vllm.py --json"
    )
    ap.add_argument(
        "--lend-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="roles lend each other idle cores when started (calibration measures the speed-up) and predicted",
    )
    ap.add_argument("--log-dir", default="bench-results/plan/logs")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()

    def say(text: str) -> None:
        print(f"[validate] {text}", file=sys.stderr, flush=True)

    if sum(x is not None for x in (args.profile, args.samples, args.calibrate_topologies)) != 1:
        ap.error("give one of --profile, --samples or --calibrate-topologies")
    if args.profile:
        profile = load_profile(Path(args.profile))
    elif args.samples:
        profile = refit(load_samples(Path(args.samples)), args.samples)
    else:
        # images are calibrated at every side the checks will send, as well as the defaults: an
        # unmeasured side would be predicted with the token count of the nearest measured one
        wanted = {
            *CalibrationConfig().image_sides,
            *(parse_workload(w, SLO()).workload.image_size for w in args.workload),
        }
        wanted |= {json.loads(Path(f).read_text())["config"].get("image_size", 0) for f in args.sweep}
        wanted |= {json.loads(Path(f).read_text())["args"]["image_size"] for f in args.vs_vllm}
        calibration = CalibrationConfig(
            requests=args.calibration_requests,
            images=tuple(int(n) for n in args.calibration_images.split(",")),
            image_sides=tuple(sorted(wanted)),
        )
        profile = calibrate_topologies(
            calibration,
            list(parse_topologies(args.calibrate_topologies)),
            args.model,
            Path(args.log_dir) / "calibration",
            say,
            args.dtype,
            lending=args.lend_cores,
            samples_out=Path(args.save_samples) if args.save_samples else None,
        )
        if args.save_profile:
            say(f"wrote {save_profile(profile, Path(args.save_profile))}")
    slo = SLO.parse(args.slo)
    env = Environment.capture(shlex.join(["python", *sys.argv]))
    blocks = [
        f"`{env.command}`",
        f"run {env.date} on {env.nproc} × {env.cpu_model} ({env.ram_gib:.0f} GiB), commit {env.commit}",
        f"profile: {profile.source} ({profile.nproc} CPUs, {profile.cpu_model})",
    ]
    if args.measure:
        loads = [parse_workload(w, slo) for w in args.workload] or [parse_workload("images=4,out=16,conc=4", slo)]
        rows = measure(profile, list(parse_topologies(args.measure)), loads, args)
        blocks += [f"### Measured now, {args.requests} requests per row", table(rows, bool(slo.given))]
    for path in args.sweep:
        rows, where = from_sweep(profile, Path(path), args.cores)
        blocks += [
            f"### {path} ({where})",
            table(rows, any(r.measured and r.measured.goodput is not None for r in rows)),
        ]
    for path in args.vs_vllm:
        blocks += [f"### {path}", from_vs_vllm(profile, Path(path), args.cores)]
    text = "\n\n".join(blocks)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
