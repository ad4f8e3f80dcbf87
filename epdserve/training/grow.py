"""Deepen a trained language model without changing what it computes.

The grown stack keeps every trained decoder layer, in order, and inserts copies of the layer
before each insertion point whose two output projections (attention ``o_proj`` and MLP
``down_proj``) are zero. Such a block adds nothing to the residual stream, so the grown model
gives exactly the trained model's logits; training then puts the new depth to use (the block
expansion of LLaMA Pro, Wu et al. 2024). The vision tower and the embeddings are untouched.
"""

from __future__ import annotations

import re

import torch

_LAYER_KEY = re.compile(r"^(?P<head>.*language_model\.layers\.)(?P<index>\d+)\.(?P<tail>.+)$")
_ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def layer_sources(old: int, new: int) -> list[tuple[int, bool]]:
    """For each layer of the grown stack: (trained layer it comes from, whether it is a new,
    identity block). Trained layers are spread evenly; each new block copies the layer before it."""
    if new < old or old < 1:
        raise ValueError(f"cannot grow {old} layers to {new}")
    placed = {i * new // old: i for i in range(old)}
    out: list[tuple[int, bool]] = []
    for j in range(new):
        if j in placed:
            out.append((placed[j], False))
        else:
            out.append((out[-1][0], True))
    return out


def grow_state_dict(state: dict[str, torch.Tensor], old: int, new: int) -> dict[str, torch.Tensor]:
    """The weights of a ``new``-layer language model that computes what the ``old``-layer one does."""
    layers: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(old)}
    grown: dict[str, torch.Tensor] = {}
    head = ""
    for key, value in state.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            grown[key] = value
            continue
        head = m["head"]
        layers[int(m["index"])][m["tail"]] = value
    if not head or any(not w for w in layers.values()):
        raise ValueError(f"the weights do not hold {old} language-model layers")
    for j, (source, new_block) in enumerate(layer_sources(old, new)):
        for tail, value in layers[source].items():
            copy = value.clone()
            if new_block and tail in _ZEROED:
                copy.zero_()
            grown[f"{head}{j}.{tail}"] = copy
    return grown


def grow_text_config(config: dict, new: int) -> dict:
    """``config.json`` (as a dict) with ``new`` language-model layers, all full attention."""
    text = dict(config["text_config"])
    text.update(num_hidden_layers=new, max_window_layers=new, layer_types=["full_attention"] * new)
    return {**config, "text_config": text}
