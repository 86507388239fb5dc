#!/usr/bin/env bash
# Session 16's remaining H200 checks in one call (no staging needed):
#   1. GPU tests of the SM90 sage kernel and the sage backend dispatch;
#   2. the SM90 block-sparse kernel: correctness + one timing row (bench/block_sparse_sm90.py);
#   3. Nsight Compute on the SM90 sage kernel (per-block and per-token K), key sections, to $OUT/ncu_*.txt.
# Usage (device): bash bench/h200_session16.sh
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/session16}; mkdir -p "$OUT"
timeout 110 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_block_sparse_sm90.py \
  tests/test_gpu_kernels.py -k "sage or int8 or numerics" 2>&1 | tail -6
timeout 75 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760 --sparsities 0.9 --budget-s 40 2>&1 | tail -9
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in ${NCU_VARIANTS:-"kblk=k_granularity:block" "default="}; do
  n=${v%%=*}
  PROF_H=12 timeout ${NCU_TIMEOUT:-150} "$NCU" --clock-control none --kernel-name regex:_sage_fwd_sm90 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section InstructionStats --print-details all python3 bench/sage_sm90_profile.py "$v" > "$OUT/ncu_$n.txt" 2>&1
  echo "== ncu $n"; grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Issued Ipc|No Eligible|Warp Cycles Per Issued|Executed Ipc|Tensor|XU|FMA|ALU" "$OUT/ncu_$n.txt" | head -24
done
