"""Seeded training of the embedded model on the shapes world (CPU, one thread by default).

Resumable: a state file (weights + optimizer + step + RNG) is written every ``--save-every``
seconds; rerunning the same command continues from it. The learning-rate schedule is a function
of the step only, so a resumed run follows the same curve.

Exact match is measured teacher-forced: a greedy decode produces the answer exactly when the
argmax at every answer position (answer tokens + end-of-turn) equals the target, so one forward
pass per batch gives the same number as generating.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.shapes import IMAGE_QUESTIONS, MULTI_QUESTIONS, QUESTION_KIND, VIDEO_QUESTIONS, ShapesWorld
from epdserve.training.args import add_arguments
from epdserve.training.build import DEFAULT_LAYERS, build_untrained
from epdserve.training.data import TRAINER_TYPES, Mixture, SampleEncoder, collate, random_system_prompt
from epdserve.training.grow import grow_state_dict, grow_text_config

EARLY = {"describe_one": 3.0, "shape": 1.0, "color": 1.0, "where": 1.0, "direction": 0.5, "moving_shape": 0.5}
# The mix of the first run (steps 500-2006 of the shipped model), kept to reproduce it: with
# multi-image questions this early the model settled on colour and ignored shape and position.
MAIN_V0 = {
    "describe": 1.0,
    "shape": 0.5,
    "color": 0.5,
    "where": 0.5,
    "count": 0.5,
    "what_at": 1.0,
    "where_is": 1.0,
    "describe_nth": 1.5,
    "which_image": 2.5,
    "direction": 0.7,
    "moving_shape": 0.5,
}
# Single shapes until the vision tower grounds shape and position (colour alone is a shortcut
# the model otherwise settles on), then everything, multi-image about a quarter of the mix.
FOCUS = {
    "describe_one": 2.0,
    "shape": 1.5,
    "where": 1.5,
    "color": 0.3,
    "count": 0.3,
    "direction": 0.4,
    "moving_shape": 0.4,
}
MAIN = {
    "describe": 1.2,
    "shape": 0.6,
    "color": 0.3,
    "where": 0.6,
    "count": 0.4,
    "what_at": 1.0,
    "where_is": 1.0,
    "describe_nth": 1.0,
    "which_image": 1.6,
    "direction": 0.6,
    "moving_shape": 0.4,
}

# Continuing from the shipped weights once prompts carry vision ids: weighted towards what was
# still weak (two-shape descriptions and positions, the multi-image questions).
REFINE = {
    "describe": 1.2,
    "shape": 0.4,
    "color": 0.2,
    "where": 0.3,
    "count": 0.2,
    "what_at": 1.0,
    "where_is": 1.0,
    "describe_nth": 1.5,
    "which_image": 2.0,
    "direction": 0.3,
    "moving_shape": 0.4,
}


def parse_mix_weights(items: list[str]) -> dict[str, float]:
    """``["which_image=6", ...]`` as a weight override for the mix (the question types of the spec,
    plus the trainer's own easier slices, ``TRAINER_TYPES``)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or (name not in QUESTION_KIND and name not in TRAINER_TYPES):
            raise SystemExit(f"--mix-weight {item!r}: expected QTYPE=W with a known question type")
        out[name] = float(value)
    return out


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    flat = total // 2
    if step < flat:
        return peak
    p = min(1.0, (step - flat) / max(1, total - flat))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def linear_patch_embed(model) -> None:
    """Run the Conv3d patch embedding as the equivalent linear map (same weights, ~4x faster backward)."""
    pe = model.model.visual.patch_embed
    conv = pe.proj

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        w = conv.weight.view(conv.weight.shape[0], -1)
        return F.linear(hidden_states.view(-1, w.shape[1]).to(w.dtype), w, conv.bias)

    pe.forward = forward


@torch.no_grad()
def teacher_forced(model, enc: SampleEncoder, samples, pad_id: int, batch: int = 32):
    """Per sample: (encoded, right, predicted ids at the answer positions). A greedy decode
    reproduces the answer exactly when the argmax at every answer position is right."""
    was_training = model.training
    model.eval()
    for i in range(0, len(samples), batch):
        encoded = [enc.encode(s) for s in samples[i : i + batch]]
        b = _to(collate(encoded, pad_id, enc.image_token_id, enc.video_token_id), model.device)
        labels = b.pop("labels")
        pred = model(**b).logits[:, :-1].argmax(-1)
        tgt = labels[:, 1:]
        ok = ((pred == tgt) | (tgt == -100)).all(-1)
        for j, (e, k) in enumerate(zip(encoded, ok.tolist(), strict=True)):
            yield e, k, pred[j][tgt[j] != -100].tolist()
    model.train(was_training)


def exact_match(model, enc: SampleEncoder, samples, pad_id: int, batch: int = 32) -> dict[str, float]:
    hits: dict[str, list[int]] = defaultdict(list)
    for e, ok, _ in teacher_forced(model, enc, samples, pad_id, batch):
        hits[e.sample.qtype].append(int(ok))
    return {q: sum(v) / len(v) for q, v in hits.items()}


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def summarize(per_type: dict[str, float]) -> dict[str, float]:
    groups = {"single": IMAGE_QUESTIONS, "multi": MULTI_QUESTIONS, "video": VIDEO_QUESTIONS}
    out = {}
    for name, qs in groups.items():
        vals = [per_type[q] for q in qs if q in per_type]
        if vals:
            out[name] = sum(vals) / len(vals)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    train(ap.parse_args(argv))


def train(args: argparse.Namespace) -> None:
    """Train; with ``--workers N`` as N data-parallel processes (gloo on loopback) that each make
    and run 1/N of every batch and average their gradients, so a step sees the same batch size."""
    if args.batch % args.workers:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --workers {args.workers}")
    parse_mix_weights(args.mix_weight)  # fail before any process starts
    args.state.mkdir(parents=True, exist_ok=True)
    init_dir = args.state / "init"
    if not (init_dir / "config.json").exists():
        prepare_init(init_dir, args.init_from, args.seed, args.layers)
    if args.rope_theta is not None:
        set_rope_theta(init_dir, args.rope_theta)
    if args.workers == 1:
        _train(0, args, 0, 0)
        return
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_train, args=(args, port, os.getpid()), nprocs=args.workers, join=True)


