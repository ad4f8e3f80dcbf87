"""Qwen2.5-VL against transformers on a tiny random-weight checkpoint (``tests.checkpoints.qwen2_5_vl``):
the windowed vision tower, M-RoPE positions whose time axis follows seconds of video, the
engine's greedy tokens alone and batched, and encoder-only / language-only loading."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.api.media import MediaResolver
from epdserve.api.protocol import VideoEmbedsPart
from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore, request_from
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, WireTensor
from epdserve.engine.request import Request
from epdserve.hf_reference import HFReference
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.models.loader import load_model
from epdserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, window_order
from epdserve.models.registry import prompt_layout
from epdserve.pd.embeds import MetadataEmbeds
from epdserve.shapes import ShapesWorld
from tests.checkpoints import build
from tests.engine_utils import assert_alone_then_batched, cases
from tests.numerics import assert_close_rel
from tests.server_utils import TEST_DEVICE

MAX_NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"), seed=0)


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> HFReference:
    return HFReference(ckpt)


@pytest.fixture(scope="module")
def proc(ckpt: Path) -> VisionProcessor:
    return VisionProcessor(ProcessorConfig.from_pretrained(ckpt))


def _noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _batch(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = torch.from_numpy(np.concatenate([v.pixel_values for v in items]))
    return pixels, torch.tensor([v.grid_thw for v in items])


# ---------------------------------------------------------------------------------------------
# the vision tower
# ---------------------------------------------------------------------------------------------


def test_window_order_makes_windows_contiguous_and_covers_every_token() -> None:
    # one 6 x 5 merged frame in windows of 4: windows of 16, 4 (right), 8, 2 (bottom) tokens
    order, lengths = window_order([(1, 12, 10), (2, 4, 4)], merge=2, window=4)
    assert lengths == [64, 16, 32, 8, 16, 16]  # in patches (4 per merged token)
    assert sorted(order.tolist()) == list(range(30 + 8))
    assert order[:16].tolist() == [r * 5 + c for r in range(4) for c in range(4)]
    assert order[16:20].tolist() == [r * 5 + 4 for r in range(4)]
    assert order[30:].tolist() == list(range(30, 38))  # a frame that is one window keeps its order


def test_vision_tower_equals_transformers(ckpt: Path, ref: HFReference, proc: VisionProcessor) -> None:
    """Grids that are not multiples of the window (partial edge windows), one that is, a video."""
    items = [proc.image(_noise(h, w, i)) for i, (h, w) in enumerate([(224, 168), (140, 196), (112, 224)])]
    items.append(proc.video([_noise(150, 150, 10 + i) for i in range(6)]))
    assert [v.grid_thw for v in items] == [(1, 16, 12), (1, 10, 14), (1, 8, 16), (3, 10, 10)]
    pixels, grids = _batch(items)
    model, _ = load_model(ckpt, parts=frozenset({"vision"}))
    with torch.no_grad():
        expected = ref.model.model.visual(pixels, grid_thw=grids).pooler_output
        got = model.visual(pixels, grids)
    assert got.shape == expected.shape == (sum(t * h * w for t, h, w in grids.tolist()) // 4, 128)
    assert_close_rel(got, expected)
    # each item alone gives its rows of the batch: windows never cross items
    with torch.no_grad():
        alone = model.visual(*_batch(items[1:2]))
    start = items[0].pixel_values.shape[0] // 4
    assert_close_rel(alone, got[start : start + alone.shape[0]])  # another batch shape: relative


# ---------------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------------


def _prompt(cfg: ModelConfig, runs: list[tuple[str, tuple[int, int, int]]]) -> list[int]:
    ids = [1, 2, 3]
    for kind, (t, h, w) in runs:
        ids += [cfg.vision_start_token_id or 0, *[cfg.placeholder(kind)] * (t * h * w // 4), 4]
    return [*ids, 5, 6]


@pytest.mark.parametrize("second", [2.0, 1.0, 0.5, 2 / 3, 0.25])
def test_positions_equal_transformers_get_rope_index(ckpt: Path, ref: HFReference, second: float) -> None:
    cfg = ModelConfig.from_pretrained(ckpt)
    runs = [("image", (1, 12, 10)), ("video", (2, 12, 12)), ("image", (1, 10, 14)), ("video", (3, 16, 12))]
    ids = _prompt(cfg, runs)
    grids_i = [g for k, g in runs if k == "image"]
    grids_v = [g for k, g in runs if k == "video"]
    ours, delta = prompt_layout(cfg).positions(ids, grids_i, grids_v, [second, 1.0])
    input_ids = torch.tensor([ids])
    mm = (input_ids == cfg.image_token_id).int() + 2 * (input_ids == cfg.video_token_id).int()
    theirs, their_delta = ref.model.model.get_rope_index(
        input_ids, mm, torch.tensor(grids_i), torch.tensor(grids_v), torch.tensor([second, 1.0])
    )
    assert ours is not None
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(their_delta)


def test_video_positions_follow_seconds_per_grid(ckpt: Path) -> None:
    cfg = ModelConfig.from_pretrained(ckpt)
    ids = _prompt(cfg, [("video", (4, 12, 12))])
    layout = prompt_layout(cfg)
    start = ids.index(cfg.placeholder("video"))
    for second, times in [(None, [0, 2, 4, 6]), (2.0, [0, 4, 8, 12]), (0.75, [0, 1, 3, 4])]:
        pos, _ = layout.positions(ids, [], [(4, 12, 12)], [second])
        assert pos is not None
        assert sorted(set(pos[0, start : start + 4 * 36].tolist())) == [start + t for t in times]


def test_text_after_a_long_video_continues_after_its_last_time(ckpt: Path) -> None:
    """Where transformers 5 and the original rule part: a video whose last temporal index reaches
    its merged height and width. We continue after the largest position (the original Qwen2.5-VL,
    vLLM); transformers continues at start + max(h, w) / merge, inside the video's time span."""
    cfg = ModelConfig.from_pretrained(ckpt)
    ids = _prompt(cfg, [("video", (3, 4, 4))])
    pos, delta = prompt_layout(cfg).positions(ids, [], [(3, 4, 4)], [2.0])  # times 0, 4, 8; 2 x 2 tokens
    assert pos is not None
    start = ids.index(cfg.placeholder("video"))
    after = start + 12
    assert pos[0, after - 1] == start + 8
    assert pos[:, after].tolist() == [start + 9] * 3
    assert delta == int(pos.max()) + 1 - len(ids)


