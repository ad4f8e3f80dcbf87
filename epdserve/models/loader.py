"""Build a model from a Hugging Face checkpoint directory, reading only the tensors it needs.

The module is built on the meta device (no memory, no random init), materialized empty on the
target device, and filled from the safetensors files through mmap. A process that builds only some
parts (the encoder: ``{"vision"}``) never reads the other parts' tensors.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
from safetensors import safe_open
from torch import nn

from epdserve.kernels import KernelChoice
from epdserve.kernels.cpu_linear import linears_in_use, prepare_linears
from epdserve.models.config import ALL_PARTS, ModelConfig
from epdserve.models.layers.decoder import Qwen2LanguageModel
from epdserve.models.registry import model_class

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint directory lacks weights, or lacks tensors the model needs."""


class LoadableModel(Protocol):
    """What the loader needs from a model class besides being an ``nn.Module``."""

    def checkpoint_param_name(self, name: str) -> str | None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def init_buffers(self) -> None: ...


@dataclass(frozen=True)
class LoadReport:
    """What a load read from disk."""

    model_dir: str  # checkpoint directory
    parts: frozenset[str]  # parts built
    tensors: tuple[str, ...]  # checkpoint tensor names read, sorted
    seconds: float  # wall time of the whole load


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name → the safetensors file holding it (single file or sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _read(files: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    for path, names in files.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialised storage on ``device`` (floating point in
    ``dtype``), keeping tied parameters tied. (``Module.to_empty`` does the same through torch's
    reference ops, whose import of sympy slows every start.)"""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = empty(b)
                module._buffers[name] = made[id(b)]


def load_model(
    model_dir: str | Path,
    parts: frozenset[str] = ALL_PARTS,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kernels: KernelChoice = "auto",
) -> tuple[nn.Module, LoadReport]:
    """The model of ``model_dir`` with only ``parts`` built and loaded, in eval mode, without grads."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    cls = model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, parts=frozenset(parts))  # type: ignore[call-arg]
    _materialize(model, dtype, torch.device(device))
    loadable = cast(LoadableModel, model)

    params = {name for name, _ in model.named_parameters()}
    wanted: dict[str, list[str]] = {}
    for name, path in checkpoint_files(model_dir).items():
        if loadable.checkpoint_param_name(name) in params:
            wanted.setdefault(str(path), []).append(name)
    loaded = loadable.load_weights(_read(wanted))
    missing = params - loaded
    if missing:
        raise CheckpointError(f"{model_dir}: no tensor for {len(missing)} parameters, e.g. {sorted(missing)[:5]}")
    loadable.init_buffers()
    # every top-level part but the language model is a media tower: whole items' patches per call
    towers = tuple(name for name, _ in model.named_children() if name != "language_model")
    kernel = prepare_linears(model, dtype, torch.device(device), kernels, towers)
    log.info("linear layers: %s", linears_in_use(dtype, torch.device(device), kernel))
    for module in model.modules():
        if isinstance(module, Qwen2LanguageModel):
            module.lay_out_tied_head(kernel)
    model.eval().requires_grad_(False)
    report = LoadReport(
        model_dir=str(model_dir),
        parts=frozenset(parts),
        tensors=tuple(sorted(n for names in wanted.values() for n in names)),
        seconds=time.perf_counter() - start,
    )
    return model, report
