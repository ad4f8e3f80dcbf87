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
# EPD_CHECK_DEVICE=cpu rehearses steps 2 and 3 on the CPU with an environment holding vLLM's CPU
# build (tests/test_gpu_check.py does, so that the script cannot rot unseen); step 1's tests are
# the vLLM CI job's own there, and are not repeated.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check}"
mkdir -p "$OUT"
VENV=${VLLM_GPU_ENV:-$PWD/.vllm-gpu-env}
PY="$VENV/bin/python"
DEVICE=${EPD_CHECK_DEVICE:-cuda}
PORT=${EPD_CHECK_PORT:-8300}  # the first of five consecutive ports the servers below take
ENC_URL=http://127.0.0.1:$((PORT + 1)) VE_URL=http://127.0.0.1:$((PORT + 2))
RT_URL=http://127.0.0.1:$((PORT + 3)) VP_URL=http://127.0.0.1:$((PORT + 4))
case "$DEVICE" in
  cuda) VLLM_ARGS="--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.35" ;;
  cpu) VLLM_ARGS="--dtype bfloat16 --max-model-len 4096 --enforce-eager"
       export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 ;;
  *) echo "gpu_check_vllm: EPD_CHECK_DEVICE must be cuda or cpu, not $DEVICE" >&2; exit 2 ;;
esac
if ! "$PY" -c "import vllm, epdserve.integrations.vllm.ec_connector" >/dev/null 2>&1; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --disable-pip-version-check "vllm==0.32.*"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[vllm]" "pytest>=8" "pytest-timeout>=2.3"
fi
DEVICE=$DEVICE "$PY" - <<'PY' | tee "$OUT/vllm-device.txt"
import os, torch, vllm
where = "cpu"
if os.environ["DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to vLLM's torch"
    where = f"cuda {torch.version.cuda} {torch.cuda.get_device_name(0)}"
print("vllm", vllm.__version__, "torch", torch.__version__, where)
PY
# 1. parity on CUDA (float32 on both sides, as on the CPU)
if [ "$DEVICE" = cuda ]; then
  EPD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -m vllm -rs tests/test_vllm_connector.py \
    -k "greedy_answers_are_vllm_s or router_drives_vllm or epdserve_s_own" 2>&1 | tee "$OUT/vllm-parity.txt"
fi

# 2 and 3: servers of our own, stopped whatever happens
export EPD_CLUSTER_SECRET=${EPD_CLUSTER_SECRET:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}
PIDS=()
# the ZMQ sockets each vLLM leaves behind when it stops: in a directory of our own, removed at the end
VLLM_RPC_BASE_PATH=$(mktemp -d); export VLLM_RPC_BASE_PATH
stop_servers() { for p in ${PIDS[@]+"${PIDS[@]}"}; do kill -TERM -- "-$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
cleanup() { stop_servers; rm -rf "$VLLM_RPC_BASE_PATH"; }
trap cleanup EXIT
wait_healthy() {  # URL PID NAME: until URL/health answers; fails when the process exited
  for _ in $(seq 1 900); do
    curl -fs "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || {
      echo "gpu_check: $3 exited during start-up ($OUT/$3.log); its last lines:" >&2
      tail -n 20 "$OUT/$3.log" >&2 || true; return 1; }
    sleep 1
  done
  echo "gpu_check: $3 not healthy after 900 s" >&2; return 1
}
MODEL=$("$PY" -m epdserve.cli model-path)

# 2. up --lm-engine vllm on the device: one image request answered through the router
setsid "$PY" -m epdserve.cli up --lm-engine vllm --topology 1e+1pd --port $PORT --device $DEVICE --dtype bfloat16 \
  --vllm-args "$VLLM_ARGS" --log-dir "$OUT/vllm-up-logs" >"$OUT/vllm-up.log" 2>&1 &
UP=$!; PIDS+=("$UP")
for _ in $(seq 1 900); do grep -q "ready in" "$OUT/vllm-up.log" && break; kill -0 "$UP" || { echo "gpu_check: up exited ($OUT/vllm-up.log)" >&2; tail -n 20 "$OUT/vllm-up.log" >&2; exit 1; }; sleep 1; done
grep -q "ready in" "$OUT/vllm-up.log" || { echo "gpu_check: up not ready after 900 s ($OUT/vllm-up.log)" >&2; exit 1; }
PORT=$PORT "$PY" - <<'PY' | tee "$OUT/vllm-up-answer.txt"
import json, os, urllib.request
from epdserve.bench.workload import image_data_url
from epdserve.shapes import ShapesWorld
content = [{"type": "image_url", "image_url": {"url": image_data_url(ShapesWorld(3).scene().render())}},
           {"type": "text", "text": "Describe."}]
body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PORT']}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
text = answer["choices"][0]["message"]["content"]
assert text, answer
print("up --lm-engine vllm:", text)
PY
kill -TERM -- "-$UP"; wait "$UP" || true; PIDS=()

# 3. the benchmark: encoder + vLLM behind the router, then a plain vLLM, one at a time on the GPU
setsid "$PY" -m epdserve.cli encoder --device $DEVICE --dtype bfloat16 --port $((PORT + 1)) >"$OUT/encoder.log" 2>&1 &
ENC=$!; PIDS+=("$ENC")
EC='{"ec_connector": "EpdserveECConnector", "ec_connector_module_path": "epdserve.integrations.vllm.ec_connector", "ec_role": "ec_consumer", "ec_connector_extra_config": {}}'
# shellcheck disable=SC2086  # VLLM_ARGS is a list of flags
setsid "$VENV/bin/vllm" serve "$MODEL" --served-model-name shapes-qwen2vl --port $((PORT + 2)) $VLLM_ARGS \
  --ec-transfer-config "$EC" >"$OUT/vllm-epd.log" 2>&1 &
VE=$!; PIDS+=("$VE")
wait_healthy $ENC_URL "$ENC" encoder
wait_healthy $VE_URL "$VE" vllm-epd
setsid "$PY" -m epdserve.cli router --encoders $ENC_URL --pds $VE_URL \
  --pd-engine vllm --port $((PORT + 3)) >"$OUT/router.log" 2>&1 &
RT=$!; PIDS+=("$RT")
wait_healthy $RT_URL "$RT" router
BENCH=(--num-requests 64 --concurrency 8 --output-len 64 --image-size 448 --no-progress)
"$PY" -m epdserve.cli bench --url $RT_URL "${BENCH[@]}" --out "$OUT/bench-epd-encoder-vllm" \
  2>&1 | tee "$OUT/bench-epd-encoder-vllm.txt"
stop_servers; PIDS=()
# shellcheck disable=SC2086
setsid "$VENV/bin/vllm" serve "$MODEL" --served-model-name shapes-qwen2vl --port $((PORT + 4)) $VLLM_ARGS \
  >"$OUT/vllm-plain.log" 2>&1 &
VP=$!; PIDS+=("$VP")
wait_healthy $VP_URL "$VP" vllm-plain
"$PY" -m epdserve.cli bench --url $VP_URL "${BENCH[@]}" --out "$OUT/bench-vllm-aggregated" \
  2>&1 | tee "$OUT/bench-vllm-aggregated.txt"
if [ "$DEVICE" = cuda ]; then
  echo "gpu_check_vllm: parity, up --lm-engine vllm and the benchmark done; results in $OUT/"
else
  echo "gpu_check_vllm: rehearsal on $DEVICE (up --lm-engine vllm and the benchmark) done; results in $OUT/"
fi
