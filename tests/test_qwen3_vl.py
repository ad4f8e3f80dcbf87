"""Qwen3-VL against transformers on a small random-weight checkpoint built offline
(``tests.checkpoints.qwen3_vl``): the vision tower with every DeepStack level, the engine's greedy
tokens (DeepStack injected chunk by chunk), and the EC contract's feature levels."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import re
from pathlib import Path
from types import MethodType, SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import ImageEmbedsPart, VideoEmbedsPart
from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore, request_from
from epdserve.engine.inputs import InputBuilder, MediaInput, PromptError
from epdserve.engine.messages import AddRequest, WireTensor
from epdserve.engine.request import Request
from epdserve.hf_reference import model_inputs
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.models.loader import load_model
from epdserve.models.qwen3_vl import Qwen3VLForConditionalGeneration
from epdserve.pd.embeds import MetadataEmbeds
from epdserve.shapes import ShapesWorld, render_images
from epdserve.transfer import header as wire
from epdserve.transfer.base import PROTOCOL_VERSION, InvalidHandle, TransferError
from epdserve.transfer.factory import make_consumer, make_producer
from tests.checkpoints import build
from tests.engine_utils import assert_alone_then_batched, drain
from tests.numerics import assert_close_rel
from tests.server_utils import TEST_DEVICE

MAX_NEW = 12
BUDGET = 8  # tokens per step: shorter than every image's placeholder run, so chunks split runs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"), seed=0)


@pytest.fixture(scope="module")
def hf(ckpt: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

    return HFQwen3VL.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(ckpt: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


# ---- the vision tower -----------------------------------------------------------------------


def test_config_and_parts(ckpt: Path) -> None:
    cfg = ModelConfig.from_pretrained(ckpt)
    assert cfg.vision_config.deepstack_visual_indexes == (1, 3)
    assert cfg.feature_levels == 3
    assert cfg.text.head_dim == 48 != cfg.text.hidden_size // cfg.text.num_attention_heads
    assert cfg.text.qk_norm and cfg.text.mrope_interleaved and not cfg.text.attention_bias
    assert cfg.modalities == {"image", "video"}
    vision, report = load_model(ckpt, parts=frozenset({"vision"}))
    assert isinstance(vision, Qwen3VLForConditionalGeneration) and vision.language_model is None
    assert all(n.startswith("model.visual.") for n in report.tensors)
    language, report = load_model(ckpt, parts=frozenset({"language"}))
    assert language.visual is None
    assert not any("visual" in n for n in report.tensors)


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 8, 8)],  # the learned table's own size: no interpolation
        [(1, 6, 10), (1, 12, 4), (2, 4, 4)],  # interpolated, non-square, two frames, batched
    ],
    ids=["table-size", "interpolated-batch"],
)
def test_vision_tower_equals_transformers_at_every_level(ckpt: Path, hf, grids: list) -> None:  # type: ignore[no-untyped-def]
    model, _ = load_model(ckpt, parts=frozenset({"vision"}))
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, model.config.vision_config.patch_dim, generator=torch.Generator().manual_seed(1))
    grid = torch.tensor(grids)
    with torch.inference_mode():
        out = hf.model.visual(pixels, grid_thw=grid, return_dict=True)
        ours = model.visual(pixels, grid)
    hidden = model.config.text.hidden_size
    expected = [out.pooler_output, *out.deepstack_features]
    assert ours.shape == (patches // 4, len(expected) * hidden)
    for level, ref in enumerate(expected):
        assert_close_rel(ours[:, level * hidden : (level + 1) * hidden], ref)


def test_processor_settings_are_read_and_equal_transformers(ckpt: Path) -> None:
    """Qwen3-VL's processor config spells the pixel bounds ``size: {shortest_edge, longest_edge}``;
    with patch 16 and mean/std 0.5 our patches equal transformers' image processor's."""
    from transformers import AutoImageProcessor

    ref = AutoImageProcessor.from_pretrained(ckpt)
    cfg = ProcessorConfig.from_pretrained(ckpt)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size) == (64 * 64, 160 * 160, 16)
    proc = VisionProcessor(cfg)
    for im in [*_cases()[2][2], _cases()[1][2][0].resize((300, 90))]:
        expected = ref(images=[im], return_tensors="np")
        ours = proc.image(im)
        assert [list(ours.grid_thw)] == expected["image_grid_thw"].tolist()
        assert_close_rel(ours.pixel_values, expected["pixel_values"])


# ---- the engine against transformers' generate ----------------------------------------------


def _cases() -> list[tuple[str, list[dict], list[Image.Image]]]:
    w = ShapesWorld(7)
    one = w.sample("describe")
    multi = w.sample("describe_nth")
    while len(multi.scenes) != 2 or multi.scenes[0].width * multi.scenes[0].height == (
        multi.scenes[1].width * multi.scenes[1].height
    ):
        multi = w.sample("describe_nth")

    def msg(n: int, q: str) -> list[dict]:
        return [{"role": "user", "content": [*({"type": "image"} for _ in range(n)), {"type": "text", "text": q}]}]

    return [
        ("text", [{"role": "user", "content": "Describe the image."}], []),
        ("image", msg(1, one.question), render_images(one)),
        ("images", msg(2, multi.question), render_images(multi)),
    ]


def _hf_inputs(tok, proc: VisionProcessor, cfg: ModelConfig, messages: list[dict], images: list) -> dict:  # type: ignore[no-untyped-def]
    """transformers' inputs, expanded and typed here independently of the code under test."""
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    vis = [proc.image(im) for im in images]
    grids = iter(v.grid_thw for v in vis)
    expanded: list[int] = []
    for t in ids["input_ids"]:
        if t == cfg.image_token_id:
            gt, gh, gw = next(grids)
            expanded += [t] * (gt * gh * gw // 4)
        else:
            expanded.append(t)
    input_ids = torch.tensor([expanded])
    out = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == cfg.image_token_id).long(),
    }
    if vis:
        out["pixel_values"] = torch.from_numpy(np.concatenate([v.pixel_values for v in vis]))
        out["image_grid_thw"] = torch.tensor([v.grid_thw for v in vis])
    return out


