"""The published widths of Qwen2-VL-2B-Instruct (vocabulary 151,936, hidden 1,536, 12 query and 2
KV heads, a 1,280-wide tower of 16 heads) at a cut depth — 2 language layers, 2 vision blocks —
served aggregated and E+PD: greedy answers equal transformers' ``generate`` on the same checkpoint.
The full depth is ``scripts/parity_real_size.py``.

The checkpoint's processor is bounded to 448 x 448 pixels: the widths are under test here, not the
published 12.8-megapixel bound, whose vision forward the memory plan would reserve per role.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdserve.hf_reference import HFReference
from epdserve.models.config import ModelConfig
from epdserve.shapes import ShapesWorld, render_images
from epdserve.up import Deployment, Topology
from tests.checkpoints.published import build_published, published_config
from tests.test_families import PD_ARGS, _deploy, ask, transformers_answer
from tests.test_families import data_url as image_url

MAX_PIXELS = 448 * 448


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "qwen2-vl-2b-l2"
    return build_published("qwen2_vl", out, layers=2, vision_depth=2, max_pixels=MAX_PIXELS)


def requests() -> list[tuple[dict, list]]:
    w = ShapesWorld(7)
    one, two = w.sample("describe"), w.sample("count")
    images = render_images(one) + render_images(two)

    def msg(ims: list, q: str) -> list[dict]:
        parts = [{"type": "image_url", "image_url": {"url": image_url(im)}} for im in ims]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": q}]}]

    return [
        ({"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 8}, []),
        ({"messages": msg(render_images(one), one.question)}, render_images(one)),
        ({"messages": msg(images, "Describe the second image."), "stream": True}, images),
    ]


@pytest.fixture(scope="module")
def aggregated(checkpoint: Path) -> Iterator[list[str]]:
    d = _deploy(checkpoint, "aggregated")
    try:
        yield [ask(d.url, checkpoint.name, r) for r, _ in requests()]
    finally:
        d.stop()


def test_the_checkpoint_has_the_published_widths(checkpoint: Path) -> None:
    cfg = ModelConfig.from_pretrained(checkpoint)
    t, v = cfg.text, cfg.vision_config
    assert (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers) == (151936, 1536, 8960, 2)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.mrope_section) == (12, 2, 128, (16, 24, 24))
    assert (v.depth, v.embed_dim, v.num_heads, v.mlp_hidden_dim, v.out_hidden_size) == (2, 1280, 16, 5120, 1536)
    assert t.tie_word_embeddings and t.rope_theta == 1e6
    assert (cfg.image_token_id, cfg.vision_start_token_id) == (151655, 151652)


def test_aggregated_answers_what_transformers_answers(checkpoint: Path, aggregated: list[str]) -> None:
    assert len(set(aggregated)) > 1, "the requests must not all get one answer"
    assert all(a.strip() for a in aggregated), "filler tokens decode to text"
    ref = HFReference(checkpoint)
    expected = [transformers_answer(ref, r, images) for r, images in requests()]
    assert aggregated == expected


def test_e_pd_answers_what_aggregated_answers(checkpoint: Path, aggregated: list[str]) -> None:
    d = _deploy(checkpoint, "1e+1pd")
    try:
        got = [ask(d.url, checkpoint.name, r) for r, _ in requests()]
    finally:
        d.stop()
    assert got == aggregated


def test_a_cut_depth_keeps_the_widths_and_the_blocks_that_still_exist() -> None:
    full, processor = published_config("qwen2_5_vl")
    cut, _ = published_config("qwen2_5_vl", layers=3, vision_depth=9)
    assert cut["text_config"] == {**full["text_config"], "num_hidden_layers": 3, "max_window_layers": 3}
    assert cut["vision_config"]["fullatt_block_indexes"] == [7]
    assert published_config("qwen2_5_vl", vision_depth=2)[0]["vision_config"]["fullatt_block_indexes"] == [1]
    assert processor["max_pixels"] == 12845056
    q3, _ = published_config("qwen3_vl", layers=2, vision_depth=12)
    assert q3["vision_config"]["deepstack_visual_indexes"] == [5, 11]
    assert published_config("qwen3_vl", layers=1)[0]["vision_config"]["deepstack_visual_indexes"] == [5]
    with pytest.raises(ValueError, match=r"layers must be 1\.\.28"):
        published_config("qwen2_vl", layers=29)


@pytest.mark.parametrize(("family", "patch"), [("qwen2_vl", 14), ("qwen2_5_vl", 14), ("qwen3_vl", 16)])
def test_a_pixel_bound_resizes_a_large_image_below_it(tmp_path: Path, family: str, patch: int) -> None:
    import transformers
    from PIL import Image

    from tests.checkpoints.published import bound_pixels

    _, published = published_config(family)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(bound_pixels(published, MAX_PIXELS)))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    grid = processor(images=[Image.new("RGB", (1600, 1200), (90, 140, 200))], return_tensors="pt")["image_grid_thw"]
    area = int(grid[0, 1] * grid[0, 2]) * patch * patch
    assert MAX_PIXELS // 2 < area <= MAX_PIXELS  # resized down to the bound, not past it
    with pytest.raises(ValueError, match="max_pixels must be"):
        bound_pixels(published, 1000)


BUILD_CHECKPOINT = Path(__file__).resolve().parent.parent / "scripts" / "build_checkpoint.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["qwen2_vl", "--size", "3b"], "no published 3b size of qwen2_vl"),
        (["qwen2_5_vl", "--layers", "2"], "--max-pixels change a published size"),
        (["qwen2_vl", "--size", "2b", "--max-pixels", "1000"], "max_pixels must be 3136..12845056"),
        (["qwen3_vl", "--size", "2b", "--vision-depth", "25"], "vision_depth must be 1..24"),
    ],
)
def test_build_checkpoint_refuses_what_is_not_published(
    tmp_path: Path, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's own main, run in this process (the script as a program: the test below)."""
    monkeypatch.setattr(sys, "argv", [str(BUILD_CHECKPOINT), args[0], str(tmp_path / "out"), *args[1:]])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(BUILD_CHECKPOINT), run_name="__main__")
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_build_checkpoint_runs_as_a_program_and_refuses_with_exit_status_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(BUILD_CHECKPOINT), "qwen2_vl", str(tmp_path / "out"), "--size", "3b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no published 3b size of qwen2_vl" in r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_e_pd_pinned_with_cores_lent_answers_what_aggregated_answers(
    checkpoint: Path, aggregated: list[str], tmp_path: Path
) -> None:
    """Pinned, the encoder and the engine core borrow each other's core while the other is idle:
    their thread counts change from layer to layer, their answers do not."""
    d = Deployment(Topology.parse("1e+1pd"), str(checkpoint), port=0, pin=True, extra_pd_args=PD_ARGS, log_dir=tmp_path)
    d.start()
    try:
        board = d.board
        got = [ask(d.url, checkpoint.name, r) for r, _ in requests()]
    finally:
        d.stop()
    assert got == aggregated
    if len(os.sched_getaffinity(0)) >= 2:  # fewer cores: nothing is pinned, nothing lent
        assert board is not None and not board.exists(), "the board is removed with the deployment"
        for role in ("encoder0", "pd0"):
            assert 'borrows="idle roles\' cores"' in (tmp_path / f"{role}.log").read_text(), role
