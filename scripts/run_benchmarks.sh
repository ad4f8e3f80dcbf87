#!/usr/bin/env bash
# Every benchmark quoted in docs/benchmarks.md, one after the other on an otherwise idle machine.
# Outputs go to $OUT (default: bench-results/); docs/benchmarks.md copies the tables.
set -euo pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>&1 | grep -v " INFO \|Warning\|warn(" | tee "$OUT/$name.txt"; }
run engine_vs_hf python -m epdserve.bench.engine_vs_hf --requests 32 --output-len 64 --concurrency 1 4 16 --image-size 448 --json "$OUT/engine_vs_hf.json"
run engine_vs_hf16 python -m epdserve.bench.engine_vs_hf --requests 64 --output-len 64 --concurrency 16 --image-size 448 --runs 3 --json "$OUT/engine_vs_hf16.json"
run profile_engine python scripts/profile_engine.py --requests 16 --output-len 256 --top 15 --out "$OUT/profile-engine.txt"
run metadata_vs_raw python -m epdserve.bench.metadata_vs_raw --requests 48 --images 4 --image-size 448 --output-len 16 --concurrency 8 --pin-cores --json "$OUT/metadata_vs_raw.json"
run transfer python -m epdserve.bench.transfer_bench
run bench_selftest epdserve bench --self-test --no-progress
run sweep epdserve sweep --out "$OUT/sweep" --topologies aggregated,1e+1pd,2e+1pd --images 1,4,10 --output-lens 16,64,256 --requests 16 --concurrency 4 --slo ttft=500ms --pin-cores --no-progress
run sweep_mixed epdserve sweep --out "$OUT/sweep-mixed" --topologies aggregated,1e+1pd --images 4 --output-lens 16 --requests 32 --concurrency 8 --mixed --slo ttft=500ms --pin-cores --no-progress
if [ -n "${LAB:-}" ]; then
  run vs_vllm python scripts/vs_vllm.py --requests 64 --concurrency 4 16 --output-len 64 --image-size 448 --pin-cores --runs 3 --json "$OUT/vs_vllm.json"
fi
