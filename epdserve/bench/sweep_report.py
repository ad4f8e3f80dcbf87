"""A sweep as files: report.md, sweep.json and gain heatmaps of each EPD topology over aggregated.

Gain is ``(aggregated − EPD) / aggregated`` in percent of a latency's p50 for the same cell:
positive means EPD is faster. It is left out (n/a) where either side has failed requests, because
the latencies of the requests that survived do not describe the workload.

    out/report.md             machine, commit, command, date, per-cell tables, embedded figures
    out/sweep.json            config, environment and every cell's full summary
    out/<metric>_gain_<t>.png images per request (rows) × output length (columns), one per EPD topology
    out/mixed_ttft.png        text vs image TTFT per topology under 50:50 traffic
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdserve.bench.plots import pyplot
from epdserve.bench.report import Summary
from epdserve.bench.sweep import Cell, CellResult, SweepConfig, SweepResult

AGGREGATED = "aggregated"
GAIN_METRICS = {"ttft": "TTFT p50", "e2e": "E2E p50"}  # latency -> its label; gains compare p50s
CLIENT_BUSY = 0.8  # client CPU per wall second above which the client may have slowed the numbers


def gain_percent(aggregated: float, epd: float) -> float | None:
    """``(aggregated − epd) / aggregated`` in %, positive when EPD is faster; None without a baseline."""
    if not aggregated > 0:
        return None
    return 100.0 * (aggregated - epd) / aggregated


@dataclass(frozen=True)
class GainGrid:
    """One latency's gain of one EPD topology over aggregated on the images × output-length grid."""

    topology: str  # the EPD topology, e.g. "1e+1pd"
    metric: str  # "ttft" or "e2e" (their p50)
    images: tuple[int, ...]  # rows: images per request
    output_lens: tuple[int, ...]  # columns: output tokens per request
    values: tuple[tuple[float | None, ...], ...]  # gain in % by [row][column]; None where not measured cleanly

    @property
    def label(self) -> str:
        return f"{GAIN_METRICS[self.metric]} gain of {self.topology} over {AGGREGATED}"


def cell_gain(base: CellResult | None, epd: CellResult | None, metric: str) -> float | None:
    """The gain of one cell, or None unless both sides completed every request."""
    if base is None or epd is None or not (base.clean and epd.clean):
        return None
    return gain_percent(getattr(base.summary, metric).p50, getattr(epd.summary, metric).p50)


def gain_grids(result: SweepResult) -> list[GainGrid]:
    """Every EPD topology's TTFT and E2E gain grids; none when aggregated was not part of the sweep."""
    c = result.config
    if AGGREGATED not in c.topologies:
        return []
    grids = []
    for topo in (t for t in c.topologies if t != AGGREGATED):
        for metric in GAIN_METRICS:
            values = tuple(
                tuple(
                    cell_gain(result.get(AGGREGATED, Cell(i, o)), result.get(topo, Cell(i, o)), metric)
                    for o in c.output_lens
                )
                for i in c.images
            )
            grids.append(GainGrid(topo, metric, c.images, c.output_lens, values))
    return grids


# ---- figures ---------------------------------------------------------------------------------------


