"""Images too large for a step's vision bound, encoded a slice of the tower's forward at a time
between engine steps: the same embeddings and tokens as one forward, decodes that go on meanwhile,
and a forward that stops when its request leaves or fails only its request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epdserve.api.tokenizer import FastTokenizer
from epdserve.common.sampling_params import SamplingParams
from epdserve.engine import vision_slices
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore, request_from
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, WireTensor
from epdserve.engine.request import MediaItem, Request
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.base import Stages
from epdserve.models.config import ModelConfig
from epdserve.models.layers import vision
from epdserve.models.loader import load_model
from epdserve.shapes import ShapesWorld
from tests import checkpoints
from tests.engine_utils import drain
from tests.numerics import assert_close_rel
from tests.server_utils import TEST_DEVICE

SLICED = 1e-9  # every image takes longer: each is encoded in slices of one stage
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def ckpt(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "qwen2_vl":
        return model_dir
    return checkpoints.build(request.param, tmp_path_factory.mktemp(request.param))


class Requests:
    """Image requests of a checkpoint, each a fresh ``Request`` (an engine consumes its items)."""

    def __init__(self, ckpt: Path) -> None:
        self.cfg = ModelConfig.from_pretrained(ckpt)
        self.proc = VisionProcessor(ProcessorConfig.from_pretrained(ckpt))
        self.builder = InputBuilder(FastTokenizer(ckpt), self.cfg)
        world = ShapesWorld(21)
        self.images = [self.proc.image(world.scene().render()) for _ in range(2)]

    def image(self, rid: str, n: int, max_tokens: int = 6, pixels=None) -> Request:
        v = self.images[n]
        media = [MediaInput(f"img-{n}", "image", v.grid_thw, v.pixel_values if pixels is None else pixels)]  # type: ignore[arg-type]
        return self._request(rid, self.builder.build(MESSAGES, media), max_tokens)

    def text(self, rid: str, max_tokens: int) -> Request:
        return self._request(rid, self.builder.build([{"role": "user", "content": "Describe it."}], []), max_tokens)

    @staticmethod
    def _request(rid: str, p, max_tokens: int) -> Request:  # type: ignore[no-untyped-def]
        pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, pos, p.mrope_delta))


def engine(ckpt: Path, vision_slice_s: float) -> EngineCore:
    """An engine whose images longer than ``vision_slice_s`` are encoded in slices; SLICED: every
    image, in slices of one stage (the step's vision bound is as small)."""
    step = SLICED if vision_slice_s == SLICED else EngineConfig.vision_step_s
    cfg = EngineConfig(
        device=TEST_DEVICE, num_kv_blocks=256, max_model_len=1024, vision_slice_s=vision_slice_s, vision_step_s=step
    )
    return EngineCore.from_pretrained(ckpt, cfg)


def steps(eng: EngineCore) -> list[tuple[bool, dict[str, list[int]], dict[str, str]]]:
    """Step until no work: per step, whether an image was in slices, the tokens and the errors."""
    out = []
    while eng.has_work:
        slicing = eng.runner.slicing is not None
        tokens: dict[str, list[int]] = {}
        errors = {}
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.error is not None:
                errors[o.request_id] = o.error
        out.append((slicing or eng.runner.slicing is not None, tokens, errors))
    return out


def run(stages: Stages) -> tuple[torch.Tensor, int]:
    """The output of a forward run as stages, and how often it paused."""
    pauses = 0
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1


def test_a_tower_paused_after_each_layer_gives_its_forward(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each block: the same operations, the same output. Within blocks too (every head its
    own stage, the MLP a row at a time, so small here is the stage bound): other shapes of the
    same products, the same output to a relative tolerance."""
    model, _ = load_model(ckpt, parts=frozenset({"vision"}))
    visual: Any = model.visual
    reqs = Requests(ckpt)
    pixels = torch.cat([torch.from_numpy(v.pixel_values) for v in reqs.images])
    grids = torch.tensor([v.grid_thw for v in reqs.images])
    depth, heads = visual.config.depth, visual.config.num_heads
    with torch.inference_mode():
        whole = visual(pixels, grids)
        sliced, pauses = run(visual.stages(pixels, grids))
        assert pauses == depth
        assert torch.equal(sliced, whole)
        monkeypatch.setattr(vision, "STAGE_MACS", 1)  # a head (per thread) at a time, the MLP a row at a time
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
        finer, pauses = run(visual.stages(pixels, grids, within_blocks=True))
        assert pauses == depth * (1 + heads + pixels.shape[0])
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two heads a stage: both threads attend
        two, pauses = run(visual.stages(pixels, grids, within_blocks=True))
        assert pauses == depth * (1 + heads // 2 + pixels.shape[0])
    assert_close_rel(finer, whole)
    assert_close_rel(two, whole)


def stages_of(ckpt: Path, reqs: Requests) -> int:
    """The pauses of the engine's forward of ``reqs``' first image (within blocks too)."""
    model, _ = load_model(ckpt, parts=frozenset({"vision"}))
    v = reqs.images[0]
    visual: Any = model.visual
    with torch.inference_mode():
        return run(visual.stages(torch.from_numpy(v.pixel_values), [v.grid_thw], within_blocks=True))[1]


def test_images_encoded_in_slices_give_the_tokens_of_one_forward(ckpt: Path) -> None:
    """Every image in slices (one stage a step) against the same engine encoding inside steps;
    each slice runs beside the other requests' decodes and prompts."""
    reqs = Requests(ckpt)
    want = drain_all(engine(ckpt, 0), reqs)
    eng = engine(ckpt, SLICED)
    got = drain_all(eng, reqs)
    assert got == want
    depth = ModelConfig.from_pretrained(ckpt).vision_config.depth
    assert eng.runner.sliced_items == 2  # two distinct images; "c" reads "a"'s from the encoder cache
    assert eng.stats().vision_sliced_items == 2  # the worker's epd_vision_sliced_items_total
    assert eng.runner.vision_patches == sum(v.pixel_values.shape[0] for v in reqs.images)
    assert eng.num_steps > 2 * depth
    eng.scheduler.blocks.check_integrity()


def drain_all(eng: EngineCore, reqs: Requests) -> dict[str, list[int]]:
    for req in (reqs.text("t", 24), reqs.image("a", 0), reqs.image("b", 1), reqs.image("c", 0)):
        eng.add_request(req)
    return drain(eng)


def test_decodes_go_on_while_an_image_is_encoded_in_slices(model_dir: Path) -> None:
    """A running request gets a token in every step that runs a slice; the image's request joins
    only once its last stage ran (the decodes never wait for the whole forward)."""
    reqs = Requests(model_dir)
    alone = engine(model_dir, 0)
    alone.add_request(reqs.image("m", 0))
    want = drain(alone)["m"]
    eng = engine(model_dir, SLICED)
    eng.add_request(reqs.text("t", 40))
    while not eng.step():  # its first token: t decodes from now on
        pass
    eng.add_request(reqs.image("m", 0))
    log = steps(eng)
    sliced = [tokens for slicing, tokens, _ in log if slicing]
    assert len(sliced) == stages_of(model_dir, reqs) + 1  # a stage a step, then the merger
    assert all(len(tokens.get("t", [])) == 1 and "m" not in tokens for tokens in sliced)
    assert [t for _, tokens, _ in log for t in tokens.get("m", [])] == want


def test_a_request_that_leaves_stops_its_sliced_forward(model_dir: Path) -> None:
    reqs = Requests(model_dir)
    eng = engine(model_dir, SLICED)
    eng.add_request(reqs.image("gone", 0))
    eng.step()
    eng.step()
    job = eng.runner.slicing
    assert job is not None and job.owner == "gone" and job.slices == 2 < stages_of(model_dir, reqs)
    eng.abort("gone")
    assert eng.runner.slicing is None and not eng.has_work
    assert "img-0" not in eng.runner.encoder_cache and eng.runner.vision_patches == 0  # nothing kept
    eng.add_request(reqs.image("next", 0))  # the same image again: encoded afresh, in full
    assert len(drain(eng)["next"]) == 6
    assert eng.runner.sliced_items == 1 and eng.runner.vision_patches == reqs.images[0].pixel_values.shape[0]


def test_an_image_that_fails_in_slices_fails_only_its_request(model_dir: Path) -> None:
    reqs = Requests(model_dir)
    want = drain_all(engine(model_dir, 0), reqs)
    eng = engine(model_dir, SLICED)
    bad = reqs.image("bad", 1, pixels=reqs.images[1].pixel_values[:-4])  # fewer patches than its grid
    eng.add_request(bad)
    for req in (reqs.text("t", 24), reqs.image("a", 0), reqs.image("b", 1), reqs.image("c", 0)):
        eng.add_request(req)
    log = steps(eng)
    errors = {rid: e for _, _, errs in log for rid, e in errs.items()}
    assert set(errors) == {"bad"} and "patches" in errors["bad"]
    got: dict[str, list[int]] = {}
    for _, tokens, _ in log:
        for rid, ids in tokens.items():
            got.setdefault(rid, []).extend(ids)
    assert {rid: got[rid] for rid in want} == want
    eng.scheduler.blocks.check_integrity()


def test_a_slice_runs_the_stages_that_fit_the_steps_vision_bound(model_dir: Path) -> None:
    reqs = Requests(model_dir)
    cfg = EngineConfig(device=TEST_DEVICE, num_kv_blocks=256, vision_slice_s=SLICED, vision_step_s=60.0)
    eng = EngineCore.from_pretrained(model_dir, cfg)
    eng.add_request(reqs.image("m", 0))
    eng.step()  # the whole forward fits the bound: done in the first step's slice
    assert eng.runner.slicing is None and eng.runner.sliced_items == 1


def test_a_slice_stops_before_a_stage_that_would_pass_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages of 1 s (a clock that the stages move): a budget of 2.5 s runs two, then stops before
    a third (2 s spent + 1 s for the next); a budget of 0 runs one; the last returns the output."""
    clock = [0.0]
    monkeypatch.setattr(vision_slices.time, "perf_counter", lambda: clock[0])

    def layers(n: int) -> Stages:
        for _ in range(n):
            clock[0] += 1.0
            yield
        return torch.ones(1)

    job = vision_slices.SlicedEncode("r", MediaItem("img", "image", 0, 1, (1, 2, 2)), 4, layers(5))
    assert job.advance(2.5) is None and clock[0] == 2.0
    assert job.advance(0.0) is None and clock[0] == 3.0
    assert job.advance(2.5) is None and clock[0] == 5.0
    out = job.advance(2.5)  # nothing left but the return
    assert out is not None and job.seconds == 5.0 and job.slices == 4
