"""Training and evaluation batches from the shapes world, through the real chat template."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from epdserve.media.processor import VisionProcessor
from epdserve.shapes import Sample, ShapesWorld, render_images, which_image_sample, which_image_target


@dataclass(frozen=True)
class Encoded:
    """One tokenized sample: prompt + answer ids, vision inputs, and where the answer starts."""

    input_ids: list[int]
    answer_start: int
    images: list[tuple[np.ndarray, tuple[int, int, int]]]
    videos: list[tuple[np.ndarray, tuple[int, int, int]]]
    sample: Sample


class SampleEncoder:
    """Turns samples into token ids with expanded placeholders (chat template, then expansion)."""

    def __init__(self, tokenizer, processor: VisionProcessor, image_token_id: int, video_token_id: int) -> None:
        self.tok = tokenizer
        self.proc = processor
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.merge = processor.config.merge_size

    def messages(self, sample: Sample, text_first: bool = False, system: str | None = None) -> list[dict]:
        media: list[dict] = (
            [{"type": "video"}] if sample.video is not None else [{"type": "image"} for _ in sample.scenes]
        )
        text = {"type": "text", "text": sample.question}
        content = [text, *media] if text_first else [*media, text]
        head = [] if system is None else [{"role": "system", "content": system}]
        return [*head, {"role": "user", "content": content}]

    def encode(
        self,
        sample: Sample,
        text_first: bool = False,
        with_answer: bool = True,
        vision_ids: bool = True,
        system: str | None = None,
    ) -> Encoded:
        prompt = self.tok.apply_chat_template(
            self.messages(sample, text_first, system),
            add_generation_prompt=True,
            tokenize=False,
            add_vision_id=vision_ids,
        )
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        images = [self._item(self.proc.image(im)) for im in render_images(sample)]
        videos = [self._item(self.proc.video(sample.frames))] if sample.video is not None else []
        expanded: list[int] = []
        it_img, it_vid = iter(images), iter(videos)
        for t in ids:
            if t == self.image_token_id:
                expanded += [t] * self._count(next(it_img)[1])
            elif t == self.video_token_id:
                expanded += [t] * self._count(next(it_vid)[1])
            else:
                expanded.append(t)
        start = len(expanded)
        if with_answer:
            expanded += self.tok(sample.answer, add_special_tokens=False)["input_ids"] + [self.end_id]
        return Encoded(expanded, start, images, videos, sample)

    def _item(self, vi):
        return vi.pixel_values, vi.grid_thw

    def _count(self, thw: tuple[int, int, int]) -> int:
        t, h, w = thw
        return t * h * w // (self.merge * self.merge)


def collate(batch: list[Encoded], pad_id: int, image_token_id: int, video_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with labels on the answer tokens only (answer + end-of-turn)."""
    n = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, e in enumerate(batch):
        L = len(e.input_ids)
        ids[i, :L] = torch.tensor(e.input_ids)
        mask[i, :L] = 1
        labels[i, e.answer_start : L] = ids[i, e.answer_start : L]
    # modality of each position (0 text, 1 image, 2 video): transformers derives M-RoPE from it
    mm = torch.zeros_like(ids)
    mm[ids == image_token_id] = 1
    mm[ids == video_token_id] = 2
    out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": mm}
    imgs = [x for e in batch for x in e.images]
    vids = [x for e in batch for x in e.videos]
    if imgs:
        out["pixel_values"] = torch.from_numpy(np.concatenate([p for p, _ in imgs]))
        out["image_grid_thw"] = torch.tensor([g for _, g in imgs], dtype=torch.long)
    if vids:
        out["pixel_values_videos"] = torch.from_numpy(np.concatenate([p for p, _ in vids]))
        out["video_grid_thw"] = torch.tensor([g for _, g in vids], dtype=torch.long)
    return out


SYSTEM_TEXT = (
    "You are a helpful assistant. Answer the question about the images briefly and exactly, look at every "
    "picture and video carefully before you answer, the user may ask about shapes colors positions and motion"
)
SYSTEM_WORDS = tuple(SYSTEM_TEXT.split())


