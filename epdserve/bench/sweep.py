"""``epdserve sweep``: when does EPD pay on this machine — a workload grid run against each topology.

``run_sweep(SweepConfig)`` starts one topology at a time on this machine (``up.Deployment``), runs
one benchmark (``loadgen.run_bench``) per workload cell against it, stops it and moves on: one
deployment start per topology, not per cell. Every topology sees byte-identical requests (the
payloads depend only on the cell and the seed, and differ between cells so that no cell finds its
prompts or images cached by an earlier one), so the cells compare like with like.

    topologies:  aggregated          1e+1pd            2e+1pd           (1e+1p+1d, ...)
    grid cells:  images per request (rows) × output length (columns), plus 50:50 text/image cells
                 (``mixed``: one per images value, at the shortest output length)

The result (``SweepResult``) holds every cell's summary and where and when the sweep ran;
``sweep_report.write_report`` turns it into report.md, sweep.json and heatmaps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO, TypedDict

from epdserve.bench.client import as_operator
from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import SLO, BenchConfig, Summary, summarize
from epdserve.bench.workload import MAX_IMAGES_PER_REQUEST, WorkloadConfig
from epdserve.common.dtypes import DType, check_dtype
from epdserve.config_flags import Flag, add_flags, field_doc, values
from epdserve.launcher import free_port
from epdserve.topology import Topology, plan_cores
from epdserve.transfer.config import CONNECTORS, Connector
from epdserve.up import Deployment

DEFAULT_TOPOLOGIES = ("aggregated", "1e+1pd", "2e+1pd")
MIXED_TEXT_FRACTION = 0.5  # the mixed cells' share of text-only requests
# every role that checks media (router, PD workers, the aggregated server) must accept the grid's largest image count
MEDIA_LIMIT_ARGS = ("--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES_PER_REQUEST, "video": 2}))


class RoleArgs(TypedDict):
    extra_encoder_args: list[str]
    extra_pd_args: list[str]
    extra_router_args: list[str]


def role_args(dtype: str, pd_args: tuple[str, ...] = ()) -> RoleArgs:
    """The extra flags of a harness's own deployment (``Deployment`` keywords): every model in
    ``dtype``, the PD workers and router taking as many media items as a workload sends."""
    return {
        "extra_encoder_args": ["--dtype", dtype],
        "extra_pd_args": [*MEDIA_LIMIT_ARGS, "--dtype", dtype, *pd_args],
        "extra_router_args": list(MEDIA_LIMIT_ARGS),
    }


# ---- configuration ---------------------------------------------------------------------------------


def parse_int_list(text: str, name: str, minimum: int = 1, maximum: int | None = None) -> tuple[int, ...]:
    """``"1,4,10"`` as ``(1, 4, 10)``: comma-separated, each within bounds, no repeats, order kept."""
    values: list[int] = []
    for item in (s.strip() for s in text.split(",")):
        try:
            v = int(item)
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not an integer (expected e.g. 1,4,10)") from None
        if v < minimum or (maximum is not None and v > maximum):
            bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
            raise ValueError(f"{name}: {v} is out of range ({bound})")
        if v in values:
            raise ValueError(f"{name}: {v} appears twice")
        values.append(v)
    return tuple(values)


def parse_topologies(text: str) -> tuple[str, ...]:
    """``"aggregated,1e+1pd"`` as canonical topology names (validated by ``Topology.parse``)."""
    names: list[str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name = topology_name(Topology.parse(item))
        if name in names:
            raise ValueError(f"topology {name} appears twice")
        names.append(name)
    if not names:
        raise ValueError("give at least one topology, e.g. aggregated,1e+1pd")
    return tuple(names)


def topology_name(t: Topology) -> str:
    if t.aggregated:
        return "aggregated"
    if t.split:
        return (f"{t.encoders}e+" if t.encoders else "") + f"{t.prefills}p+{t.decodes}d"
    return f"{t.encoders}e+{t.pds}pd"


@dataclass(frozen=True)
class Cell:
    """One workload of the sweep; the same cell sends the same bytes to every topology."""

    images: int  # images in each image request
    output_len: int  # output tokens of every request
    mixed: bool = False  # half the requests are text-only (kind "text"), the rest carry the images

    @property
    def label(self) -> str:
        return f"{'mixed ' if self.mixed else ''}{self.images} img × {self.output_len} tok"

    def workload(self, image_size: int, prompt_tokens: int = 0) -> WorkloadConfig:
        return WorkloadConfig(
            images_per_request=self.images,
            image_size=image_size,
            prompt_tokens=prompt_tokens,
            output_len=self.output_len,
            text_fraction=MIXED_TEXT_FRACTION if self.mixed else 0.0,
        )


@dataclass(frozen=True)
class SweepConfig:
    """Every knob of one sweep; ``run_sweep`` needs nothing else."""

    topologies: tuple[str, ...] = DEFAULT_TOPOLOGIES  # started in turn, each as 'epdserve up --topology' takes it
    images: tuple[int, ...] = (1, 4, 10)  # images per request: the grid's rows
    output_lens: tuple[int, ...] = (16, 64, 256)  # output tokens per request: the grid's columns
    image_size: int = 0  # side of every image in px (0: the generated shapes images' own sizes, 84 to 168 px)
    prompt_tokens: int = 0  # pad every prompt's text to about this many tokens (long prompts); 0: the question only
    requests: int = 16  # measured requests per cell and topology
    warmup: int = 2  # unmeasured requests before each cell
    concurrency: int = 4  # closed loop: requests in flight (unused when request_rate > 0)
    request_rate: float = 0.0  # open loop: Poisson arrivals in req/s; 0 means closed loop
    seed: int = 0  # fixes payloads and arrival times (the same in every topology)
    slo: SLO = field(default_factory=SLO)  # bounds for goodput; none set: no goodput
    mixed: bool = False  # also run 50:50 text/image cells, one per images value at the shortest output length
    model: str | None = None  # checkpoint directory (unset: the embedded model)
    dtype: DType = "float32"  # weights and activations of every encoder and language model
    pin_cores: bool = False  # pin roles to cores as 'epdserve up --pin-cores' does
    lend_cores: bool = True  # pinned: a computing encoder or engine also borrows idle roles' cores (as up does)
    ec_connector: Connector = "shm"  # how embeddings travel from encoders to PD workers
    pd_args: tuple[str, ...] = ()  # extra flags of every PD worker and of the aggregated server
    timeout_s: float = 600.0  # time allowed per request
    log_dir: Path | None = None  # each role's log goes to <log_dir>/<topology>/<role>.log; None: no logs
    command: str = ""  # the command line that asked for the sweep, quoted for a shell (for the report)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if not self.topologies:
            raise ValueError("give at least one topology")
        object.__setattr__(self, "topologies", tuple(topology_name(Topology.parse(t)) for t in self.topologies))
        if len(set(self.topologies)) != len(self.topologies):
            raise ValueError(f"a topology appears twice in {self.topologies}")
        if not self.images or not self.output_lens:
            raise ValueError("the grid needs at least one images value and one output length")
        if self.request_rate == 0 and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.ec_connector not in CONNECTORS:
            raise ValueError(f"ec_connector must be one of {', '.join(CONNECTORS)}, got {self.ec_connector!r}")
        for cell in self.cells:  # the benchmark's own checks: images 0..50, output_len >= 1, counts, rate
            self.bench(cell, "http://127.0.0.1:1")

    @property
    def cells(self) -> tuple[Cell, ...]:
        """The grid row by row, then the mixed cells."""
        grid = [Cell(i, o) for i in self.images for o in self.output_lens]
        mixed = [Cell(i, min(self.output_lens), mixed=True) for i in self.images] if self.mixed else []
        return (*grid, *mixed)

    @property
    def arrival(self) -> str:
        """How requests arrive, in words."""
        return f"Poisson {self.request_rate:g} req/s" if self.request_rate > 0 else f"concurrency {self.concurrency}"

    def cell_seed(self, cell: Cell) -> int:
        """The payload seed of one cell: the same in every topology, different in every cell, so
        no cell is served from the prefix or encoder caches a previous cell filled (a cell's
        warm-up uses seed + 1)."""
        return self.seed + 100 * (self.cells.index(cell) + 1)

    def bench(self, cell: Cell, url: str) -> BenchConfig:
        """The benchmark of one cell against the deployment at ``url``."""
        return BenchConfig(
            url=url,
            workload=cell.workload(self.image_size, self.prompt_tokens),
            num_requests=self.requests,
            warmup=self.warmup,
            concurrency=max(1, self.concurrency),
            request_rate=self.request_rate,
            seed=self.cell_seed(cell),
            slo=self.slo,
            timeout_s=self.timeout_s,
        )


# ---- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """Where and when a sweep ran: the report's header."""

    nproc: int  # CPUs this process may use (what ``nproc`` prints)
    cpu_model: str  # "model name" of /proc/cpuinfo (the architecture where it has none)
    ram_gib: float  # MemTotal of /proc/meminfo in GiB (0 when unknown)
    commit: str  # ``git rev-parse --short HEAD`` of the code, "-dirty" with uncommitted changes; "unknown" outside git
    command: str  # the command line of the sweep
    date: str  # local start time, ISO 8601 with UTC offset
    python: str  # Python version
    platform: str  # OS and kernel

    @classmethod
    def capture(cls, command: str) -> Environment:
        return cls(
            nproc=len(os.sched_getaffinity(0)),
            cpu_model=_cpu_model(),
            ram_gib=_ram_gib(),
            commit=git_commit(Path(__file__).resolve().parent),
            command=command,
            date=datetime.now().astimezone().isoformat(timespec="seconds"),
            python=platform.python_version(),
            platform=platform.platform(),
        )


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def _ram_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)  # the value is in kB
    return 0.0


