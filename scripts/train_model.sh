#!/usr/bin/env bash
# The exact training history of the embedded model (epdserve/assets/shapes-qwen2vl), on one CPU
# thread. Run 1 used the first mix and was stopped at step 2006 when shape and position questions
# were still at chance; run 2 resumed it with the single-shape focus phase and the final mix and
# was stopped at 10397 to evaluate; run 3 finished the schedule.
# See docs/model.md for wall times and accuracy.
set -euo pipefail
STATE=${STATE:-$HOME/epd-train/state}
OUT=${OUT:-$HOME/epd-train/final}
epdserve train-shapes --out "$OUT" --state "$STATE" --steps 10000 --eval-every 500 --mix-v0 --stop-at 2006
epdserve train-shapes --out "$OUT" --state "$STATE" --steps 13000 --eval-every 500 --focus-until 4000 --stop-at 10397
epdserve train-shapes --out "$OUT" --state "$STATE" --steps 13000 --eval-every 500 --focus-until 4000
cp "$OUT"/* "$(epdserve model-path)"/
