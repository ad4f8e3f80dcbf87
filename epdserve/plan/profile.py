"""A profile: what each stage of a request costs on this hardware, fitted from measured requests.

One ``PathCosts`` per serving path the profile has seen:

    aggregated   one engine: media decode in its front end, the vision forward inside prefill
    epd          router → encoder(s) → EC connector → PD worker (prefill and decode in one engine)
    split        router → encoder(s) → prefill worker → KV connector → decode worker

Costs are linear in what the workload description fixes (images, pixels, prompt and output tokens,
decode batch) and are fitted by non-negative least squares to ``Sample``s (encode and prefill by
their relative errors): requests timed by the client and by the server's stage timing
(``api.timing``). Only requests of unloaded runs
(concurrency 1) give the stage costs, so that no queueing hides in them; the decode step's growth
with the batch comes from runs at several concurrencies.

Profiles are JSON with a ``version``; a file of another version, or one missing a field, is refused
with ``ProfileError`` rather than half read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

PROFILE_VERSION = 1
Path_ = Literal["aggregated", "epd", "split"]
PATHS: tuple[Path_, ...] = ("aggregated", "epd", "split")
MIN_SAMPLES = 3  # fewer unloaded requests than this cannot fit a path's costs
LEND_NOISE = 1.1  # a lending speed-up below this is within identical runs' spread: taken as none
RELATIVE_FLOOR_S = 1e-3  # a relative fit weighs a run no more than one taking this long
LENDING = ("lend_encode_x", "lend_prefill_x", "lend_decode_x")  # PathCosts' speed-ups (1 at least)


class ProfileError(ValueError):
    """A profile file that cannot be used (wrong version, missing fields), or too few samples to fit one."""


@dataclass(frozen=True)
class PathCosts:
    """What one request costs on one serving path, in seconds (every coefficient >= 0)."""

    encode_call_s: float  # per request with media: the encode round trip beyond its images' work (0: aggregated)
    encode_image_s: float  # per image on an encoder: fetch, decode, resize, vision forward, put
    encode_mpx_s: float  # per megapixel of image on an encoder (decode and resize grow with the pixels)
    prefill_s: float  # per request: the fixed part of prefill (admitted until the first token)
    prefill_token_s: float  # per prompt token (text and visual) in prefill
    prefill_media_s: float  # per request with images in prefill (placing embeddings, multimodal positions)
    prefill_image_s: float  # per image in prefill (aggregated: the vision forward runs inside prefill)
    overhead_s: float  # per request: latency to the first token outside encode, queue and prefill (HTTP, router, hops)
    overhead_image_s: float  # per image: latency outside those stages (media decode in a front end, embedding fetch)
    decode_step_s: float  # one decode step of the engine: its fixed part
    decode_seq_s: float  # one decode step: its growth per sequence in the batch
    samples: int  # requests the fit used
    ttft_rms_s: float  # root mean square error of the fit's TTFT on the unloaded requests
    # speed-ups of a role computing alone while every other role lends it its idle cores (pinned
    # deployments, ``up``'s default); 1: not calibrated, or nothing to gain
    lend_encode_x: float = 1.0  # an encoder's
    lend_prefill_x: float = 1.0  # a prefill's
    lend_decode_x: float = 1.0  # a decode step's
    # per megapixel of image in prefill (aggregated: the vision forward grows with the pixels, apart
    # from the language model's cost of the visual tokens); 0 in profiles made before it was fitted
    prefill_mpx_s: float = 0.0

    def encode(self, images: int, pixels: float) -> float:
        """Encoder work of one request with ``images`` images of ``pixels`` pixels each (0 without images)."""
        if images == 0:
            return 0.0
        return self.encode_call_s + images * (self.encode_image_s + self.encode_mpx_s * pixels / 1e6)

    def prefill(self, prompt_tokens: float, images: int, pixels: float) -> float:
        """Engine time of one request's prefill (``pixels``: per image)."""
        media = self.prefill_media_s if images else 0.0
        per_image = self.prefill_image_s + self.prefill_mpx_s * pixels / 1e6
        return self.prefill_s + self.prefill_token_s * prompt_tokens + media + per_image * images

    def overhead(self, images: int) -> float:
        return self.overhead_s + self.overhead_image_s * images

    def step(self, batch: float) -> float:
        """One decode step with ``batch`` sequences running."""
        return self.decode_step_s + self.decode_seq_s * batch

    @property
    def lends(self) -> bool:
        """Whether a calibration found roles faster on lent cores."""
        return max(self.lend_encode_x, self.lend_prefill_x, self.lend_decode_x) > 1.0


