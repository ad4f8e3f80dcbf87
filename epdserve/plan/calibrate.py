"""A short calibration run: requests of known shape against a live deployment, timed stage by stage.

``calibrate_url(CalibrationConfig, url)`` sends, one at a time (nothing queues, so every stage
time is a cost), text requests plain and padded and image requests of a few counts and sizes, then
text requests with a longer answer at a few concurrencies (the decode step's growth with the
batch). Every request asks for ``X-EPD-Timing`` (the load client always does); the deployment's
path — aggregated, E+PD or E+P+D — is read from the stages it reports. ``calibrate_urls`` turns
the samples of one or more deployments into a ``Profile``; ``calibrate_topologies`` starts each
topology on this machine (pinned, as ``up --pin-cores``), calibrates it and stops it. Both can keep
their samples (``plan.record``), which ``refit`` fits again.

``profile_from_sweep`` fits a profile to the cells of an ``epdserve sweep`` instead: each cell's
mean stage times, its queueing stages taken out. Its cells ran loaded, so what load adds to a stage
beyond its queue (a prefill sharing steps with running decodes) stays in the costs; a calibration
is the sharper measurement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from epdserve.bench.client import RequestResult, as_operator
from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.sweep import _cpu_model, role_args
from epdserve.bench.workload import WorkloadConfig
from epdserve.common.dtypes import DType
from epdserve.launcher import free_port
from epdserve.plan.model import path_of
from epdserve.plan.profile import (
    PATHS,
    PathCosts,
    Profile,
    ProfileError,
    Sample,
    fit_path,
    fit_token_counts,
    lending_speedups,
)
from epdserve.plan.record import SampleRecord, save_samples
from epdserve.shapes import ShapesWorld
from epdserve.topology import Topology
from epdserve.up import Deployment


@dataclass(frozen=True)
class CalibrationConfig:
    """What a calibration run sends; a few dozen short requests per deployment."""

    images: tuple[int, ...] = (1, 4, 8)  # image counts of the unloaded image requests
    image_sides: tuple[int, ...] = (0, 224)  # image sides in px (0: the generator's own sizes, 84 to 168 px)
    padding: int = 96  # prompt tokens of the padded text requests (prefill's cost per token)
    output_len: int = 8  # output tokens of the unloaded requests
    decode_output_len: int = 48  # output tokens of the decode runs
    concurrencies: tuple[int, ...] = (1, 2, 4)  # closed-loop concurrencies of the decode runs
    requests: int = 4  # measured requests per unloaded cell (decode runs: this × concurrency)
    warmup: int = 1  # unmeasured requests before each cell
    seed: int = 0  # payload seed; each cell adds its own offset so no cell hits another's caches
    timeout_s: float = 120.0  # time allowed per request

    def __post_init__(self) -> None:
        if self.requests < 1 or not self.images or not self.image_sides or not self.concurrencies:
            raise ValueError("calibration needs requests >= 1, image counts, image sides and concurrencies")
        if min(self.concurrencies) < 1 or 0 in self.images:
            raise ValueError("concurrencies and image counts must be >= 1")
        if self.output_len < 1 or self.decode_output_len < 2:
            raise ValueError("output_len must be >= 1 and decode_output_len >= 2")

    def cells(self) -> list[tuple[WorkloadConfig, int]]:
        """(workload, concurrency) of every run, in the order they are sent."""
        quiet = [
            (WorkloadConfig(images_per_request=0, output_len=self.output_len), 1),
            (WorkloadConfig(images_per_request=0, prompt_tokens=self.padding, output_len=self.output_len), 1),
            *(
                (WorkloadConfig(images_per_request=n, image_size=side, output_len=self.output_len), 1)
                for side in self.image_sides
                for n in self.images
            ),
        ]
        decode = [
            (WorkloadConfig(images_per_request=0, output_len=self.decode_output_len), c) for c in self.concurrencies
        ]
        return [*quiet, *decode]

    def lending_cells(self) -> list[tuple[WorkloadConfig, int]]:
        """The runs repeated with idle roles lending their cores: the padded text requests, the image
        requests at the largest side and the decode run at concurrency 1."""
        side = max(self.image_sides)
        return [
            (w, c)
            for w, c in self.cells()
            if c == 1 and (w.prompt_tokens or w.image_size == side or w.output_len == self.decode_output_len)
        ]


def native_pixels(seed: int = 0, n: int = 64) -> float:
    """Mean pixels of the workload generator's own images (the size an image_size of 0 sends)."""
    world = ShapesWorld(seed)
    sizes = [world.scene().render().size for _ in range(n)]
    return sum(w * h for w, h in sizes) / n


