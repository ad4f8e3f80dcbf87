"""Benchmark: the engine's steps against what this machine allows, on one checkpoint.

    python scripts/roofline.py --model /tmp/qwen2-vl-2b --dtype bfloat16 --threads 1 2

Measures, in this process, for each thread count:

- the machine: memory bandwidth (reading a 1 GiB tensor) and the peak matmul rate in the dtype
  (a square 2048 matmul, and the language model's widest linear at 1,024 rows); for bfloat16,
  the better of that and the float32 rate, since a CPU without bfloat16 arithmetic (AVX2) can
  multiply bfloat16 values at its float32 rate;
- a decode step at batch 1 (the engine core, a short text prompt already prefilled) against its
  bound: the bytes one step must read (the language model's weights and the output projection,
  the KV of the context) over the best bandwidth measured at any of the thread counts;
- prefill of a text prompt of ``--prompt-tokens`` tokens, in one engine step, against the peak
  matmul rate: 2 x (linear weights) x tokens floating-point operations, attention not counted;
  and the rate of the linear layers alone (their operations over the time spent inside them);
- the vision tower over one image of ``--image-size`` pixels a side, the same way; and its
  attention over that image's frame alone (random q, k and v of the tower's heads), as the
  tower runs it and through PyTorch's SDPA, 4 x heads x rows² x head size operations each.

Prints one table; ``--json`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epdserve.bench.transfer_bench import timed
from epdserve.common.dtypes import torch_dtype
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.engine.request import Request
from epdserve.kernels.ops import LayerOps
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.models.layers.vision import attend_frames
from epdserve.shapes import ShapesWorld


def _best(fn: Callable[[], object], repeat: int) -> float:
    return min(timed(fn, repeat))


def bandwidth_gbs(repeat: int = 5) -> float:
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    return x.numel() * 4 / _best(lambda: x.sum(), repeat) / 1e9


def matmul_tflops(m: int, k: int, n: int, dtype: torch.dtype, repeat: int = 5) -> float:
    a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2 * m * k * n / _best(lambda: torch.nn.functional.linear(a, w), repeat) / 1e12


def weights(model: torch.nn.Module) -> tuple[int, int, int]:
    """Parameters a decode step reads (the language model, with the output projection: the
    embedding table when tied), those a prefill token multiplies (the language model's layers),
    and the vision tower's. Packed linear weights are parameters too, so counting them works
    whatever layout the kernels chose."""
    named = dict(model.named_parameters())
    lm = {n: p.numel() for n, p in named.items() if not n.startswith("visual")}
    embed = sum(v for n, v in lm.items() if "embed_tokens" in n)
    head = sum(v for n, v in lm.items() if "lm_head" in n)
    total = sum(lm.values())
    step = total if not head else total - embed
    vision = sum(p.numel() for n, p in named.items() if n.startswith("visual"))
    return step, total - embed - head, vision


class LinearClock:
    """Time spent inside every linear layer of a model (whatever layout the kernels chose) and
    the floating-point operations done there, while ``on``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on, self.seconds, self.flops = False, 0.0, 0
        for m in model.modules():
            if type(m).__name__.endswith("Linear"):
                m.forward = self._timed(m, m.forward)  # type: ignore[method-assign]

    def _timed(self, m: torch.nn.Module, forward: Callable) -> Callable:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not self.on:
                return forward(x)
            t0 = time.perf_counter()
            y = forward(x)
            self.seconds += time.perf_counter() - t0
            self.flops += 2 * x.numel() * int(m.out_features)  # type: ignore[arg-type]
            return y

        return run

    def rate(self, fn: Callable[[], object]) -> float:
        """TFLOP/s of the linear layers during one call of ``fn``."""
        self.on, self.seconds, self.flops = True, 0.0, 0
        try:
            fn()
        finally:
            self.on = False
        return self.flops / self.seconds / 1e12


def attention_tflops(ops: LayerOps, rows: int, heads: int, d: int, dtype: torch.dtype) -> tuple[float, float]:
    """(a tower's attention over one frame of ``rows`` rows as ``ops`` run it, PyTorch's SDPA)
    in TFLOP/s; where ``ops`` leave the shape to SDPA the two are the same call."""
    q, k, v = (torch.randn(rows, heads, d).to(dtype) for _ in range(3))

    def sdpa() -> object:  # as the tower calls it: [frames, heads, rows, D] views of its rows
        qf, kf, vf = (y.view(1, rows, heads, d).transpose(1, 2) for y in (q, k, v))
        return F.scaled_dot_product_attention(qf, kf, vf)

    def tower() -> object:
        return attend_frames(q, k, v, rows, ops)

    flops = 4 * heads * rows**2 * d
    with torch.inference_mode():
        return flops / _best(tower, 5) / 1e12, flops / _best(sdpa, 5) / 1e12


def text_request(rid: str, tokens: int, out: int, seed: int, vocab: int) -> Request:
    """A prompt of ``tokens`` ids below ``vocab`` no other request shares (the prefix cache is off anyway)."""
    from epdserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    return Request(rid, [(i * 7919 + seed * 104729) % (vocab // 2) for i in range(tokens)], params)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dtype = torch_dtype(args.dtype)
    cfg = ModelConfig.from_pretrained(args.model)
    text = cfg.text
    config = EngineConfig(
        dtype=args.dtype,
        num_kv_blocks=512,
        max_num_batched_tokens=max(2048, args.prompt_tokens),
        enable_prefix_caching=False,
        threads=0,
    )
    engine = EngineCore.from_pretrained(args.model, config)
    model = engine.runner.model
    clock = LinearClock(model)
    visual = model.visual
    vision = cfg.vision
    if vision is None:
        raise SystemExit(f"{args.model} has no vision tower to measure")
    step_params, layer_params, vision_params = weights(model)
    elem = torch.finfo(dtype).bits // 8
    step_weight_bytes = step_params * elem
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * elem
    proc = VisionProcessor(ProcessorConfig.from_pretrained(args.model))
    image = ShapesWorld(0).scene().render().resize((args.image_size, args.image_size), Image.Resampling.BICUBIC)
    v = proc.image(image)
    pixels = torch.as_tensor(v.pixel_values).to(dtype)
    patches = pixels.shape[0]

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = bandwidth_gbs()
        peak = matmul_tflops(2048, 2048, 2048, dtype)
        if dtype != torch.float32:
            peak = max(peak, matmul_tflops(2048, 2048, 2048, torch.float32))
        widest = matmul_tflops(1024, text.hidden_size, text.intermediate_size, dtype)

        # decode at batch 1: a short prompt prefilled, then steps timed one by one
        ctx = 64
        engine.add_request(text_request(f"d{threads}", ctx, args.decode_steps + 8, threads, text.vocab_size))
        engine.step()  # the prefill
        for _ in range(3):
            engine.step()
        steps = []
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        decode_s = statistics.median(steps)
        while engine.has_work:
            engine.step()
        decode_bytes = step_weight_bytes + kv_per_token * (ctx + args.decode_steps)

        # prefill: the whole prompt in one step (the first step of a fresh request)
        prefill = []
        for i in range(3):
            rid = f"p{threads}-{i}"
            engine.add_request(text_request(rid, args.prompt_tokens, 1, 100 * threads + i + 1, text.vocab_size))
            t0 = time.perf_counter()
            out = engine.step()
            prefill.append(time.perf_counter() - t0)
            if not any(o.request_id == rid and o.token_ids for o in out):
                raise SystemExit("the prompt did not fit one step: raise --prompt-tokens' step budget")
            while engine.has_work:
                engine.step()
        prefill_s = min(prefill)
        prefill_flops = 2 * layer_params * args.prompt_tokens
        engine.add_request(text_request(f"l{threads}", args.prompt_tokens, 1, 1000 + threads, text.vocab_size))
        prefill_linears = clock.rate(engine.step)
        while engine.has_work:
            engine.step()

        with torch.inference_mode():
            vision_s = _best(lambda: visual(pixels, [v.grid_thw]), 2)
            vision_linears = clock.rate(lambda: visual(pixels, [v.grid_thw]))
        vision_flops = 2 * vision_params * patches
        frame_rows = int(v.grid_thw[1] * v.grid_thw[2])
        attention, sdpa = attention_tflops(visual.ops, frame_rows, vision.num_heads, vision.head_dim, dtype)

        row = {
            "threads": threads,
            "bandwidth_gbs": bw,
            "peak_tflops": peak,
            "widest_linear_tflops": widest,
            "decode_ms": decode_s * 1e3,
            "decode_bytes": decode_bytes,
            "prefill_tokens": args.prompt_tokens,
            "prefill_s": prefill_s,
            "prefill_tflops": prefill_flops / prefill_s / 1e12,
            "prefill_linears_tflops": prefill_linears,
            "vision_patches": patches,
            "vision_s": vision_s,
            "vision_tflops": vision_flops / vision_s / 1e12,
            "vision_linears_tflops": vision_linears,
            "vision_attention_tflops": attention,
            "vision_attention_sdpa_tflops": sdpa,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    # the bound of a decode step is the machine's: the best bandwidth any thread count reached
    best_bw = max(r["bandwidth_gbs"] for r in rows)
    for r in rows:
        r["decode_bound_ms"] = r["decode_bytes"] / (best_bw * 1e9) * 1e3
    print(
        f"\n{args.model.name}, {args.dtype}: language-model layers {layer_params / 1e9:.2f} B parameters "
        f"(a decode step reads {step_weight_bytes / 1e9:.2f} GB), vision tower {vision_params / 1e9:.2f} B\n"
    )
    columns = (
        "threads | bandwidth GB/s | peak matmul TFLOP/s | decode step ms | bound ms | step/bound | "
        "prefill TFLOP/s | of peak | its linears | of peak | vision TFLOP/s | of peak | its linears | of peak | "
        "its attention | of peak | SDPA's | of peak"
    )
    print(f"| {columns} |")
    print("|" + "---|" * len(columns.split(" | ")))
    for r in rows:
        peak = r["peak_tflops"]
        rates = " | ".join(
            f"{r[key]:.2f} | {r[key] / peak:.0%}"
            for key in (
                "prefill_tflops",
                "prefill_linears_tflops",
                "vision_tflops",
                "vision_linears_tflops",
                "vision_attention_tflops",
                "vision_attention_sdpa_tflops",
            )
        )
        print(
            f"| {r['threads']} | {r['bandwidth_gbs']:.1f} | {peak:.2f} | {r['decode_ms']:.0f} | "
            f"{r['decode_bound_ms']:.0f} | {r['decode_ms'] / r['decode_bound_ms']:.2f}x | {rates} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": {**vars(args), "model": str(args.model), "json": str(args.json)},
                                         "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
