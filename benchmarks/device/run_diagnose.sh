#!/usr/bin/env bash
# Device run, next (prepared 2026-12-04, not run: loans were paused): where a speculative round's time
# goes on CUDA (bench_host --models smollm2-f32), the real-model tests, never lose with longer bursts.
# Every step has a time limit under one deadline; $OUT comes back even if one is cut.
END=${END:-480}
source benchmarks/device/common.sh
step 60 prep python3 benchmarks/device/prep.py
# where a speculative round's time goes on CUDA: per-phase host/device microseconds, plain vs K = 3
step 110 host python3 benchmarks/bench_host.py --models smollm2-f32 --tokens 128 --repeats 3 --widths 4 --out $OUT/r
# early dispatch off / on on CUDA (on the CPU it hid a verify's graph build; unmeasured on a GPU, off there by default)
step 100 early python3 benchmarks/bench_early_dispatch.py --models smollm2-f32 --concurrency 1 --repeats 3 --out $OUT/r
# the suite's tests of the real model (the serve tests need openai/starlette, absent there)
step 130 pytest python3 -m pytest -q -p no:cacheprovider -p only_smollm2 -n 0 -W ignore --continue-on-collection-errors tests/
# never lose on CUDA, longer bursts than the first run's (4 x 32 tokens)
step 120 control python3 benchmarks/bench_control.py --models smollm2-f32 --concurrency 1,4,8 --prompts 8 \
  --max-tokens 64 --repeats 3 --arms plain,default,k1,k3 --out $OUT/r
ls -la $OUT/r >> $L
tail -c 11000 $L