def path_of_stages(stages: dict[str, float]) -> str:
    """The serving path a request's Server-Timing shows: prefill workers report ``prefill_*``,
    the router (in front of encoders) ``router_*``; an aggregated server only ``pd_*``."""
    if any(s.startswith("prefill_") for s in stages):
        return "split"
    if any(s.startswith(("router_", "encoder_")) for s in stages):
        return "epd"
    if any(s.startswith("pd_") for s in stages):
        return "aggregated"
    raise ProfileError("the deployment reported no stage timing (Server-Timing): is it an epdserve deployment?")


def samples_of_run(results: list[RequestResult], w: WorkloadConfig, concurrency: int, pixels: float) -> list[Sample]:
    """The successful requests of one run as samples (a failed request would fit nonsense)."""
    ok = [r for r in results if r.ok and r.e2e > 0]
    if len(ok) < len(results):
        bad = next(r for r in results if not r.ok)
        raise ProfileError(
            f"a calibration request failed ({bad.error or f'HTTP {bad.status}'}): fix the deployment first"
        )
    decoding = sum((r.e2e - r.ttft) / r.e2e for r in ok) / len(ok)
    media = [r for r in ok if r.kind == "image"]
    path = path_of_stages(media[0].stages if media else ok[0].stages) if ok else ""
    return [
        Sample(
            path=path,
            images=w.images_per_request if r.kind == "image" else 0,
            image_side=w.image_size,
            pixels=float(w.image_size**2) if w.image_size else pixels,
            padding=w.prompt_tokens,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            concurrency=concurrency,
            ttft_s=r.ttft,
            tpot_s=r.tpot,
            decode_batch=concurrency * decoding,
            stages=dict(r.stages),
        )
        for r in ok
    ]


def calibrate_url(
    config: CalibrationConfig,
    url: str,
    say: Callable[[str], None] = lambda s: None,
    cells: list[tuple[WorkloadConfig, int]] | None = None,
) -> list[Sample]:
    """Every calibration run (or those of ``cells``) against the deployment at ``url``, as samples
    of its path."""
    pixels = native_pixels(config.seed)
    samples: list[Sample] = []
    for i, (w, concurrency) in enumerate(config.cells()):
        if cells is not None and (w, concurrency) not in cells:
            continue  # (the seed stays that of the run's place in the full calibration)
        bench = BenchConfig(
            url=url.rstrip("/"),
            workload=w,
            num_requests=config.requests * concurrency,
            warmup=config.warmup,
            concurrency=concurrency,
            seed=config.seed + 100 * (i + 1),
            timeout_s=config.timeout_s,
        )
        res = asyncio.run(run_bench(bench))
        samples += samples_of_run(res.results, w, concurrency, pixels)
        s = res.summary
        say(
            f"{url}: {w.images_per_request} img × {w.image_size or 'own'} px, pad {w.prompt_tokens}, "
            f"{w.output_len} tok, concurrency {concurrency}: TTFT p50 {1e3 * s.ttft.p50:.1f} ms, "
            f"TPOT p50 {1e3 * s.tpot.p50:.2f} ms"
        )
    paths = {s.path for s in samples if s.images}
    if len(paths) != 1:
        raise ProfileError(f"{url}: image requests took more than one path ({', '.join(sorted(paths))})")
    path = paths.pop()
    return [Sample(**{**s.__dict__, "path": path}) for s in samples]  # text requests show no router stage


