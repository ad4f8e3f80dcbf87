"""matplotlib for the benchmark figures: an optional dependency (the ``plot`` extra), imported only
when a figure is drawn, so serving never needs it."""

from __future__ import annotations

import importlib.util
from typing import Any

INSTALL_HINT = "figures need matplotlib: pip install 'epdserve[plot]'"


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_plotting() -> None:
    """Raise ``PlottingUnavailable`` now, before a long run, rather than when its figures are drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlottingUnavailable(INSTALL_HINT)


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (no display: works headless)."""
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
