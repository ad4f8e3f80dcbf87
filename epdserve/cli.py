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


def _serve(args: argparse.Namespace) -> int:
    import json
    import logging
    from pathlib import Path

    from epdserve.api.server import ServerConfig, serve
    from epdserve.engine.config import EngineConfig
    from epdserve.media.limits import MediaLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mm = json.loads(args.limit_mm_per_prompt) if args.limit_mm_per_prompt else {}
    limits = MediaLimits(
        max_images_per_prompt=int(mm.get("image", 8)),
        max_videos_per_prompt=int(mm.get("video", 2)),
        allow_private_addresses=args.allow_private_media,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        fetch_timeout_s=args.media_fetch_timeout,
    )
    engine = EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        threads=args.threads,
    )
    config = ServerConfig(
        model=Path(args.model or default_model_dir()),
        served_model_name=args.served_model_name or "",
        host=args.host,
        port=args.port,
        engine=engine,
        limits=limits,
    )
    serve(config)
    return 0


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """Flags of a language-model instance, named as in vLLM where vLLM has them."""
    s.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: directory name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=1024)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, default=2048)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--threads", type=int, default=0, help="torch threads for the engine (0: torch default)")
    s.add_argument("--limit-mm-per-prompt", default=None, help='JSON, e.g. \'{"image": 8, "video": 2}\'')
    s.add_argument("--allowed-media-domains", nargs="*", default=None, help="hosts allowed for http(s) media")
    s.add_argument(
        "--allow-private-media", action="store_true", help="allow fetching media from private/loopback addresses"
    )
    s.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds per http(s) media fetch")


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

    s = sub.add_parser("serve", help="serve the model: OpenAI-compatible API (aggregated E+P+D)")
    add_engine_args(s)
    commands["serve"] = _serve

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
