#!/usr/bin/env bash
# The H200 measurements still open after 2026-12-02 (issues 5, 6, 10, 11), as ONE device call.
# Stage first (device call 1: carry [".gpu-a"], `bash .gpu-a/stage.sh`), then (call 2: carry [".gpu-b"]):
#   bash bench/h200_next.sh
# Each step has its own time limit (560 s in all, inside the 600 s call limit); everything lands in $OUT.
set -uo pipefail
source .gpu-b/activate.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log"; }
# issue 11: compiled native step vs diffusers, 480p and 720p
step 190 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --compile \
    --backends "auto,torch_cudnn_sdpa,video_sparse_attn:sparsity=0.9" --out "$OUT/e2e480.json"
step 100 python3 bench/e2e.py --arch 1.3b --res 720p --repeats 3 --backends "auto" --out "$OUT/e2e720.json"
# issue 6: the per-backend table at both video shapes (sol/sage_sla rows were missing)
step 120 python3 bench/sparse_backends.py --shapes wan480,wan720 --heads 40 --repeats 2 --out "$OUT/sparse_backends.json"
# issue 5: block-sparse kernel re-timed after the FA4-path sync cache
step 90 python3 bench/sparse.py --out "$OUT/sp" --budget-s 75
# issue 10 (world size 1 through the NCCL launch path on the single GPU)
step 60 python3 bench/multigpu.py --gpus 1 --arch 1.3b --res 480p --repeats 2 --out "$OUT/mg.json"
