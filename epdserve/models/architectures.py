"""The architectures this build serves (config.json ``architectures[0]``) and where each one's
model class and prompt layout live, as import paths: a leaf that ``config`` checks names against
and ``registry`` imports from, without importing either.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# architecture → (model class, prompt layout class), as "module:attribute"
ARCHITECTURES: Mapping[str, tuple[str, str]] = MappingProxyType(
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


class UnknownArchitectureError(ValueError):
    """config.json names an architecture that has no model file here."""


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def check_architecture(architecture: str) -> None:
    """Raise UnknownArchitectureError, naming what is supported, unless ``architecture`` is."""
    if architecture not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
