"""Architecture name (config.json ``architectures[0]``) → model class, imported on first use.

Adding an architecture is one file in ``epdserve/models`` and one line here; unused model files
are never imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

from torch import nn

_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "Qwen2VLForConditionalGeneration": "epdserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    }
)


class UnknownArchitectureError(ValueError):
    """config.json names an architecture that has no model file here."""


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; raises UnknownArchitectureError for others."""
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise UnknownArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    cls: type[nn.Module] = getattr(importlib.import_module(module_name), class_name)
    return cls