def random_system_prompt(rng: random.Random, max_words: int = 30) -> str:
    """A system message of random length: the media then start at a different position, so the
    model cannot tie "left" or "the second" to absolute positions."""
    return " ".join(rng.choice(SYSTEM_WORDS) for _ in range(rng.randint(0, max_words)))


# Question types only the trainer draws: easier slices of the spec's distributions, for curricula.
TRAINER_TYPES = (
    "describe_one",
    "which_colour",
    "which_two",
    "which_many",
    "which_both",
    "which_by_colour",
    "which_same_kind",
    "where_same_kind",
)


class Mixture:
    """Draws question types by weight; weights change with the curriculum phase."""

    def __init__(self, world: ShapesWorld, seed: int) -> None:
        self.world = world
        self.rng = random.Random(seed)
        self._own = {
            "describe_one": self._describe_one,
            "which_colour": self._which_colour,
            "which_two": self._which_two,
            "which_many": self._which_many,
            "which_both": self._which_both,
            "which_by_colour": self._which_by_colour,
            "which_same_kind": self._which_same_kind,
            "where_same_kind": self._where_same_kind,
        }

    def draw(self, weights: dict[str, float]) -> Sample:
        qtypes = list(weights)
        q = self.rng.choices(qtypes, weights=[weights[k] for k in qtypes])[0]
        own = self._own.get(q)
        return own() if own is not None else self.world.sample(q)

    def _describe_one(self) -> Sample:
        scene = self.world.scene(1)
        return Sample("image", "describe", "Describe the image.", scene.description, scenes=(scene,))

    def _which_colour(self) -> Sample:
        """ "Which image has the red circle?" where no other shape is red: the colour alone finds
        the image (a spec question, from the easy end of its distribution)."""
        w = self.world
        n = w.rng.randint(2, 4)
        while True:
            scenes = tuple(w.scene() for _ in range(n))
            target = w.rng.choice(w.rng.choice(scenes).shapes)
            same = [i for i, sc in enumerate(scenes) for s in sc.shapes if s.color == target.color]
            if len(same) == 1:
                break
        return which_image_sample(scenes, target, same[0])

    def _which_two(self) -> Sample:
        """The easiest "Which image has ...?": two images of one shape each, in different colours."""
        w = self.world
        while True:
            scenes = (w.scene(1), w.scene(1))
            if scenes[0].shapes[0].color != scenes[1].shapes[0].color:
                break
        i = w.rng.randrange(2)
        return which_image_sample(scenes, scenes[i].shapes[0], i)

    def _which_many(self) -> Sample:
        """The spec's "Which image has ...?" with only its hardest image counts, 3 and 4."""
        return self.world.which_image(self.world.rng.randint(3, 4))

    def _which_both(self) -> Sample:
        """The spec's "Which image has the red circle?" where another image has something red and
        another has a circle: only the colour and the shape together, on one shape, find the image."""
        return self._which_image_where(lambda with_color, with_kind, n: with_color > 1 and with_kind > 1)

    def _which_by_colour(self) -> Sample:
        """The spec's "Which image has the red circle?" where another image has a circle (in
        another colour): the shape alone does not find the image, the colour must pick it."""
        return self._which_image_where(lambda with_color, with_kind, n: with_kind > 1)

    def _which_same_kind(self) -> Sample:
        """The spec's "Which image has the red circle?" where every image has a circle: only the
        colour picks the image."""
        return self._which_image_where(lambda with_color, with_kind, n: with_kind == n)

    def _where_same_kind(self) -> Sample:
        """The spec's "Where is the red circle?" where both shapes are circles: only the colour
        picks the shape."""
        while True:
            s = self.world.sample("where_is")
            a, b = s.scenes[0].shapes
            if a.kind == b.kind:
                return s

    def _which_image_where(self, keep: Callable[[int, int, int], bool]) -> Sample:
        """The spec's which-image question over 2-4 images, drawn until ``keep(images with the
        asked colour, images with the asked shape, images)`` holds."""
        w = self.world
        while True:
            s = w.which_image(w.rng.randint(2, 4))
            color, kind = which_image_target(s)
            with_color = sum(any(sh.color == color for sh in sc.shapes) for sc in s.scenes)
            with_kind = sum(any(sh.kind == kind for sh in sc.shapes) for sc in s.scenes)
            if keep(with_color, with_kind, len(s.scenes)):
                return s
