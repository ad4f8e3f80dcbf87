"""Benchmark: epdserve (aggregated, or a split topology) vs transformers ``generate``, same requests.

For each concurrency level the same image requests (shapes-world images, fixed output length
via min_tokens/ignore_eos) go to a freshly started ``epdserve serve`` (or ``up`` of each of
``--topologies``, roles pinned) over HTTP (closed loop, N clients) and to transformers in this
process (batches of N, left-padded, greedy). Prints request
throughput, output tokens/s, TTFT p50/p99 and TPOT p50 side by side; with ``--runs`` the two
systems take turns, and the summary is each ratio's median over the runs.

    python -m epdserve.bench.engine_vs_hf --requests 32 --output-len 64 --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from epdserve.assets import default_model_dir
from epdserve.bench.client import RequestResult
from epdserve.bench.closed_loop import closed_loop, summarize
from epdserve.bench.workload import image_payload
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.shapes import SIDES, ShapesWorld
from epdserve.topology import Topology
from epdserve.up import Deployment

Request = tuple[str, list[Image.Image]]  # a question and its images


def make_requests(n: int, seed: int, size: int | None, images: int = 1) -> list[Request]:
    world = ShapesWorld(seed)
    out = []
    for _ in range(n):
        s = world.sample("describe")
        imgs = [s.scenes[0].render() if i == 0 else world.scene().render() for i in range(images)]
        out.append((s.question, [img.resize((size, size)) if size else img for img in imgs]))
    return out


def server_payloads(model: str, reqs: list[Request], out_len: int) -> list[tuple[str, dict]]:
    return [("image", image_payload(model, q, imgs, out_len)) for q, imgs in reqs]


def run_hf(
    model_dir: Path, reqs, out_len: int, conc: int, device: str = "cpu", dtype: str = "float32"
) -> tuple[list[RequestResult], float]:
    from epdserve.hf_reference import HFReference

    ref = HFReference(model_dir)
    try:
        return _generate(ref, reqs, out_len, conc, device, dtype)
    finally:  # the model's reference cycles would keep every load of it resident
        del ref
        gc.collect()


def _generate(ref, reqs, out_len: int, conc: int, device: str, dtype: str) -> tuple[list[RequestResult], float]:
    from transformers import LogitsProcessor, LogitsProcessorList

    from epdserve.common.dtypes import torch_dtype

    ref.model.to(device=device, dtype=torch_dtype(dtype))
    ref.tok.padding_side = "left"

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.t: float | None = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    results: list[RequestResult] = []
    t_start = time.perf_counter()
    for i in range(0, len(reqs), conc):
        batch = reqs[i : i + conc]
        inputs = [ref.inputs([_msg(q, len(imgs))], images=imgs) for q, imgs in batch]
        merged = {k: v.to(device) for k, v in _left_pad(inputs, ref.tok.pad_token_id).items()}
        merged["pixel_values"] = merged["pixel_values"].to(torch_dtype(dtype))
        ft = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref.model.generate(
                **merged,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                logits_processor=LogitsProcessorList([ft]),
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        # a batch of `conc` requests arrives together (closed loop of `conc` clients): its first
        # token comes after the batched prefill, its end after the batched decode
        for _ in batch:
            results.append(
                RequestResult(ok=True, status=200, ttft=(ft.t or t1) - t0, e2e=t1 - t0, output_tokens=out_len)
            )
    return results, time.perf_counter() - t_start


def _msg(q: str, images: int) -> dict:
    return {"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": q}]}


def _left_pad(inputs: list[dict], pad_id: int) -> dict:
    n = max(x["input_ids"].shape[1] for x in inputs)
    out: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        fill = pad_id if key == "input_ids" else 0
        rows = [torch.nn.functional.pad(x[key], (n - x[key].shape[1], 0), value=fill) for x in inputs]
        out[key] = torch.cat(rows)
    out["pixel_values"] = torch.cat([x["pixel_values"] for x in inputs])
    out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in inputs])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_dir())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--image-size", type=int, default=0, help=f"resize images to this square side (0: native {SIDES} sizes)"
    )
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both the server and transformers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where both systems run")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 for both systems")
    ap.add_argument("--topologies", default="aggregated", help="epdserve's, comma-separated (split ones start pinned)")
    ap.add_argument("--runs", type=int, default=1, help="repeat both systems in turn; the summary is the median ratio")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, startups = [], []
    for run in range(args.runs):
        # new images for every run and concurrency level (the same for both systems): a level
        # never hits the prefix or encoder cache a previous one filled
        reqs = {
            c: make_requests(
                args.requests, args.seed + 1000 * run + 100 * (i + 1), args.image_size or None, args.images_per_request
            )
            for i, c in enumerate(args.concurrency)
        }
        warm = make_requests(4, args.seed + 1000 * run + 1, args.image_size or None, args.images_per_request)
        for topology in args.topologies.split(","):
            startup, served = _serve(args, topology, reqs, warm)
            startups.append(startup)
            rows += [{"run": run, "system": f"epdserve:{topology}", **r} for r in served]
        run_hf(args.model, warm, args.output_len, 4, args.device, args.dtype)
        for c in args.concurrency:
            res, wall = run_hf(args.model, reqs[c], args.output_len, c, args.device, args.dtype)
            rows.append({"run": run, "system": "transformers", "concurrency": c, **summarize(res, wall)})
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nepdserve startup to healthy: {statistics.median(startups):.1f}s (median); {args.requests} requests of "
        f"{args.images_per_request} image(s), {args.output_len} output tokens, {args.runs} run(s)\n"
    )
    print("| run | system | conc | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['system']} | {r['concurrency']} | {r['req_per_s']:.3f} | {r['out_tok_per_s']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} |"
        )
    print("\nepdserve over transformers, median over runs (each run's ratio in brackets)\n")
    print("| topology | conc | req/s | TTFT p50 | TTFT p99 | TPOT p50 |")
    print("|---|---|---|---|---|---|")
    for topology in args.topologies.split(","):
        for c in args.concurrency:
            cells = [_ratios(rows, f"epdserve:{topology}", run, c) for run in range(args.runs)]
            medians = " | ".join(_median_cell([x[k] for x in cells]) for k in RATIOS)
            print(f"| {topology} | {c} | {medians} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"startup_s": startups, "rows": rows}, indent=2))


RATIOS = ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


def _serve(
    args: argparse.Namespace, topology: str, reqs: dict[int, list[Request]], warm: list[Request]
) -> tuple[float, list[dict]]:
    """A fresh ``epdserve`` of ``topology``: warm it, then each concurrency level's requests."""
    url, startup, end = _start(args, topology)
    rows = []
    try:
        name = args.model.name
        asyncio.run(closed_loop(url, server_payloads(name, warm, args.output_len), 4))
        for c in args.concurrency:
            res, wall = asyncio.run(closed_loop(url, server_payloads(name, reqs[c], args.output_len), c))
            rows.append({"concurrency": c, **summarize(res, wall)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        end()
    return startup, rows


def _start(args: argparse.Namespace, topology: str) -> tuple[str, float, Callable[[], None]]:
    """``epdserve serve`` with ``--threads`` for aggregated, else ``up`` of the topology with its
    roles pinned: its URL, its start-up seconds and how to stop it."""
    limit = ["--limit-mm-per-prompt", json.dumps({"image": args.images_per_request})]
    models = ["--device", args.device, "--dtype", args.dtype]
    if topology != "aggregated":
        d = Deployment(
            Topology.parse(topology), str(args.model), port=free_port(), pin=True, extra_encoder_args=models,
            extra_pd_args=models, extra_args=limit,
        )  # fmt: skip
        d.start()
        return d.url, d.startup_s, d.stop
    port = free_port()
    serve = ["serve", "--model", str(args.model), "--port", str(port), "--threads", str(args.threads)]
    proc = start_role([*serve, *models, *limit])
    try:
        startup = wait_healthy(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        stop(proc)
        raise
    return f"http://127.0.0.1:{port}", startup, lambda: stop(proc)


def _ratios(rows: list[dict], system: str, run: int, conc: int) -> dict[str, float]:
    ours, theirs = ({**r} for s in (system, "transformers") for r in rows
                    if (r["run"], r["system"], r["concurrency"]) == (run, s, conc))  # fmt: skip
    return {k: ours[k] / theirs[k] if theirs[k] else float("nan") for k in RATIOS}


def _median_cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [" + ", ".join(f"{v:.2f}" for v in values) + "]"


if __name__ == "__main__":
    main()
