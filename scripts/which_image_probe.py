"""Teacher-forced accuracy on "Which image has the <color> <shape>?", broken down the ways that
told run 6's experiments apart: by the number of images and the answer's position, and by whether
the asked colour (or shape) alone picks out the image; and, for the misses, what the image the
model named has of the asked shape: its colour, its kind, both (on different shapes) or neither.

python scripts/which_image_probe.py CHECKPOINT_DIR_OR_STATE_PT [--seed 7] [--n 240] [--slice which_two]

A ``state.pt`` is read with the ``init`` directory beside it. ``--slice`` draws one of the
trainer's which-image slices (``which_two``, ``which_colour``, ``which_many``,
``which_both``, ``which_by_colour``, ``which_same_kind``) instead of the spec's question.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

from epdserve.shapes import ORDINALS, Sample, ShapesWorld, which_image_target
from epdserve.training.data import TRAINER_TYPES, Mixture
from epdserve.training.train import checkpoint_files, load_checkpoint, state_weights, teacher_forced


def load(path: Path):
    tok, model, enc = load_checkpoint(checkpoint_files(path))
    if not path.is_dir():  # a run's state file: its weights
        model.load_state_dict(state_weights(path))
    return tok, model.eval(), enc


def category(s: Sample) -> str:
    color, kind = which_image_target(s)
    shapes = [sh for sc in s.scenes for sh in sc.shapes]
    if sum(sh.color == color for sh in shapes) == 1:
        return "colour alone"
    if sum(sh.kind == kind for sh in shapes) == 1:
        return "shape alone"
    return "both needed"


def named_has(s: Sample, word: str) -> str:
    """What a wrong answer names: an image with (or without) the asked colour and kind."""
    if word not in ORDINALS[: len(s.scenes)]:
        return "no such image"
    if s.answer == f"the {word}":
        return "the right image, in other words"
    color, kind = which_image_target(s)
    shapes = s.scenes[ORDINALS.index(word)].shapes
    has_colour = any(sh.color == color for sh in shapes)
    has_kind = any(sh.kind == kind for sh in shapes)
    has = {
        (True, True): "the asked colour and kind",
        (True, False): "the asked colour",
        (False, True): "the asked kind",
    }
    return "an image with " + has.get((has_colour, has_kind), "neither")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--slice", default=None, choices=[t for t in TRAINER_TYPES if t.startswith("which_")])
    args = ap.parse_args()
    tok, model, enc = load(args.checkpoint)
    world = ShapesWorld(args.seed)
    mix = Mixture(world, args.seed)
    samples = [mix.draw({args.slice: 1.0}) if args.slice else world.sample("which_image") for _ in range(args.n)]
    hits: dict[str, list[int]] = defaultdict(list)
    answers: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    for e, ok, pred in teacher_forced(model, enc, samples, tok.pad_token_id, batch=24):
        s = e.sample
        n, k = len(s.scenes), ORDINALS.index(s.answer.split()[1]) + 1
        for key in ("all", category(s), f"{n} images", f"{n} images, answer {k}"):
            hits[key].append(int(ok))
        word = tok.decode([pred[1]]).strip()  # the answer's second token: the ordinal
        answers[word] += 1
        if not ok:
            misses[f"{category(s)}: named {named_has(s, word)}"] += 1
    for key in sorted(hits, key=lambda k: (k != "all", k)):
        v = hits[key]
        print(f"{key:22s} {sum(v) / len(v):.3f}  ({len(v)})")
    print("ordinals predicted:", dict(answers))
    for key, count in sorted(misses.items()):
        print(f"miss, {key}: {count}")


if __name__ == "__main__":
    main()
