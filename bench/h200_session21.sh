#!/usr/bin/env bash
# Session 21's H200 plan: issue 25, FP8 DiT linears with the fused per-row activation quantizer
# (src/ditattn/models/fp8_linear.py: one Triton pass per distinct linear input, the self-attention q/k/v
# sharing one, the feed-forward's GELU inside the second GEMM's quantizer; torchao's weights and the same
# torch._scaled_mm).  Before it, the eager FP8 step was 601 ms against 448 ms bf16 (torchao's activation
# quantization ~235 ms of it); the bar is fa + FP8 <= 390 ms (1.6x diffusers' 625 ms).
#
#   bash bench/h200_session21.sh fp8act     # the GPU tests of tests/test_dit_quantization.py (the kernel bit for bit
#                                           # against torchao's quantization, the fused linear against torchao's
#                                           # forward, the tiny DiT eager and compiled), then the 1.3B 480p x 81 step:
#                                           # fa + sage_attn, bf16 / fp8 linears, eager, kernel profile (~7 min)
#   bash bench/h200_session21.sh fp8act14b  # the 14B architecture, the same rows, --repeats 3 (random init on the
#                                           # CPU first; ~8 min)
#
# Staging: `bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh` and `bash bench/stage_extra.sh` (torchao's
# Python code as .gpu-c, 0.7 MB) here once; device calls 1 and 2: carry [".gpu-a"] `bash .gpu-a/stage.sh`, carry
# [".gpu-a2"] `bash .gpu-a2/stage.sh`; then, while warm, each part with carry [".gpu-b", ".gpu-c"] (the script
# sources .gpu-b/activate.sh and .gpu-c/activate.sh itself).
# Everything lands in $OUT: log, dit_quant_<arch>.json (every row with its profile), the table last.
set -uo pipefail
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
stage() {
  source .gpu-b/activate.sh || { echo "no .gpu-b: stage it (bash ../shared/gpu/prepare.sh), carry it"; exit 3; }
  source .gpu-c/activate.sh || { echo "no .gpu-c: bash bench/stage_extra.sh here, carry it"; exit 3; }
}
case "${1:-}" in
fp8act)
  stage
  step 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_dit_quantization.py -k gpu
  step 440 python3 bench/dit_quant.py --arch 1.3b --res 480p --frames 81 --backends fa,sage_attn --quant none,fp8 \
      --variants eager --profile --budget-s 380 --out-dir "$OUT" ;;
fp8act14b)
  stage
  step 570 python3 bench/dit_quant.py --arch 14b --res 480p --frames 81 --backends fa,sage_attn --quant none,fp8 \
      --variants eager --profile --repeats 3 --budget-s 470 --out-dir "$OUT" ;;
*) echo "usage: bash bench/h200_session21.sh fp8act|fp8act14b" >&2; exit 2 ;;
esac
