#!/usr/bin/env bash
# The H200 runs still open after session 17 (no device time was left in it), one device call per part,
# in priority order (the lossy path first).  Stage first (device call 1: carry [".gpu-a"],
# `bash .gpu-a/stage.sh`), then each part with carry [".gpu-b"] (".gpu-b", ".shapes-vae" for shapes-dit):
#
#   bash bench/h200_session18.sh fp8fix     # issue 17: the FP8 P.V fix (row sums in FP32 on the CUDA cores): the
#                                           # SM90 GPU tests, then fp16 / kblk / fp8 / fp8_direct at 2 shapes (~4 min)
#   bash bench/h200_session18.sh kernels    # issues 17 + 18: first GPU run of the FP8 P.V option and of the SM90
#                                           # block-sparse kernel; TFLOP/s + error next to FA4 / cuDNN (~9 min)
#   bash bench/h200_session18.sh bsfix      # issue 18: the SM90 block-sparse kernel after its Triton 3.6 compile fix —
#                                           # GPU tests, then correctness + time vs Triton / FA4 / ideal (~5 min)
#   bash bench/h200_session18.sh shapes     # issue 20: train ditattn:shapes, VAE then DiT, one call (~9.5 min)
#   bash bench/h200_session18.sh shapes-vae # ... or the VAE alone (8.5 min); copy $OUT/shapes to .shapes-vae/,
#   bash bench/h200_session18.sh shapes-dit # ... then the DiT from it (9.5 min, carry .shapes-vae too)
#   bash bench/h200_session18.sh sparse     # issues 18 item 3 + 19: VSA selection share (packed vs padded edge
#                                           # tiles), fidelity frontier at 480p with 12 / 40 heads (~9.5 min)
#   bash bench/h200_session18.sh selection  # issue 19: GPU tests of the pooled-query predictor kernels, the predictors'
#                                           # cost against the Sparge call (bench/selection_cost.py), the fidelity
#                                           # frontier at 480p with 12 heads (~9 min)
#   bash bench/h200_session18.sh selection40 # issue 19: the same frontier with 40 heads (~9.5 min)
#   bash bench/h200_session18.sh vsasel     # issue 18 item 3: VSA selection in Triton (pooling + top-k lists) —
#                                           # GPU tests, then vsa_stages before/after, packed tiles (~3.3 min)
#   bash bench/h200_session18.sh sparsedef  # issue 19 (a)+(b): GPU tests of the sync-free SVG2 / Sol paths, SVG2's warm
#                                           # step by stage, then the defaults and the candidate settings against FA4 dense
#                                           # on the inputs of the CPU --error-only runs (--gen-device cpu) (~4.5 min)
#   bash bench/h200_session18.sh eco        # issues 21 + 24: diffusers WanPipeline with ditattn inside, the I2V DiT
#                                           # step, 14B 720p with offload + VAE tiling (~9.5 min)
#   bash bench/h200_session18.sh quant      # issue 25: 8-bit DiT linears, 1.3B step (carry .gpu-c too: stage_extra.sh)
#   bash bench/h200_session18.sh quant14b   # issue 25: the 14B architecture
#
# Every step has its own time limit inside the 600 s call limit; everything lands in $OUT, tables last.
set -uo pipefail
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ -f .gpu-b/activate.sh ] && source .gpu-b/activate.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
case "${1:-}" in
kernels)
  step 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_block_sparse_sm90.py \
      tests/test_gpu_kernels.py -k "not compiles and (sage or int8 or numerics or block_sparse)"
  step 240 python3 bench/sage_sm90.py --out "$OUT/sage" --budget-s 170 \
      --variants "fp16=;kblk=k_granularity:block;fp8=pv_dtype:fp8;fp8_kblk=pv_dtype:fp8/k_granularity:block/pv_overlap:true"
  step 150 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760,75600 --sparsities 0.9 --budget-s 110 ;;
bsfix)
  step 110 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_block_sparse_sm90.py -k "not compiles"
  step 190 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760,75600 --sparsities 0.9,0.85,0.95 \
      --budget-s 160 --variants "default=;online=static_max:false" ;;
fp8fix)
  step 110 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py -k "not compiles"
  step 120 python3 bench/sage_sm90.py --out "$OUT/sage" --budget-s 90 --shapes "1,40,32760,128;1,24,4096,64" \
      --variants "fp16=;kblk=k_granularity:block;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct" ;;
verify18)  # session 18's last call: both kernel fixes (fp8fix + bsfix) in one call, tight limits (~7.5 min)
  step 100 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_block_sparse_sm90.py \
      -k "not compiles"
  step 110 python3 bench/sage_sm90.py --out "$OUT/sage" --budget-s 80 --shapes "1,40,32760,128;1,24,4096,64" \
      --variants "fp16=;kblk=k_granularity:block;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct"
  step 150 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760,75600 --sparsities 0.9,0.85 \
      --budget-s 120 --variants "default=;online=static_max:false" ;;
