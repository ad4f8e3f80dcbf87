#!/usr/bin/env bash
# The vLLM path of scripts/gpu_check.sh on a lent GPU machine (never part of CI): epdserve's
# encoder on CUDA feeding `vllm serve` on CUDA through epdserve's EC connector.
#   bash scripts/gpu_check_vllm.sh OUT      (OUT: where results go; gpu_check.sh --vllm passes its own)
# 1. parity: tests/test_vllm_connector.py on CUDA (EPD_TEST_DEVICE=cuda): greedy tokens of
#    encoder + vLLM (local encoding forbidden, so every answer comes from epdserve's embeddings)
#    equal a plain vLLM's on the same requests, through the router too;
# 2. `epdserve up --lm-engine vllm` on CUDA answering end to end;
# 3. a short benchmark, the same workload against encoder + vLLM (through the router) and
#    against a plain vLLM (aggregated).
# vLLM's CUDA build goes into its own environment (VLLM_GPU_ENV, default .vllm-gpu-env), with this
# package's [vllm] extra; the environment is reused when it already imports both.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check}"
mkdir -p "$OUT"
VENV=${VLLM_GPU_ENV:-$PWD/.vllm-gpu-env}
PY="$VENV/bin/python"
if ! "$PY" -c "import vllm, epdserve.integrations.vllm.ec_connector" >/dev/null 2>&1; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --disable-pip-version-check "vllm==0.32.*"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[vllm]" "pytest>=8" "pytest-timeout>=2.3"
fi
"$PY" - <<'PY' | tee "$OUT/vllm-device.txt"
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device visible to vLLM's torch"
print("vllm", vllm.__version__, "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
# 1. parity on CUDA (float32 on both sides, as on the CPU)
EPD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -m vllm -rs tests/test_vllm_connector.py \
  -k "greedy_answers_are_vllm_s or router_drives_vllm or epdserve_s_own" 2>&1 | tee "$OUT/vllm-parity.txt"

# 2 and 3: servers of our own, stopped whatever happens
export EPD_CLUSTER_SECRET=${EPD_CLUSTER_SECRET:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}
PIDS=()
cleanup() { for p in ${PIDS[@]+"${PIDS[@]}"}; do kill -TERM -- "-$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_healthy() {  # URL PID NAME: until URL/health answers; fails when the process exited
  for _ in $(seq 1 900); do
    curl -fs "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "gpu_check: $3 exited during start-up ($OUT/$3.log)" >&2; return 1; }
    sleep 1
  done
  echo "gpu_check: $3 not healthy after 900 s" >&2; return 1
}
MODEL=$("$PY" -m epdserve.cli model-path)
VLLM_ARGS="--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.35"

# 2. up --lm-engine vllm on CUDA: one image request answered through the router
setsid "$PY" -m epdserve.cli up --lm-engine vllm --topology 1e+1pd --port 8300 --device cuda --dtype bfloat16 \
  --vllm-args "$VLLM_ARGS" --log-dir "$OUT/vllm-up-logs" >"$OUT/vllm-up.log" 2>&1 &
UP=$!; PIDS+=("$UP")
for _ in $(seq 1 900); do grep -q "ready in" "$OUT/vllm-up.log" && break; kill -0 "$UP" || { echo "gpu_check: up exited ($OUT/vllm-up.log)" >&2; exit 1; }; sleep 1; done
"$PY" - <<'PY' | tee "$OUT/vllm-up-answer.txt"
import json, urllib.request
from epdserve.bench.workload import image_data_url
from epdserve.shapes import ShapesWorld
content = [{"type": "image_url", "image_url": {"url": image_data_url(ShapesWorld(3).scene().render())}},
           {"type": "text", "text": "Describe."}]
body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0}
req = urllib.request.Request("http://127.0.0.1:8300/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
text = answer["choices"][0]["message"]["content"]
assert text, answer
print("up --lm-engine vllm (cuda):", text)
PY
kill -TERM -- "-$UP"; wait "$UP" || true; PIDS=()

# 3. the benchmark: encoder + vLLM behind the router, then a plain vLLM, one at a time on the GPU
setsid "$PY" -m epdserve.cli encoder --device cuda --dtype bfloat16 --port 8301 >"$OUT/encoder.log" 2>&1 &
ENC=$!; PIDS+=("$ENC")
EC='{"ec_connector": "EpdserveECConnector", "ec_connector_module_path": "epdserve.integrations.vllm.ec_connector", "ec_role": "ec_consumer", "ec_connector_extra_config": {}}'
# shellcheck disable=SC2086  # VLLM_ARGS is a list of flags
setsid "$VENV/bin/vllm" serve "$MODEL" --served-model-name shapes-qwen2vl --port 8302 $VLLM_ARGS \
  --ec-transfer-config "$EC" >"$OUT/vllm-epd.log" 2>&1 &
VE=$!; PIDS+=("$VE")
wait_healthy http://127.0.0.1:8301 "$ENC" encoder
wait_healthy http://127.0.0.1:8302 "$VE" vllm-epd
setsid "$PY" -m epdserve.cli router --encoders http://127.0.0.1:8301 --pds http://127.0.0.1:8302 \
  --pd-engine vllm --port 8303 >"$OUT/router.log" 2>&1 &
RT=$!; PIDS+=("$RT")
wait_healthy http://127.0.0.1:8303 "$RT" router
BENCH=(--num-requests 64 --concurrency 8 --output-len 64 --image-size 448 --no-progress)
"$PY" -m epdserve.cli bench --url http://127.0.0.1:8303 "${BENCH[@]}" --out "$OUT/bench-epd-encoder-vllm" \
  2>&1 | tee "$OUT/bench-epd-encoder-vllm.txt"
cleanup; PIDS=()
# shellcheck disable=SC2086
setsid "$VENV/bin/vllm" serve "$MODEL" --served-model-name shapes-qwen2vl --port 8304 $VLLM_ARGS \
  >"$OUT/vllm-plain.log" 2>&1 &
VP=$!; PIDS+=("$VP")
wait_healthy http://127.0.0.1:8304 "$VP" vllm-plain
"$PY" -m epdserve.cli bench --url http://127.0.0.1:8304 "${BENCH[@]}" --out "$OUT/bench-vllm-aggregated" \
  2>&1 | tee "$OUT/bench-vllm-aggregated.txt"
echo "gpu_check_vllm: parity, up --lm-engine vllm and the benchmark done; results in $OUT/"
