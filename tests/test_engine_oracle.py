"""Oracle: the engine's greedy tokens equal transformers' generate on the embedded checkpoint,
for text-only, one image, several images of different sizes, a video, and all of them batched."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore, request_from
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, WireTensor
from epdserve.engine.request import Request
from epdserve.hf_reference import HFReference
from epdserve.kernels import KernelChoice
from epdserve.kernels import ops as kernel_ops
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.shapes import ShapesWorld, render_images
from tests.engine_utils import assert_alone_then_batched, cases, drain
from tests.server_utils import TEST_DEVICE

MAX_NEW = 12


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


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
        media.append(MediaInput(f"{rid}-{len(media)}", part["type"], v.grid_thw, v.pixel_values))
    p = builder.build(messages, media)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
    return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta, list(eos)))


@pytest.mark.parametrize(
    ("kernels", "chunk_budget"),
    [("auto", None), ("auto", 0), ("torch", None)],
    ids=["fused-kernels", "fused-kernels-sdpa-prefill", "torch-mirrored-decode-kv"],
)
def test_greedy_tokens_match_transformers_alone_and_batched(
    model_dir: Path,
    ref: HFReference,
    kernels: KernelChoice,
    chunk_budget: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if chunk_budget is not None:  # prompt chunks through SDPA, not the kernels' row-wise attention
        monkeypatch.setattr(kernel_ops, "CHUNK_ROWS_BUDGET", chunk_budget)
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    eng = EngineCore.from_pretrained(
        model_dir,
        EngineConfig(
            device=TEST_DEVICE,
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            kernels=kernels,
        ),
    )
    if kernels == "torch":  # the one path without the kernels
        assert eng.runner.decode.name == "torch" and eng.runner.decode.mirror is not None
    builder = InputBuilder(ref.tok, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    expected = {}
    for name, messages, images, videos in cases():
        inputs = ref.inputs(messages, images=images, videos=videos)
        expected[name] = ref.generate_ids(inputs, max_new_tokens=MAX_NEW)
    # each alone, then all concurrently (chunked prefill: budget 64 splits the longer prompts)
    assert_alone_then_batched(
        eng, lambda sfx: [engine_request(n + sfx, builder, proc, m, i, v, eos) for n, m, i, v in cases()], expected
    )


def test_prefix_cache_never_reuses_blocks_across_different_images(model_dir: Path, ref: HFReference) -> None:
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    eng = EngineCore.from_pretrained(
        model_dir, EngineConfig(device=TEST_DEVICE, block_size=4, num_kv_blocks=256, max_model_len=1024)
    )
    builder = InputBuilder(ref.tok, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    world = ShapesWorld(4)
    a = world.sample("describe")
    b = world.sample("describe")
    while (b.scenes[0].width, b.scenes[0].height) != (a.scenes[0].width, a.scenes[0].height) or b.answer == a.answer:
        b = world.sample("describe")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": a.question}]}]
    ra = engine_request("a", builder, proc, msgs, render_images(a), [], eos)
    ra.mm_items[0].uuid = "uuid-a"
    eng.add_request(ra)
    drain(eng)
    rb = engine_request("b", builder, proc, msgs, render_images(b), [], eos)
    rb.mm_items[0].uuid = "uuid-b"
    image_offset = rb.mm_items[0].offset
    eng.add_request(rb)
    got = drain(eng)["b"]
    assert got == ref.generate_ids(ref.inputs(msgs, images=render_images(b)), max_new_tokens=MAX_NEW)
    assert 0 < rb.num_cached_tokens <= image_offset  # the text before the image is shared, nothing after
    # the same image again reuses everything but the last block
    rc = engine_request("c", builder, proc, msgs, render_images(b), [], eos)
    rc.mm_items[0].uuid = "uuid-b"
    eng.add_request(rc)
    assert drain(eng)["c"] == got
    assert rc.num_cached_tokens > rb.mm_items[0].end


def test_preemption_under_kv_pressure_keeps_outputs_exact(model_dir: Path, ref: HFReference) -> None:
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    eos = frozenset(ref.model.generation_config.eos_token_id)
    world = ShapesWorld(12)
    samples = [world.sample("describe") for _ in range(5)]
    msgs = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}] for s in samples]
    expected = {
        f"r{i}": ref.generate_ids(ref.inputs(m, images=render_images(s)), max_new_tokens=MAX_NEW)
        for i, (m, s) in enumerate(zip(msgs, samples, strict=True))
    }
    # room for the two longest prompts, not for their outputs: decoding must preempt
    bs = 8
    probe = InputBuilder(ref.tok, cfg)
    lengths = sorted(
        engine_request("p", probe, proc, m, render_images(s), [], eos).prompt_len
        for m, s in zip(msgs, samples, strict=True)
    )
    blocks = -(-lengths[-1] // bs) + -(-lengths[-2] // bs)
    eng = EngineCore.from_pretrained(
        model_dir,
        EngineConfig(
            device=TEST_DEVICE,
            block_size=bs,
            num_kv_blocks=blocks,
            max_model_len=blocks * bs,
            enable_prefix_caching=False,
        ),
    )
    builder = InputBuilder(ref.tok, cfg)
    for i, (m, s) in enumerate(zip(msgs, samples, strict=True)):
        eng.add_request(engine_request(f"r{i}", builder, proc, m, render_images(s), [], eos))
    got = drain(eng)
    assert got == expected
    assert eng.scheduler.num_preemptions > 0
    eng.scheduler.blocks.check_integrity()
    assert eng.scheduler.blocks.num_free == blocks


def test_a_step_encodes_each_image_once_and_a_bad_item_fails_only_its_request(
    model_dir: Path, ref: HFReference, caplog: pytest.LogCaptureFixture
) -> None:
    """Every image of a step goes through the vision tower in one forward, an image two requests
    share once; an item the tower refuses fails its own request and the others run as alone (the
    failed batched forward is logged, not swallowed)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    builder = InputBuilder(ref.tok, cfg)
    world = ShapesWorld(11)
    a, b = world.scene().render(), world.scene().render()
    va, vb = proc.image(a), proc.image(b)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]

    def request(rid: str, uuid: str, v, pixels=None) -> Request:
        p = builder.build(msgs, [MediaInput(uuid, "image", v.grid_thw, v.pixel_values if pixels is None else pixels)])
        pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta))

    alone = {}
    for rid, uuid, v in (("a", "img-a", va), ("b", "img-b", vb)):
        eng = EngineCore.from_pretrained(model_dir, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256))
        eng.add_request(request(rid, uuid, v))
        alone[rid] = drain(eng)[rid]

    eng = EngineCore.from_pretrained(model_dir, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256))
    for req in (request("a1", "img-a", va), request("a2", "img-a", va), request("b", "img-b", vb)):
        eng.add_request(req)
    got = drain(eng)
    assert eng.runner.vision_patches == va.pixel_values.shape[0] + vb.pixel_values.shape[0]  # one forward each
    assert got["a1"] == got["a2"] == alone["a"] and got["b"] == alone["b"]

    eng = EngineCore.from_pretrained(model_dir, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256))
    eng.add_request(request("a", "img-a", va))
    eng.add_request(request("bad", "img-bad", va, pixels=va.pixel_values[:-4]))  # fewer patches than its grid
    eng.add_request(request("b", "img-b", vb))
    outs: dict[str, list[int]] = {}
    errors = {}
    while eng.has_work:
        for o in eng.step():
            if o.error is not None:
                errors[o.request_id] = o.error
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert set(errors) == {"bad"} and "vision encoding failed" in errors["bad"]
    assert outs["a"] == alone["a"] and outs["b"] == alone["b"]
    batched = [r for r in caplog.records if r.name == "epdserve.engine.model_runner" and "one batch" in r.message]
    assert len(batched) == 1 and batched[0].levelname == "WARNING" and "patches" in batched[0].message


