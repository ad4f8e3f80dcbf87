"""The tier table names only tests that exist: a renamed test must not silently lose its tier, its
place in the smoke run or in the full matrix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.tiers import EXTRAS, FULL_MATRIX, SMOKE, TIERS, tier_of

HERE = Path(__file__).parent


def functions(file: str) -> set[str]:
    tree = ast.parse((HERE / file).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_row_names_an_existing_file_and_test_and_a_tier() -> None:
    for key, tier in TIERS.items():
        file, _, test = key.partition("::")
        assert (HERE / file).is_file(), key
        assert not test or test in functions(file), f"{key}: no such test"
        assert tier in ("unit", "integration", "e2e"), key


def test_smoke_and_full_matrix_entries_name_existing_tests() -> None:
    for key in SMOKE | FULL_MATRIX:
        file, _, test = key.partition("::")
        assert test.split("[")[0] in functions(file), f"{key}: no such test"
    assert all(file in TIERS for file in EXTRAS)


def test_every_test_file_has_a_tier() -> None:
    assert sorted(p.name for p in HERE.glob("test_*.py") if p.name not in TIERS) == []


def test_a_test_row_overrides_its_files_row() -> None:
    assert tier_of("test_topologies.py", "test_topology_parsing") == "unit"
    assert tier_of("test_topologies.py", "test_1e1pd_equals_aggregated") == "e2e"
    with pytest.raises(KeyError):
        tier_of("test_no_such_file.py", "test_x")
