"""How many torch threads a role's model gets when the operator leaves it to the server."""

from __future__ import annotations

from torch import nn

from epdserve.assets import default_model_dir
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.kernels.parallel import PARALLEL_WEIGHT, threads_for
from epdserve.models.loader import load_model


def test_a_model_with_a_large_weight_gets_every_core() -> None:
    side = 1 << 10  # a square weight of exactly PARALLEL_WEIGHT elements
    assert side * side == PARALLEL_WEIGHT
    model = nn.Sequential(nn.Linear(side, side), nn.Linear(side, 8))
    assert threads_for(model, cores=6) == 6
    assert threads_for(model, cores=1) == 1


def test_a_small_model_gets_one_thread_whatever_its_embedding_table() -> None:
    # the table is looked up, not multiplied: its size says nothing about the matmuls
    model = nn.Sequential(nn.Embedding(4 * PARALLEL_WEIGHT // 64, 64), nn.Linear(64, 256), nn.Linear(256, 64))
    assert threads_for(model, cores=8) == 1
    assert threads_for(nn.Sequential(nn.Linear(1023, 1024)), cores=8) == 1  # one element short


def test_the_embedded_model_runs_on_one_thread_by_default() -> None:
    model, _ = load_model(default_model_dir())
    assert threads_for(model, cores=64) == 1
    assert threads_for(model) == 1


def test_an_engine_core_resolves_its_threads_unless_told() -> None:
    assert EngineCore.from_pretrained(default_model_dir(), EngineConfig()).threads == 1
    assert EngineCore.from_pretrained(default_model_dir(), EngineConfig(threads=3)).threads == 3
