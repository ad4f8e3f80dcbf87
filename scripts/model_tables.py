"""Markdown tables for docs/embedded-model.md from the trainer's probe logs and `epdserve eval-shapes` JSON.

python scripts/model_tables.py probe STATE/log.jsonl [--every 1000] [--offset 13000]
python scripts/model_tables.py eval docs/results/eval.json [docs/results/eval-plain.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from epdserve.shapes import QUESTION_KIND

GROUPS = ("single-image", "multi-image", "video")
PROBE_COLUMNS = ("single", "multi", "video", "describe", "what_at", "where_is", "describe_nth", "which_image")


def probe_table(path: str, every: int, offset: int) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    out = ["| step | " + " | ".join(PROBE_COLUMNS) + " |", "|---" * (len(PROBE_COLUMNS) + 1) + "|"]
    for r in rows:
        if r["step"] % every:
            continue
        vals = [r.get(c, r["per_type"].get(c)) for c in PROBE_COLUMNS]
        out.append(f"| {r['step'] + offset} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    return "\n".join(out)


def eval_table(main: str, plain: str | None) -> str:
    rep = json.loads(Path(main).read_text())
    other = json.loads(Path(plain).read_text()) if plain else None
    head = ["question type", "accuracy", "with zeroed vision embeddings"]
    if other:
        head.append("prompt without vision ids")
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for q in (*QUESTION_KIND, *GROUPS):
        cells = [rep["accuracy"][q], rep["zeroed_embeddings"][q]]
        if other:
            cells.append(other["accuracy"][q])
        name, fmt = (f"**{q}**", "**{:.3f}**") if q in GROUPS else (q, "{:.3f}")
        out.append(f"| {name} | " + " | ".join([fmt.format(cells[0]), *(f"{c:.3f}" for c in cells[1:])]) + " |")
    sw = rep["swapped_embeddings"]
    out.append("")
    out.append(
        f"Swapped embeddings ({sw['questions']} single-image questions): answer matches its own image "
        f"{sw['matches_own_image']:.3f}, the donor image {sw['matches_donor_image']:.3f}."
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("log")
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--offset", type=int, default=0, help="added to the step numbers")
    e = sub.add_parser("eval")
    e.add_argument("main")
    e.add_argument("plain", nargs="?")
    args = ap.parse_args()
    print(probe_table(args.log, args.every, args.offset) if args.cmd == "probe" else eval_table(args.main, args.plain))


if __name__ == "__main__":
    main()