def git_commit(directory: Path) -> str:
    """Short commit of the checkout holding ``directory``; "-dirty" when tracked files changed (as ``git describe --dirty``)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


@dataclass(frozen=True)
class TopologyRun:
    """One topology's deployment during the sweep."""

    topology: str  # canonical name, e.g. "1e+1pd"
    startup_s: float  # seconds until every role answered /health (0 when it did not start)
    cores: dict[str, list[int]]  # role -> CPUs it was pinned to; roles not listed (router, aggregated) use all
    error: str = ""  # why it did not start or its cells were cut short; "" when all went well


@dataclass(frozen=True)
class CellResult:
    """One cell measured against one topology."""

    topology: str  # canonical topology name
    cell: Cell  # the workload
    summary: Summary  # all measured requests
    per_kind: dict[str, Summary]  # "text" and "image" summaries of mixed cells; empty otherwise
    client_cpu_fraction: float  # the load client's CPU per wall second (near 1: the client limits the numbers)
    error: str = ""  # why the benchmark could not run at all; "" when it ran (request errors are in summary)
    first_failure: str = ""  # the first failed request's error text, shortened: why, without opening the logs

    @property
    def clean(self) -> bool:
        """Every request streamed to the end: only then do its latencies describe the workload."""
        return not self.error and self.summary.requests > 0 and self.summary.completed == self.summary.requests


