"""Driving an in-process engine core in the oracle tests."""

from __future__ import annotations

from epdserve.engine.core import EngineCore


def drain(eng: EngineCore) -> dict[str, list[int]]:
    """Step ``eng`` until it has no work; every request's tokens (no request may fail)."""
    out: dict[str, list[int]] = {}
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out
