"""Copying checkpoint tensors into a model whose q/k/v and gate/up projections are fused.

Each family maps a checkpoint name to (our parameter, slice index or None); a tensor with an
index fills its row slice of the fused parameter (the module's ``shard_sizes`` give the slices),
which counts as loaded once every slice has arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

MapName = Callable[[str], "tuple[str, int | None] | None"]


class WeightLoadError(ValueError):
    """A checkpoint tensor has the wrong shape, or a parameter found no tensor."""


# checkpoint name (after the prefix) → (fused parameter, slice index); shared by every family
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: MapName,
    reshape: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> set[str]:
    """Copy ``weights`` (checkpoint names) into ``model``'s parameters; returns the names filled.

    ``reshape(ours, tensor)`` gives a whole (unfused) tensor the shape of its parameter where the
    checkpoint stores it otherwise (a Conv3d patch kernel)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    shards: dict[str, set[int]] = {}
    for name, tensor in weights:
        mapped = map_name(name)
        if mapped is None or mapped[0] not in params:
            continue
        ours, index = mapped
        if index is not None:
            sizes = modules[ours.rsplit(".", 2)[0]].shard_sizes
            part = params[ours].narrow(0, sum(sizes[:index]), sizes[index])
            if tensor.shape != part.shape:
                raise WeightLoadError(f"{name}: checkpoint shape {list(tensor.shape)}, model {list(part.shape)}")
            part.copy_(tensor)
            shards.setdefault(ours, set()).add(index)
            if len(shards[ours]) == len(sizes):
                loaded.add(ours)
            continue
        param = params[ours]
        if reshape is not None:
            tensor = reshape(ours, tensor)
        if tensor.shape != param.shape:
            raise WeightLoadError(f"{name}: checkpoint shape {list(tensor.shape)}, model {list(param.shape)}")
        param.copy_(tensor)
        loaded.add(ours)
    return loaded
