"""Request payloads for benchmarks: shapes-world media as data URLs in OpenAI chat requests.

``build_workload`` turns a ``WorkloadConfig`` (images per request, image size, prompt and output
length, text/image/video mix, reused-media fraction) into encoded request bodies. Everything that
costs CPU — rendering, PNG/GIF and base64 encoding, JSON — happens here, before a benchmark clock
starts.
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass

from PIL import Image

from epdserve.bench.client import encode_request
from epdserve.shapes import IMAGE_QUESTIONS, MULTI_QUESTIONS, VIDEO_QUESTIONS, ShapesWorld

MAX_IMAGES_PER_REQUEST = 50
# Padding words: shapes-world words are single tokens both in the embedded model's 420-token
# vocabulary and in ordinary BPE vocabularies, so one word is about one token everywhere. Random
# word order (rather than one repeated sentence) keeps padded prompts from sharing prefix-cache blocks.
PAD_WORDS = (
    "red", "green", "blue", "yellow", "circle", "square", "triangle", "left", "right", "top", "bottom",
    "image", "shape", "shapes", "first", "second", "third", "fourth", "the", "and", "this", "there",
    "color", "moving",
)  # fmt: skip
KINDS = ("text", "image", "video")


@dataclass(frozen=True)
class WorkloadConfig:
    """What each request of a benchmark looks like."""

    images_per_request: int = 1  # images in each "image" request (0–50); 0 makes those requests text-only
    image_size: int = 0  # resize images and video frames to this square side in px (0: their own sizes, 84 to 168 px)
    prompt_tokens: int = 0  # pad the question with neutral words to roughly this many text tokens; 0: no padding
    output_len: int = 64  # output tokens per request (max_tokens)
    exact_output: bool = True  # also send min_tokens=max_tokens and ignore_eos so every answer is output_len long
    text_fraction: float = 0.0  # fraction of requests without media (kind "text")
    video_fraction: float = 0.0  # fraction of requests carrying one GIF video instead of images (kind "video")
    repeated_fraction: float = 0.0  # fraction of media items taken from a small reused pool (encoder-cache hits)
    pool_size: int = 4  # distinct images (and distinct videos) in the reused pool

    def __post_init__(self) -> None:
        if not 0 <= self.images_per_request <= MAX_IMAGES_PER_REQUEST:
            raise ValueError(
                f"images_per_request must be in 0..{MAX_IMAGES_PER_REQUEST}, got {self.images_per_request}"
            )
        if self.image_size < 0:
            raise ValueError(f"image_size must be >= 0, got {self.image_size}")
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        for name in ("text_fraction", "video_fraction", "repeated_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.text_fraction + self.video_fraction > 1.0 + 1e-9:
            raise ValueError("text_fraction + video_fraction must be at most 1")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")


@dataclass(frozen=True)
class BenchRequest:
    """One ready-to-send request: its label and its encoded streaming body."""

    kind: str  # "text", "image" or "video"
    body: bytes  # JSON of the streaming chat request (client.encode_request)
    num_images: int  # image parts in the request
    num_videos: int  # video parts in the request
    num_repeated: int  # media parts taken from the reused pool

    @property
    def payload(self) -> dict:
        """The request as a dict (for inspection; the benchmark sends ``body``)."""
        return json.loads(self.body)


def image_data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def gif_data_url(frames: list[Image.Image]) -> str:
    """An animated GIF of the frames (100 ms each) as a data URL."""
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def image_payload(model: str, question: str, images: list[Image.Image], out_len: int, exact: bool = True) -> dict:
    """A chat request with the images first, then the question; ``exact`` fixes the output length."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    return chat_payload(model, parts, question, out_len, exact)


def chat_payload(model: str, media_parts: list[dict], text: str, out_len: int, exact: bool = True) -> dict:
    """A greedy chat request of media parts then text; ``exact`` adds min_tokens and ignore_eos."""
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": [*media_parts, {"type": "text", "text": text}]}],
        "max_tokens": out_len,
        "temperature": 0,
    }
    if exact:
        body.update(min_tokens=out_len, ignore_eos=True)
    return body


