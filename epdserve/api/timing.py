"""Per-request stage timing: where one request's time went, role by role.

A client asks for it with the request header ``X-EPD-Timing: 1`` (off by default) and gets the
standard ``Server-Timing`` response header: ``stage;dur=<ms>`` entries, e.g.::

    Server-Timing: router_encode;dur=41.2, encoder_queue;dur=0.3, encoder_compute;dur=28.1,
                   encoder_put;dur=0.4, pd_preprocess;dur=1.1, pd_fetch;dur=2.0, pd_queue;dur=0.2,
                   pd_prefill;dur=35.7, media;desc="1 computed"

Stages (each role prefixes its own):

- ``router_encode``: the router's wall time for the request's encode calls (0 when every item came
  from its directory or was skipped); ``router_decode``: with ``--frontend-decode``, the router's
  own fetch and decode of the slowest item (a part of ``router_encode``); ``encoder_fetch``,
  ``encoder_preprocess``, ``encoder_queue``, ``encoder_compute``, ``encoder_put``: the encoders'
  own report, the slowest item per stage;
  ``media``: how each item was obtained (computed, cache_hit, store_hit, directory, skipped);
- ``pd_`` (or ``prefill_``/``decode_``): ``preprocess`` (template, media decode), ``fetch``
  (embeddings, or KV, arriving through a connector), ``queue`` (in the engine core: the step
  running when it came, then ready and not admitted yet), ``prefill`` (admitted until the first
  token), and, for answers that are not streamed, ``decode``.

Streamed answers carry the stages known when their headers go out (up to the first token). The
same stages feed each role's ``*_stage_seconds{stage}`` histograms, timing asked for or not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TIMING_HEADER = "X-EPD-Timing"  # request header: "1" asks for Server-Timing in the response
SERVER_TIMING = "Server-Timing"
_ENTRY = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*((?:;[^,]*)?)")
_DUR = re.compile(r";\s*dur=([0-9.eE+-]+)")


def wanted(headers: Mapping[str, str]) -> bool:
    return headers.get(TIMING_HEADER, "").strip() in ("1", "true", "yes")


def server_timing(stages: Mapping[str, float], desc: Mapping[str, str] | None = None) -> str:
    """A ``Server-Timing`` value: ``stages`` in seconds (written in ms), ``desc`` as descriptions."""
    parts = [f"{name};dur={1e3 * s:.3f}" for name, s in stages.items()]
    parts += [f'{name};desc="{text}"' for name, text in (desc or {}).items()]
    return ", ".join(parts)


def parse_server_timing(value: str) -> dict[str, float]:
    """The ``dur`` entries of a ``Server-Timing`` value, in seconds (malformed entries skipped)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        m = _ENTRY.match(entry)
        if m is None:
            continue
        d = _DUR.search(m.group(2))
        if d is not None:
            try:
                out[m.group(1)] = float(d.group(1)) / 1e3
            except ValueError:
                continue
    return out


def prefixed(prefix: str, stages: Mapping[str, float]) -> dict[str, float]:
    return {f"{prefix}_{name}": s for name, s in stages.items()}
