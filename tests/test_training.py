"""The trainer: resumable state, export, and data-parallel workers (tiny runs from scratch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from epdserve.training.args import add_arguments
from epdserve.training.train import _average_gradients, train


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new checkpoint (seed 5, the default layer count) that tests read or copy, never change."""
    from epdserve.training.build import build_untrained

    path = tmp_path_factory.mktemp("untrained") / "ckpt"
    build_untrained(path, seed=5)
    return path


def _args(tmp: Path, *extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    base = ["--out", str(tmp / "out"), "--state", str(tmp / "state"), "--batch", "2", "--early-steps", "0"]
    return ap.parse_args([*base, "--eval-every", "2", "--probe-per-type", "1", *extra])


@pytest.mark.timeout(300)
def test_stop_resume_and_export(tmp_path: Path, untrained: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    train(_args(tmp_path, "--steps", "2", "--stop-at", "1", "--init-from", str(untrained)))
    assert torch.load(tmp_path / "state" / "state.pt", weights_only=False)["step"] == 1
    assert not (tmp_path / "out").exists()
    train(_args(tmp_path, "--steps", "2", "--init-from", str(untrained)))
    assert "resumed at step 1" in capfd.readouterr().out
    log = [json.loads(line) for line in (tmp_path / "state" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2] and set(log[0]["per_type"]) >= {"describe", "which_image", "direction"}
    trained = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    init = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "state" / "init").state_dict()
    assert trained.keys() == init.keys()
    assert any(not torch.equal(trained[k], init[k]) for k in init)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        tmp_path / "state" / "init" / "tokenizer.json"
    ).read_bytes()


def _rank(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    mean_loss = _average_gradients(params, torch.tensor(10.0 * (rank + 1)), workers=2)
    torch.save({"loss": mean_loss, "grads": [p.grad for p in params]}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_workers_average_gradients_and_loss(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["loss"] == 15.0
        assert all(torch.equal(g, torch.full_like(g, 1.5)) for g in got["grads"])


@pytest.mark.timeout(300)
def test_two_workers_train_and_export(tmp_path: Path, untrained: Path) -> None:
    train(_args(tmp_path, "--steps", "2", "--workers", "2", "--init-from", str(untrained)))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    log = [json.loads(line) for line in (tmp_path / "state" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2] and log[0]["loss"] > 0


def test_batch_must_split_evenly(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="multiple of --workers"):
        train(_args(tmp_path, "--steps", "1", "--workers", "3"))


def test_mix_weight_overrides_are_checked() -> None:
    from epdserve.training.train import parse_mix_weights

    assert parse_mix_weights(["which_image=6", "which_colour=2.5"]) == {"which_image": 6.0, "which_colour": 2.5}
    for bad in ("which_image", "no_such_type=1"):
        with pytest.raises(SystemExit, match="--mix-weight"):
            parse_mix_weights([bad])


def _which_slice(name: str, seed: int) -> list:
    """200 questions of one of the trainer's which-image slices, each checked to be a valid spec
    question: exactly one image has the asked shape, and the answer names that image."""
    from epdserve.shapes import ORDINALS, ShapesWorld, which_image_target
    from epdserve.training.data import Mixture

    mix = Mixture(ShapesWorld(seed), seed=seed)
    out = []
    for _ in range(200):
        s = mix.draw({name: 1.0})
        color, kind = which_image_target(s)
        holders = [i for i, sc in enumerate(s.scenes) if sc.has(color, kind)]
        assert s.qtype == "which_image" and len(holders) == 1
        assert s.answer == f"the {ORDINALS[holders[0]]}"
        out.append((s, color, kind, holders[0]))
    return out


def test_which_colour_is_a_spec_question_that_the_colour_alone_answers() -> None:
    drawn = _which_slice("which_colour", 3)
    for s, color, _, holder in drawn:
        assert [i for i, sc in enumerate(s.scenes) for sh in sc.shapes if sh.color == color] == [holder]
    assert {len(s.scenes) for s, *_ in drawn} == {2, 3, 4}


def test_which_two_is_two_one_shape_images_in_different_colours() -> None:
    drawn = _which_slice("which_two", 6)
    for s, *_ in drawn:
        assert [len(sc.shapes) for sc in s.scenes] == [1, 1]
        assert s.scenes[0].shapes[0].color != s.scenes[1].shapes[0].color
    assert {holder for *_, holder in drawn} == {0, 1}


def test_which_many_is_the_spec_question_over_three_or_four_images() -> None:
    assert {len(s.scenes) for s, *_ in _which_slice("which_many", 4)} == {3, 4}


def test_which_both_needs_the_colour_and_the_shape_together() -> None:
    drawn = _which_slice("which_both", 5)
    for s, color, kind, holder in drawn:
        # another image shares the colour, and another (maybe the same one) the shape
        others = [sc for i, sc in enumerate(s.scenes) if i != holder]
        assert any(sh.color == color for sc in others for sh in sc.shapes)
        assert any(sh.kind == kind for sc in others for sh in sc.shapes)
    assert {len(s.scenes) for s, *_ in drawn} == {2, 3, 4}


def test_which_by_colour_needs_the_colour_to_pick_among_images_with_the_shape() -> None:
    drawn = _which_slice("which_by_colour", 5)
    for s, _, kind, holder in drawn:
        others = [sc for i, sc in enumerate(s.scenes) if i != holder]
        assert any(sh.kind == kind for sc in others for sh in sc.shapes)
    assert {len(s.scenes) for s, *_ in drawn} == {2, 3, 4}


def test_which_same_kind_has_the_asked_shape_in_every_image() -> None:
    drawn = _which_slice("which_same_kind", 5)
    for s, _, kind, _ in drawn:
        assert all(any(sh.kind == kind for sh in sc.shapes) for sc in s.scenes)
    assert {len(s.scenes) for s, *_ in drawn} == {2, 3, 4}


def test_where_same_kind_asks_where_one_of_two_same_kind_shapes_is() -> None:
    from epdserve.shapes import LOCATION_PHRASE, ShapesWorld
    from epdserve.training.data import Mixture

    mix = Mixture(ShapesWorld(8), seed=8)
    answers = set()
    for _ in range(100):
        s = mix.draw({"where_same_kind": 1.0})
        a, b = s.scenes[0].shapes
        assert s.qtype == "where_is" and a.kind == b.kind and a.color != b.color
        asked = next(sh for sh in (a, b) if s.question == f"Where is the {sh.color} {sh.kind}?")
        assert s.answer == LOCATION_PHRASE[asked.location]
        answers.add(s.answer)
    assert answers == set(LOCATION_PHRASE.values())


def test_a_continued_run_takes_the_files_of_what_it_continues_from(tmp_path: Path, untrained: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    from epdserve.training.train import prepare_init, set_rope_theta

    src = untrained
    # from a checkpoint directory
    prepare_init(tmp_path / "a" / "init", src, seed=99)
    assert (tmp_path / "a" / "init" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # from another run's state file: the files beside it, and the weights in it
    model = Qwen2VLForConditionalGeneration.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    torch.save({"model": model.state_dict()}, tmp_path / "a" / "state.pt")
    prepare_init(tmp_path / "b" / "init", tmp_path / "a" / "state.pt", seed=99)
    assert (tmp_path / "b" / "init" / "config.json").read_text() == (src / "config.json").read_text()
    started = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "b" / "init").state_dict()
    assert all(torch.equal(started[k], v) for k, v in model.state_dict().items())
    with pytest.raises(SystemExit, match="no checkpoint files"):
        prepare_init(tmp_path / "c" / "init", tmp_path / "nowhere" / "state.pt", seed=99)
    set_rope_theta(tmp_path / "b" / "init", 100.0)
    config = json.loads((tmp_path / "b" / "init" / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["rope_theta"] == 100.0
    assert config["vision_config"]["rope_parameters"]["rope_theta"] == 10000.0


@pytest.mark.timeout(300)
def test_workers_end_when_the_trainer_is_killed(tmp_path: Path, untrained: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "epdserve.training.train", "--out", str(tmp_path / "out")]
    cmd += ["--state", str(tmp_path / "state"), "--batch", "2", "--steps", "100000", "--workers", "2"]
    cmd += ["--early-steps", "0", "--eval-every", "100000", "--init-from", str(untrained)]  # no model to build
    trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children() -> list[int]:
        path = Path(f"/proc/{trainer.pid}/task/{trainer.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 240
    workers: list[int] = []
    while len(workers) < 2 and time.time() < deadline:  # the two ranks (beside the resource tracker)
        workers = [p for p in children() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        time.sleep(0.5)
    assert len(workers) == 2, "the trainer did not start its workers"
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.time() + 30
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in workers), "workers kept running after the trainer was killed"


def test_layer_sources_spread_the_trained_layers_and_copy_the_one_before() -> None:
    from epdserve.training.grow import layer_sources

    assert layer_sources(4, 4) == [(0, False), (1, False), (2, False), (3, False)]
    assert layer_sources(4, 8) == [(i // 2, i % 2 == 1) for i in range(8)]
    assert layer_sources(4, 6) == [(0, False), (1, False), (1, True), (2, False), (3, False), (3, True)]
    with pytest.raises(ValueError, match="cannot grow"):
        layer_sources(4, 3)


@pytest.mark.timeout(300)
def test_a_grown_model_answers_exactly_as_the_trained_one(tmp_path: Path, untrained: Path) -> None:
    import shutil

    from transformers import Qwen2VLForConditionalGeneration

    from epdserve.shapes import ShapesWorld
    from epdserve.training.data import collate
    from epdserve.training.train import load_checkpoint, prepare_init

    src = tmp_path / "run" / "init"  # a run's init, with its state file beside it
    shutil.copytree(untrained, src)  # random weights: every block changes the residual stream
    trained = Qwen2VLForConditionalGeneration.from_pretrained(src).state_dict()
    torch.save({"model": trained}, tmp_path / "run" / "state.pt")
    for source, name in ((src, "from-dir"), (tmp_path / "run" / "state.pt", "from-state")):
        prepare_init(tmp_path / name / "init", source, seed=99, layers=6)
    tok, small, enc = load_checkpoint(src)
    _, grown, _ = load_checkpoint(tmp_path / "from-dir" / "init")
    _, grown_from_state, _ = load_checkpoint(tmp_path / "from-state" / "init")
    assert grown.config.text_config.num_hidden_layers == 6
    for name in ("from-dir", "from-state"):  # the checkpoint's generation settings are kept
        kept = json.loads((tmp_path / name / "init" / "generation_config.json").read_text())
        assert kept["eos_token_id"] == json.loads((src / "generation_config.json").read_text())["eos_token_id"]
    layers = grown.model.language_model.layers
    assert torch.equal(
        layers[2].self_attn.q_proj.weight, trained["model.language_model.layers.1.self_attn.q_proj.weight"]
    )
    assert not layers[2].self_attn.o_proj.weight.any() and not layers[2].mlp.down_proj.weight.any()
    assert torch.equal(layers[4].mlp.down_proj.weight, trained["model.language_model.layers.3.mlp.down_proj.weight"])
    world = ShapesWorld(3)
    samples = [enc.encode(world.sample(q)) for q in ("which_image", "describe", "direction")]
    batch = collate(samples, tok.pad_token_id, enc.image_token_id, enc.video_token_id)
    batch.pop("labels")
    with torch.no_grad():
        want = small(**batch).logits
        assert want.abs().max() > 0
        assert torch.equal(grown(**batch).logits, want)
        assert torch.equal(grown_from_state(**batch).logits, want)
    with pytest.raises(SystemExit, match="cannot grow"):
        prepare_init(tmp_path / "shrunk" / "init", src, seed=99, layers=2)


def test_a_new_model_takes_the_layer_count(tmp_path: Path) -> None:
    from epdserve.training.train import prepare_init

    prepare_init(tmp_path / "init", None, seed=1, layers=2)
    config = json.loads((tmp_path / "init" / "config.json").read_text())["text_config"]
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
