"""Our Qwen2-VL model code equals transformers' on the same checkpoint (fp32, CPU, one thread)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from epdserve.hf_reference import HFReference
from epdserve.media.processor import VisionInput
from epdserve.models.config import ModelConfig
from epdserve.models.layers.vision import frame_runs
from epdserve.models.loader import load_model
from epdserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, mrope_positions
from epdserve.models.registry import UnknownArchitectureError, model_class
from epdserve.shapes import ShapesWorld
from tests.dense_attention import DenseCausalAttention, DenseKVCache
from tests.numerics import assert_close_rel

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Qwen2VLForConditionalGeneration:
    m, _ = load_model(model_dir)
    assert isinstance(m, Qwen2VLForConditionalGeneration)
    return m


@pytest.fixture(scope="module")
def vision_only(model_dir: Path) -> Qwen2VLForConditionalGeneration:
    m, _ = load_model(model_dir, parts=frozenset({"vision"}))
    assert isinstance(m, Qwen2VLForConditionalGeneration)
    return m


def _images() -> list[Image.Image]:
    """Scenes of several sizes, including non-square ones so that rows and columns differ."""
    world = ShapesWorld(3)
    scenes = [world.scene().render() for _ in range(4)]
    return [*scenes[:2], scenes[2].resize((56, 112)), scenes[3].resize((140, 70))]


def _batch(items: list[VisionInput]) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = torch.from_numpy(np.concatenate([v.pixel_values for v in items]))
    return pixels, torch.tensor([v.grid_thw for v in items])


def _messages(*parts: str) -> list[dict]:
    content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


# ---- vision tower ---------------------------------------------------------------------------


@torch.inference_mode()
def test_vision_tower_matches_hf_images(hf: HFReference, vision_only: Qwen2VLForConditionalGeneration) -> None:
    pixels, grid = _batch([hf.proc.image(img) for img in _images()])
    assert len({tuple(g) for g in grid.tolist()}) == 4  # the sizes really differ
    ref = torch.cat(hf.model.model.get_image_features(pixels, grid).pooler_output)
    assert vision_only.visual is not None
    ours = vision_only.visual(pixels, grid)
    assert ours.shape == ref.shape
    assert_close_rel(ours, ref)


@torch.inference_mode()
def test_vision_tower_matches_hf_video(hf: HFReference, vision_only: Qwen2VLForConditionalGeneration) -> None:
    videos = [hf.proc.video(ShapesWorld(seed).video().frames()) for seed in (5, 6)]
    pixels, grid = _batch(videos)
    assert all(t == 2 for t in grid[:, 0].tolist())  # attention is per frame: two frames per item
    ref = torch.cat(hf.model.model.get_video_features(pixels, grid).pooler_output)
    assert vision_only.visual is not None
    assert_close_rel(vision_only.visual(pixels, grid), ref)


@torch.inference_mode()
def test_vision_tower_batches_items_of_one_size_as_hf_does_one_by_one(
    hf: HFReference, vision_only: Qwen2VLForConditionalGeneration
) -> None:
    """Consecutive items of one frame size share one attention call (``frame_runs``); every
    item's embeddings still equal transformers' for that item alone."""
    images = _images()
    items = [hf.proc.image(img) for img in (images[0], images[0], images[2], images[2], images[2], images[1])]
    pixels, grid = _batch(items)
    assert frame_runs([tuple(g) for g in grid.tolist()]) == [
        (2, grid[0, 1].item() * grid[0, 2].item()),
        (3, 56 * 112 // 14**2),
        (1, grid[5, 1].item() * grid[5, 2].item()),
    ]
    assert vision_only.visual is not None
    ours = vision_only.visual(pixels, grid).split([v.grid_thw[1] * v.grid_thw[2] // 4 for v in items])
    for item, emb in zip(items, ours, strict=True):
        p, g = _batch([item])
        assert_close_rel(emb, torch.cat(hf.model.model.get_image_features(p, g).pooler_output))


def test_frame_runs_join_only_consecutive_equal_frames() -> None:
    assert frame_runs([(1, 4, 4), (2, 4, 4), (1, 2, 4), (1, 4, 4), (1, 2, 8)]) == [(3, 16), (1, 8), (2, 16)]
    assert frame_runs([]) == []


def test_vision_tower_rejects_inconsistent_grid(hf: HFReference, vision_only: Qwen2VLForConditionalGeneration) -> None:
    pixels, grid = _batch([hf.proc.image(_images()[0])])
    assert vision_only.visual is not None
    with pytest.raises(MediaPlaceholderError):
        vision_only.visual(pixels[:-4], grid)
    with pytest.raises(MediaPlaceholderError):
        vision_only.visual(pixels[:12], torch.tensor([[1, 3, 4]]))  # h not a multiple of the merge size


# ---- M-RoPE positions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "parts",
    [
        ("describe the scene",),
        ("image", "what is it?"),
        ("image", "and", "image", "image", "compare them"),
        ("video", "where does it move?"),
        ("image", "then", "video", "image", "mixed"),
    ],
    ids=["text", "one-image", "images", "video", "mixed"],
)
def test_mrope_positions_match_hf(hf: HFReference, model_dir: Path, parts: tuple[str, ...]) -> None:
    images = _images()[1 : 1 + parts.count("image")]
    videos = [ShapesWorld(5).video().frames()] * parts.count("video")
    inputs = hf.inputs(_messages(*parts), images=images, videos=videos)
    ref, ref_delta = hf.model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
    )
    ours, delta = mrope_positions(
        inputs["input_ids"][0].tolist(),
        inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"),
        ModelConfig.from_pretrained(model_dir),
    )
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta)
    if parts == ("describe the scene",):
        assert delta == 0
        np.testing.assert_array_equal(ours, np.broadcast_to(np.arange(ours.shape[1]), (3, ours.shape[1])))


def test_mrope_text_after_a_run_starts_past_every_row(model_dir: Path) -> None:
    # A video with more temporal patches (4) than merged rows/columns (2): the text after it
    # starts at max + 1 over all rows, as in the original Qwen2-VL. (transformers 5.24 continues
    # at start + max(h, w)/2 here; with the 4-frame videos of our processor t is 2 and both agree.)
    config = ModelConfig.from_pretrained(model_dir)
    ids = [7, *[config.video_token_id] * 16, 8, 9]
    positions, delta = mrope_positions(ids, None, [[4, 4, 4]], config)
    assert positions[:, 1:17].max(axis=1).tolist() == [4, 2, 2]
    assert positions[:, 17].tolist() == [5, 5, 5]
    assert delta == 7 - len(ids)


def test_mrope_adjacent_items_are_split_by_grid(model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir)
    img = config.image_token_id
    positions, _ = mrope_positions([img] * 8, [[1, 4, 4], [1, 4, 4]], None, config)
    assert positions[:, :4].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    assert positions[:, 4:].tolist() == [[2, 2, 2, 2], [2, 2, 3, 3], [2, 3, 2, 3]]


@pytest.mark.parametrize(
    ("count", "grids"),
    [(4, [[1, 4, 4], [1, 4, 4]]), (8, [[1, 4, 4]]), (3, [[1, 4, 4]]), (4, [[1, 3, 4]])],
    ids=["extra-grid", "extra-run", "short-run", "odd-grid"],
)
def test_mrope_rejects_mismatched_grids(model_dir: Path, count: int, grids: list[list[int]]) -> None:
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(MediaPlaceholderError):
        mrope_positions([1, *[config.image_token_id] * count, 2], grids, None, config)


# ---- language model -------------------------------------------------------------------------


def _prompt_embeds(
    model: Qwen2VLForConditionalGeneration, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    assert model.visual is not None
    image = model.visual(inputs["pixel_values"], inputs["image_grid_thw"]) if "pixel_values" in inputs else None
    video = (
        model.visual(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        if "pixel_values_videos" in inputs
        else None
    )
    ids = inputs["input_ids"][0]
    positions, delta = mrope_positions(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), model.config)
    return model.embed_prompt(ids, image, video), torch.from_numpy(positions), delta


@torch.inference_mode()
def test_prompt_logits_match_hf(hf: HFReference, model: Qwen2VLForConditionalGeneration) -> None:
    inputs = hf.inputs(_messages("image", "image", "which one has more shapes?"), images=_images()[:2])
    ref = hf.model(**inputs).logits[0]
    embeds, positions, _ = _prompt_embeds(model, inputs)
    assert model.language_model is not None
    hidden = model.language_model(embeds, positions, DenseCausalAttention())
    assert_close_rel(model.language_model.compute_logits(hidden), ref)


@torch.inference_mode()
def test_greedy_decode_matches_hf_generate(hf: HFReference, model: Qwen2VLForConditionalGeneration) -> None:
    inputs = hf.inputs(
        _messages("image", "video", "what moves?"), images=_images()[2:3], videos=[ShapesWorld(7).video().frames()]
    )
    steps = 10
    ref = hf.model.generate(
        **inputs, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref_ids = ref.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    eos = set(hf.model.generation_config.eos_token_id or [])

    lm = model.language_model
    assert lm is not None
    embeds, positions, delta = _prompt_embeds(model, inputs)
    cache = DenseKVCache()
    hidden = lm(embeds, positions, cache)
    ours: list[int] = []
    for step in range(steps):
        logits = lm.compute_logits(hidden[-1:])[0]
        # every step's logits, not only the argmax: a random-init model repeats one token
        assert_close_rel(logits, ref.logits[step][0])
        token = int(logits.argmax())
        ours.append(token)
        if token in eos:
            break
        index = len(cache)  # absolute index of the token being fed
        hidden = lm(lm.embed_tokens(torch.tensor([token])), torch.full((3, 1), index + delta), cache)
    assert ours == ref_ids


# ---- loading --------------------------------------------------------------------------------


def _is_language_tensor(name: str) -> bool:
    return any(k in name for k in ("language_model", "lm_head", "embed_tokens")) or name.startswith("model.layers.")


def test_vision_only_load_reads_no_language_tensor(model_dir: Path) -> None:
    m, report = load_model(model_dir, parts=frozenset({"vision"}))
    assert isinstance(m, Qwen2VLForConditionalGeneration) and m.language_model is None
    assert report.tensors and not any(_is_language_tensor(n) for n in report.tensors)
    assert all("visual" in n for n in report.tensors)


def test_language_only_load_reads_no_vision_tensor(model_dir: Path) -> None:
    m, report = load_model(model_dir, parts=frozenset({"language"}))
    assert isinstance(m, Qwen2VLForConditionalGeneration) and m.visual is None
    assert report.tensors and not any("visual" in n for n in report.tensors)
    assert any("embed_tokens" in n for n in report.tensors)


def test_loads_sharded_checkpoint_with_transformers5_names(
    model_dir: Path, model: Qwen2VLForConditionalGeneration, tmp_path: Path
) -> None:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    renamed = {
        ("model." + n if n.startswith("visual.") else n.replace("model.", "model.language_model.", 1)): t
        for n, t in tensors.items()
    }
    names = sorted(renamed)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: renamed[n].contiguous() for n in shard}, str(tmp_path / file))
    weight_map = {n: file for file, shard in shards.items() for n in shard}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())

    loaded, report = load_model(tmp_path)
    assert set(report.tensors) == set(renamed) - {"lm_head.weight"}
    expected = model.state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0)


def test_untied_lm_head_is_loaded(model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config["text_config"]["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not n.startswith("visual.")}  # noqa: SIM118
    head = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file({**tensors, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))

    m, report = load_model(tmp_path, parts=frozenset({"language"}))
    assert "lm_head.weight" in report.tensors
    assert isinstance(m, Qwen2VLForConditionalGeneration) and m.language_model is not None
    hidden = torch.randn(3, head.shape[1])
    assert_close_rel(m.language_model.compute_logits(hidden), hidden @ head.T)


# ---- config and registry --------------------------------------------------------------------


def test_config_accepts_original_hub_layout(model_dir: Path) -> None:
    new = json.loads((model_dir / "config.json").read_text())
    text = dict(new["text_config"])
    rope = text.pop("rope_parameters")
    vision = {k: v for k, v in new["vision_config"].items() if k not in ("rope_parameters", "in_channels")}
    old = {
        **{k: v for k, v in new.items() if k not in ("text_config", "vision_config")},
        **text,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "vision_config": {**vision, "in_chans": new["vision_config"]["in_channels"]},
    }
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(new)


def test_checkpoint_names_of_both_layouts_map_to_ours() -> None:
    name = Qwen2VLForConditionalGeneration.checkpoint_param_name
    # gate/up and q/k/v fill slices of fused parameters
    assert name("model.layers.0.mlp.up_proj.weight") == "language_model.layers.0.mlp.gate_up_proj.weight"
    assert name("model.language_model.layers.0.mlp.up_proj.weight") == "language_model.layers.0.mlp.gate_up_proj.weight"
    assert name("model.layers.2.self_attn.v_proj.bias") == "language_model.layers.2.self_attn.qkv_proj.bias"
    assert name("model.layers.2.self_attn.o_proj.weight") == "language_model.layers.2.self_attn.o_proj.weight"
    assert name("visual.blocks.1.attn.qkv.bias") == "visual.blocks.1.attn.qkv.bias"
    assert name("model.visual.blocks.1.attn.qkv.bias") == "visual.blocks.1.attn.qkv.bias"
    assert name("lm_head.weight") == "language_model.lm_head.weight"
    assert name("something.else") is None


def test_registry() -> None:
    assert model_class("Qwen2VLForConditionalGeneration") is Qwen2VLForConditionalGeneration
    with pytest.raises(UnknownArchitectureError, match="Qwen2VLForConditionalGeneration"):
        model_class("LlamaForCausalLM")
