"""Greedy parity of a published-size checkpoint, served in each topology, against transformers.

    python scripts/parity_real_size.py qwen2_vl /tmp/qwen2-vl-2b --dtype bfloat16 \
        --topologies aggregated,1e+1pd,1e+1p+1d

Builds the checkpoint into the directory if it has none (``scripts/build_checkpoint.py --size``),
serves it in each topology in turn (``epdserve up``), asks a text request and an image request
(448 x 448, greedy), stops the deployment, then loads the checkpoint into transformers at the same
dtype and generates the same tokens. Prints each answer's tokens, the first position where one
differs from transformers' (if any), and each language-model worker's memory line. The
deployments and transformers never hold the weights at the same time.

In bfloat16 two correct implementations may part ways after some tokens when the top two logits
of a random model are within rounding of each other; the script says where, with the margin.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai
import torch
from PIL import Image

from epdserve.bench.workload import image_data_url
from epdserve.hf_reference import HFReference
from epdserve.launcher import free_port
from epdserve.up import Deployment, Topology
from tests.checkpoints.published import SIZES, build_published


def serve_answers(
    model: Path, topology: str, dtype: str, max_tokens: int, image: Image.Image, logs: Path
) -> list[list[str]]:
    """The tokens of the text and the image request's greedy answers from ``topology``."""
    flags = ["--dtype", dtype, "--max-model-len", "4096"]
    t0 = time.time()
    d = Deployment(
        Topology.parse(topology),
        str(model),
        port=free_port(),
        extra_pd_args=flags,
        extra_encoder_args=["--dtype", dtype],
        log_dir=logs / topology,
        startup_timeout_s=900,
    )
    d.start()
    out = []
    try:
        print(f"{topology}: ready in {time.time() - t0:.0f} s", flush=True)
        c = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=1800)
        for content in (
            "Describe the image.",
            [{"type": "image_url", "image_url": {"url": image_data_url(image)}}, {"type": "text", "text": "What?"}],
        ):
            r = c.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
                temperature=0,
                max_tokens=max_tokens,
                logprobs=True,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
            out.append([t.token for t in r.choices[0].logprobs.content])
    finally:
        d.stop()
    for log in sorted((logs / topology).glob("*.log")):
        line = next((ln for ln in log.read_text().splitlines() if " memory: " in ln), None)
        if line:
            print(f"  {line[line.rindex(': ', 0, line.index(' memory: ')) + 2 :]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=sorted(SIZES))
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=0, help="build with this many language layers (0: all)")
    ap.add_argument(
        "--topologies", default="aggregated", help="comma-separated, as 'epdserve up --topology' takes them"
    )
    args = ap.parse_args()
    if not (args.model_dir / "config.json").is_file():
        t0 = time.time()
        build_published(args.family, args.model_dir, layers=args.layers)
        print(f"built {args.model_dir} in {time.time() - t0:.0f} s", flush=True)
    image = Image.new("RGB", (448, 448))
    image.paste((200, 40, 40), (0, 0, 224, 448))
    logs = Path(tempfile.mkdtemp())
    topologies = args.topologies.split(",")
    served = {t: serve_answers(args.model_dir, t, args.dtype, args.max_tokens, image, logs) for t in topologies}
    ref = HFReference(args.model_dir, dtype=getattr(torch, args.dtype))
    same = True
    for i, (content, images) in enumerate(
        (("Describe the image.", []), ([{"type": "image"}, {"type": "text", "text": "What?"}], [image]))
    ):
        inputs = ref.inputs([{"role": "user", "content": content}], images=images)
        t0 = time.time()
        out = ref.model.generate(
            **inputs, max_new_tokens=args.max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        hf_tokens = [ref.tok.decode([t]) for t in ids]
        print(f"request {i}: transformers {time.time() - t0:.0f} s")
        print(f"  transformers {hf_tokens}")
        for topology, answers in served.items():
            print(f"  {topology:<12} {answers[i]}")
            diff = next((k for k, (a, b) in enumerate(zip(answers[i], hf_tokens, strict=False)) if a != b), None)
            if diff is not None:
                same = False
                top = out.logits[diff][0].float().topk(2).values.tolist()
                print(
                    f"  {topology}: first difference at token {diff}: transformers' top-2 logits {top[0]:.4f} {top[1]:.4f}"
                )
    print("PARITY" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
