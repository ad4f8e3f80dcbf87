"""Architecture name (config.json ``architectures[0]``) → model class and prompt layout, imported
on first use.

Adding an architecture is a model file (and its torch-free prompt layout) in ``epdserve/models`` and
one line here; unused model files are never imported, and the front end, which asks only for the
layout, never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from epdserve.models.base import PromptLayout
    from epdserve.models.config import ModelConfig

# architecture → (model class, prompt layout class), as "module:attribute"
_ARCHITECTURES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "Qwen2VLForConditionalGeneration": (
            "epdserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
            "epdserve.models.qwen2_vl_layout:Qwen2VLLayout",
        ),
        "Qwen2_5_VLForConditionalGeneration": (
            "epdserve.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
            "epdserve.models.qwen2_5_vl_layout:Qwen2_5_VLLayout",
        ),
        "Qwen3VLForConditionalGeneration": (
            "epdserve.models.qwen3_vl:Qwen3VLForConditionalGeneration",
            "epdserve.models.qwen3_vl_layout:Qwen3VLLayout",
        ),
        "Qwen2AudioForConditionalGeneration": (
            "epdserve.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
            "epdserve.models.qwen2_audio_layout:Qwen2AudioLayout",
        ),
    }
)


def _load(target: str) -> Any:
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


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
    cls: type[nn.Module] = _load(_ARCHITECTURES[architecture][0])
    return cls


def prompt_layout(config: ModelConfig) -> PromptLayout:
    """The prompt rules (placeholder counts, rotary positions) of ``config``'s architecture."""
    check_architecture(config.architecture)
    layout: PromptLayout = _load(_ARCHITECTURES[config.architecture][1])(config)
    return layout