def prepare_init(init_dir: Path, init_from: Path | None, seed: int, layers: int | None = None) -> None:
    """The run's starting checkpoint: new (``layers`` language-model layers, else the default),
    or the one it continues from (a checkpoint directory, or another run's ``state.pt`` with the
    files of its ``init``), grown to ``layers`` layers if that is more than it has."""
    import shutil

    if init_from is None:
        build_untrained(init_dir, seed=seed, layers=layers or DEFAULT_LAYERS)
        return
    source = checkpoint_files(init_from)
    if not (source / "config.json").exists():
        raise SystemExit(f"--init-from {init_from}: no checkpoint files at {source}")
    shutil.copytree(source, init_dir)
    for f in init_dir.iterdir():
        f.chmod(0o644)
    config = json.loads((init_dir / "config.json").read_text())
    trained = config["text_config"]["num_hidden_layers"]
    if init_from.is_file() or (layers is not None and layers != trained):
        _write_start_weights(init_dir, init_from, config, layers or trained)


def _write_start_weights(init_dir: Path, init_from: Path, config: dict, layers: int) -> None:
    """Save the weights of ``init_from`` (whose ``config.json`` is ``config``) as the run's
    starting checkpoint, grown to ``layers``."""
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if init_from.is_file():
        weights = state_weights(init_from)
    else:
        weights = Qwen2VLForConditionalGeneration.from_pretrained(init_from, dtype=torch.float32).state_dict()
    trained = config["text_config"]["num_hidden_layers"]
    if layers != trained:
        try:
            weights = grow_state_dict(weights, trained, layers)
        except ValueError as e:
            raise SystemExit(f"--layers {layers}: {e}") from None
        (init_dir / "config.json").write_text(json.dumps(grow_text_config(config, layers), indent=2) + "\n")
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig.from_pretrained(init_dir))
    model.load_state_dict(weights)
    model.generation_config = GenerationConfig.from_pretrained(init_dir)  # keep the checkpoint's
    model.save_pretrained(init_dir)


def checkpoint_files(weights: Path) -> Path:
    """The directory with the config and tokenizer that go with ``weights``: the checkpoint
    directory itself, or the ``init`` beside a run's ``state.pt``."""
    return weights if weights.is_dir() else weights.parent / "init"


def load_checkpoint(files: Path):
    """Tokenizer, float32 model and sample encoder from a checkpoint directory."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(files)
    model = Qwen2VLForConditionalGeneration.from_pretrained(files, dtype=torch.float32)
    cfg = model.config
    enc = SampleEncoder(
        tok, VisionProcessor(ProcessorConfig.from_pretrained(files)), cfg.image_token_id, cfg.video_token_id
    )
    return tok, model, enc


def state_weights(state_file: Path) -> dict[str, torch.Tensor]:
    """The model weights in a run's ``state.pt``."""
    return torch.load(state_file, weights_only=False, map_location="cpu")["model"]