def test_the_vision_estimate_counts_only_what_the_tower_would_run(model_dir: Path, ref: HFReference) -> None:
    """What the scheduler's vision budget reads: the patches of the items a chunk reaches that
    the tower must encode (none cached, none with embeddings), at the rate last timed."""
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    builder = InputBuilder(ref.tok, cfg)
    world = ShapesWorld(12)
    va, vb = proc.image(world.scene().render()), proc.image(world.scene().render())
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]

    def request(rid: str, uuid: str, v) -> Request:
        p = builder.build(msgs, [MediaInput(uuid, "image", v.grid_thw, v.pixel_values)])
        pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta))

    eng = EngineCore.from_pretrained(model_dir, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256))
    runner = eng.runner
    first = request("a", "img-a", va)
    assert runner.vision_cost(first, 0, first.prompt_len) == 0  # nothing timed yet: no estimate
    eng.add_request(first)
    drain(eng)
    assert runner.vision_rate.value > 0
    fresh = request("b", "img-b", vb)
    want = vb.pixel_values.shape[0] * runner.vision_rate.value
    assert runner.vision_cost(fresh, 0, fresh.prompt_len) == pytest.approx(want)
    assert runner.vision_cost(fresh, 0, fresh.mm_items[0].offset) == 0  # a chunk that stops before it
    again = request("a2", "img-a", va)
    assert runner.vision_cost(again, 0, again.prompt_len) == 0  # in the encoder cache
