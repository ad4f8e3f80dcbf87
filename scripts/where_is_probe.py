"""Teacher-forced accuracy on "Where is the <color> <shape>?" (two shapes), by what tells the two
shapes apart: only the colour (both the same kind), only the kind (both the same colour), or both.

python scripts/where_is_probe.py CHECKPOINT_DIR_OR_STATE_PT [--seed 11] [--n 240]

Run 9 scored at chance when only the colour tells the shapes apart, while naming a shape's colour
was exact: the model reads colour out but does not select by it. A ``state.pt`` is read with the
``init`` directory beside it.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from which_image_probe import load

from epdserve.shapes import Sample, ShapesWorld
from epdserve.training.train import teacher_forced


def category(s: Sample) -> str:
    a, b = s.scenes[0].shapes
    if a.kind == b.kind:
        return "colour alone"
    return "kind alone" if a.color == b.color else "either"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--n", type=int, default=240)
    args = ap.parse_args()
    tok, model, enc = load(args.checkpoint)
    world = ShapesWorld(args.seed)
    samples = [world.sample("where_is") for _ in range(args.n)]
    hits: dict[str, list[int]] = defaultdict(list)
    for e, ok, _ in teacher_forced(model, enc, samples, tok.pad_token_id, batch=24):
        for key in ("all", category(e.sample)):
            hits[key].append(int(ok))
    for key in sorted(hits, key=lambda k: (k != "all", k)):
        v = hits[key]
        print(f"{key:14s} {sum(v) / len(v):.3f}  ({len(v)})")


if __name__ == "__main__":
    main()
