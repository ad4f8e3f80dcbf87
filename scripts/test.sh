#!/usr/bin/env bash
# The project's test command: installs what it needs, then lint, format check, type check, tests.
#   bash scripts/test.sh            what CI runs: every tier, the connector x family matrix reduced
#   bash scripts/test.sh --smoke    the smoke tier: unit tests and a few quick integration tests
#   bash scripts/test.sh --full     every tier and every connector x family combination
# Other arguments go to pytest (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
pytest_args=()
for arg in "$@"; do
    case "$arg" in
        --smoke) pytest_args+=(-m smoke) ;;
        --full) export EPD_FULL_MATRIX=1 ;;
        *) pytest_args+=("$arg") ;;
    esac
done
# every process the tests start (roles, engine cores, test workers) reads the compiled modules the
# first one wrote, instead of compiling epdserve and the tests again (some environments turn the
# cache off)
unset PYTHONDONTWRITEBYTECODE
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# the shared embedding store's tests run a real redis-server, Mooncake's wheel needs the RDMA and
# NUMA libraries even over TCP, the multi-host test needs ip, the fused CPU kernels a C++
# compiler (Debian's packages)
missing=()
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)  # the multi-host test's network namespaces
for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    ldconfig -p 2>/dev/null | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python -m ruff check .
python -m ruff format --check .
python -m mypy epdserve
# test files run in parallel worker processes (most of a test's time is waiting on the processes it
# starts), each file whole in one worker so its deployments are shared; EPD_TEST_WORKERS=0 runs
# everything in this process
python -m pytest -q -p no:cacheprovider -n "${EPD_TEST_WORKERS:-3}" --dist loadfile ${pytest_args[@]+"${pytest_args[@]}"}
