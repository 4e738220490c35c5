#!/usr/bin/env bash
# Every committed benchmark, in sequence, on a quiet machine. Results land in bench_results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
GMLX=.venv/bin/gmlx
export GMLX_CONFIG="${GMLX_CONFIG:-$PWD/bench_results/config.toml}"  # never the user's real config
$PY benchmarks/bench_scalar.py --prompts 8 --max-tokens 128 --repeats 3 --ks 1,2,3,4
$PY benchmarks/bench_batch.py --concurrency 1,2,4,8,16 --max-tokens 64 --repeats 3 --join-late-repeats 3
$GMLX sweep-cap --num-draft-tokens 2,3 --max-tokens 64 --repeats 3 --out bench_results
$GMLX bench --concurrency 1,2,4,8 --requests 8 --max-tokens 64 --ignore-eos --seed 0 --ab both \
  --baseline plain,mlx-lm --repeats 2 --verify --out bench_results