@pytest.mark.parametrize(("duration", "second"), [(300, 0.6), ([300, 500, 200, 100], 2 / 3), (0, 2.0)])
def test_pixels_and_metadata_only_videos_get_the_same_positions(
    ckpt: Path, ref: HFReference, duration: int | list[int], second: float
) -> None:
    """The aggregated server (pixels) and a PD worker given only the grid, the encoder's
    ``second_per_grid`` and a handle build the same prompt and positions: transformers' for the
    clip's own timing (temporal patch size x the sampled frames' spacing; a GIF without frame
    durations: the checkpoint's 1 fps)."""
    cfg = ModelConfig.from_pretrained(ckpt)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
    assert proc.config.second_per_grid == 2.0  # 2 frames per temporal patch at 1 fps
    frames = ShapesWorld(3).video().frames()
    gif = io.BytesIO()
    timing = {"duration": duration} if duration else {}
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], loop=0, **timing)
    with ThreadPoolExecutor(1) as pool:
        pixels = MediaResolver("m", proc, MediaLimits(), pool).process_bytes("video", gif.getvalue())
    assert pixels.second_per_grid == pytest.approx(second)
    builder = InputBuilder(ref.tok, cfg)
    part = msgspec.convert(
        {
            "type": "video_embeds",
            "video_embeds": {"video_grid_thw": list(pixels.grid_thw), "second_per_grid": pixels.second_per_grid},
            "uuid": pixels.uuid,
            "ec_handle": {"key": pixels.uuid},
        },
        VideoEmbedsPart,
    )
    metadata_only = asyncio.run(
        MetadataEmbeds("m", 128, builder.num_tokens, second_per_grid=proc.config.second_per_grid)(part)
    )
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]
    a, b = builder.build(messages, [pixels]), builder.build(messages, [metadata_only])
    assert a.token_ids == b.token_ids and a.mrope_delta == b.mrope_delta
    assert a.mrope_positions is not None and b.mrope_positions is not None
    np.testing.assert_array_equal(a.mrope_positions, b.mrope_positions)
    # and they are transformers' positions for the same frames at the clip's timing
    assert pixels.second_per_grid is not None
    inputs = ref.inputs(messages, videos=[frames], video_seconds=[pixels.second_per_grid])
    theirs, _ = ref.model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        video_grid_thw=inputs["video_grid_thw"],
        second_per_grid_ts=inputs["second_per_grid_ts"],
    )
    np.testing.assert_array_equal(a.mrope_positions, theirs[:, 0].numpy())
    if duration:  # the timing shows: the checkpoint's fps would place the frame groups elsewhere
        at_config, _ = ref.model.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            video_grid_thw=inputs["video_grid_thw"],
            second_per_grid_ts=torch.tensor([proc.config.second_per_grid]),
        )
        assert not np.array_equal(a.mrope_positions, at_config[:, 0].numpy())


