#!/usr/bin/env bash
# Session 22's H200 plan (each part one device call; session 22 itself had no device time).  Issue 17: the per-channel Q/K balance (`qk_balance`) of sage_attn's
# INT8 prologue, now in the Triton passes (src/ditattn/attention/kernels/int8_quant.py: qk_balance_prologue,
# quantize_qk) and a backend parameter.  On the CPU reference it takes the default per-token K path from 2.09 % to
# 1.82 % error on the worst structured input (docs/sage_sm90_notes.md); this run checks the GPU kernels compute the
# same quantization and measures what the extra prologue pass (one more read of Q; K's statistics pass replaces its mean pass) costs.
#
#   bash bench/h200_session22.sh sage-balance  # the GPU tests of tests/test_sage_sm90.py and tests/test_sage_balance.py
#                                              # (the SM90 and Triton kernels with the balance against the reference
#                                              # of the same quantization, the prologue against the reference's
#                                              # steps), then bench/sage_sm90.py: correctness (err vs float32 and vs
#                                              # the quantized reference) and TFLOP/s, prologue included, at
#                                              # 1,40,32760,128 / 1,40,16384,128 / 1,24,4096,128 for default (token K),
#                                              # token + qk_balance 0.5, block K, block + qk_balance 0.75 (~8.5 min)
#   bash bench/h200_session22.sh sage-persist  # the persistent schedule of the sage SM90 kernel (config `persistent`,
#                                              # never run on a GPU: a hang points at the barrier protocol — Q
#                                              # release, ring/turn phases across tiles): the GPU tests of
#                                              # tests/test_sage_sm90.py (every numerics case one CTA per tile,
#                                              # persistent on the full grid and on 3 CTAs), then bench/sage_sm90.py
#                                              # default vs persist at 1,24,4096,128 / 1,24,4096,64 (issue 17: 0.70x
#                                              # FA4 there) / 1,40,16384,128 / 1,40,32760,128 (~8.5 min)
#
# Order for the next device session (30 min; session 22 had none): after the two stage calls,
#   1. bash bench/h200_session20.sh fid40b      carry [".gpu-b"]           #19: Sparge cdfthreshd at 40/12 heads (~5 min)
#   2. bash bench/h200_session21.sh fp8act      carry [".gpu-b", ".gpu-c"] #25: the fused FP8 activation quantizer (~7 min)
#   3. bash .gpu-sage2/run.sh                   carry [".gpu-b", ".gpu-sage2"] #17: upstream SageAttention2 anchor (<= 575 s)
#   4. bash bench/h200_session22.sh sage-balance carry [".gpu-b"]          #17 (~8.5 min)
#   then bash .gpu-vsa/run.sh (#18 anchor), fp8act14b, in the session after; sage-persist (#17, carry [".gpu-b"],
#   ~8.5 min) fits in place of 3 or 4 if the short-sequence speed is the more urgent question.  .gpu-sage2 / .gpu-vsa are staged by
#   scripts kept outside the repository (fetched code); docs/benchmarks.md §2 / §3 describe what they do.
#
# Staging: `bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh` here once; device calls 1 and 2: carry
# [".gpu-a"] `bash .gpu-a/stage.sh`, carry [".gpu-a2"] `bash .gpu-a2/stage.sh`; then, while warm, the part with
# carry [".gpu-b"] (the script sources .gpu-b/activate.sh itself).
# Everything lands in $OUT: log, sage/sage_sm90.json, the tables last.
source bench/device_common.sh
case "${1:-}" in
sage-balance)
  use_gpu_b
  step 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_sage_balance.py \
      -k "not compiles"
  # the prologue (statistics passes, factors, quantization) is inside sage_attention_sm90, so inside every timed call
  step 360 python3 bench/sage_sm90.py --out "$OUT/sage" --budget-s 270 \
      --shapes "1,40,32760,128;1,40,16384,128;1,24,4096,128" \
      --variants "default=;bal=qk_balance:0.5;kblk=k_granularity:block;kblk_bal=k_granularity:block/qk_balance:0.75" ;;
sage-persist)
  use_gpu_b
  step 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py -k "not compiles"
  step 330 python3 bench/sage_sm90.py --out "$OUT/sage_p" --budget-s 300 \
      --shapes "1,24,4096,128;1,24,4096,64;1,40,16384,128;1,40,32760,128" --variants "default=;persist=persistent:true" ;;
*) echo "usage: bash bench/h200_session22.sh sage-balance|sage-persist" >&2; exit 2 ;;
esac
