#!/usr/bin/env bash
# Session 21's H200 plan (each part one device call).  Issue 25: FP8 DiT linears with the fused per-row activation quantizer
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
#   bash bench/h200_session21.sh sage2-anchor  # issue 17: upstream SageAttention2's SM90 kernel (INT8 Q.K + FP8
#                                              # P.V) timed next to FA4 and our sage_attn sm90 (fp16 / fp8 P.V),
#                                              # with its error vs float32 (bench/sage2_anchor.py; ~5 min).  It
#                                              # needs a built upstream package in $SAGE2_DIR (default
#                                              # /tmp/sage2/pkg); the build is not in this repository (the
#                                              # workplace keeps fetched code and recipes that build it out of
#                                              # commits): the device command "bash .gpu-sage2/run.sh", carry
#                                              # [".gpu-b", ".gpu-sage2"], builds it first and then runs this
#                                              # part with SAGE2_T0 set, so build + bench stay under 575 s.
#                                              # Without the build it stops with one line + the build log's tail.
#
#   bash bench/h200_session21.sh vsa-anchor    # issue 18 item 4: FastVideo's own VSA forward (fastvideo-kernel 0.3.5,
#                                              # the ThunderKittens sm_90a kernel) timed next to our Triton / SM90
#                                              # kernels and FA4 block-sparse at the same lists, S 32760 / 75600, 40
#                                              # heads, sparsity 0.9 first, then 0.85 / 0.95 while the budget lasts,
#                                              # after a check against float32 (bench/vsa_anchor.py).  It needs the
#                                              # package built into $DITATTN_VSA_SITE (default /tmp/ditattn-vsa/site);
#                                              # the build is not in this repository (as for sage2-anchor): the
#                                              # device command "bash .gpu-vsa/run.sh", carry [".gpu-b", ".gpu-vsa"],
#                                              # builds it first (<= 360 s, log $OUT/vsa_build.log) and then runs
#                                              # this part with VSA_T0 set, so build + bench stay under 575 s.
#                                              # Without the build it stops with one line + the build log's tail.
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
sage2-anchor)
  # the whole call (build included, when run.sh started the clock) ends by 575 s; the bench keeps 30 s spare
  t0=${SAGE2_T0:-$(date +%s)}
  source .gpu-b/activate.sh || exit 3
  left=$(( 575 - ($(date +%s) - t0) ))
  if [ "$left" -lt 90 ]; then echo "sage2-anchor: only ${left}s left of the call, not enough for the bench"; exit 3; fi
  step "$left" python3 bench/sage2_anchor.py --sage2-dir "${SAGE2_DIR:-/tmp/sage2/pkg}" \
      --build-log "$OUT/sage2_build.log" --out "$OUT/sage2" --budget-s $(( left - 30 )) ;;
vsa-anchor)
  # the whole call (build included, when .gpu-vsa/run.sh started the clock) ends by 575 s; the bench checks its
  # budget before each (S, sparsity) row and a 720p row takes up to ~1.5 min, so it keeps 100 s spare
  t0=${VSA_T0:-$(date +%s)}
  source .gpu-b/activate.sh || exit 3
  left=$(( 575 - ($(date +%s) - t0) ))
  if [ "$left" -lt 90 ]; then echo "vsa-anchor: only ${left}s left of the call, not enough for the bench"; exit 3; fi
  step "$left" python3 bench/vsa_anchor.py --site "${DITATTN_VSA_SITE:-/tmp/ditattn-vsa/site}" \
      --build-log "$OUT/vsa_build.log" --out "$OUT/vsa" --budget-s $(( left > 150 ? left - 100 : left - 40 )) ;;
*) echo "usage: bash bench/h200_session21.sh fp8act|fp8act14b|sage2-anchor|vsa-anchor" >&2; exit 2 ;;
esac
