"""Shared fixtures: the model directory under test, and one cluster secret for every role a test
starts (they inherit the environment, as the roles of one deployment share the secret)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import torch

from epdserve.assets import default_model_dir
from epdserve.hf_reference import HFReference

torch.set_num_threads(1)
os.environ.setdefault("EPD_CLUSTER_SECRET", secrets.token_hex(32))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFReference:
    """transformers' model on the checkpoint: the correctness oracle."""
    return HFReference(model_dir)


def pytest_configure(config: pytest.Config) -> None:
    if not (default_model_dir() / "config.json").is_file():
        raise pytest.UsageError(f"the embedded model is missing at {default_model_dir()}")
