"""Command-line arguments of the trainer (kept free of heavy imports: the CLI parses them)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True, help="final checkpoint directory")
    ap.add_argument("--state", type=Path, required=True, help="resumable training state directory")
    ap.add_argument("--steps", type=int, default=6000, help="optimizer steps to train for")
    ap.add_argument("--batch", type=int, default=16, help="samples per optimizer step (across workers)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the generated training data and the weights")
    ap.add_argument(
        "--early-steps", type=int, default=500, help="steps trained on the early question mix before the main one"
    )
    ap.add_argument("--focus-until", type=int, default=3500, help="single-shape curriculum phase ends at this step")
    ap.add_argument(
        "--mix-v0", action="store_true", help="the first run's mix (no focus phase); see docs/embedded-model.md"
    )
    ap.add_argument("--refine", action="store_true", help="the refining mix used when continuing from shipped weights")
    ap.add_argument(
        "--mix-weight",
        action="append",
        default=[],
        metavar="QTYPE=W",
        help="override one question type's weight in the mix (repeatable), e.g. which_image=6",
    )
    ap.add_argument(
        "--plain-frac",
        type=float,
        default=0.1,
        help="fraction of prompts rendered without vision ids (1: none has them; the embedded model's first trainings used 1)",
    )
    ap.add_argument(
        "--system-frac",
        type=float,
        default=0.0,
        help="fraction of prompts with a random system message (varies where the media start)",
    )
    ap.add_argument("--stop-at", type=int, default=0, help="save the state and stop at this step (0: run to --steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--workers", type=int, default=1, help="data-parallel processes (one per core on CPU)")
    ap.add_argument("--device", default="cpu", help="torch device to train on (cpu, cuda); the data is made on the CPU")
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from these weights (a checkpoint directory or another run's state.pt) when no state exists yet",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="language-model layers: of a new model, or what --init-from's trained stack grows to "
        "(inserted blocks start as the identity, so the grown model answers as the trained one)",
    )
    ap.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="set the language model's rotary base in the run's config (the weights are kept)",
    )
    ap.add_argument("--start-step", type=int, default=0, help="step number to continue from with --init-from")
    ap.add_argument("--eval-every", type=int, default=250, help="steps between evaluations on held-out questions")
    ap.add_argument("--probe-per-type", type=int, default=24, help="probe questions per type at each evaluation")
    ap.add_argument("--save-every", type=float, default=300.0, help="seconds between state saves")
