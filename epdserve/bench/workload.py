"""Request payloads for benchmarks: shapes-world media as data URLs in OpenAI chat requests."""

from __future__ import annotations

import base64
import io

from PIL import Image


def image_data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_payload(model: str, question: str, images: list[Image.Image], out_len: int, exact: bool = True) -> dict:
    """A chat request with the images first, then the question; ``exact`` fixes the output length."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
        "max_tokens": out_len,
        "temperature": 0,
    }
    if exact:
        body.update(min_tokens=out_len, ignore_eos=True)
    return body
