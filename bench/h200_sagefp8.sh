#!/usr/bin/env bash
# FP8 P.V in the SM90 sage kernel (issue 17), first H200 run, one device call (at most ~9 min):
#   1. GPU tests of the SM90 kernel (fp16 and fp8 P.V numerics against the quantization reference and
#      float32) and of the sage backend;
#   2. compute-sanitizer memcheck of the FP8 variants on an odd GQA shape (new TMA descriptor for V^T);
#   3. bench/sage_sm90.py: error vs float32 / cosine / error vs the quantization reference on random,
#      structured (Wan 3-D RoPE) and V-offset inputs plus a 32,760-token check on sampled rows, then
#      TFLOP/s next to cuDNN, FA4 and the Triton INT8 kernel (fp16 and fp8 P.V) for each variant.
# Usage (device): bash bench/h200_sagefp8.sh        (results under $OUT/sagefp8)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/sagefp8}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-"fp16=;kblk=k_granularity:block;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct/pv_overlap:true;fp8_kblk=pv_dtype:fp8/k_granularity:block/pv_overlap:true;fp8_kblk_early=pv_dtype:fp8/k_granularity:block;fp8_smooth=pv_dtype:fp8/v_smooth:true"}
timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_gpu_kernels.py \
  -k "not compiles and (sage or int8 or numerics)" 2>&1 | tail -8
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  timeout 100 "$SAN" --tool memcheck python3 bench/sage_sm90_sanitize.py \
    "fp8=pv_dtype:fp8;fp8_kblk=pv_dtype:fp8/k_granularity:block/pv_overlap:true;fp8_direct=pv_dtype:fp8/pv_accum:direct" \
    > "$OUT/memcheck.txt" 2>&1
  echo "== memcheck (rc $?)"; grep -E "ok|ERROR SUMMARY" "$OUT/memcheck.txt" | tail -5
fi
timeout 280 python3 bench/sage_sm90.py --out "$OUT" --budget-s 180 --variants "$VARIANTS" 2>&1 | tail -40