def set_rope_theta(init_dir: Path, theta: float) -> None:
    """Set the language model's rotary base (M-RoPE's ``rope_theta``) in the run's config; the
    weights are kept, so training adapts them to the new positions."""
    path = init_dir / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["rope_parameters"]["rope_theta"] = theta
    path.write_text(json.dumps(config, indent=2) + "\n")


def _exit_with_parent(parent: int) -> None:
    """A worker ends when the process that started it is gone: stopping the trainer (Ctrl-C, kill)
    must not leave workers training on and writing the state file."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _average_gradients(params: list[torch.nn.Parameter], loss: torch.Tensor, workers: int) -> float:
    """All-reduce every gradient (and the loss, for the log) in one flat buffer; returns the mean loss."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    flat /= workers
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g)
        offset += n
    return float(flat[-1])


def _train(rank: int, args: argparse.Namespace, port: int, parent: int) -> None:
    if parent:
        _exit_with_parent(parent)
    torch.set_num_threads(args.threads)
    workers = args.workers
    lead = rank == 0
    if workers > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    init_dir = args.state / "init"
    tok, model, enc = load_checkpoint(init_dir)
    pad_id = tok.pad_token_id
    device = torch.device(args.device)
    model.to(device)  # type: ignore[arg-type]  # (transformers types .to oddly)
    linear_patch_embed(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    step = 0
    state_file = args.state / "state.pt"
    if not state_file.exists() and args.init_from is not None:
        # the run's init holds the weights it continues from (the optimizer state starts fresh)
        step = args.start_step
        if lead:
            print(f"initialised from {args.init_from} at step {step}", flush=True)
    if state_file.exists():
        st = torch.load(state_file, weights_only=False, map_location="cpu")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        if lead:
            print(f"resumed at step {step}", flush=True)
    # the data stream depends on (seed, step, rank) so a resumed run sees fresh, reproducible data
    # (rank 0 draws what a single-process run draws)
    shift = step + rank * 100_003
    world = ShapesWorld(args.seed * 1_000_003 + shift)
    mix = Mixture(world, args.seed + shift)
    # a separate stream decides which prompts omit the vision ids, so --plain-frac leaves the rest
    # of the data stream as it was
    plain = random.Random(args.seed * 7 + shift)
    system_rng = random.Random(args.seed * 11 + shift)
    overrides = parse_mix_weights(args.mix_weight)
    params = [p for p in model.parameters() if p.requires_grad]
    probe = ShapesWorld(987_654)  # a small fixed probe set, distinct from the evaluation seed
    held_out = [probe.sample(q) for q in QUESTION_KIND for _ in range(args.probe_per_type)]
    log = (args.state / "log.jsonl").open("a") if lead else None
    model.train()
    t_start, t_save, losses = time.time(), time.time(), []
    while step < args.steps:
        if step < args.early_steps:
            weights = EARLY
        elif args.mix_v0:
            weights = MAIN_V0
        elif args.refine:
            weights = REFINE
        else:
            weights = FOCUS if step < args.focus_until else MAIN
        if step >= args.early_steps:
            weights = {**weights, **overrides}
        batch = [
            enc.encode(
                mix.draw(weights),
                text_first=mix.rng.random() < 0.15,
                vision_ids=args.plain_frac < 1 and plain.random() >= args.plain_frac,
                system=random_system_prompt(system_rng) if system_rng.random() < args.system_frac else None,
            )
            for _ in range(args.batch // workers)
        ]
        b = _to(collate(batch, pad_id, enc.image_token_id, enc.video_token_id), device)
        lr = lr_at(step, args.steps, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(**b).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(_average_gradients(params, loss, workers) if workers > 1 else loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if not lead:
            if step == args.stop_at:
                return
            continue
        if step % 50 == 0:
            rate = (time.time() - t_start) / len(losses)
            print(f"step {step} loss {sum(losses[-50:]) / 50:.4f} lr {lr:.2e} {rate:.3f}s/step", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            em = exact_match(model, enc, held_out, pad_id)
            rec = {"step": step, "time": time.time(), "loss": sum(losses[-50:]) / 50, **summarize(em), "per_type": em}
            print(json.dumps(rec), flush=True)
            assert log is not None
            log.write(json.dumps(rec) + "\n")
            log.flush()
        stopping = step == args.stop_at
        if time.time() - t_save > args.save_every or step == args.steps or stopping:
            tmp = args.state / "state.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, state_file)
            t_save = time.time()
        if stopping:
            return
    if lead:
        export(model, init_dir, args.out)


def export(model, init_dir: Path, out: Path) -> None:
    """Write the trained weights with the tokenizer/processor files of the init checkpoint."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in init_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    model.save_pretrained(out)


if __name__ == "__main__":
    main()
