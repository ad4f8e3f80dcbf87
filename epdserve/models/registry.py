"""Architecture name (config.json ``architectures[0]``) → model class, imported on first use.

Adding an architecture is one file in ``epdserve/models`` and one line here; unused model files
are never imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from epdserve.models.base import PromptLayout
    from epdserve.models.config import ModelConfig

_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "Qwen2VLForConditionalGeneration": "epdserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    }
)


class UnknownArchitectureError(ValueError):
    """config.json names an architecture that has no model file here."""


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def check_architecture(architecture: str) -> None:
    """Raise UnknownArchitectureError, naming what is supported, unless ``architecture`` is."""
    if architecture not in _ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )


def model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; raises UnknownArchitectureError for others."""
    check_architecture(architecture)
    target = _ARCHITECTURES[architecture]
    module_name, class_name = target.split(":")
    cls: type[nn.Module] = getattr(importlib.import_module(module_name), class_name)
    return cls


def prompt_layout(config: ModelConfig) -> PromptLayout:
    """The prompt rules (placeholder counts, rotary positions) of ``config``'s architecture."""
    layout: PromptLayout = model_class(config.architecture).prompt_layout(config)  # type: ignore[attr-defined]
    return layout
