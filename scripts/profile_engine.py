"""Profile the engine's per-token work: N concurrent text+image requests stepped to the end in
this process, detokenized as a server would, under cProfile. Works on this tree and on the tree
before the engine core split (``git worktree add /tmp/before c8f9cc6`` and run it from there), so
the two profiles compare the same work.

    python scripts/profile_engine.py --requests 16 --output-len 256 --out bench-results/profile-engine.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from epdserve.assets import default_model_dir
from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import request_from
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, WireTensor
from epdserve.engine.request import Request
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.shapes import ShapesWorld


def requests(model_dir: Path, tok, n: int, out_len: int) -> list[Request]:
    builder = InputBuilder(tok, ModelConfig.from_pretrained(model_dir))
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    world = ShapesWorld(0)
    reqs = []
    for i in range(n):
        s = world.sample("describe")
        v = proc.image(s.scenes[0].render())
        media = [MediaInput(f"img-{i}", "image", v.grid_thw, v.pixel_values)]
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}]
        p = builder.build(msgs, media)
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
        reqs.append(request_from(AddRequest(f"r{i}", p.token_ids, params, p.mm_items, pos, p.mrope_delta)))
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch"], help="fused CPU kernels or PyTorch ops")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = default_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    config = EngineConfig(num_kv_blocks=1024, dtype=args.dtype, kernels=args.kernels)
    try:  # the engine core (this tree): the front end detokenizes
        from epdserve.engine.core import EngineCore
        from epdserve.engine.detokenizer import Detokenizer

        engine = EngineCore.from_pretrained(model_dir, config)
        detoks: dict[str, Detokenizer] = {}

        def consume(outs) -> None:
            for o in outs:
                d = detoks.setdefault(o.request_id, Detokenizer(tok))
                d.push(o.token_ids, final=o.finished)

        label = "engine core + front-end detokenizer"
    except ImportError:  # before the split: the engine detokenizes itself
        from epdserve.engine.engine import LLMEngine  # type: ignore[import-not-found]

        engine = LLMEngine.from_pretrained(model_dir, config)

        def consume(outs) -> None:
            pass

        label = "LLMEngine (detokenizes in step)"
    for r in requests(model_dir, tok, 2, 8):  # warm up
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    for r in requests(model_dir, tok, args.requests, args.output_len):
        engine.add_request(r)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = 0
    while engine.has_work:
        consume(engine.step())
        steps += 1
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    tokens = args.requests * args.output_len
    head = (
        f"# {label} ({args.dtype}): {args.requests} requests x {args.output_len} tokens, {steps} steps, "
        f"{wall:.2f} s under the profiler, {tokens / wall:.0f} tok/s\n"
    )
    text = head + buf.getvalue()
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
