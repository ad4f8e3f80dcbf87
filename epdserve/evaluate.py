"""Shapes-world evaluation: exact-match accuracy per question type, greedy, through transformers.

With ``--ablations`` the same questions are asked again with the vision embeddings zeroed, and
single-image questions with the embedding of a different image of the same size swapped in
(the answer should then follow the donor image).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from epdserve.assets import default_model_dir
from epdserve.hf_reference import HFReference
from epdserve.shapes import (
    IMAGE_QUESTIONS,
    MULTI_QUESTIONS,
    QUESTION_KIND,
    VIDEO_QUESTIONS,
    Sample,
    ShapesWorld,
    render_images,
)

GROUPS = {"single-image": IMAGE_QUESTIONS, "multi-image": MULTI_QUESTIONS, "video": VIDEO_QUESTIONS}


def held_out(seed: int, per_type: int) -> list[Sample]:
    world = ShapesWorld(seed)
    return [world.sample(q) for q in QUESTION_KIND for _ in range(per_type)]


def ask(ref: HFReference, s: Sample, override=None) -> str:
    if s.video is not None:
        return ref.answer(s.question, video=s.frames, override=override)
    return ref.answer(s.question, images=render_images(s), override=override)


def accuracy(results: dict[str, list[bool]]) -> dict[str, float]:
    per_type = {q: sum(v) / len(v) for q, v in results.items()}
    for g, qs in GROUPS.items():
        vals = [x for q in qs for x in results.get(q, [])]
        if vals:
            per_type[g] = sum(vals) / len(vals)
    return per_type


def swap_donor(world: ShapesWorld, s: Sample) -> Sample:
    """Same question, an image of the same size (same embedding count) with a different answer."""
    target = (s.scenes[0].width, s.scenes[0].height)
    while True:
        d = world.sample(s.qtype)
        if (d.scenes[0].width, d.scenes[0].height) == target and d.question == s.question and d.answer != s.answer:
            return d


def main(args: argparse.Namespace) -> int:
    template_kwargs = {"add_vision_id": False} if args.no_vision_ids else {}
    ref = HFReference(args.model or default_model_dir(), template_kwargs=template_kwargs)
    samples = held_out(args.seed, args.per_type)
    t0 = time.time()
    plain: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        plain[s.qtype].append(ask(ref, s) == s.answer)
    report: dict[str, object] = {
        "model": str(ref.model_dir),
        "seed": args.seed,
        "template_kwargs": template_kwargs,
        "questions": len(samples),
        "accuracy": accuracy(plain),
        "seconds": round(time.time() - t0, 1),
    }
    if args.ablations:
        zeroed: dict[str, list[bool]] = defaultdict(list)
        for s in samples:
            zeroed[s.qtype].append(ask(ref, s, override=torch.zeros_like) == s.answer)
        report["zeroed_embeddings"] = accuracy(zeroed)
        donors = ShapesWorld(args.seed + 1)
        own, follows = [], []
        for s in samples:
            if s.kind != "image":
                continue
            d = swap_donor(donors, s)
            d_inputs = ref.inputs(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": d.question}]}],
                images=render_images(d),
            )
            with torch.inference_mode():
                donor_emb = ref.model.model.get_image_features(d_inputs["pixel_values"], d_inputs["image_grid_thw"])
            donor_emb = donor_emb.pooler_output if hasattr(donor_emb, "pooler_output") else donor_emb
            donor_emb = torch.cat(list(donor_emb)) if isinstance(donor_emb, (list, tuple)) else donor_emb
            got = ask(ref, s, override=lambda _out, e=donor_emb: e)
            own.append(got == s.answer)
            follows.append(got == d.answer)
        report["swapped_embeddings"] = {
            "matches_own_image": sum(own) / len(own),
            "matches_donor_image": sum(follows) / len(follows),
            "questions": len(own),
        }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
