# Sourced by the run_*.sh scripts on the device: a deadline ($END seconds from start), a log under
# $OUT, `step CAP NAME CMD...` (CMD under min(CAP, time left)), MLX's CUDA build installed ($PY: the
# python, python3 by default; LOCAL=1 installs nothing: a rehearsal here).
set -u
T0=$(date +%s); END=${END:-500}; L=$OUT/log.txt; mkdir -p $OUT/r
el() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $L; }
step() {  # step CAP_S NAME CMD...: run CMD with min(CAP, time left) as its limit
  local cap=$1 name=$2; shift 2; local left=$(( END - ($(date +%s) - T0) ))
  [ $left -lt 15 ] && { el "$name skipped (no time)"; return; }
  [ $cap -gt $left ] && cap=$left
  el "$name start (limit $cap s)"; timeout $cap "$@" >> $L 2>&1; el "$name rc $?"
}
PY=${PY:-python3}
if [ -n "${LOCAL:-}" ]; then  # LOCAL=1: a rehearsal on this machine (no install; gmlx's cache as configured here)
  export PYTHONPATH="${PYTHONPATH:-$PWD}:$PWD/benchmarks/device" PYTHONUNBUFFERED=1
else
  source .gpu/install.sh >> $L 2>&1 || { cat $L; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu-whl:$PWD/benchmarks/device" PYTHONUNBUFFERED=1 GMLX_CACHE=/tmp/gmlx-cache
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $L 2>&1
fi
{ nproc; $PY -c "import mlx.core as mx, mlx_lm, transformers; print('mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__, 'transformers', transformers.__version__)"; } >> $L 2>&1
el installed