def _request(rid: str, builder: InputBuilder, proc: VisionProcessor, messages, images, eos) -> Request:  # type: ignore[no-untyped-def]
    media = [
        MediaInput(f"{rid}-{i}", "image", v.grid_thw, v.pixel_values) for i, v in enumerate(map(proc.image, images))
    ]
    p = builder.build(messages, media)
    pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta, list(eos)))


def _eos(hf, tok) -> frozenset[int]:  # type: ignore[no-untyped-def]
    """The end tokens transformers' generate stops at."""
    eos = hf.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else []) or frozenset(
        {tok.convert_tokens_to_ids("<|im_end|>")}
    )


def test_greedy_tokens_match_transformers_alone_and_batched(ckpt: Path, hf, tok) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    assert proc.config.patch_size == 16 and proc.config.image_mean == (0.5, 0.5, 0.5)
    eos = _eos(hf, tok)
    expected = {}
    for name, messages, images in _cases():
        inputs = _hf_inputs(tok, proc, cfg, messages, images)
        with torch.inference_mode():
            out = hf.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        expected[name] = out[0, inputs["input_ids"].shape[1] :].tolist()
    eng = EngineCore.from_pretrained(
        ckpt, EngineConfig(device=TEST_DEVICE, max_num_batched_tokens=BUDGET, num_kv_blocks=256, max_model_len=1024)
    )
    builder = InputBuilder(tok, cfg)
    for name, messages, images in _cases():
        req = _request(name, builder, proc, messages, images, eos)
        assert all(it.length > BUDGET for it in req.mm_items)  # every run is split by a chunk boundary
        eng.add_request(req)
        assert drain(eng)[name] == expected[name], name
    # all at once, under other uuids (no encoder-cache or prefix-cache hits): batched chunks
    for name, messages, images in _cases():
        eng.add_request(_request(name + "#b", builder, proc, messages, images, eos))
    got = drain(eng)
    for name in expected:
        assert got[name + "#b"] == expected[name], name
    eng.scheduler.blocks.check_integrity()


