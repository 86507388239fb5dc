#!/usr/bin/env bash
# The H200 measurements still open (issues 5, 6, 10, 11), one device call per part (600 s limit each).
# Stage first (device call 1: carry [".gpu-a"], `bash .gpu-a/stage.sh`), then (carry [".gpu-b"]):
#   bash bench/h200_next.sh e2e       # issue 11: the step, eager + compiled, profiled, 480p and 720p
#   bash bench/h200_next.sh kernels   # issues 6, 5, 10: sparse backends at both shapes, block-sparse re-time, 1-GPU NCCL
#   bash bench/h200_next.sh fused     # issue 11 after the fused kernels + whole generate; issue 6: sage_sla / sol
#   bash bench/h200_next.sh remeasure # issue 6: sage_sla / sol re-timed; issue 5: block-sparse with kernel times
#   bash bench/h200_next.sh profile   # issue 6: per-kernel profile of the sparse backends (SP_S=secs: + 64-token re-time)
#   bash bench/h200_next.sh tma       # issue 5: block-sparse Triton kernel with TMA loads, tests + bench/sparse.py
#   bash bench/h200_next.sh final     # issue 11: 480p step (dense, VSA 0.9) after session 14, then whole generate
#   bash bench/h200_next.sh floor     # issue 5: GPU tests after the softmax-helper refactor; bench/sparse.py with the
#                                     # gather and math floors (bench/gather_floor.py) next to every kernel
#                                     # (SP_SEQS=32760 SP_S=220: one sequence length only)
#   bash bench/h200_next.sh defaults64 # issue 5: after the new default at block 64 (SP_S=0: no bench/sparse.py): GPU tests, 64-token rows, VSA step
#   bash bench/h200_next.sh edgetiles  # issue 18 item 3: packed edge tiles, the VSA selection stage's share, the VSA step packed vs padded
# Each step has its own time limit (< 560 s per part, inside the 600 s call limit); everything lands in $OUT.
set -uo pipefail
source .gpu-b/activate.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log"; }
case "${1:-}" in
e2e)
  step 330 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --compile --profile \
      --backends "auto,torch_cudnn_sdpa,video_sparse_attn:sparsity=0.9" --out "$OUT/e2e480.json"
  step 190 python3 bench/e2e.py --arch 1.3b --res 720p --repeats 3 --compile --diffusers-backends native \
      --backends "auto,video_sparse_attn:sparsity=0.9" --out "$OUT/e2e720.json" ;;
kernels)
  step 90 python3 bench/sparse_backends.py --shapes wan480 --backends sage_sla_attn,sol_attn --heads 40 --repeats 2 \
      --out "$OUT/sparse_backends480.json"
  step 200 python3 bench/sparse_backends.py --shapes wan720 --heads 40 --repeats 2 --out "$OUT/sparse_backends720.json"
  step 130 python3 bench/sparse.py --out "$OUT/sp" --budget-s 110
  step 100 python3 bench/multigpu.py --gpus 1 --arch 1.3b --res 480p --repeats 2 --out "$OUT/mg.json" ;;
fused)  # ONE call: the fused DiT kernels (step eager vs unfused, GPU tests), sage_sla / sol re-timed, whole generate
  step 160 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --variants unfused,eager --profile \
      --diffusers-backends native --backends "auto,video_sparse_attn:sparsity=0.9" --out "$OUT/e2e480.json"
  step 50 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "fused"
  if [ "${SB_S:-100}" -gt 0 ]; then step "${SB_S:-100}" python3 bench/sparse_backends.py --shapes wan480,wan720 \
      --backends sage_sla_attn,sol_attn --heads 40 --repeats 2 --out "$OUT/sparse_backends.json"; fi
  # SB_S=0 / GEN_S=0 skip the sparse-backend / whole-generate steps (when the device budget is short)
  if [ "${GEN_S:-200}" -gt 0 ]; then step "${GEN_S:-200}" python3 bench/generate.py --steps 3 --out "$OUT/generate.json"; fi ;;
remeasure)  # issue 6: sage_sla / sol after their fixes, both shapes; issue 5: block-sparse with kernel times
  step 200 python3 bench/sparse_backends.py --shapes wan480,wan720 --backends sage_sla_attn,sol_attn --heads 40 \
      --repeats 2 --out "$OUT/sparse_backends.json"
  step 300 python3 bench/sparse.py --out "$OUT/sp" --budget-s 280 ;;
profile)  # issue 6: where the sparse backends spend their time, after the fused Sol / SageSLA kernels
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "block_sparse or sol"
  step 240 python3 bench/sparse_backends.py --shapes wan480,wan720 --backends sla_attn,sage_sla_attn,sol_attn \
      --heads 40 --repeats 2 --profile --out "$OUT/sparse_backends_profile.json"
  if [ "${SP_S:-0}" -gt 0 ]; then step "$SP_S" python3 bench/sparse.py --out "$OUT/sp" --budget-s $((SP_S - 20)) \
      --block-sizes 64; fi ;;
tma)  # issue 5: the block-sparse Triton kernel with TMA descriptor loads, checked and timed
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "block_sparse"
  step 300 python3 bench/sparse.py --out "$OUT/sp" --budget-s 280 ;;
final)  # issue 11 after session 14's sparse-engine changes: the 480p step (dense + VSA 0.9), then the whole generate
  step 200 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --variants eager --diffusers-backends native \
      --backends "auto,video_sparse_attn:sparsity=0.9" --out "$OUT/e2e480.json"
  step 300 python3 bench/generate.py --steps 3 --out "$OUT/generate.json" ;;
floor)  # issue 5: is the 64-token gap data movement? the gather alone vs the kernels, every cell
  step 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py tests/test_bench_gather_floor.py \
      -k "block_sparse or sol or gather"
  step "${SP_S:-400}" python3 bench/sparse.py --out "$OUT/sp" --budget-s $((${SP_S:-400} - 20)) \
      --seqs "${SP_SEQS:-32760,75600}" ;;
defaults64)  # issue 5: block size 64 defaults to one-stage TMA loads: GPU tests, the 64-token rows, the VSA step
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "block_sparse or sol"
  if [ "${SP_S:-150}" -gt 0 ]; then step "${SP_S:-150}" python3 bench/sparse.py --out "$OUT/sp" --budget-s $((${SP_S:-150} - 20)) \
      --seqs 32760 --block-sizes 64 --sparsities "${SP_SPARSITIES:-0.85,0.9,0.95}"; fi
  step 150 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --variants eager --diffusers-backends native \
      --backends "video_sparse_attn:sparsity=0.9" --out "$OUT/e2e480.json" ;;
edgetiles)  # issue 18 item 3: GPU tests, VSA stages (selection vs call, padded vs packed), the 480p VSA 0.9 step both ways
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "block_sparse or sol"
  step 220 python3 bench/vsa_stages.py --out "$OUT/vsa_stages"
  step 250 python3 bench/e2e.py --arch 1.3b --res 480p --repeats 3 --variants eager --diffusers-backends native \
      --backends "video_sparse_attn:sparsity=0.9,video_sparse_attn:sparsity=0.9;edge_tiles=padded" \
      --out "$OUT/e2e480.json" ;;
*) echo "usage: bash bench/h200_next.sh e2e|kernels|fused|remeasure|profile|tma|final|floor|defaults64|edgetiles" >&2; exit 2 ;;
esac