verify18s)  # the same, leaner (~4.5 min): when less device time is left
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_block_sparse_sm90.py \
      -k "not compiles"
  step 75 python3 bench/sage_sm90.py --out "$OUT/sage" --budget-s 55 --shapes "1,40,32760,128" \
      --variants "fp16=;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct"
  step 100 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760 --sparsities 0.9 --budget-s 75 ;;
verify18m)  # minimal (~3 min): the GPU tests of both kernel fixes, then the block-sparse SM90 timing at 480p
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sage_sm90.py tests/test_block_sparse_sm90.py \
      -k "not compiles"
  step 80 python3 bench/block_sparse_sm90.py --out "$OUT/bs" --seqs 32760 --sparsities 0.9 --budget-s 60 ;;
shapes)
  step 590 python3 -m ditattn.train.shapes --stage all --preset full --device cuda --vae-budget-s 180 \
      --dit-budget-s 330 --out "$OUT/shapes" ;;
shapes-vae)
  step 540 python3 -m ditattn.train.shapes --stage vae --preset full --device cuda --vae-budget-s 470 --out "$OUT/shapes" ;;
shapes-dit)
  step 590 python3 -m ditattn.train.shapes --stage dit --preset full --device cuda --init .shapes-vae \
      --dit-budget-s 520 --out "$OUT/shapes" ;;
sparse)
  step 200 python3 bench/vsa_stages.py --out "$OUT/vsa_stages"
  step 370 python3 bench/fidelity.py --grids wan480 --heads 12,40 --budget-s 300 --out "$OUT/fid" ;;
selection)
  step 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "pooled_query or sol"
  step 100 python3 bench/selection_cost.py --out "$OUT/selcost"
  step 350 python3 bench/fidelity.py --grids wan480 --heads 12 --budget-s 290 --out "$OUT/fid12" ;;
sparsedef)
  step 75 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py -k "svg2 or synchronise"
  step 65 python3 bench/svg2_stages.py --heads 12 --out "$OUT/svg2_stages"
  step 150 python3 bench/fidelity.py --grids wan480 --heads 12 --gen-device cpu --budget-s 110 --out "$OUT/fid" \
      --cases "sparse_video_gen_2_attn (defaults),sparse_video_gen_2_attn warm_iters=2,sparse_video_gen_2_attn top_p=0.95,sparse_video_gen_2_attn recluster_every=4,sol_attn (defaults),sol_attn tau=0.75,sol_attn tau=0.5,sparge_attn (defaults),sparge_attn topk=0.4,sparge_attn exact topk=0.5,sparge_attn exact topk=0.45,sparge_attn exact topk=0.4,sparge_attn exact topk=0.35,sparge_attn exact topk=0.3" ;;
selection40)
  step 580 python3 bench/fidelity.py --grids wan480 --heads 40 --budget-s 500 --out "$OUT/fid40" ;;
vsasel)
  step 85 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_gpu_kernels.py tests/test_block_select.py \
      tests/test_bench_vsa_stages.py -k "vsa or select or stages"
  step 115 python3 bench/vsa_stages.py --layouts packed --out "$OUT/vsa_stages" ;;
eco)
  step 200 python3 bench/diffusers_apply.py --arch 1.3b --res 480p --frames 81 --steps 3 --out "$OUT/diffusers_apply"
  step 150 python3 bench/e2e.py --arch 14b --res 480p --i2v --repeats 3 --diffusers-backends native --backends auto \
      --out "$OUT/e2e_i2v.json"
  step 220 python3 bench/wan_memory.py --arch 14b --res 720p --frames 81 --steps 2 --variants none,group+tiling \
      --out "$OUT/wan_memory.json" ;;
quant)  # carry [".gpu-b", ".gpu-c"] (bash bench/stage_extra.sh writes .gpu-c: torchao's Python code)
  source .gpu-c/activate.sh
  step 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_dit_quantization.py -k gpu
  step 480 python3 bench/dit_quant.py --arch 1.3b --res 480p --frames 81 --backends fa,sage_attn --variants eager \
      --budget-s 420 --out-dir "$OUT" ;;
quant14b)  # carry [".gpu-b", ".gpu-c"]
  source .gpu-c/activate.sh
  step 560 python3 bench/dit_quant.py --arch 14b --res 480p --frames 81 --backends fa,sage_attn --variants eager \
      --repeats 3 --budget-s 480 --out-dir "$OUT" ;;
*) echo "usage: bash bench/h200_session18.sh fp8fix|kernels|bsfix|shapes|shapes-vae|shapes-dit|sparse|selection|selection40|vsasel|sparsedef|eco|quant|quant14b" >&2; exit 2 ;;
esac
