#!/usr/bin/env bash
# The project's test command: installs what it needs, then lint, format check, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# the shared embedding store's tests run a real redis-server (Debian's package)
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
python -m ruff check .
python -m ruff format --check .
python -m mypy epdserve
python -m pytest -q -p no:cacheprovider "$@"
