#!/usr/bin/env bash
# Session 21's H200 plan.  Parts (each one device call, each self-contained):
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
# Staging for the .gpu-b parts: `bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh` here once, then
# device calls carry [".gpu-a"] `bash .gpu-a/stage.sh`, carry [".gpu-a2"] `bash .gpu-a2/stage.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
case "${1:-}" in
sage2-anchor)
  # the whole call (build included, when run.sh started the clock) ends by 575 s; the bench keeps 30 s spare
  t0=${SAGE2_T0:-$(date +%s)}
  source .gpu-b/activate.sh || exit 3
  left=$(( 575 - ($(date +%s) - t0) ))
  if [ "$left" -lt 90 ]; then echo "sage2-anchor: only ${left}s left of the call, not enough for the bench"; exit 3; fi
  step "$left" python3 bench/sage2_anchor.py --sage2-dir "${SAGE2_DIR:-/tmp/sage2/pkg}" \
      --build-log "$OUT/sage2_build.log" --out "$OUT/sage2" --budget-s $(( left - 30 )) ;;
*) echo "usage: bash bench/h200_session21.sh sage2-anchor" >&2; exit 2 ;;
esac
