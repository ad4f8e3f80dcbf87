#!/usr/bin/env bash
# The exact training history of the embedded model (epdserve/assets/shapes-qwen2vl) on CPU.
# See docs/embedded-model.md for wall times and accuracy.
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

# Run 6 continues from run 5's shipped weights to teach "Which image has the red circle?", which
# stayed at chance through runs 1-5. A curriculum of easier slices of that question: two
# one-shape images in different colours (which_two) until it broke through, then questions the
# colour alone answers (which_colour) beside the spec's own, shifting towards the spec's.
R6="--refine --lr 2e-4 --steps 10500 --early-steps 0"
$T --out "$OUT-6" --state "$STATE-6" --init-from "$OUT-5" $R6 --seed 780 \
  --mix-weight which_two=10 --mix-weight which_image=0 --stop-at 2368
R6="$R6 --system-frac 0.5 --workers 2"
$T --out "$OUT-6" --state "$STATE-6" --init-from "$OUT-5" $R6 --seed 781 \
  --mix-weight which_two=2 --mix-weight which_colour=3 --mix-weight which_image=3 --stop-at 3988
# Not bit-exact from here: stopping the run above left its two workers training on (a bug, since
# fixed), so from step 3988 they and the run below wrote the same state file; the state the last
# line resumed from at 6034 is from one of the two (both curriculum mixes, seeds 781 and 782).
W="--mix-weight which_two=0.5 --mix-weight which_colour=3 --mix-weight which_image=4.5"
$T --out "$OUT-6" --state "$STATE-6" --init-from "$OUT-5" $R6 --seed 782 $W --stop-at 6034
# the last stretch shortens the schedule (--steps 8000) so the learning rate decays in the time left
$T --out "$OUT-6" --state "$STATE-6" --init-from "$OUT-5" ${R6/--steps 10500/--steps 8000} --seed 783 $W
# Run 7: a short second pass from run 6's weights (fresh optimizer, lr 1e-4 decaying over 1200 steps).
$T --out "$OUT-7" --state "$STATE-7" --init-from "$OUT-6" --refine --early-steps 0 --system-frac 0.5 \
  --lr 1e-4 --steps 1200 --seed 784 --workers 2 $W
# Run 8: from run 7's weights, the spec's which-image question over 3-4 images (which_many), then
# also the questions only colour and shape together answer (which_both); the last stretch
# lengthens the schedule to 12000 steps (the learning rate steps back up from 1.2e-4 to 1.8e-4).
R8="--refine --early-steps 0 --system-frac 0.5 --lr 2e-4 --workers 2"
$T --out "$OUT-8" --state "$STATE-8" --init-from "$OUT-7" $R8 --steps 10000 --seed 6789 --stop-at 5329 \
  --mix-weight which_two=0.3 --mix-weight which_colour=2 --mix-weight which_image=3.7 --mix-weight which_many=2.5
W8="--mix-weight which_two=0.2 --mix-weight which_colour=1.5 --mix-weight which_image=3"
W8="$W8 --mix-weight which_many=1.5 --mix-weight which_both=3"
$T --out "$OUT-8" --state "$STATE-8" --init-from "$OUT-7" $R8 --steps 10000 --seed 6790 --stop-at 7395 $W8
$T --out "$OUT-8" --state "$STATE-8" --init-from "$OUT-7" $R8 --steps 12000 --seed 6791 $W8
# Run 9: run 8's weights grown to an 8-layer language model (inserted layers start as the identity),
# lr 3e-4 over 8000 steps with run 8's mix; from step 5508 the which_by_colour slice (another image
# has the asked shape, so the colour must pick the image) joins the mix. The first stretch ran with
# --steps 9000 and was stopped at 2756; below step 4000 the two schedules give the same learning rate.
R9="--refine --early-steps 0 --system-frac 0.5 --lr 3e-4 --steps 8000 --workers 2 --layers 8"
$T --out "$OUT-9" --state "$STATE-9" --init-from "$OUT-8" $R9 --seed 6792 $W8 --stop-at 2756
$T --out "$OUT-9" --state "$STATE-9" --init-from "$OUT-8" $R9 --seed 6792 $W8 --stop-at 5508
W9="--mix-weight which_two=0.2 --mix-weight which_colour=1 --mix-weight which_image=2.5 --mix-weight which_many=1"
W9="$W9 --mix-weight which_both=2 --mix-weight which_by_colour=3"
$T --out "$OUT-9" --state "$STATE-9" --init-from "$OUT-8" $R9 --seed 6793 $W9
# Run 10: from run 9's weights (fresh optimizer, lr 2e-4 over 6500 steps) with run 9's last mix; from
# step 580 the which_same_kind slice (every image has the asked shape: only the colour picks the
# image) joins it, from step 2081 it weighs twice as much, and from step 3894 where_same_kind (the
# spec's "Where is the red circle?" with two circles) joins too; at step 4811 the schedule is
# lengthened to 7700 steps (the learning rate steps back up from 1.2e-4 to 1.7e-4).
R10="--refine --early-steps 0 --system-frac 0.5 --lr 2e-4 --steps 6500 --workers 2"
$T --out "$OUT-10" --state "$STATE-10" --init-from "$OUT-9" $R10 --seed 6794 $W9 --stop-at 580
$T --out "$OUT-10" --state "$STATE-10" --init-from "$OUT-9" $R10 --seed 6794 $W9 --mix-weight which_same_kind=3 --stop-at 2081
$T --out "$OUT-10" --state "$STATE-10" --init-from "$OUT-9" $R10 --seed 6795 $W9 --mix-weight which_same_kind=6 --stop-at 3894
W10="$W9 --mix-weight which_same_kind=4 --mix-weight where_same_kind=5"
$T --out "$OUT-10" --state "$STATE-10" --init-from "$OUT-9" $R10 --seed 6796 $W10 --stop-at 4811
$T --out "$OUT-10" --state "$STATE-10" --init-from "$OUT-9" ${R10/--steps 6500/--steps 7700} --seed 6796 $W10
cp "$OUT-10"/* "$(epdserve model-path)"/