def test_deepstack_levels_change_the_answer(ckpt: Path, hf, tok) -> None:  # type: ignore[no-untyped-def]
    """The levels beyond the first matter (the parity above would not notice them missing if
    they did not): transformers without its DeepStack input answers differently."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    _, messages, images = _cases()[1]
    inputs = _hf_inputs(tok, proc, cfg, messages, images)
    with torch.inference_mode():
        full = hf(**inputs).logits[0, -1]
        lm = hf.model.language_model
        original = lm._deepstack_process
        lm._deepstack_process = lambda hidden, mask, embeds: hidden  # type: ignore[method-assign]
        try:
            plain = hf(**inputs).logits[0, -1]
        finally:
            lm._deepstack_process = original  # type: ignore[method-assign]
    assert float((full - plain).abs().max()) > 1e-2 * float(full.abs().max())


# ---- video: a timestamped run per frame group ----------------------------------------------


def _hf_video_text(grid_thw: tuple[int, int, int], fps: float, temporal_patch_size: int) -> str:
    """transformers' own expansion of one video placeholder (``Qwen3VLProcessor.replace_video_token``,
    timestamps from ``_calculate_timestamps``) for frames 0 .. t*temporal_patch_size - 1 at ``fps``.
    (The processor is not built whole: its video processor needs torchvision.)"""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=temporal_patch_size),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
    )
    processor._calculate_timestamps = MethodType(Qwen3VLProcessor._calculate_timestamps, processor)  # type: ignore[attr-defined]
    frames = grid_thw[0] * temporal_patch_size
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))
    inputs = {"video_grid_thw": torch.tensor([grid_thw]), "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(processor, inputs, 0)  # type: ignore[arg-type]


def _hf_video_inputs(tok, proc: VisionProcessor, messages: list[dict], images: list, videos: list) -> dict:  # type: ignore[no-untyped-def]
    """transformers' inputs: the processor's text expansion of every placeholder, then the whole
    text tokenized at once (as ``Qwen3VLProcessor.__call__`` does), with our pixels."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    imgs, vids = [proc.image(im) for im in images], [proc.video(v) for v in videos]
    it_i, it_v = iter(imgs), iter(vids)
    pieces = []
    for piece in re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", text):
        if piece == "<|image_pad|>":
            t, h, w = next(it_i).grid_thw
            piece *= t * h * w // 4
        elif piece == "<|video_pad|>":
            piece = _hf_video_text(next(it_v).grid_thw, proc.config.video_fps, proc.config.temporal_patch_size)
        pieces.append(piece)
    input_ids = torch.tensor([tok("".join(pieces), add_special_tokens=False)["input_ids"]])
    image, video = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")
    return model_inputs(input_ids, image, video, imgs, vids)


def _video_cases() -> list[tuple[str, list[dict], list[Image.Image], list[list[Image.Image]]]]:
    w = ShapesWorld(11)
    one = w.sample("describe")
    vid = w.sample("direction")
    longer = w.sample("direction")
    six = [*longer.frames, *longer.frames[:2]]  # three frame groups

    def msg(media: list[str], q: str) -> list[dict]:
        return [{"role": "user", "content": [*({"type": m} for m in media), {"type": "text", "text": q}]}]

    return [
        ("video", msg(["video"], vid.question), [], [vid.frames]),
        ("video3", msg(["video"], longer.question), [], [six]),
        ("image+video", msg(["image", "video"], "Describe the image."), render_images(one), [vid.frames]),
        ("video+image+video", msg(["video", "image", "video"], "?"), render_images(one), [six, vid.frames]),
    ]


