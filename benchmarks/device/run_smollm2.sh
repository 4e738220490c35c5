#!/usr/bin/env bash
# Device run (issue 20): SmolLM2 width 1 on CUDA, drafters side by side; the CLI as a user runs it;
# never lose (bench_control); the suite's real-model tests. Ran 2026-12-04 (bench_results/20261204T120500Z_gpu_run.log).
# Every step has a time limit under one deadline; $OUT comes back even if one is cut.
END=${END:-560}
source benchmarks/device/common.sh
step 100 prep python3 benchmarks/device/prep.py
# GPU goal: width 1, SmolLM2 float32, the drafters side by side (warm-up inside), code and chat
step 130 matrix-f32 python3 benchmarks/bench_matrix.py --models smollm2-f32 --concurrency 1 --max-tokens 64 --repeats 5 \
  --arms plain,eagle3,chain,ngram,default --out $OUT/r
# the user's path: the CLI as a user runs it, default then plain (JSON stats)
step 40 generate-default python3 -m gmlx_cli.app generate --model smollm2 --max-tokens 96 --json \
  "Write a Python function that returns the second largest number in a list."
step 40 generate-plain python3 -m gmlx_cli.app generate --model smollm2 --max-tokens 96 --json --no-speculative \
  "Write a Python function that returns the second largest number in a list."
# never lose on CUDA: default vs plain vs fixed K, c = 1, 2, 4, 8
step 110 control python3 benchmarks/bench_control.py --models smollm2-f32 --concurrency 1,2,4,8 --prompts 4 \
  --max-tokens 32 --repeats 3 --arms plain,default,k1,k3 --out $OUT/r
step 60 matrix-q python3 benchmarks/bench_matrix.py --models smollm2-q --concurrency 1 --max-tokens 64 --repeats 3 \
  --arms plain,eagle3,default --out $OUT/r
# the suite's tests of the real model (39; the embedded model's weights do not travel: 64 MiB)
step 500 pytest python3 -m pytest -q -p no:cacheprovider -p only_smollm2 -n 0 -W ignore --continue-on-collection-errors tests/
ls -la $OUT/r >> $L
tail -c 11000 $L
