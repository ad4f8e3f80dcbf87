"""The optional extras the tests use, and whether each loads here: a test of an extra skips, with
the reason, where its package is missing or cannot load its native libraries (Mooncake's wheel
needs the RDMA and NUMA libraries even over TCP)."""

from __future__ import annotations

import importlib

# the module a test imports -> the extra that installs it
EXTRAS = {"mooncake.store": "mooncake", "redis": "store", "opentelemetry.sdk": "tracing", "vllm": "vllm"}


def unavailable(module: str) -> str | None:
    """Why ``module`` cannot be imported here; None when it can."""
    try:
        importlib.import_module(module)
    except ImportError as e:  # not installed, or a compiled part whose shared libraries are missing
        return f"{module} does not load ({e}): pip install 'epdserve[{EXTRAS[module]}]'"
    return None