@dataclass(frozen=True)
class SweepResult:
    """A finished (or interrupted) sweep."""

    config: SweepConfig  # what was asked
    environment: Environment  # where and when it ran
    topologies: tuple[TopologyRun, ...]  # in the order they ran
    cells: tuple[CellResult, ...]  # in the order they ran
    duration_s: float  # wall time of the whole sweep, starts and stops included
    interrupted: bool = False  # Ctrl-C / SIGTERM cut it short; the results hold what finished

    def get(self, topology: str, cell: Cell) -> CellResult | None:
        return next((c for c in self.cells if c.topology == topology and c.cell == cell), None)


# ---- running ---------------------------------------------------------------------------------------


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        progress.write(f"[sweep] {text}\n")
        progress.flush()


def _cell_line(r: CellResult) -> str:
    s = r.summary
    if r.error:
        return f"{r.topology:>10} {r.cell.label}: {r.error}"
    errors = f", errors {s.errors}" if s.errors else ""
    return (
        f"{r.topology:>10} {r.cell.label}: {s.completed}/{s.requests} ok, {s.request_throughput:.2f} req/s, "
        f"TTFT p50 {1e3 * s.ttft.p50:.1f} ms, E2E p50 {1e3 * s.e2e.p50:.1f} ms{errors}"
    )


def run_cell(config: SweepConfig, topology: str, cell: Cell, url: str) -> CellResult:
    """One benchmark of ``cell`` against the deployment at ``url``; a failure to run is recorded, not raised."""
    bench = config.bench(cell, url)
    try:
        res = asyncio.run(run_bench(bench))
    except RuntimeError as e:  # e.g. the deployment died and /v1/models is gone
        return CellResult(topology, cell, summarize([], 0.0, config.slo), {}, 0.0, error=str(e))
    failure = next((r.error or f"HTTP {r.status}" for r in res.results if not r.ok), "")
    return CellResult(topology, cell, res.summary, res.per_kind, res.cpu_fraction, first_failure=failure[:300])


