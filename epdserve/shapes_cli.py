"""The shapes world's commands: ``epdserve demo`` (ask the embedded model, here or on a running
server), ``eval-shapes`` and ``train-shapes``; ``CommandError``, a command's one-line error."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from epdserve.assets import default_model_dir
from epdserve.security.credentials import API_KEY_ENV


class CommandError(Exception):
    """What went wrong and what to do, as one line: the command's error, without a traceback."""


def demo(args: argparse.Namespace) -> int:
    if not args.url:
        return _ask_shapes(args, _local_asker(args.model))
    import openai

    url = args.url
    try:
        return _ask_shapes(args, _server_asker(url, args.api_key))
    except openai.APIConnectionError:
        raise CommandError(f"no server answers at {url}: start one with 'epdserve up', or check --url") from None
    except openai.AuthenticationError:
        raise CommandError(
            f"the server at {url} refused the API key: pass its key with --api-key KEY (or set {API_KEY_ENV})"
        ) from None
    except openai.NotFoundError:
        raise CommandError(f"{url} serves no OpenAI API under /v1: --url takes the server's address") from None
    except openai.APIStatusError as e:
        raise CommandError(f"the server at {url} answered {e.status_code}: {e.message}") from None


def _ask_shapes(args: argparse.Namespace, ask: Callable[[str, list, list], str]) -> int:
    from epdserve.shapes import ShapesWorld, render_images

    world = ShapesWorld(args.seed)
    right = 0
    for _ in range(args.n):
        sample = world.sample()
        answer = ask(sample.question, render_images(sample), sample.frames)
        media = "video" if sample.video is not None else f"{len(sample.scenes)} image(s)"
        right += answer == sample.answer
        mark = "ok" if answer == sample.answer else "WRONG"
        print(f"[{media}] {sample.question} -> {answer!r} (expected {sample.answer!r}) {mark}")
    print(f"{right}/{args.n} exact")
    return 0


def _local_asker(model: str | None):
    from epdserve.hf_reference import HFReference

    ref = HFReference(model or default_model_dir())
    return lambda q, images, frames: ref.answer(q, images=images or None, video=frames or None)


def _server_asker(url: str, api_key: str | None = None):
    import openai

    from epdserve.bench.client import server_url
    from epdserve.bench.workload import gif_data_url, image_data_url
    from epdserve.security.credentials import api_key_from

    # the server's API key: the flag, else the environment's, as every client of the deployment reads it
    client = openai.OpenAI(base_url=server_url(url) + "/v1", api_key=api_key_from(api_key) or "none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(q: str, images: list, frames: list) -> str:
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
        if frames:
            parts.append({"type": "video_url", "video_url": {"url": gif_data_url(frames)}})
        messages: Any = [{"role": "user", "content": [*parts, {"type": "text", "text": q}]}]
        r = client.chat.completions.create(model=model, temperature=0, messages=messages)
        return r.choices[0].message.content or ""

    return ask


def eval_shapes(args: argparse.Namespace) -> int:
    from epdserve.evaluate import main as eval_main

    return eval_main(args)


def train_shapes(args: argparse.Namespace) -> int:
    from epdserve.training.train import train

    train(args)
    return 0


def add_demo_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--seed", type=int, default=7, help="seed of the generated images and questions")
    s.add_argument("-n", type=int, default=5, help="number of questions")
    s.add_argument(
        "--url", default=None, help="ask a running server instead (e.g. http://127.0.0.1:8000, with or without /v1)"
    )
    s.add_argument("--api-key", default=None, help=f"the server's API key with --url (default: ${API_KEY_ENV})")


def add_eval_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--per-type", type=int, default=60, help="questions per question type")
    s.add_argument("--seed", type=int, default=20261130, help="held-out seed (training uses other seeds)")
    s.add_argument("--ablations", action="store_true", help="also run with zeroed and swapped vision embeddings")
    s.add_argument("--json", default=None, help="write the report as JSON to this file")
    s.add_argument(
        "--no-vision-ids",
        action="store_true",
        help="render prompts with add_vision_id=False (no 'Picture N: ' before each image)",
    )


def add_train_args(s: argparse.ArgumentParser) -> None:
    from epdserve.training.args import add_arguments

    add_arguments(s)