@dataclass(frozen=True)
class Profile:
    """The costs of this hardware and model, per serving path, and how prompts turn into tokens."""

    paths: dict[str, PathCosts]  # serving path ("aggregated", "epd", "split") -> its costs
    text_tokens: float  # prompt tokens of an unpadded text request of the workload generator (template included)
    padded_extra_tokens: (
        float  # prompt tokens of a padded text request beyond the padding asked for (template, question)
    )
    image_tokens: dict[int, float]  # visual tokens per image by image side in px (0: the generator's own sizes)
    native_pixels: float  # mean pixels of the generator's own images (image side 0)
    nproc: int  # CPUs of the machine that was profiled
    cpu_model: str  # its processor
    source: str  # what was measured: the deployment URL(s) or sweep file, and when
    version: int = PROFILE_VERSION  # the file format; another version is refused

    def costs(self, path: str) -> PathCosts:
        if path not in self.paths:
            raise ProfileError(
                f"the profile has no costs of the {path} path (it has {', '.join(self.paths) or 'none'})"
            )
        return self.paths[path]

    def tokens_per_image(self, side: int) -> float:
        """Visual tokens of one image of ``side`` px: measured, else those of the nearest measured side."""
        if not self.image_tokens:
            raise ProfileError("the profile has no image token counts")
        if side in self.image_tokens:
            return self.image_tokens[side]
        sized = [s for s in self.image_tokens if s > 0] or list(self.image_tokens)
        return self.image_tokens[min(sized, key=lambda s: abs(s - side))]

    def text_prompt_tokens(self, padding: int) -> float:
        """Prompt tokens of a text request padded to about ``padding`` tokens (0: unpadded)."""
        return self.text_tokens if padding == 0 else max(self.text_tokens, padding + self.padded_extra_tokens)

    def pixels(self, side: int) -> float:
        return float(side * side) if side > 0 else self.native_pixels

    # ---- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["image_tokens"] = {str(k): v for k, v in self.image_tokens.items()}
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: not a JSON object")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ProfileError(
                f"{where}: profile version {version!r}, this epdserve reads version {PROFILE_VERSION} "
                "(make a new one with `epdserve plan calibrate`)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - data.keys())
        if missing:
            raise ProfileError(f"{where}: missing {', '.join(missing)}")
        fields = dataclasses.fields(PathCosts)
        cost_names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING}  # later additions: optional
        paths: dict[str, PathCosts] = {}
        for name, costs in dict(data["paths"]).items():
            if name not in PATHS:
                raise ProfileError(f"{where}: unknown path {name!r} (expected one of {', '.join(PATHS)})")
            if not isinstance(costs, dict) or required - costs.keys():
                raise ProfileError(f"{where}: path {name} lacks {', '.join(sorted(required - set(costs or ())))}")
            values = {k: costs[k] for k in cost_names if k in costs}
            if any(not isinstance(v, int | float) or not math.isfinite(v) or v < 0 for v in values.values()):
                raise ProfileError(f"{where}: path {name} has a negative or non-numeric cost")
            if any(values.get(k, 1.0) < 1.0 for k in LENDING):
                raise ProfileError(f"{where}: path {name} has a lending speed-up below 1")
            paths[name] = PathCosts(**values)
        try:
            image_tokens = {int(k): float(v) for k, v in dict(data["image_tokens"]).items()}
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: image_tokens must map image sides to token counts") from None
        return cls(
            paths=paths,
            text_tokens=float(data["text_tokens"]),
            padded_extra_tokens=float(data["padded_extra_tokens"]),
            image_tokens=image_tokens,
            native_pixels=float(data["native_pixels"]),
            nproc=int(data["nproc"]),
            cpu_model=str(data["cpu_model"]),
            source=str(data["source"]),
            version=version,
        )


def save_profile(profile: Profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return path


def load_profile(path: Path) -> Profile:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"cannot read the profile {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON ({e})") from None
    return Profile.from_json(data, str(path))


