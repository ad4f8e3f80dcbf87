"""Locations of the assets shipped inside the package (the embedded default model)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "shapes-qwen2vl"


def default_model_dir() -> Path:
    """Directory of the embedded Qwen2-VL shapes-world checkpoint (Hugging Face format)."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_NAME
