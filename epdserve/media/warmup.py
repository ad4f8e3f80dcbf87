"""The image a role's warm-up sends through its own media path before it serves (``pd.warmup``,
``encoder.warmup``): small, inside every supported processor's bounds, made here (no file)."""

from __future__ import annotations

import base64
import io

from PIL import Image

WARMUP_IMAGE_SIDE = 112  # pixels: a few patches of every supported vision tower


def warmup_png(side: int = WARMUP_IMAGE_SIDE) -> bytes:
    """A ``side`` × ``side`` RGB gradient as PNG bytes."""
    img = Image.new("RGB", (side, side))
    img.putdata([(x * 255 // side, y * 255 // side, (x + y) * 127 // side) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def warmup_data_url() -> str:
    """``warmup_png`` as a ``data:`` URL, as a chat request carries it."""
    return "data:image/png;base64," + base64.b64encode(warmup_png()).decode()
