"""Content hashes of media items: the key of encoder caches and of multimodal prefix-cache blocks.

Two items get the same hash only if the same model would see the same pixels: the model identity,
modality, raw media bytes and the preprocessing settings all go into it. Every field is length
prefixed, so no two different inputs share a byte stream (``("ab", "c")`` vs ``("a", "bc")``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

_DOMAIN = b"epdserve.media_uuid.v1"  # bump when the encoding changes


def canonical_json(obj: Mapping[str, Any]) -> bytes:
    """Key-order independent JSON; NaN/inf and non-JSON types are refused (TypeError/ValueError)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def media_uuid(model_id: str, modality: str, data: bytes, processor_kwargs: Mapping[str, Any]) -> str:
    """Hex sha256 identifying ``data`` as ``modality`` input of ``model_id`` under ``processor_kwargs``."""
    h = hashlib.sha256()
    for field in (_DOMAIN, model_id.encode(), modality.encode(), data, canonical_json(processor_kwargs)):
        h.update(len(field).to_bytes(8, "big"))
        h.update(field)
    return h.hexdigest()
