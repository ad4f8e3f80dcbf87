"""The shapes world: a seeded generator of images, videos, questions and exact answers.

This module is the specification, as code; tests, benchmarks, training and outside
checks all generate their data from it. Every draw goes through one ``random.Random`` so a seed
fixes the whole stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageDraw

SIDES = (84, 112, 140, 168)
SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
LOCATIONS: dict[str, tuple[float, float]] = {
    "left": (0.27, 0.5),
    "right": (0.73, 0.5),
    "top": (0.5, 0.27),
    "bottom": (0.5, 0.73),
}
LOCATION_PHRASE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
}
PAIRS = (("left", "right"), ("top", "bottom"))
ORDINALS = ("first", "second", "third", "fourth")
DIRECTIONS = {"right": "to the right", "left": "to the left", "down": "down", "up": "up"}
VIDEO_FRAMES = 4

Kind = Literal["image", "multi_image", "video"]

# Question types, grouped by media kind; the names are stable (reports, training mixes).
IMAGE_QUESTIONS = ("describe", "shape", "color", "where", "count", "what_at", "where_is")
MULTI_QUESTIONS = ("describe_nth", "which_image")
VIDEO_QUESTIONS = ("direction", "moving_shape")
QUESTION_KIND: dict[str, Kind] = {
    **{q: "image" for q in IMAGE_QUESTIONS},
    **{q: "multi_image" for q in MULTI_QUESTIONS},
    **{q: "video" for q in VIDEO_QUESTIONS},
}


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    rgb: tuple[int, int, int]
    size: float
    location: str
    cx: float
    cy: float

    @property
    def phrase(self) -> str:
        return f"a {self.color} {self.kind}"

    @property
    def description(self) -> str:
        return f"{self.phrase} {LOCATION_PHRASE[self.location]}"


def draw_shape(
    draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, size: float, rgb: tuple[int, int, int]
) -> None:
    h = size / 2
    if kind == "circle":
        draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=rgb)
    elif kind == "square":
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=rgb)
    elif kind == "triangle":
        draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=rgb)
    else:
        raise ValueError(f"unknown shape {kind!r}")


@dataclass(frozen=True)
class Scene:
    """One still image: 1 or 2 shapes on a gray background."""

    width: int
    height: int
    background: int
    shapes: tuple[Shape, ...]

    def render(self) -> Image.Image:
        img = Image.new("RGB", (self.width, self.height), (self.background,) * 3)
        draw = ImageDraw.Draw(img)
        for s in self.shapes:
            draw_shape(draw, s.kind, s.cx, s.cy, s.size, s.rgb)
        return img

    @property
    def description(self) -> str:
        # shapes are stored left before right, top before bottom
        return " and ".join(s.description for s in self.shapes)

    def has(self, color: str, kind: str) -> bool:
        return any(s.color == color and s.kind == kind for s in self.shapes)


@dataclass(frozen=True)
class Video:
    """Four frames of one shape moving along the middle line from one edge to the other."""

    side: int
    background: int
    kind: str
    color: str
    rgb: tuple[int, int, int]
    size: float
    direction: str
    centers: tuple[tuple[float, float], ...]

    def frames(self) -> list[Image.Image]:
        out = []
        for cx, cy in self.centers:
            img = Image.new("RGB", (self.side, self.side), (self.background,) * 3)
            draw_shape(ImageDraw.Draw(img), self.kind, cx, cy, self.size, self.rgb)
            out.append(img)
        return out


@dataclass(frozen=True)
class Sample:
    """A question about media with its exact answer."""

    kind: Kind
    qtype: str
    question: str
    answer: str
    scenes: tuple[Scene, ...] = ()
    video: Video | None = None

    @property
    def frames(self) -> list[Image.Image]:
        return self.video.frames() if self.video is not None else []


class ShapesWorld:
    """Seeded generator following the spec exactly."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # ---- primitives -------------------------------------------------------------------------
    def _rgb(self, color: str) -> tuple[int, int, int]:
        r = self.rng
        return tuple(max(0, min(255, c + r.randint(-20, 20))) for c in COLORS[color])  # type: ignore[return-value]

    def _shape(
        self, width: int, height: int, location: str, kind: str | None = None, color: str | None = None
    ) -> Shape:
        r = self.rng
        kind = kind or r.choice(SHAPES)
        color = color or r.choice(list(COLORS))
        size = r.uniform(0.28, 0.38) * min(width, height)
        fx, fy = LOCATIONS[location]
        cx = (fx + r.uniform(-0.04, 0.04)) * width
        cy = (fy + r.uniform(-0.04, 0.04)) * height
        return Shape(kind, color, self._rgb(color), size, location, cx, cy)

    def scene(self, n_shapes: int | None = None) -> Scene:
        r = self.rng
        width, height = r.choice(SIDES), r.choice(SIDES)
        background = r.randint(235, 255)
        n = n_shapes or r.choice((1, 2))
        if n == 1:
            shapes: tuple[Shape, ...] = (self._shape(width, height, r.choice(list(LOCATIONS))),)
        else:
            pair = r.choice(PAIRS)
            shapes = tuple(self._shape(width, height, loc) for loc in pair)
        return Scene(width, height, background, shapes)

    def video(self) -> Video:
        r = self.rng
        side = r.choice(SIDES)
        background = r.randint(235, 255)
        kind, color = r.choice(SHAPES), r.choice(list(COLORS))
        size = r.uniform(0.28, 0.38) * side
        direction = r.choice(list(DIRECTIONS))
        start = size / 2 + r.choice((1, 2))
        step = r.uniform(0.20, 0.25) * side
        mid = side / 2
        centers = []
        for i in range(VIDEO_FRAMES):
            pos = start + i * step
            if direction == "right":
                centers.append((pos, mid))
            elif direction == "left":
                centers.append((side - pos, mid))
            elif direction == "down":
                centers.append((mid, pos))
            else:
                centers.append((mid, side - pos))
        return Video(side, background, kind, color, self._rgb(color), size, direction, tuple(centers))

    # ---- questions --------------------------------------------------------------------------
    def sample(self, qtype: str | None = None) -> Sample:
        """One question of the given type (or a uniformly chosen type)."""
        qtype = qtype or self.rng.choice(list(QUESTION_KIND))
        if qtype not in QUESTION_KIND:
            raise ValueError(f"unknown question type {qtype!r}")
        kind = QUESTION_KIND[qtype]
        if kind == "image":
            return self._image_question(qtype)
        if kind == "multi_image":
            return self._multi_question(qtype)
        return self._video_question(qtype)

    def _image_question(self, qtype: str) -> Sample:
        r = self.rng
        if qtype in ("shape", "color", "where"):
            scene = self.scene(1)
        elif qtype in ("what_at", "where_is"):
            scene = self.scene(2)
            while qtype == "where_is" and scene.shapes[0].phrase == scene.shapes[1].phrase:
                scene = self.scene(2)
        else:
            scene = self.scene()
        s0 = scene.shapes[0]
        if qtype == "describe":
            q, a = "Describe the image.", scene.description
        elif qtype == "shape":
            q, a = "What shape is this?", f"a {s0.kind}"
        elif qtype == "color":
            q, a = "What color is the shape?", s0.color
        elif qtype == "where":
            q, a = "Where is the shape?", LOCATION_PHRASE[s0.location]
        elif qtype == "count":
            q, a = "How many shapes are there?", ("one", "two")[len(scene.shapes) - 1]
        elif qtype == "what_at":
            s = r.choice(scene.shapes)
            q, a = f"What is {LOCATION_PHRASE[s.location]}?", s.phrase
        else:  # where_is
            s = r.choice(scene.shapes)
            q, a = f"Where is the {s.color} {s.kind}?", LOCATION_PHRASE[s.location]
        return Sample("image", qtype, q, a, scenes=(scene,))

    def _multi_question(self, qtype: str) -> Sample:
        r = self.rng
        n = r.randint(2, 4)
        if qtype == "describe_nth":
            scenes = tuple(self.scene() for _ in range(n))
            i = r.randrange(n)
            return Sample(
                "multi_image", qtype, f"Describe the {ORDINALS[i]} image.", scenes[i].description, scenes=scenes
            )
        return self.which_image(n)

    def which_image(self, n: int) -> Sample:
        """ "Which image has the <color> <shape>?" over ``n`` images, exactly one of which has it."""
        r = self.rng
        while True:
            scenes = tuple(self.scene() for _ in range(n))
            target = r.choice(r.choice(scenes).shapes)
            holders = [i for i, sc in enumerate(scenes) if sc.has(target.color, target.kind)]
            if len(holders) == 1:
                break
        return which_image_sample(scenes, target, holders[0])

    def _video_question(self, qtype: str) -> Sample:
        v = self.video()
        if qtype == "direction":
            q, a = "Which way does the shape move?", DIRECTIONS[v.direction]
        else:
            q, a = "What shape is moving?", f"a {v.kind}"
        return Sample("video", qtype, q, a, video=v)


def which_image_sample(scenes: tuple[Scene, ...], target: Shape, index: int) -> Sample:
    """ "Which image has the <color> <shape>?" asked of ``scenes``; ``target`` is in image ``index``."""
    q = f"Which image has the {target.color} {target.kind}?"
    return Sample("multi_image", "which_image", q, f"the {ORDINALS[index]}", scenes=scenes)


def which_image_target(sample: Sample) -> tuple[str, str]:
    """The (color, kind) a which_image ``sample`` asks for: the inverse of ``which_image_sample``."""
    color, kind = sample.question.removeprefix("Which image has the ").removesuffix("?").split()
    return color, kind


def render_images(sample: Sample) -> list[Image.Image]:
    """The still images of a sample, in order (empty for a video sample)."""
    return [sc.render() for sc in sample.scenes]
