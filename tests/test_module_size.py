"""No Python module of epdserve is over ``MAX_LINES`` lines: a file that grows past it is split by
concept (docs/architecture.md's module map names the pieces). Files that are not Python, such as
the C++ kernel source or the embedded model's assets, are not modules and are not counted."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "epdserve"
MAX_LINES = 600


def oversized(package: Path, max_lines: int) -> list[str]:
    """Every ``.py`` file under ``package`` with more than ``max_lines`` lines, with its count."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > max_lines:
            found.append(f"{path.relative_to(package.parent)}: {lines} lines")
    return found


def test_a_module_over_the_limit_is_named(tmp_path: Path) -> None:
    pkg = tmp_path / "epdserve"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "short.py").write_text("x = 1\n" * 3)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * 4)
    (pkg / "sub" / "kernel.cpp").write_text("int x;\n" * 10)
    assert oversized(pkg, 3) == ["epdserve/sub/long.py: 4 lines"]
    assert oversized(pkg, 4) == []


def test_no_epdserve_module_is_over_the_limit() -> None:
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the whole package was read
    found = oversized(PACKAGE, MAX_LINES)
    assert not found, f"split these by concept (at most {MAX_LINES} lines each):\n" + "\n".join(found)