# ---------------------------------------------------------------------------------------------
# the engine against transformers' generate
# ---------------------------------------------------------------------------------------------


def engine_request(
    rid: str, builder: InputBuilder, proc: VisionProcessor, messages, images, videos, eos
) -> tuple[Request, np.ndarray | None]:
    media = []
    it_i, it_v = iter(images), iter(videos)
    for part in messages[0]["content"] if isinstance(messages[0]["content"], list) else []:
        if part["type"] == "image":
            v, second = proc.image(next(it_i)), None
        elif part["type"] == "video":
            v, second = proc.video(next(it_v)), proc.config.second_per_grid
        else:
            continue
        media.append(
            MediaInput(f"{rid}-{len(media)}", part["type"], v.grid_thw, v.pixel_values, second_per_grid=second)
        )
    p = builder.build(messages, media)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
    add = AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta, list(eos))
    return request_from(add), p.mrope_positions


def test_greedy_tokens_match_transformers_alone_and_batched(
    ckpt: Path, ref: HFReference, proc: VisionProcessor
) -> None:
    cfg = ModelConfig.from_pretrained(ckpt)
    eng = EngineCore.from_pretrained(
        ckpt, EngineConfig(device=TEST_DEVICE, max_num_batched_tokens=64, num_kv_blocks=256, max_model_len=1024)
    )
    builder = InputBuilder(ref.tok, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    expected = {}
    for name, messages, images, videos in cases():
        inputs = ref.inputs(messages, images=images, videos=videos)
        expected[name] = ref.generate_ids(inputs, max_new_tokens=MAX_NEW)
    for name, messages, images, videos in cases():
        if videos:  # 1 fps frames: a temporal patch spans 2 s, 4 positions at 2 tokens per second
            req, pos = engine_request(name, builder, proc, messages, images, videos, eos)
            video = np.asarray(req.prompt_token_ids) == cfg.placeholder("video")
            assert pos is not None and sorted(set(pos[0, video].tolist()))[1] - pos[0, video].min() == 4
    # each alone, then all concurrently (chunked prefill: budget 64 splits the longer prompts)
    assert_alone_then_batched(
        eng, lambda sfx: [engine_request(n + sfx, builder, proc, m, i, v, eos)[0] for n, m, i, v in cases()], expected
    )


# ---------------------------------------------------------------------------------------------
# weight loading
# ---------------------------------------------------------------------------------------------


def test_encoder_only_and_language_only_loading(ckpt: Path, proc: VisionProcessor) -> None:
    full, _ = load_model(ckpt)
    vision, vision_report = load_model(ckpt, parts=frozenset({"vision"}))
    language, language_report = load_model(ckpt, parts=frozenset({"language"}))
    assert vision.language_model is None and language.visual is None
    assert all(name.startswith("visual.") for name in vision_report.tensors)
    assert vision_report.tensors and not any(name.startswith("visual.") for name in language_report.tensors)
    pixels, grids = _batch([proc.image(_noise(168, 224, 3))])
    with torch.no_grad():
        assert torch.equal(vision.visual(pixels, grids), full.visual(pixels, grids))
    theirs = dict(full.language_model.state_dict())
    for name, tensor in language.language_model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_transformers_in_memory_names_load(ckpt: Path, ref: HFReference, proc: VisionProcessor) -> None:
    """transformers 5 names its modules model.visual / model.language_model (the saved files use
    visual / model): both fill every parameter with the same tensors."""
    config = ModelConfig.from_pretrained(ckpt)
    model = Qwen2_5_VLForConditionalGeneration(config)
    state = ref.model.state_dict()
    assert any(k.startswith("model.visual.") for k in state) and any(
        k.startswith("model.language_model.") for k in state
    )
    loaded = model.load_weights(state.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    model.init_buffers()
    full, _ = load_model(ckpt)
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(full.state_dict().items()), strict=True):
        assert torch.equal(a, b), name
