"""The ``epdserve`` command line: one subcommand per role or tool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from epdserve.assets import default_model_dir


def _model_path(args: argparse.Namespace) -> int:
    print(default_model_dir())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from epdserve.hf_reference import HFReference
    from epdserve.shapes import ShapesWorld, render_images

    ref = HFReference(args.model or default_model_dir())
    world = ShapesWorld(args.seed)
    for _ in range(args.n):
        sample = world.sample()
        if sample.video is not None:
            answer = ref.answer(sample.question, video=sample.frames)
        else:
            answer = ref.answer(sample.question, images=render_images(sample))
        media = "video" if sample.video is not None else f"{len(sample.scenes)} image(s)"
        mark = "ok" if answer == sample.answer else "WRONG"
        print(f"[{media}] {sample.question} -> {answer!r} (expected {sample.answer!r}) {mark}")
    return 0


def _eval_shapes(args: argparse.Namespace) -> int:
    from epdserve.evaluate import main as eval_main

    return eval_main(args)


def _train_shapes(args: argparse.Namespace) -> int:
    from epdserve.training.train import main as train_main

    train_main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    s = sub.add_parser("model-path", help="print the directory of the embedded model")
    commands["model-path"] = _model_path

    s = sub.add_parser("demo", help="ask the embedded model questions about generated shapes images")
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("-n", type=int, default=5, help="number of questions")
    commands["demo"] = _demo

    s = sub.add_parser("eval-shapes", help="exact-match accuracy per question type (transformers, greedy)")
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--per-type", type=int, default=60, help="questions per question type")
    s.add_argument("--seed", type=int, default=20261130, help="held-out seed (training uses other seeds)")
    s.add_argument("--ablations", action="store_true", help="also run with zeroed and swapped vision embeddings")
    s.add_argument("--json", default=None, help="write the report as JSON to this file")
    commands["eval-shapes"] = _eval_shapes

    s = sub.add_parser("train-shapes", help="train the shapes-world model (see docs/model.md)")
    s.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the trainer (--out, --state, ...)")
    commands["train-shapes"] = _train_shapes

    p.set_defaults(_commands=commands)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args._commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
