"""``epdserve sweep`` as a command: run the grid (``sweep.py``), then write its report
(``sweep_report.py``, which reads the results ``sweep.py`` defines)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from epdserve.bench.plots import PlottingUnavailable, check_plotting
from epdserve.bench.sweep import config_from_args, run_sweep
from epdserve.bench.sweep_report import write_report


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM takes the Ctrl-C path so the running deployment is stopped and the report still written
    raise KeyboardInterrupt


def run_cli(args: argparse.Namespace) -> int:
    """``epdserve sweep``: run the grid, write the report, print where it is."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"epdserve sweep: error: {e}", file=sys.stderr)
        return 2
    try:
        check_plotting()  # the report's heatmaps are optional: said now, not after the sweep
        plots = True
    except PlottingUnavailable as e:
        print(f"epdserve sweep: the report will have tables and no heatmaps ({e})", file=sys.stderr)
        plots = False
    n = len(config.cells)
    print(
        f"epdserve sweep: {len(config.topologies)} topologies × {n} cells × {config.requests} requests "
        f"({config.arrival}) -> {args.out}",
        file=sys.stderr,
    )
    signal.signal(signal.SIGTERM, _interrupt)
    result = run_sweep(config, None if args.no_progress else sys.stderr)
    paths = write_report(result, Path(args.out), plots)
    print(f"wrote {paths[0]}" + (f" (+{len(paths) - 1} files)" if len(paths) > 1 else ""))
    if result.interrupted:
        return 130
    return 0 if result.cells and all(c.clean for c in result.cells) else 1