# ---- fitting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One measured request: what it was, what the client saw, and the server's stage timing."""

    path: str  # the serving path it went through
    images: int  # images it carried
    image_side: int  # the image side its run asked for in px (0: the generator's own sizes)
    pixels: float  # pixels of each of its images
    padding: int  # the prompt padding its run asked for in tokens (0: none)
    prompt_tokens: int  # prompt tokens (usage), visual ones included
    output_tokens: int  # completion tokens (usage)
    concurrency: int  # requests in flight in its run (1: unloaded)
    ttft_s: float  # client's time to first token
    tpot_s: float  # client's time per output token after the first
    decode_batch: float  # mean decode batch of its run (concurrency × the share of a request's life spent decoding)
    stages: dict[str, float] = field(default_factory=dict)  # Server-Timing stages in seconds

    def stage(self, *names: str) -> float:
        """The first of ``names`` the server reported (the worker's role prefixes its stages), else 0."""
        return next((self.stages[n] for n in names if n in self.stages), 0.0)

    @property
    def encode_s(self) -> float:
        return self.stage("router_encode")

    @property
    def queue_s(self) -> float:
        return self.stage("pd_queue", "prefill_queue")

    @property
    def prefill_s(self) -> float:
        return self.stage("pd_prefill", "prefill_prefill")

    @property
    def timed(self) -> bool:
        """The server reported its prefill (a request without stage timing cannot split its TTFT)."""
        return "pd_prefill" in self.stages or "prefill_prefill" in self.stages


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, pin the most negative coefficient at 0, repeat.
    (A cost cannot be negative; an unconstrained fit of noisy small terms would make one so and
    push the others up to compensate.)"""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if sol.min() >= 0:
            x[:] = 0
            x[free] = sol
            return x
        free.pop(int(np.argmin(sol)))
    return x


def _fit(rows: list[list[float]], targets: list[float], relative: bool = False) -> list[float]:
    """``relative``: least squares of the relative errors, so that every run counts alike where
    their times span orders of magnitude (a text prompt's prefill beside eight large images'):
    an absolute fit lets the longest runs decide and may price the short ones at nothing."""
    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    if relative:
        w = 1.0 / np.maximum(b, RELATIVE_FLOOR_S)
        a, b = a * w[:, None], b * w
    # columns that never vary from 0 cannot be identified: leave them at 0 rather than let lstsq invent them
    keep = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    x = np.zeros(a.shape[1])
    if keep:
        x[keep] = nnls(a[:, keep], b)
    return [float(v) for v in x]


def _key(s: Sample) -> tuple[int, int, int, int, int]:
    """What identifies the run a sample came from."""
    return (s.images, s.image_side, s.padding, s.concurrency, s.output_tokens)


def _cells(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples grouped by the run they came from (same images, side, padding, concurrency, output)."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault(_key(s), []).append(s)
    return list(groups.values())


def _median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=float)))


def fit_path(samples: Sequence[Sample], loaded: bool = False) -> PathCosts:
    """The costs of one path from its samples: stage costs from the unloaded ones, the decode step's
    growth with the batch from every run. Each run counts once, by its median request: a shared
    machine's occasional stall should not tilt a line fitted to a few dozen requests.

    ``loaded``: the stage costs from samples of loaded runs too, whose queueing stages were taken
    out already (a sweep's cells); what else load adds to a stage stays in it."""
    quiet = [s for s in samples if (loaded or s.concurrency == 1) and s.timed]
    if len(quiet) < MIN_SAMPLES:
        what = "runs" if loaded else "unloaded requests"
        raise ProfileError(
            f"{len(quiet)} {what} with stage timing measured; fitting a path needs at least {MIN_SAMPLES}"
        )
    cells = _cells(quiet)

    def med(cell: list[Sample], value: Callable[[Sample], float]) -> float:
        return _median([value(s) for s in cell])

    media = [c for c in cells if c[0].images > 0]
    e_call, e_img, e_mpx = (
        _fit(
            [[1.0, c[0].images, c[0].images * c[0].pixels / 1e6] for c in media],
            [med(c, lambda s: s.encode_s) for c in media],
            relative=True,
        )
        if media
        else (0.0, 0.0, 0.0)
    )
    # text requests price a token; image requests then their pixels (a vision forward inside the
    # prefill grows with them, as their visual tokens do: without text the two could not be told apart)
    p0, p_tok, p_media, p_img, p_mpx = _fit(
        [
            [
                1.0,
                med(c, lambda s: s.prompt_tokens),
                float(c[0].images > 0),
                c[0].images,
                c[0].images * c[0].pixels / 1e6,
            ]
            for c in cells
        ],
        [med(c, lambda s: s.prefill_s) for c in cells],
        relative=True,
    )
    o0, o_img = _fit(
        [[1.0, c[0].images] for c in cells],
        [med(c, lambda s: max(0.0, s.ttft_s - s.encode_s - s.queue_s - s.prefill_s)) for c in cells],
    )
    # text-only requests: no prefill of long image prompts interrupting their decode steps
    answers = [c for c in _cells(samples) if c[0].output_tokens > 1]
    decoding = [c for c in answers if c[0].images == 0] or answers
    if not decoding:
        raise ProfileError("no request with more than one output token: the decode step cannot be fitted")
    d0, d_seq = _fit(
        [[1.0, med(c, lambda s: s.decode_batch)] for c in decoding], [med(c, lambda s: s.tpot_s) for c in decoding]
    )
    costs = PathCosts(
        encode_call_s=e_call,
        encode_image_s=e_img,
        encode_mpx_s=e_mpx,
        prefill_s=p0,
        prefill_token_s=p_tok,
        prefill_media_s=p_media,
        prefill_image_s=p_img,
        prefill_mpx_s=p_mpx,
        overhead_s=o0,
        overhead_image_s=o_img,
        decode_step_s=d0,
        decode_seq_s=d_seq,
        samples=len(samples),
        ttft_rms_s=0.0,
    )
    errors = [
        costs.overhead(s.images)
        + costs.encode(s.images, s.pixels)
        + costs.prefill(s.prompt_tokens, s.images, s.pixels)
        - s.ttft_s
        for s in quiet
    ]
    return dataclasses.replace(costs, ttft_rms_s=math.sqrt(sum(e * e for e in errors) / len(errors)))


def lending_speedups(own: Sequence[Sample], lent: Sequence[Sample]) -> dict[str, float]:
    """The ``lend_*_x`` speed-ups of a path: the same runs measured with each role on its own cores
    (``own``) and with idle roles lending theirs (``lent``), unloaded, so that every stage runs
    while the others idle. Each is the geometric mean over the runs both have of the ratio of their
    median times (encode: image runs; prefill: every unloaded run; decode: TPOT of the concurrency-1
    runs with more than one output token); 1 below ``LEND_NOISE`` (roles too small to borrow, or
    noise)."""
    pairs = []
    by_key = {_key(c[0]): c for c in _cells(lent)}
    for cell in _cells(own):
        other = by_key.get(_key(cell[0]))
        if other is not None:
            pairs.append((cell, other))

    def speedup(value: Callable[[Sample], float], use: Callable[[Sample], bool]) -> float:
        ratios = []
        for a, b in pairs:
            if use(a[0]):
                ta, tb = _median([value(s) for s in a]), _median([value(s) for s in b])
                if ta > 0 and tb > 0:
                    ratios.append(math.log(ta / tb))
        x = math.exp(sum(ratios) / len(ratios)) if ratios else 1.0
        return x if x >= LEND_NOISE else 1.0

    return {
        "lend_encode_x": speedup(lambda s: s.encode_s, lambda s: s.images > 0 and s.concurrency == 1 and s.timed),
        "lend_prefill_x": speedup(lambda s: s.prefill_s, lambda s: s.concurrency == 1 and s.timed),
        "lend_decode_x": speedup(lambda s: s.tpot_s, lambda s: s.concurrency == 1 and s.output_tokens > 1),
    }


def fit_token_counts(samples: Sequence[Sample]) -> tuple[float, float, dict[int, float]]:
    """From usage: (prompt tokens of an unpadded text request, tokens of a padded request beyond its
    padding, visual tokens per image by image side), by least squares over the runs

        prompt tokens = [unpadded] × text + [padded] × (padding + extra) + images × tokens(side)

    Text-only runs, or image runs of two image counts, tell the text's tokens from the images'."""
    cells = _cells(samples)
    sides = sorted({c[0].image_side for c in cells if c[0].images})
    rows = [
        [float(c[0].padding == 0), float(c[0].padding > 0), *(c[0].images * float(c[0].image_side == s) for s in sides)]
        for c in cells
    ]
    targets = [_median([s.prompt_tokens for s in c]) - c[0].padding for c in cells]
    a = np.asarray(rows)
    used = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    if not cells or np.linalg.matrix_rank(a[:, used]) < len(used):
        raise ProfileError(
            "the runs cannot tell the text's tokens from the images': measure text-only requests, "
            "or images at two counts per image size"
        )
    x = _fit(rows, targets)
    return x[0], x[1], {side: x[2 + i] for i, side in enumerate(sides)}