def request_kinds(n: int, config: WorkloadConfig, rng: random.Random) -> list[str]:
    """Kinds of ``n`` requests in a shuffled order; counts follow the fractions exactly (rounded)."""
    n_video = round(n * config.video_fraction)
    n_text = min(round(n * config.text_fraction), n - n_video)
    n_image = n - n_video - n_text
    if config.images_per_request == 0:
        n_text, n_image = n_text + n_image, 0
    kinds = ["video"] * n_video + ["text"] * n_text + ["image"] * n_image
    rng.shuffle(kinds)
    return kinds


def pad_prompt(question: str, tokens: int, rng: random.Random) -> str:
    """The question preceded by random neutral words so the text is roughly ``tokens`` tokens."""
    # about one token per word plus one for the final punctuation mark and one for the added period
    words = tokens - len(question.split()) - 2
    if words <= 0:
        return question
    return " ".join(rng.choice(PAD_WORDS) for _ in range(words)) + ". " + question


class _Media:
    """Draws fresh or pooled media data URLs for one workload; each distinct item is encoded once."""

    def __init__(self, world: ShapesWorld, config: WorkloadConfig, rng: random.Random) -> None:
        self.world, self.config, self.rng = world, config, rng
        self.image_pool: list[str] = []
        self.video_pool: list[str] = []

    def _resize(self, img: Image.Image) -> Image.Image:
        side = self.config.image_size
        return img.resize((side, side)) if side else img

    def fresh_image(self) -> str:
        return image_data_url(self._resize(self.world.scene().render()))

    def fresh_video(self) -> str:
        return gif_data_url([self._resize(f) for f in self.world.video().frames()])

    def pooled_image(self) -> str:
        if not self.image_pool:
            self.image_pool = [self.fresh_image() for _ in range(self.config.pool_size)]
        return self.rng.choice(self.image_pool)

    def pooled_video(self) -> str:
        if not self.video_pool:
            self.video_pool = [self.fresh_video() for _ in range(self.config.pool_size)]
        return self.rng.choice(self.video_pool)


def build_workload(config: WorkloadConfig, model: str, n: int, seed: int) -> list[BenchRequest]:
    """``n`` encoded requests for ``model``; the same arguments give the same bytes."""
    rng = random.Random(seed)
    world = ShapesWorld(seed)
    media = _Media(world, config, rng)
    kinds = request_kinds(n, config, rng)
    slots = [config.images_per_request if k == "image" else int(k == "video") for k in kinds]
    # exactly round(fraction * items) media items come from the pool, spread at random
    n_items = sum(slots)
    pooled = set(rng.sample(range(n_items), round(n_items * config.repeated_fraction)))
    out: list[BenchRequest] = []
    item = 0
    for kind, n_media in zip(kinds, slots, strict=True):
        repeated = sum(1 for i in range(item, item + n_media) if i in pooled)
        parts: list[dict] = []
        if kind == "image":
            qtype = rng.choice(IMAGE_QUESTIONS if n_media == 1 else MULTI_QUESTIONS)
            question = world.sample(qtype).question
            for i in range(item, item + n_media):
                url = media.pooled_image() if i in pooled else media.fresh_image()
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "video":
            question = world.sample(rng.choice(VIDEO_QUESTIONS)).question
            url = media.pooled_video() if item in pooled else media.fresh_video()
            parts.append({"type": "video_url", "video_url": {"url": url}})
        else:
            question = f"Describe {world.scene().description}."
        item += n_media
        text = pad_prompt(question, config.prompt_tokens, rng)
        body = encode_request(chat_payload(model, parts, text, config.output_len, config.exact_output))
        out.append(BenchRequest(kind, body, len(parts) if kind == "image" else 0, int(kind == "video"), repeated))
    return out
