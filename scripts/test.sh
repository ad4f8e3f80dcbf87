#!/usr/bin/env bash
# The project's test command: installs what it needs, then lint, format check, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
python -m ruff check .
python -m ruff format --check .
python -m mypy epdserve
python -m pytest -q -p no:cacheprovider "$@"
