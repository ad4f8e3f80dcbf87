"""The oracle tests' requests, and driving an in-process engine core through them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from epdserve.engine.core import EngineCore
from epdserve.engine.request import Request
from epdserve.shapes import ShapesWorld, render_images


def drain(eng: EngineCore) -> dict[str, list[int]]:
    """Step ``eng`` until it has no work; every request's tokens (no request may fail)."""
    out: dict[str, list[int]] = {}
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def assert_alone_then_batched(
    eng: EngineCore, requests: Callable[[str], Iterable[Request]], expected: dict[str, list[int]]
) -> None:
    """``requests(suffix)`` gives the requests with ids ``name + suffix``: each one alone, then all
    at once (chunked prefill splits the longer prompts), must give ``expected[name]``; the block
    manager is consistent after."""
    for req in requests(""):
        eng.add_request(req)
        assert drain(eng)[req.request_id] == expected[req.request_id], req.request_id
    for req in requests("#b"):
        eng.add_request(req)
    got = drain(eng)
    for name in expected:
        assert got[name + "#b"] == expected[name], name
    eng.scheduler.blocks.check_integrity()


def cases() -> list[tuple[str, list[dict], list, list]]:
    """(name, chat messages with bare image/video parts, images, videos): text, one image, images
    of different sizes, a video, an image and a video."""
    w = ShapesWorld(99)
    one = w.sample("describe")
    multi = w.sample("describe_nth")
    while len({(sc.width, sc.height) for sc in multi.scenes}) < 2:
        multi = w.sample("describe_nth")
    vid = w.sample("direction")

    def msg(media: list[str], q: str) -> list[dict]:
        return [{"role": "user", "content": [*({"type": m} for m in media), {"type": "text", "text": q}]}]

    return [
        ("text", [{"role": "user", "content": "Describe the image."}], [], []),
        ("image", msg(["image"], one.question), render_images(one), []),
        ("images", msg(["image"] * len(multi.scenes), multi.question), render_images(multi), []),
        ("video", msg(["video"], vid.question), [], [vid.frames]),
        ("image+video", msg(["image", "video"], "Describe the image."), render_images(one), [vid.frames]),
    ]