def _media(rid: str, proc: VisionProcessor, messages: list[dict], images: list, videos: list) -> list[MediaInput]:
    it_i, it_v = iter(images), iter(videos)
    media = []
    for part in messages[0]["content"]:
        if part["type"] == "image":
            v, second = proc.image(next(it_i)), None
        elif part["type"] == "video":
            v, second = proc.video(next(it_v)), proc.config.second_per_grid
        else:
            continue
        uuid = f"{rid}-{len(media)}"
        media.append(MediaInput(uuid, part["type"], v.grid_thw, v.pixel_values, second_per_grid=second))
    return media


def _video_request(rid: str, builder: InputBuilder, proc: VisionProcessor, messages, images, videos, eos) -> Request:  # type: ignore[no-untyped-def]
    p = builder.build(messages, _media(rid, proc, messages, images, videos))
    pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta, list(eos)))


def test_video_prompt_and_positions_equal_transformers(ckpt: Path, hf, tok) -> None:  # type: ignore[no-untyped-def]
    """Timestamped frame groups, tokenized like the processor's whole text, and
    ``get_rope_index``'s positions (each group an image-like run), with images around them."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    assert proc.config.video_fps == 2.0 and proc.config.second_per_grid == 1.0
    builder = InputBuilder(tok, cfg)
    for name, messages, images, videos in _video_cases():
        inputs = _hf_video_inputs(tok, proc, messages, images, videos)
        p = builder.build(messages, _media(name, proc, messages, images, videos))
        assert p.token_ids == inputs["input_ids"][0].tolist(), name
        expected, delta = hf.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            inputs["attention_mask"],
        )
        assert p.mrope_positions is not None
        assert np.array_equal(p.mrope_positions, expected[:, 0].numpy()), name
        assert p.mrope_delta == int(delta), name
        # every frame group's run holds its rows, in order, between its own vision start and end
        ids = np.asarray(p.token_ids)
        for it in p.mm_items:
            if it.modality == "video":
                t, h, w = it.grid_thw
                assert len(it.runs) == t and all(k == h * w // 4 for _, k in it.runs) and it.offset == it.runs[0][0]
                for o, k in it.runs:
                    assert (ids[o : o + k] == cfg.video_token_id).all()
                    assert ids[o - 1] == cfg.vision_start_token_id and ids[o + k] == cfg.vision_end_token_id
    assert "<0.2 seconds>" in tok.decode(p.token_ids) and "<2.2 seconds>" in tok.decode(p.token_ids)


def test_video_prompt_from_metadata_equals_pixels(ckpt: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """A metadata-only video (E+PD: grid only, the processor's fps on the PD side) makes the
    prompt and positions the pixels make; another frame rate makes other timestamps."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    builder = InputBuilder(tok, cfg)
    _, messages, images, videos = _video_cases()[1]
    (pixels,) = _media("v", proc, messages, images, videos)
    width = cfg.text.hidden_size * cfg.feature_levels
    resolver = MetadataEmbeds("m", width, builder.num_tokens, second_per_grid=proc.config.second_per_grid)
    handle = {"key": "u"}
    part = msgspec.convert(
        {
            "type": "video_embeds",
            "uuid": "u",
            "video_embeds": {"video_grid_thw": list(pixels.grid_thw)},
            "ec_handle": handle,
        },
        VideoEmbedsPart,
    )
    meta = asyncio.run(resolver(part))
    a, b = builder.build(messages, [pixels]), builder.build(messages, [meta])
    assert a.token_ids == b.token_ids and a.mrope_delta == b.mrope_delta
    assert a.mrope_positions is not None and b.mrope_positions is not None
    assert np.array_equal(a.mrope_positions, b.mrope_positions)
    assert [it.runs for it in a.mm_items] == [it.runs for it in b.mm_items]
    slower = builder.build(messages, [dataclasses.replace(pixels, second_per_grid=4.0)])  # 0.5 fps
    assert "<1.0 seconds>" in tok.decode(slower.token_ids) and "<1.0 seconds>" not in tok.decode(a.token_ids)
    with pytest.raises(PromptError, match="seconds per temporal patch must be positive"):
        builder.build(messages, [dataclasses.replace(pixels, second_per_grid=0.0)])


def test_video_greedy_tokens_match_transformers_alone_and_batched(ckpt: Path, hf, tok) -> None:  # type: ignore[no-untyped-def]
    """Every frame group's rows (all DeepStack levels) land at its own run, chunk by chunk."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    eos = _eos(hf, tok)
    expected = {}
    for name, messages, images, videos in _video_cases():
        inputs = _hf_video_inputs(tok, proc, messages, images, videos)
        with torch.inference_mode():
            out = hf.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        expected[name] = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len({tuple(v) for v in expected.values()}) > 1
    eng = EngineCore.from_pretrained(
        ckpt, EngineConfig(device=TEST_DEVICE, max_num_batched_tokens=BUDGET, num_kv_blocks=512, max_model_len=1024)
    )
    builder = InputBuilder(tok, cfg)

    def requests(sfx: str) -> list[Request]:
        return [_video_request(n + sfx, builder, proc, m, i, v, eos) for n, m, i, v in _video_cases()]

    for req in requests(""):
        assert all(n > BUDGET for it in req.mm_items for _, _, n in it.placements())  # chunks split every run
    assert_alone_then_batched(eng, requests, expected)


def test_the_core_refuses_runs_that_do_not_tile_the_item(ckpt: Path, tok) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    eng = EngineCore.from_pretrained(ckpt, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256, max_model_len=1024))
    _, messages, images, videos = _video_cases()[0]
    p = InputBuilder(tok, cfg).build(messages, _media("v", proc, messages, images, videos))
    (item,) = p.mm_items
    (o0, k0), (o1, k1) = item.runs
    pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for i, runs in enumerate([((o0, k0), (o1, k1 - 1)), ((o0, k0), (o0 + 1, k1)), ((o0 + 1, k0), (o1, k1))]):
        bad = msgspec.structs.replace(item, runs=runs)
        out = eng.add(AddRequest(f"bad{i}", p.token_ids, params, [bad], pos, p.mrope_delta, []))
        assert out and out[0].error is not None and "do not tile" in out[0].error


# ---- the EC contract carries the feature levels ----------------------------------------------

HIDDEN, LEVELS, ROWS = 128, 3, 6


@pytest.fixture(params=["shm", "tcp", "fs"])
def connector(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    from tests.test_transfer import config

    producer = make_producer(config(request.param, tmp_path))
    consumer = make_consumer(config(request.param, tmp_path))
    yield producer, consumer
    producer.close()
    asyncio.run(consumer.close())


def _features(rows: int = ROWS, levels: int = LEVELS) -> torch.Tensor:
    return torch.randn(rows, levels * HIDDEN, generator=torch.Generator().manual_seed(5))


def test_protocol_version_was_bumped_for_the_levels() -> None:
    assert PROTOCOL_VERSION >= 3
    header = wire.make_header("k", "m", _features(), "0" * 16, LEVELS)
    assert header.levels == LEVELS and header.version == PROTOCOL_VERSION
    assert wire.decode(wire.encode(header)) == header
    with pytest.raises(TransferError, match="protocol version 2"):
        wire.validate(msgspec.structs.replace(header, version=2), ROWS, HIDDEN, "m", ["float32"], LEVELS)
    with pytest.raises(TransferError, match="cannot hold 5 feature levels"):
        wire.make_header("k", "m", _features(), "0" * 16, 5)


def test_levels_round_trip_through_every_connector_and_are_validated(connector) -> None:  # type: ignore[no-untyped-def]
    from tests.test_transfer import MODEL, resign

    producer, consumer = connector
    sent = _features()
    handle = producer.put("k", sent, MODEL, LEVELS)
    assert handle["levels"] == LEVELS

    def fails(h: dict, width: int = HIDDEN, levels: int = LEVELS) -> TransferError:
        with pytest.raises(TransferError) as err:
            asyncio.run(consumer.get(h, ROWS, width, MODEL, levels))
        return err.value

    # a consumer of a one-level model (Qwen2-VL) refuses it: a clear error for that request
    err = fails(handle, levels=1)
    assert isinstance(err, InvalidHandle) and "carry 3 feature level(s) but this model takes 1" in str(err)
    # levels missing, wrong, or a width that is not levels x hidden, even when the cluster signed it
    missing = {k: v for k, v in handle.items() if k != "levels"}
    assert "malformed" in str(fails(resign(missing)))
    assert "carry 2 feature level(s) but this model takes 3" in str(fails(resign(handle, levels=2)))
    narrow = resign(handle, shape=[ROWS, 2 * HIDDEN], nbytes=ROWS * 2 * HIDDEN * 4)
    assert f"expects width {LEVELS * HIDDEN} ({LEVELS} feature levels of {HIDDEN})" in str(fails(narrow))
    assert "expects width" in str(fails(handle, width=HIDDEN // 2))
    # and the real handle still works after all of those
    assert torch.equal(asyncio.run(consumer.get(handle, ROWS, HIDDEN, MODEL, LEVELS)), sent)


def test_store_entries_carry_the_levels() -> None:
    from epdserve.store.record import pack, unpack

    key = b"k" * 32
    value, header = pack("u", "m", (1, 4, 6), _features(), key, LEVELS)
    assert header.levels == LEVELS
    item = unpack(value, "u", "m", key, lambda g: ROWS, HIDDEN, ["float32"], LEVELS)
    assert torch.equal(item.embeddings, _features())
    with pytest.raises(InvalidHandle, match="feature level"):
        unpack(value, "u", "m", key, lambda g: ROWS, HIDDEN, ["float32"], 1)


def test_inline_embeddings_must_carry_every_level(ckpt: Path) -> None:
    """A metadata-only request with embeddings by value: the width the PD worker asks of it."""
    cfg = ModelConfig.from_pretrained(ckpt)
    resolver = MetadataEmbeds("m", cfg.text.hidden_size * cfg.feature_levels, lambda g: g[0] * g[1] * g[2] // 4)

    def part(t: torch.Tensor) -> ImageEmbedsPart:
        data = base64.b64encode(t.numpy().tobytes()).decode()
        embeds = {"data": data, "dtype": "float32", "image_grid_thw": [1, 4, 6]}
        body = {"type": "image_embeds", "uuid": "u", "image_embeds": embeds}
        return msgspec.convert(body, ImageEmbedsPart)

    got = asyncio.run(resolver(part(_features())))
    assert got.embeddings is not None and got.embeddings.shape == (ROWS, LEVELS * HIDDEN)
    with pytest.raises(BadRequest, match=f"rows of {LEVELS * HIDDEN} float32"):
        asyncio.run(resolver(part(_features(levels=1))))


def test_embeddings_without_the_levels_fail_only_their_request(ckpt: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """Whatever path an item took, the engine refuses one whose width is not levels x hidden."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    eng = EngineCore.from_pretrained(ckpt, EngineConfig(device=TEST_DEVICE, num_kv_blocks=256, max_model_len=1024))
    builder = InputBuilder(tok, cfg)
    _, messages, images = _cases()[1]
    v = proc.image(images[0])
    rows = builder.num_tokens(v.grid_thw)
    one_level = WireTensor.of(np.zeros((rows, cfg.text.hidden_size), dtype=np.float32))
    bad = builder.build(messages, [MediaInput("bad", "image", v.grid_thw, embeddings=one_level)])
    params = SamplingParams(temperature=0.0, max_tokens=2)
    pos = WireTensor.of(bad.mrope_positions) if bad.mrope_positions is not None else None
    eng.add_request(request_from(AddRequest("bad", bad.token_ids, params, bad.mm_items, pos, bad.mrope_delta, [])))
    eng.add_request(_request("good", builder, proc, messages, images, frozenset()))
    errors, tokens = {}, {}
    while eng.has_work:
        for o in eng.step():
            if o.error is not None:
                errors[o.request_id] = o.error
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    assert "3 feature levels of 128" in errors["bad"]
    assert "good" not in errors and len(tokens["good"]) == MAX_NEW