def plot_gain(grid: GainGrid, path: Path) -> Path:
    """A heatmap in the form of NVIDIA Dynamo's EPD figures: diverging colours centred at 0, numbers in the cells."""
    import numpy as np

    plt = pyplot()
    data = np.array([[math.nan if v is None else v for v in row] for row in grid.values], dtype=float)
    finite = np.abs(data[np.isfinite(data)])
    # symmetric limits keep 0 at the colormap's neutral middle whatever the spread
    limit = max(10.0, float(finite.max())) if finite.size else 10.0
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")  # n/a cells in grey
    # wide enough for the title even with a single column
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(grid.output_lens) + 2.5), 0.9 * len(grid.images) + 1.8))
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    for r, row in enumerate(grid.values):
        for col, v in enumerate(row):
            text = "n/a" if v is None else f"{v:+.1f}%"
            strong = v is not None and abs(v) > 0.6 * limit  # dark ends of the colormap need light text
            ax.text(col, r, text, ha="center", va="center", fontsize=10, color="white" if strong else "black")
    ax.set_xticks(range(len(grid.output_lens)), [str(o) for o in grid.output_lens])
    ax.set_yticks(range(len(grid.images)), [str(i) for i in grid.images])
    ax.set(xlabel="output tokens per request", ylabel="images per request", title=grid.label)
    fig.colorbar(im, ax=ax, label="gain % (positive: EPD faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def mixed_cells(result: SweepResult) -> list[Cell]:
    return [c for c in result.config.cells if c.mixed]


def plot_mixed(result: SweepResult, path: Path) -> Path:
    """Text and image TTFT (bars: p50, ticks: p99) per topology, one panel per images value."""
    plt = pyplot()
    cells = mixed_cells(result)
    topologies = result.config.topologies
    fig, axes = plt.subplots(1, len(cells), figsize=(2.2 * len(topologies) * len(cells) + 1.5, 4), squeeze=False)
    width = 0.38
    for ax, cell in zip(axes[0], cells, strict=True):
        for k, (kind, colour) in enumerate((("text", "tab:blue"), ("image", "tab:orange"))):
            xs, p50, p99 = [], [], []
            for x, topo in enumerate(topologies):
                r = result.get(topo, cell)
                s = r.per_kind.get(kind) if r is not None else None
                if s is not None and s.completed:
                    xs.append(x + (k - 0.5) * width)
                    p50.append(1e3 * s.ttft.p50)
                    p99.append(1e3 * s.ttft.p99)
            ax.bar(xs, p50, width, color=colour, label=f"{kind} p50")
            ax.scatter(xs, p99, marker="_", s=300, color="black", label="p99" if k else None, zorder=3)
        ax.set_xticks(range(len(topologies)), list(topologies))
        ax.set_xlim(-0.6, len(topologies) - 0.4)  # the same slots whether or not every bar is there
        ax.set(ylabel="TTFT (ms)", title=f"50:50 text/image, {cell.images} img, {cell.output_len} tok")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- text ------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _stat(s: Summary | None, metric: str, stat: str) -> str:
    """One latency statistic in ms; "–" where the kind has no completed request."""
    return "–" if s is None or not s.completed else _ms(getattr(getattr(s, metric), stat))


def _goodput(s: Summary) -> str:
    return "–" if s.goodput is None else f"{s.goodput:.2f}"


def _status(r: CellResult) -> str:
    """ok/sent, with why it is not clean."""
    s = r.summary
    if r.error:
        return f"not run: {r.error}"
    note = f" ⚠ {', '.join(f'{k}: {v}' for k, v in s.errors.items())}" if s.errors else ""
    return f"{s.completed}/{s.requests}{note}" + (" (client busy)" if r.client_cpu_fraction > CLIENT_BUSY else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def file_stem(topology: str) -> str:
    """A topology name fit for file names and Markdown links ("1e+1pd" -> "1e_1pd")."""
    return topology.replace("+", "_")


def format_markdown(result: SweepResult, figures: dict[str, Path]) -> str:
    """The report; ``figures`` maps "<metric>:<topology>" and "mixed" to PNGs next to it."""
    c, env = result.config, result.environment
    lines = [
        "# epdserve sweep: when does EPD pay on this machine",
        "",
        f"- **Date:** {env.date}",
        f"- **Command:** `{env.command or '(library call)'}`",
        f"- **Commit:** `{env.commit}`",
        f"- **Duration:** {result.duration_s:.1f} s"
        + (" — **interrupted**, partial results" if result.interrupted else ""),
        "",
        "## Machine",
        "",
        *_table(
            ["nproc", "CPU", "RAM", "Python", "OS"],
            [[str(env.nproc), env.cpu_model, f"{env.ram_gib:.1f} GiB", env.python, env.platform]],
        ),
        "",
        "## Settings",
        "",
        f"- topologies: {', '.join(c.topologies)}; cores pinned: {_pinning(c)}; EC connector: {c.ec_connector}",
        f"- per cell: {c.requests} measured requests after {c.warmup} warm-up, {c.arrival}, seed {c.seed} "
        "(the same request bytes in every topology)",
        f"- images: {'spec sizes 84–168 px' if c.image_size == 0 else f'{c.image_size} px square'}; "
        f"text: {f'~{c.prompt_tokens} tokens per prompt' if c.prompt_tokens else 'the question only'}; "
        f"SLO for goodput: {c.slo}",
        f"- model: {c.model or 'embedded'}; extra PD flags: `{' '.join(c.pd_args) or 'none'}`",
        "- the load client runs on the same machine and shares its cores with the servers",
        "",
        "| topology | started in | cores | note |",
        "|---|---:|---|---|",
    ]
    for run in result.topologies:
        cores = "; ".join(f"{role}: {','.join(map(str, cpus))}" for role, cpus in run.cores.items()) or "all"
        if run.cores:
            cores += "; router: all"
        lines.append(f"| {run.topology} | {run.startup_s:.1f} s | {cores} | {run.error} |")

    grids = gain_grids(result)
    lines += ["", "## Gain of EPD over aggregated", ""]
    if not grids:
        lines.append("No gains: the sweep did not include `aggregated`.")
    else:
        lines += [
            "gain = (aggregated − EPD) / aggregated × 100 of the p50 latency in the same cell; "
            "**positive: EPD is faster**. n/a: a side had failed requests or did not run.",
            "",
        ]
    for g in grids:
        lines += [f"### {g.label}", ""]
        header = ["images \\ output tokens", *(str(o) for o in g.output_lens)]
        rows = [
            [str(i), *("n/a" if v is None else f"{v:+.1f}%" for v in row)]
            for i, row in zip(g.images, g.values, strict=True)
        ]
        lines += [*_table(header, rows), ""]
        key = f"{g.metric}:{g.topology}"
        if key in figures:
            lines += [f"![{g.label}]({figures[key].name})", ""]

    lines += ["## Results per cell", ""]
    header = ["images", "output", "topology", "ok/sent", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms"]
    header += ["E2E p50 ms", "goodput req/s"]
    rows = []
    for cell in (x for x in c.cells if not x.mixed):
        for topo in c.topologies:
            r = result.get(topo, cell)
            if r is None:
                continue
            s = r.summary
            rows.append(
                [
                    str(cell.images),
                    str(cell.output_len),
                    topo,
                    _status(r),
                    f"{s.request_throughput:.2f}",
                    _stat(s, "ttft", "p50"),
                    _stat(s, "ttft", "p99"),
                    _stat(s, "itl", "p99"),
                    _stat(s, "e2e", "p50"),
                    _goodput(s),
                ]
            )
    lines += _table(header, rows) if rows else ["No cell ran."]

    if mixed_cells(result):
        lines += [
            "",
            "## Mixed traffic: 50:50 text-only and image requests",
            "",
            f"Same arrivals ({c.arrival}); text requests carry no media, so any TTFT they lose "
            "is waiting behind image encoding.",
            "",
        ]
        header = ["images", "output", "topology", "ok/sent", "req/s", "text TTFT p50 ms", "text TTFT p99 ms"]
        header += ["image TTFT p50 ms", "image TTFT p99 ms", "text E2E p50 ms", "image E2E p50 ms", "goodput req/s"]
        rows = []
        for cell in mixed_cells(result):
            for topo in c.topologies:
                r = result.get(topo, cell)
                if r is None:
                    continue
                text, image = r.per_kind.get("text"), r.per_kind.get("image")
                rows.append(
                    [
                        str(cell.images),
                        str(cell.output_len),
                        topo,
                        _status(r),
                        f"{r.summary.request_throughput:.2f}",
                        _stat(text, "ttft", "p50"),
                        _stat(text, "ttft", "p99"),
                        _stat(image, "ttft", "p50"),
                        _stat(image, "ttft", "p99"),
                        _stat(text, "e2e", "p50"),
                        _stat(image, "e2e", "p50"),
                        _goodput(r.summary),
                    ]
                )
        lines += _table(header, rows) if rows else ["No mixed cell ran."]
        if "mixed" in figures:
            lines += ["", f"![text vs image TTFT under mixed traffic]({figures['mixed'].name})"]
    failures = [r for r in result.cells if r.error or r.first_failure]
    if failures:
        lines += ["", "## Failures", "", "The first error of each cell with failed requests:", ""]
        lines += [
            f"- {r.topology}, {r.cell.label}: `{' '.join((r.error or r.first_failure).split())}`" for r in failures
        ]
    return "\n".join(lines) + "\n"


# ---- files -----------------------------------------------------------------------------------------


def _summary_json(s: Summary) -> dict[str, Any]:
    return dataclasses.asdict(s)


def sweep_json(result: SweepResult) -> dict[str, Any]:
    """Config, environment, topologies, every cell's full summary (and per-kind summaries), and the gains."""
    return {
        "config": dataclasses.asdict(result.config),
        "environment": dataclasses.asdict(result.environment),
        "duration_s": result.duration_s,
        "interrupted": result.interrupted,
        "topologies": [dataclasses.asdict(t) for t in result.topologies],
        "cells": [
            {
                "topology": r.topology,
                "cell": dataclasses.asdict(r.cell),
                "clean": r.clean,
                "error": r.error,
                "client_cpu_fraction": r.client_cpu_fraction,
                "first_failure": r.first_failure,
                "summary": _summary_json(r.summary),
                "per_kind": {k: _summary_json(s) for k, s in r.per_kind.items()},
            }
            for r in result.cells
        ],
        "gains": [dataclasses.asdict(g) for g in gain_grids(result)],
    }


def write_report(result: SweepResult, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write report.md (first in the returned list), sweep.json and, with ``plots``, the figures
    into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Path] = {}
    for g in gain_grids(result) if plots else []:
        path = out_dir / f"{g.metric}_gain_{file_stem(g.topology)}.png"
        figures[f"{g.metric}:{g.topology}"] = plot_gain(g, path)
    if plots and any(r.cell.mixed for r in result.cells):
        figures["mixed"] = plot_mixed(result, out_dir / "mixed_ttft.png")
    data = out_dir / "sweep.json"
    data.write_text(json.dumps(sweep_json(result), indent=1, default=str))  # default: Path fields as text
    report = out_dir / "report.md"
    report.write_text(format_markdown(result, figures))
    return [report, data, *figures.values()]


def _pinning(c: SweepConfig) -> str:
    if not c.pin_cores:
        return "no"
    return "yes, idle cores lent" if c.lend_cores else "yes, each role on its own cores only"