def fit_profile(
    samples: list[Sample], pixels: float, nproc: int, cpu_model: str, source: str, loaded: bool = False
) -> Profile:
    """The profile of samples (each path they took fitted on its own) on the machine named."""
    paths: dict[str, PathCosts] = {
        p: fit_path([s for s in samples if s.path == p], loaded=loaded)
        for p in PATHS
        if any(s.path == p for s in samples)
    }
    if not paths:
        raise ProfileError("no samples")
    text, extra, image_tokens = fit_token_counts(samples)
    return Profile(
        paths=paths,
        text_tokens=text,
        padded_extra_tokens=extra,
        image_tokens=image_tokens,
        native_pixels=pixels,
        nproc=nproc,
        cpu_model=cpu_model,
        source=source,
    )


def _here(source: str) -> str:
    """``source``, when, and how loaded this machine is: other work on it inflates every cost."""
    when = f"{datetime.now().astimezone().isoformat(timespec='seconds')}, load average {os.getloadavg()[0]:.1f}"
    return f"{source}, {when}"


def refit(record: SampleRecord, where: str = "") -> Profile:
    """The profile of a calibration's saved samples, fitted as this epdserve fits."""
    source = record.source + (f", fitted again from {where}" if where else "")
    profile = fit_profile(record.own, record.native_pixels, record.nproc, record.cpu_model, source)
    return with_lending(profile, record.own, record.lent)


def calibrate_urls(
    config: CalibrationConfig,
    urls: list[str],
    say: Callable[[str], None] = lambda s: None,
    samples_out: Path | None = None,
) -> Profile:
    samples = [s for url in urls for s in calibrate_url(config, url, say)]
    return _fitted(_record("calibration of " + ", ".join(urls), config, samples, []), samples_out, say)


def _record(source: str, config: CalibrationConfig, own: list[Sample], lent: list[Sample]) -> SampleRecord:
    """What a calibration on this machine measured."""
    return SampleRecord(
        _here(source), len(os.sched_getaffinity(0)), _cpu_model(), native_pixels(config.seed), own, lent
    )


def _fitted(record: SampleRecord, samples_out: Path | None, say: Callable[[str], None]) -> Profile:
    """The profile of ``record``, saved first to ``samples_out`` (a fit that fails loses nothing)."""
    if samples_out is not None:
        say(f"wrote {save_samples(record, samples_out)}")
    return refit(record)


