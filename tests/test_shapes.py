"""The shapes world follows the spec in issue 2 exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest

from epdserve.shapes import (
    COLORS,
    DIRECTIONS,
    ORDINALS,
    QUESTION_KIND,
    SIDES,
    ShapesWorld,
    render_images,
)

OBJECT = r"a (red|green|blue|yellow) (circle|square|triangle)"
LOCATION = r"(on the left|on the right|at the top|at the bottom)"
DESCRIPTION = re.compile(rf"^{OBJECT} {LOCATION}( and {OBJECT} {LOCATION})?$")


def test_same_seed_same_stream_different_seed_differs() -> None:
    w1, w2, w3 = ShapesWorld(3), ShapesWorld(3), ShapesWorld(4)
    a = [w1.sample() for _ in range(20)]
    assert a == [w2.sample() for _ in range(20)]
    assert a != [w3.sample() for _ in range(20)]


def test_image_geometry_background_and_colors() -> None:
    world = ShapesWorld(11)
    for _ in range(200):
        sc = world.scene()
        assert sc.width in SIDES and sc.height in SIDES
        assert 235 <= sc.background <= 255
        assert len(sc.shapes) in (1, 2)
        img = np.asarray(sc.render())
        assert img.shape == (sc.height, sc.width, 3)
        assert tuple(img[0, 0]) == (sc.background,) * 3
        for s in sc.shapes:
            base = COLORS[s.color]
            assert all(abs(c - b) <= 20 for c, b in zip(s.rgb, base, strict=True))
            assert 0.28 * min(sc.width, sc.height) <= s.size <= 0.38 * min(sc.width, sc.height)
            fx, fy = {"left": (0.27, 0.5), "right": (0.73, 0.5), "top": (0.5, 0.27), "bottom": (0.5, 0.73)}[s.location]
            assert abs(s.cx / sc.width - fx) <= 0.04 + 1e-9 and abs(s.cy / sc.height - fy) <= 0.04 + 1e-9
            # the centre pixel has the shape's colour (a triangle's centroid is inside it too)
            y = int(s.cy + (s.size / 6 if s.kind == "triangle" else 0))
            assert tuple(img[y, int(s.cx)]) == s.rgb
        if len(sc.shapes) == 2:
            locs = tuple(s.location for s in sc.shapes)
            assert locs in (("left", "right"), ("top", "bottom"))


def test_questions_and_exact_answers() -> None:
    world = ShapesWorld(5)
    for q in QUESTION_KIND:
        for _ in range(40):
            s = world.sample(q)
            assert s.qtype == q and s.kind == QUESTION_KIND[q]
            assert s.answer == s.answer.lower() and not s.answer.endswith(".")
            if q == "describe":
                assert s.question == "Describe the image." and DESCRIPTION.match(s.answer)
                assert s.answer == s.scenes[0].description
            elif q == "shape":
                assert s.question == "What shape is this?" and re.fullmatch(r"a (circle|square|triangle)", s.answer)
            elif q == "color":
                assert s.question == "What color is the shape?" and s.answer in COLORS
            elif q == "where":
                assert s.question == "Where is the shape?" and re.fullmatch(LOCATION, s.answer)
            elif q == "count":
                assert s.answer == ("one", "two")[len(s.scenes[0].shapes) - 1]
            elif q == "what_at":
                assert re.fullmatch(rf"What is {LOCATION}\?", s.question) and re.fullmatch(OBJECT, s.answer)
                assert len(s.scenes[0].shapes) == 2
            elif q == "where_is":
                m = re.fullmatch(r"Where is the (\w+) (\w+)\?", s.question)
                assert m and re.fullmatch(LOCATION, s.answer)
                holders = [x for x in s.scenes[0].shapes if (x.color, x.kind) == m.groups()]
                assert len(holders) == 1  # unambiguous
            elif q == "describe_nth":
                assert 2 <= len(s.scenes) <= 4
                i = ORDINALS.index(s.question.split()[2])
                assert s.answer == s.scenes[i].description
            elif q == "which_image":
                m = re.fullmatch(r"Which image has the (\w+) (\w+)\?", s.question)
                assert m and 2 <= len(s.scenes) <= 4
                holders = [i for i, sc in enumerate(s.scenes) if sc.has(*m.groups())]
                assert len(holders) == 1 and s.answer == f"the {ORDINALS[holders[0]]}"
            elif q == "direction":
                assert s.question == "Which way does the shape move?" and s.answer in DIRECTIONS.values()
            elif q == "moving_shape":
                assert s.question == "What shape is moving?" and re.fullmatch(r"a (circle|square|triangle)", s.answer)


def test_two_shape_description_order() -> None:
    world = ShapesWorld(8)
    for _ in range(100):
        sc = world.scene(2)
        a, b = sc.shapes
        assert (a.location, b.location) in (("left", "right"), ("top", "bottom"))
        assert sc.description == f"{a.phrase} {_loc(a.location)} and {b.phrase} {_loc(b.location)}"


def _loc(loc: str) -> str:
    return {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}[loc]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_video_motion(seed: int) -> None:
    world = ShapesWorld(seed)
    for _ in range(50):
        v = world.video()
        frames = v.frames()
        assert len(frames) == 4 and all(f.size == (v.side, v.side) for f in frames)
        assert v.side in SIDES and 0.28 * v.side <= v.size <= 0.38 * v.side
        axis = 0 if v.direction in ("left", "right") else 1
        pos = [c[axis] for c in v.centers]
        other = [c[1 - axis] for c in v.centers]
        assert all(o == v.side / 2 for o in other)  # along the middle line
        steps = np.diff(pos)
        sign = 1 if v.direction in ("right", "down") else -1
        assert all(0.20 * v.side - 1e-9 <= sign * d <= 0.25 * v.side + 1e-9 for d in steps)
        start = pos[0] if sign > 0 else v.side - pos[0]
        assert v.size / 2 + 1 - 1e-9 <= start <= v.size / 2 + 2 + 1e-9
        # the shape's colour is where the centre says it is in every frame
        for f, (cx, cy) in zip(frames, v.centers, strict=True):
            y = cy + (v.size / 6 if v.kind == "triangle" else 0)
            if 0 <= cx < v.side and 0 <= y < v.side:
                assert np.asarray(f)[int(y), int(cx)].tolist() == list(v.rgb)


def test_render_images_counts() -> None:
    world = ShapesWorld(0)
    assert len(render_images(world.sample("describe_nth"))) >= 2
    assert render_images(world.sample("direction")) == []
