#!/usr/bin/env bash
# Issue 20: the second round of ditattn:shapes training on the H200, continuing the session-18 weights
# (docs/shapes.md, "Second round").  One device call per part; none needs the .gpu-a stage call.
#
# Once, on this machine (project root):
#   bash bench/stage_train.sh                                     # -> .gpu-train/ (6.4 MB: diffusers wheel)
#   mkdir -p .shapes-gpu18 && cp /work/notes/gpu18/shapes/shapes/shapes.{json,safetensors} .shapes-gpu18/
#
# Call A (~9.5 min), carry [".gpu-train", ".shapes-gpu18"]:
#   bash bench/h200_session19.sh shapes-dec
#     the VAE decoder alone continues from .shapes-gpu18 for 470 s (encoder frozen: the latents, and so the
#     session-18 DiT, stay valid); the output package = that DiT + the new decoder, judged (guidance tuned on
#     held-out prompts, samples, prompt following at 3 sizes).  Then, here:
#   mkdir -p .shapes-dec && cp <files_at>/shapes/shapes.{json,safetensors} .shapes-dec/
#
# Call B (~9.5 min), carry [".gpu-train", ".shapes-dec"] (or ".shapes-gpu18" if call A failed):
#   bash bench/h200_session19.sh shapes-dit2
#     text encoder + DiT continue from .shapes-dec (else .shapes-gpu18) for 480 s on its VAE, then judged.
#     Its $OUT/shapes is the candidate to ship (docs/shapes.md, "After the GPU run").
#
# Alternatives: shapes-all2 (one call: decoder 190 s then DiT 300 s, from .shapes-gpu18) if only one call is
# left; shapes-vae2 (encoder + decoder continue, 470 s: the latents change, the DiT must then adapt).
# Each call carries ~20 MB (.gpu-train 6.4 MB + one 13 MB package) plus the tracked files: under 64 MiB.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
source .gpu-train/activate.sh || { echo "no .gpu-train: run bash bench/stage_train.sh here and carry it"; exit 3; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() { local secs=$1; shift; echo "== $* (limit ${secs}s)"; timeout "$secs" "$@" 2>&1 | tee -a "$OUT/log" | tail -45; }
pick() { for d in "$@"; do [ -f "$d/shapes.safetensors" ] && { echo "$d"; return; }; done
         echo "none of $* holds shapes.safetensors: carry one" >&2; exit 3; }
# SHAPES_EXTRA: flags appended to every training command (later flags win), for a CPU rehearsal of a part:
#   OUT=/tmp/rehearsal SHAPES_EXTRA="--preset tiny --device cpu --vae-steps 2 --dit-steps 2" bash bench/h200_session19.sh shapes-dec
train() { step "$1" python3 -m ditattn.train.shapes --preset full --device cuda --out "$OUT/shapes" "${@:2}" \
            ${SHAPES_EXTRA:-}; }
case "${1:-}" in
shapes-dec)
  train 580 --stage vae --vae-train decoder --resume "$(pick .shapes-gpu18)" --vae-budget-s 470 ;;
shapes-dit2)
  train 585 --stage dit --resume "$(pick .shapes-dec .shapes-gpu18)" --dit-budget-s 480 ;;
shapes-all2)
  train 585 --stage all --vae-train decoder --resume "$(pick .shapes-gpu18)" --vae-budget-s 190 --dit-budget-s 300 ;;
shapes-vae2)
  train 580 --stage vae --resume "$(pick .shapes-gpu18)" --vae-budget-s 470 ;;
*) echo "usage: bash bench/h200_session19.sh shapes-dec|shapes-dit2|shapes-all2|shapes-vae2" >&2; exit 2 ;;
esac
ls -la "$OUT/shapes"
grep -E "steps in|PSNR|guidance|prompt following|sample " "$OUT/shapes/train.log" | tail -20
