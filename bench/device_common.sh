# Sourced (from the repository root) by the bench/h200_session*.sh device scripts: the environment, $OUT,
# step() and the activation of the staged packages.
set -uo pipefail
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# step SECS CMD...: CMD under a time limit, its output appended to $OUT/log, its last 45 lines shown
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
# .gpu-b: the staged GPU packages (bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh);
# .gpu-c: torchao's Python code (bash bench/stage_extra.sh); each must be in the call's carry
use_gpu_b() { source .gpu-b/activate.sh || { echo "no .gpu-b: stage it (bash ../shared/gpu/prepare.sh), carry it"; exit 3; }; }
use_gpu_c() { source .gpu-c/activate.sh || { echo "no .gpu-c: bash bench/stage_extra.sh here, carry it"; exit 3; }; }