def run_sweep(config: SweepConfig, progress: TextIO | None = None) -> SweepResult:
    """Each topology in turn: start it, run every cell, stop it. Ctrl-C stops the deployment and returns
    what finished (``interrupted``); a topology that fails to start is recorded and skipped."""
    env = Environment.capture(config.command)
    t0 = time.perf_counter()
    cores = sorted(os.sched_getaffinity(0))
    runs: list[TopologyRun] = []
    cells: list[CellResult] = []
    interrupted = False
    for name in config.topologies:
        topo = Topology.parse(name)
        plan = plan_cores(topo, cores).by_process() if config.pin_cores else {}
        deployment = Deployment(
            topo,
            config.model,
            port=free_port(),
            pin=config.pin_cores,
            lend_cores=config.lend_cores,
            ec_connector=config.ec_connector,
            log_dir=config.log_dir / name.replace("+", "_") if config.log_dir else None,
            **role_args(config.dtype, config.pd_args),
        )
        _say(progress, f"starting {name}")
        try:
            try:
                deployment.start()
            except (RuntimeError, TimeoutError, OSError) as e:
                _say(progress, f"{name} did not start: {e}")
                runs.append(TopologyRun(name, 0.0, plan, error=f"did not start: {e}"))
                continue
            _say(progress, f"{name} ready in {deployment.startup_s:.1f} s at {deployment.url}")
            with as_operator(deployment.cluster):  # told every stage's timing, the router's too
                for cell in config.cells:
                    result = run_cell(config, name, cell, deployment.url)
                    cells.append(result)
                    _say(progress, _cell_line(result))
            runs.append(TopologyRun(name, deployment.startup_s, plan))
        except KeyboardInterrupt:
            interrupted = True
            runs.append(TopologyRun(name, deployment.startup_s, plan, error="interrupted"))
            break
        finally:
            deployment.stop()
    return SweepResult(config, env, tuple(runs), tuple(cells), time.perf_counter() - t0, interrupted)


# ---- command line ----------------------------------------------------------------------------------


def command_line(argv: list[str]) -> str:
    """``argv`` as the shell command that was typed (``python -m epdserve.cli`` rather than the script path)."""
    prog = argv[0] if argv else "epdserve"
    head = ["python", "-m", "epdserve.cli"] if prog.endswith(os.path.join("epdserve", "cli.py")) else [prog]
    if Path(prog).name == "epdserve":
        head = ["epdserve"]
    return shlex.join([*head, *argv[1:]])


SWEEP_FLAGS = (
    "image_size",
    "prompt_tokens",
    "requests",
    "warmup",
    "seed",
    "mixed",
    "model",
    "dtype",
    "pin_cores",
    "lend_cores",
    "ec_connector",
    Flag("timeout_s", "--timeout"),
)
ARRIVAL_FLAGS = ("concurrency", "request_rate")  # one or the other


def add_cli_flags(s: argparse.ArgumentParser) -> None:
    """The flags of ``epdserve sweep``: ``SweepConfig`` fields, lists as comma-separated text."""
    d = SweepConfig()
    s.add_argument("--out", required=True, help="directory for report.md, sweep.json, the heatmaps and role logs")
    for name in ("topologies", "images", "output_lens"):
        default = ",".join(map(str, getattr(d, name)))
        help_text = f"{field_doc(SweepConfig, name)}, comma-separated (default: {default})"
        s.add_argument("--" + name.replace("_", "-"), default=None, help=help_text)
    add_flags(s, SweepConfig, SWEEP_FLAGS)
    add_flags(s.add_mutually_exclusive_group(), SweepConfig, ARRIVAL_FLAGS)
    s.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,e2e=2s (as in epdserve bench)")
    s.add_argument("--pd-args", default="", help="extra flags of every PD worker, e.g. --pd-args='--threads 1'")
    s.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """The ``SweepConfig`` of ``epdserve sweep`` flags (``add_cli_flags``)."""
    out = Path(args.out)
    lists: dict[str, Any] = {}
    if args.topologies is not None:
        lists["topologies"] = parse_topologies(args.topologies)
    if args.images is not None:
        lists["images"] = parse_int_list(args.images, "--images", 0, MAX_IMAGES_PER_REQUEST)
    if args.output_lens is not None:
        lists["output_lens"] = parse_int_list(args.output_lens, "--output-lens")
    return SweepConfig(
        **lists,
        **values(args, SWEEP_FLAGS),
        **values(args, ARRIVAL_FLAGS),
        slo=SLO.parse(args.slo or ""),
        pd_args=tuple(shlex.split(args.pd_args or "")),
        log_dir=out / "logs",
        command=command_line(sys.argv),
    )


__all__ = [
    "Cell",
    "CellResult",
    "Environment",
    "SweepConfig",
    "SweepResult",
    "TopologyRun",
    "parse_int_list",
    "parse_topologies",
    "run_sweep",
]
