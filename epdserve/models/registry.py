"""Architecture name (config.json ``architectures[0]``) → model class and prompt layout, imported
on first use.

Adding an architecture is a model file (and its torch-free prompt layout) in ``epdserve/models`` and
one entry in ``architectures``; unused model files are never imported, and the front end, which
asks only for the layout, never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from epdserve.models.architectures import (
    ARCHITECTURES,
    UnknownArchitectureError,
    check_architecture,
    supported_architectures,
)

if TYPE_CHECKING:
    from torch import nn

    from epdserve.models.base import PromptLayout
    from epdserve.models.config import ModelConfig

# the architecture names and their error are ``architectures``'; callers may take them from here
__all__ = ["UnknownArchitectureError", "model_class", "prompt_layout", "supported_architectures"]


def _load(target: str) -> Any:
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``; raises UnknownArchitectureError for others."""
    check_architecture(architecture)
    cls: type[nn.Module] = _load(ARCHITECTURES[architecture][0])
    return cls


def prompt_layout(config: ModelConfig) -> PromptLayout:
    """The prompt rules (placeholder counts, rotary positions) of ``config``'s architecture."""
    check_architecture(config.architecture)
    layout: PromptLayout = _load(ARCHITECTURES[config.architecture][1])(config)
    return layout
