#!/usr/bin/env bash
# The CUDA path on a lent GPU machine (never part of CI): oracle parity of the engine on the GPU
# against transformers, each precision's server answering end to end, and a short benchmark.
#   bash scripts/gpu_check.sh            # from the repository root; writes gpu_check/ (or $OUT)
#   bash scripts/gpu_check.sh --vllm     # then the vLLM path too: epdserve encoders on CUDA feeding
#                                        # `vllm serve` on CUDA (docs/vllm.md), parity and a benchmark
#   bash scripts/gpu_check.sh --vllm-only
# EPD_CHECK_DEVICE=cpu runs the same steps on the CPU, in the environment it is started from: a
# rehearsal of the script itself (tests/test_gpu_check.py).
set -euo pipefail
OUT="${OUT:-gpu_check}"
DEVICE=${EPD_CHECK_DEVICE:-cuda}
mkdir -p "$OUT"
VLLM=0; EPD=1
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --vllm-only) VLLM=1; EPD=0 ;;
    *) echo "gpu_check: unknown argument $arg" >&2; exit 2 ;;
  esac
done
if [ "$EPD" = 1 ]; then
if [ "$DEVICE" = cuda ]; then python -m pip install -q -e ".[dev]" 2>&1 | tail -2 || true; fi
DEVICE=$DEVICE python - <<'PY' | tee "$OUT/device.txt"
import os, torch
where = "cpu"
if os.environ["DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    where = f"cuda {torch.version.cuda} {torch.cuda.get_device_name(0)}"
print(torch.__version__, where)
PY
# 1. greedy tokens on the device identical to transformers (float32), engine in- and out-of-process
EPD_TEST_DEVICE=$DEVICE python -m pytest -q -p no:cacheprovider \
  tests/test_engine_oracle.py tests/test_engine_client.py 2>&1 | tee "$OUT/oracle.txt"
# 1b. the same for every other model family (tiny random-weight checkpoints built offline)
EPD_TEST_DEVICE=$DEVICE python -m pytest -q -p no:cacheprovider -k greedy \
  tests/test_qwen2_5_vl.py tests/test_qwen3_vl.py tests/test_qwen2_audio.py 2>&1 | tee "$OUT/oracle-families.txt"
# 2. every role on the device at each precision answers end to end (1e+1pd through the router)
for dtype in float32 bfloat16 float16; do
  EPD_TEST_DEVICE=$DEVICE EPD_TEST_DTYPE=$dtype python -m pytest -q -p no:cacheprovider \
    tests/test_server.py -k "models_and_health or streaming_equals" 2>&1 | tee "$OUT/server-$dtype.txt"
done
# 3. a short benchmark: epdserve vs transformers generate, both on the device
python -m epdserve.bench.engine_vs_hf --device $DEVICE --dtype bfloat16 --requests 64 --output-len 64 \
  --concurrency 4 16 --json "$OUT/engine_vs_hf_$DEVICE.json" 2>&1 | tee "$OUT/bench.txt"
fi
if [ "$VLLM" = 1 ]; then
  bash scripts/gpu_check_vllm.sh "$OUT"
fi
echo "gpu_check: all steps passed; results in $OUT/"
