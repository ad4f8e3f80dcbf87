"""``GET /health``: whether a role serves, and which role it is.

Every epdserve role names itself in its answer (``encoder``, ``pd``, ``prefill``, ``decode``,
``router``), so whoever probes an address can tell the role it expects from another one that holds
that address: a port taken by the wrong process is then a failed probe, not a healthy worker
that answers every request with 404. Servers that name no role (vLLM, whose ``/health`` has an
empty body) are taken at their status alone.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

MAX_HEALTH_BYTES: Final = 4096  # more than any role's answer: a longer body names no role


class _Named(msgspec.Struct):
    role: str | None = None


def health_body(role: str, **details: Any) -> dict[str, Any]:
    """The JSON object a healthy ``role`` answers with (``details``: what it adds, e.g. counts)."""
    return {"status": "ok", "role": role, **details}


def named_role(body: bytes) -> str | None:
    """The role a ``/health`` answer names; None when it names none or cannot be read (it comes
    from whatever holds the address: never trusted to parse)."""
    if len(body) > MAX_HEALTH_BYTES:
        return None
    try:
        return msgspec.json.decode(body, type=_Named).role
    except msgspec.DecodeError:
        return None


def is_other_role(body: bytes, expected: str) -> str | None:
    """The role a ``/health`` answer names when it is not ``expected``; None when it is, or names none."""
    named = named_role(body)
    return named if named is not None and named != expected else None