def calibrate_topologies(
    config: CalibrationConfig,
    topologies: list[str],
    model: str | None = None,
    log_dir: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
    dtype: DType = "float32",
    lending: bool = True,
    samples_out: Path | None = None,
) -> Profile:
    """Start each topology on this machine in turn (roles pinned as ``up --pin-cores`` pins them,
    every model in ``dtype``), calibrate it, stop it. A topology of separate roles is then started
    again lending idle cores (``up``'s default) for ``lending_cells``, which give its path's
    ``lend_*_x`` speed-ups (``lending=False``: not measured, 1). Role logs go to ``log_dir``
    (default: a new temporary directory); the samples, before they are fitted, to ``samples_out``."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="epd-plan-"))
    say(f"role logs in {log_dir}")
    samples: list[Sample] = []
    lent: list[Sample] = []
    for name in topologies:
        topology = Topology.parse(name)
        # the model counts a role's own cores as its servers, at any load: costs come from roles
        # kept to their own cores, and lending is a speed-up measured apart
        for lend in (False, True) if lending and not topology.aggregated else (False,):
            deployment = Deployment(
                topology,
                model,
                port=free_port(),
                pin=True,
                lend_cores=lend,
                log_dir=log_dir / (name.replace("+", "_") + ("-lent" if lend else "")),
                **role_args(dtype),
            )
            say(f"starting {name}" + (", lending idle cores" if lend else ""))
            try:
                deployment.start()
                with as_operator(deployment.cluster):
                    if lend:
                        lent += calibrate_url(config, deployment.url, say, config.lending_cells())
                    else:
                        samples += calibrate_url(config, deployment.url, say)
            finally:
                deployment.stop()
    source = "calibration of " + ", ".join(topologies) + " started pinned"
    return _fitted(_record(source, config, samples, lent), samples_out, say)


def with_lending(profile: Profile, own: list[Sample], lent: list[Sample]) -> Profile:
    """``profile`` with the lending speed-ups of every path that ``lent`` measured."""
    paths = dict(profile.paths)
    for path in {s.path for s in lent}:
        speedups = lending_speedups([s for s in own if s.path == path], [s for s in lent if s.path == path])
        paths[path] = dataclasses.replace(
            paths[path],
            lend_encode_x=speedups["lend_encode_x"],
            lend_prefill_x=speedups["lend_prefill_x"],
            lend_decode_x=speedups["lend_decode_x"],
        )
    return dataclasses.replace(profile, paths=paths)


def samples_from_sweep(data: dict, pixels: float) -> list[Sample]:
    """One sample per clean, unmixed cell of a sweep (sweep.json): its mean request, stage times
    without their queues."""
    config = data["config"]
    rate, concurrency = config["request_rate"], config["concurrency"]
    out = []
    for cell in data["cells"]:
        if not cell["clean"] or cell["cell"]["mixed"]:
            continue  # a mixed cell's means blend text and image requests
        s = cell["summary"]
        stages = {name: st["mean"] for name, st in s.get("stages", {}).items()}
        if not stages:
            continue
        enc_queue = stages.get("encoder_queue", 0.0)
        if "router_encode" in stages:
            stages["router_encode"] = max(0.0, stages["router_encode"] - enc_queue)
        ttft, e2e = s["ttft"]["mean"], s["e2e"]["mean"]
        # requests decoding at once: closed loop, the clients' share of time in decode; open, Little's law
        batch = rate * (e2e - ttft) if rate > 0 else concurrency * (e2e - ttft) / e2e
        side = config.get("image_size", 0)
        n = s["completed"]
        out.append(
            Sample(
                path=path_of(Topology.parse(cell["topology"])),
                images=cell["cell"]["images"],
                image_side=side,
                pixels=float(side * side) if side else pixels,
                padding=config.get("prompt_tokens", 0),
                prompt_tokens=round(s["input_tokens"] / n),
                output_tokens=round(s["output_tokens"] / n),
                concurrency=0 if rate > 0 else concurrency,
                ttft_s=ttft - enc_queue,
                tpot_s=s["tpot"]["mean"],
                decode_batch=batch,
                stages=stages,
            )
        )
    return out


def profile_from_sweep(path: Path) -> Profile:
    """The profile of a sweep.json's cells (``samples_from_sweep``), per topology path it ran."""
    try:
        data = json.loads(path.read_text())
        env = data["environment"]
        samples = samples_from_sweep(data, native_pixels(data["config"].get("seed", 0)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProfileError(f"{path}: not a readable sweep.json ({type(e).__name__}: {e})") from None
    if not samples:
        raise ProfileError(
            f"{path}: no clean cell with stage timing (sweeps before the client recorded Server-Timing have "
            "none); calibrate instead: epdserve plan --calibrate-topologies aggregated,1e+1pd"
        )
    return fit_profile(
        samples,
        native_pixels(data["config"].get("seed", 0)),
        int(env["nproc"]),
        str(env["cpu_model"]),
        f"sweep {path} (run {env['date']} at commit {env['commit']})",
        loaded=True,
    )
