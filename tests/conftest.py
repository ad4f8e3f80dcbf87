"""Shared fixtures (the model directory under test, one cluster secret for every role a test starts:
they inherit the environment, as the roles of one deployment share the secret) and the test tiers.

Every test has one tier, a pytest marker given here from ``tests/tiers.py`` (a test file missing
from its table stops the run):

- ``unit``: in this process, no other process started (checked while it runs); seconds.
- ``integration``: real processes on loopback: one role, one connector, a store, a tool.
- ``e2e``: whole deployments: topologies, model families, failures.

``smoke`` marks every unit test and a few quick integration and e2e tests that together reach
every subsystem: ``pytest -m smoke`` (``scripts/test.sh --smoke``) is a check of a minute or two.

``full`` marks the connector x family combinations that repeat what another combination already
checks (each connector runs end to end, each family once per kind of topology, in the default
run): they skip unless ``EPD_FULL_MATRIX=1`` (``scripts/test.sh --full``). docs/testing.md.
"""

from __future__ import annotations

import multiprocessing.process
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from epdserve.assets import default_model_dir
from epdserve.hf_reference import HFReference
from tests.optional import unavailable
from tests.tiers import EXTRAS, FULL_MATRIX, SMOKE, TIERS, tier_of

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


class _ExtraMissing(pytest.Module):
    """A test file whose optional extra does not load here: reported as skipped, never imported."""

    reason = ""

    def collect(self) -> list[Any]:
        raise pytest.skip.Exception(self.reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    module = EXTRAS.get(module_path.name)
    why = unavailable(module) if module else None
    if why is None:
        return None
    skipped = _ExtraMissing.from_parent(parent, path=module_path)
    skipped.reason = why
    return skipped


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full = os.environ.get("EPD_FULL_MATRIX") == "1"
    unknown = sorted({item.path.name for item in items if item.path.name not in TIERS})
    if unknown:
        raise pytest.UsageError(
            f"no tier for {', '.join(unknown)}: add each file to TIERS in tests/tiers.py "
            "(unit, integration or e2e; see docs/testing.md)"
        )
    # files with whole deployments first, unit files last (each file keeps its own order): the
    # parallel workers take files in this order, so the long ones do not start at the end
    rank = {"e2e": 0, "integration": 1, "unit": 2}
    weight: dict[str, int] = {}
    for item in items:
        name = getattr(item, "originalname", item.name)
        tier = tier_of(item.path.name, name)
        weight[item.path.name] = min(weight.get(item.path.name, rank["unit"]), rank[tier])
        item.add_marker(tier)
        if tier == "unit" or f"{item.path.name}::{name}" in SMOKE:
            item.add_marker("smoke")
        if f"{item.path.name}::{item.name}" in FULL_MATRIX:
            item.add_marker("full")
            if not full:
                item.add_marker(pytest.mark.skip(reason="a combination of the full matrix: scripts/test.sh --full"))
    items.sort(key=lambda item: weight[item.path.name])


class ProcessStarted(AssertionError):
    """A test of the unit tier started a process: it belongs to another tier (tests/tiers.py)."""


# what a unit test may not start: an interpreter (a role, an engine core, a worker) or a server;
# tools it runs and waits for (a compiler, ldconfig, git) are part of the code under test
SERVERS = ("python", "epdserve", "redis-server", "mooncake_master", "taskset")


def _program(args: object) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")  # type: ignore[call-overload]
    return os.path.basename(os.fsdecode(first)).split()[0] if first else ""


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keeps the unit tier honest: a unit test that starts a role, an interpreter or a server fails."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    where = f"{request.node.path.name}::{getattr(request.node, 'originalname', request.node.name)}"
    popen_init = subprocess.Popen.__init__

    def refuse(what: str) -> ProcessStarted:
        return ProcessStarted(f"{where} is a unit test but starts {what}: give it a tier in tests/tiers.py")

    def checked_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _program(args).startswith(SERVERS):
            raise refuse(_program(args))
        popen_init(self, args, *rest, **kwargs)

    def no_start(self: multiprocessing.process.BaseProcess) -> None:
        raise refuse("a multiprocessing process")

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_start)
    yield
