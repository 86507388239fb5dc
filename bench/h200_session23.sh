#!/usr/bin/env bash
# Session 24's H200 plan (each part one device call, after the two stage calls: carry [".gpu-a"]
# `bash .gpu-a/stage.sh`, carry [".gpu-a2"] `bash .gpu-a2/stage.sh`; staging here once:
# `bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh && bash bench/stage_extra.sh`).
#
#   bash bench/h200_session23.sh sage-ncu   # carry [".gpu-b"]: issue 17's "which unit is the limit" — Nsight
#                                           # Compute on the sage SM90 kernel (default per-token K, per-block K)
#                                           # and FA4's forward at 1x40x32760x128 bf16: pipe utilisation
#                                           # (tensor, MUFU/xu, FMA, ALU), issue-slot use, warp-stall reasons
#                                           # (bench/ncu_summary.py); ncu's availability is checked first (~3 min)
#
# Everything lands in $OUT: log, the .ncu-rep, its raw CSV, the summary last.
set -uo pipefail
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
case "${1:-}" in
sage-ncu)
  source .gpu-b/activate.sh || { echo "no .gpu-b: stage it (bash ../shared/gpu/prepare.sh), carry it"; exit 3; }
  command -v ncu >/dev/null || { echo "sage-ncu: no ncu on this machine's PATH"; exit 3; }
  ncu --version | tail -1
  # two launches per config (compile + warm, then the one to read): profile all six, read the second of each
  step 420 env PROF_S=32760 PROF_H=40 ncu --clock-control none --target-processes all \
      --kernel-name regex:"_sage_fwd_sm90|FlashAttentionForwardSm90" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
      --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
      -f -o "$OUT/sage_ncu" python3 bench/sage_sm90_profile.py "default=;kblk=k_granularity:block;fa4="
  ncu --import "$OUT/sage_ncu.ncu-rep" --page raw --csv > "$OUT/sage_ncu_raw.csv" 2>>"$OUT/log"
  ncu --import "$OUT/sage_ncu.ncu-rep" --page details --print-details all > "$OUT/sage_ncu_details.txt" 2>>"$OUT/log"
  python3 bench/ncu_summary.py "$OUT/sage_ncu_raw.csv" --top 8 | tee "$OUT/sage_ncu_summary.txt" ;;
*) echo "usage: bash bench/h200_session23.sh sage-ncu" >&2; exit 2 ;;
esac
