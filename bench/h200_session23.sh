#!/usr/bin/env bash
# Session 24's H200 plan, all run in session 24 (figures: docs/benchmarks.md §2 run 26, §11 H200 run 5, §14
# session 24; §3 run 25 for the VSA anchor) (each part one device call, after the two stage calls: carry [".gpu-a"]
# `bash .gpu-a/stage.sh`, carry [".gpu-a2"] `bash .gpu-a2/stage.sh`; staging here once:
# `bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh && bash bench/stage_extra.sh`).
#
#   bash bench/h200_session23.sh sage-ncu   # carry [".gpu-b"]: issue 17's "which unit is the limit" — Nsight
#                                           # Compute on the sage SM90 kernel (default per-token K, per-block K)
#                                           # and FA4's forward at 1x40x32760x128 bf16: pipe utilisation
#                                           # (tensor, MUFU/xu, FMA, ALU), issue-slot use, warp-stall reasons
#                                           # (bench/ncu_summary.py); ncu's availability is checked first (~3 min)
#   bash bench/h200_session23.sh cdf        # carry [".gpu-b"]: issue 19, sparge cdfthreshd through the direct
#                                           # list builder (mass_lists, Triton mask_block_lists on CUDA): the CUDA
#                                           # test (lists equal the mask path's, no host sync), the selection
#                                           # cost mask path vs lists and the whole call against FA4 dense
#                                           # (bench/selection_cost.py --cdf), then the frontier rows at 40/12
#                                           # heads (bench/fidelity.py) (~4 min)
#   bash bench/h200_session23.sh fp8q       # carry [".gpu-b", ".gpu-c"]: issue 25, the reworked FP8 activation
#                                           # quantizer (reciprocal multiply with a 17-bit rounding, GELU once
#                                           # per element, several rows per program): its GPU tests, old vs new
#                                           # kernel on the 1.3B / 14B shapes with the launch sweep
#                                           # (bench/fp8_quant_kernel.py), then the profiled 1.3B step (~8 min)
#
# Order for session 24 (30 min of device time): the two stage calls, then cdf (~4 min), sage-ncu (~4 min), fp8q
# (~8 min), then the VSA anchor (issue 18): carry [".gpu-b", ".gpu-vsa"] `bash .gpu-vsa/run.sh` (<= 575 s; its
# staging script lives outside the repository, docs/benchmarks.md §3 says what it does).
#
# Everything lands in $OUT: log, the .ncu-rep, its raw CSV, the summary last.
source bench/device_common.sh
case "${1:-}" in
sage-ncu)
  use_gpu_b
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
cdf)
  use_gpu_b
  step 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k cdfthreshd
  step 150 python3 bench/selection_cost.py --cdf --exact --heads 40 --out "$OUT/selcost_cdf"
  step 200 python3 bench/fidelity.py --grids wan480 --heads 40,12 --gen-device cpu --budget-s 160 --out "$OUT/fidcdf" \
      --cases "sol_attn (defaults),sparge_attn exact topk=0.4,sparge_attn exact cdf=0.93 topk=0.3,sparge_attn exact cdf=0.94 topk=0.28,sparge_attn exact cdf=0.9 topk=0.3" ;;
fp8q)
  use_gpu_b
  use_gpu_c
  step 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_dit_quantization.py -k gpu
  step 150 python3 bench/fp8_quant_kernel.py --sweep --out "$OUT"
  step 200 python3 bench/dit_quant.py --arch 1.3b --res 480p --frames 81 --backends fa,sage_attn --quant none,fp8 \
      --variants eager --profile --budget-s 170 --out-dir "$OUT" ;;
*) echo "usage: bash bench/h200_session23.sh sage-ncu|cdf|fp8q" >&2; exit 2 ;;
esac
