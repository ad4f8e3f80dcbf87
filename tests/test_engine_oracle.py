"""Oracle: the engine's greedy tokens equal transformers' generate on the embedded checkpoint,
for text-only, one image, several images of different sizes, a video, and all of them batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.engine import LLMEngine
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.request import Request
from epdserve.engine.sampling_params import SamplingParams
from epdserve.hf_reference import HFReference
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.shapes import ShapesWorld, render_images

MAX_NEW = 12


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


def cases() -> list[tuple[str, list[dict], list, list]]:
    w = ShapesWorld(99)
    one = w.sample("describe")
    multi = w.sample("describe_nth")
    while len({(sc.width, sc.height) for sc in multi.scenes}) < 2:
        multi = w.sample("describe_nth")
    vid = w.sample("direction")

    def msg(media: list[str], q: str) -> list[dict]:
        return [{"role": "user", "content": [*({"type": m} for m in media), {"type": "text", "text": q}]}]

    return [
        ("text", [{"role": "user", "content": "Describe the image."}], [], []),
        ("image", msg(["image"], one.question), render_images(one), []),
        ("images", msg(["image"] * len(multi.scenes), multi.question), render_images(multi), []),
        ("video", msg(["video"], vid.question), [], [vid.frames]),
        ("image+video", msg(["image", "video"], "Describe the image."), render_images(one), [vid.frames]),
    ]


def engine_request(rid: str, builder: InputBuilder, proc: VisionProcessor, messages, images, videos, eos) -> Request:
    media = []
    it_i, it_v = iter(images), iter(videos)
    for part in messages[0]["content"] if isinstance(messages[0]["content"], list) else []:
        if part["type"] == "image":
            v = proc.image(next(it_i))
        elif part["type"] == "video":
            v = proc.video(next(it_v))
        else:
            continue
        media.append(MediaInput(f"{rid}-{len(media)}", part["type"], v.grid_thw, torch.from_numpy(v.pixel_values)))
    p = builder.build(messages, media)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return Request(rid, p.token_ids, params, p.mm_items, p.mrope_positions, p.mrope_delta, eos_token_ids=eos)


def test_greedy_tokens_match_transformers_alone_and_batched(model_dir: Path, ref: HFReference) -> None:
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    eng = LLMEngine.from_pretrained(model_dir, EngineConfig(max_num_batched_tokens=64, num_kv_blocks=256))
    builder = InputBuilder(eng.tokenizer, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    expected = {}
    for name, messages, images, videos in cases():
        inputs = ref.inputs(messages, images=images, videos=videos)
        expected[name] = ref.generate_ids(inputs, max_new_tokens=MAX_NEW)
    # each alone, then all concurrently (chunked prefill: budget 64 splits the longer prompts)
    for name, messages, images, videos in cases():
        eng.add_request(engine_request(name, builder, proc, messages, images, videos, eos))
        assert run(eng)[name] == expected[name], name
    for name, messages, images, videos in cases():
        eng.add_request(engine_request(name + "#b", builder, proc, messages, images, videos, eos))
    got = run(eng)
    for name in expected:
        assert got[name + "#b"] == expected[name], name
    eng.scheduler.blocks.check_integrity()


def run(eng: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out
