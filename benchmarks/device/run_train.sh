#!/usr/bin/env bash
# Device run (issue 20, lever 1: the head's agreement; prepared 2026-12-06, not yet run): SmolLM2's
# EAGLE-3 head trained further on a GPU, on self-distillation data at a scale this 2-core CPU cannot make
# (it answers at ~100 tokens/s here: 200-290k tokens a 25-35 minute data run, five such runs so far).
# 1. data: `smollm2_data --aux --general` in big batches, one prompt plan (~1,430 prompts) per seed, seed
#    after seed until DATA_S (170) seconds are spent (held-out shards from the first seed only);
# 2. train: `train_smollm2_eagle3` from the shipped head (--init), batch BATCH (64), TRAIN_MIN minutes, the
#    head exported to $OUT/e3 at each best held-out figure (TRAIN_MIN 3);
# 3. judge: `replay_smollm2_eagle3 --extended` (12 questions a kind, none in the training prompts) for
#    the new head and the shipped one: live accepted drafts per round at K = 3 and first-draft agreement.
# On the device of 2026-12-04 installing took 33 s and prep 23 s: ~550 s in all, under a call's 600.
# Back here: if the new head accepts more on chat and code, copy $OUT/e3/* into gmlx/weights/smollm2/eagle3,
# record the run in its MODEL_CARD.md, and measure it in wall time (bench_heads.py, bench_lone_prior.py).
# Every step has a time limit under one deadline; $OUT comes back even if one is cut.
# Rehearsal on this machine (small figures, the same steps): LOCAL=1 OUT=/tmp/tr END=900 DATA_S=200
#   TRAIN_MIN=1 BATCH=8 PY=.venv/bin/python bash benchmarks/device/run_train.sh
# Rehearsed 2026-12-07 (556b744, the Xeon; END=660 DATA_S=100): prep, data, train, both replays rc 0 in 312 s.
END=${END:-570}
source benchmarks/device/common.sh
DATA_S=${DATA_S:-170}; TRAIN_MIN=${TRAIN_MIN:-3}; BATCH=${BATCH:-64}; D=${DATA_DIR:-/tmp/sd}
step 100 prep $PY benchmarks/device/prep.py
rm -rf $D; mkdir -p $D; seed=20; stop=$(( $(date +%s) + DATA_S ))
while [ $(( stop - $(date +%s) )) -gt 20 ] && [ $(( END - ($(date +%s) - T0) )) -gt 60 ]; do
  left=$(( stop - $(date +%s) )); val=0; [ $seed -eq 20 ] && val=4
  step $(( left + 60 )) data-$seed $PY -m gmlx_training.smollm2_data --out $D/s$seed --aux --general --batch $BATCH \
    --val-batches $val --minutes $(awk "BEGIN { print $left / 60 }") --seed $seed
  seed=$(( seed + 1 ))
done
{ du -sh $D; ls $D/*/train-*.npz | wc -l; } >> $L 2>&1
step 330 train $PY -m gmlx_training.train_smollm2_eagle3 --data $D/s* --init gmlx/weights/smollm2/eagle3 \
  --out $OUT/e3 --minutes $TRAIN_MIN --batch $BATCH --lr 3e-4 --eval-min 1
# the new head first: if the deadline cuts the second, both replay here too (deterministic, on this CPU's numerics)
[ -f $OUT/e3/model.safetensors ] && step 100 replay-new $PY -m gmlx_training.replay_smollm2_eagle3 --extended --head $OUT/e3
step 100 replay-shipped $PY -m gmlx_training.replay_smollm2_eagle3 --extended
ls -la $OUT/e3 >> $L 2>&1
tail -c 11000 $L
