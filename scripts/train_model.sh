#!/usr/bin/env bash
# The exact training history of the embedded model (epdserve/assets/shapes-qwen2vl) on CPU.
# See docs/model.md for wall times and accuracy.
#
# Runs 1-3 (one thread, prompts without vision ids, as the chat template then had none): run 1
# used the first mix and was stopped at step 2006 when shape and position questions were still at
# chance; run 2 resumed it with the single-shape focus phase and was stopped at 10397 to evaluate;
# run 3 finished the schedule (step 13,000, the checkpoint shipped before vision ids).
#
# Runs 4-5 continue from it with the template's vision ids ("Picture 2: ") and the refine mix:
# run 4 stopped at 1479; run 5 starts from run 4's weights with random system prompts in half the
# prompts, on one process to step 1153, then on two data-parallel processes to the end.
set -euo pipefail
STATE=${STATE:-$HOME/epd-train/state}
OUT=${OUT:-$HOME/epd-train/final}
T="epdserve train-shapes --eval-every 500"

$T --out "$OUT" --state "$STATE" --plain-frac 1 --steps 10000 --mix-v0 --stop-at 2006
$T --out "$OUT" --state "$STATE" --plain-frac 1 --steps 13000 --focus-until 4000 --stop-at 10397
$T --out "$OUT" --state "$STATE" --plain-frac 1 --steps 13000 --focus-until 4000

R4="--refine --lr 2e-4 --steps 10000 --seed 4321"
$T --out "$OUT-4" --state "$STATE-4" --init-from "$OUT" $R4 --stop-at 1479

R5="--refine --lr 2e-4 --steps 10500 --seed 5678 --early-steps 0 --system-frac 0.5"
$T --out "$OUT-5" --state "$STATE-5" --init-from "$STATE-4/state.pt" $R5 --stop-at 1153
$T --out "$OUT-5" --state "$STATE-5" --init-from "$STATE-4/state.pt" $R5 --workers 2

cp "$OUT-5"/* "$(epdserve model-path)"/
