#!/usr/bin/env bash
# Stage what training ditattn:shapes needs on the H200 (it has torch + transformers but no diffusers and no
# registry) as one small carry folder, .gpu-train (~6.4 MB: the diffusers 0.42.1 and importlib_metadata wheels
# and activate.sh), instead of the 54 MiB .gpu-b of ../shared/gpu/prepare.sh (FlashAttention-4's runtime,
# which training does not use).  So a training call needs no stage call first and can carry a package to
# resume from next to it (13 MB each; 64 MiB per call in all).
#
# Run once from the project root on this machine:
#     bash bench/stage_train.sh
# then in a device call: carry [".gpu-train", ".shapes-NAME"], command "bash bench/h200_session20.sh PART"
# (or "source .gpu-train/activate.sh && python3 -m ditattn.train.shapes ...").
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
cache=${DITATTN_GPU_CACHE:-$HOME/.cache/ditattn-gpu}
mkdir -p "$cache/whl"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.gpu-train/ "$exclude" 2>/dev/null || echo /.gpu-train/ >> "$exclude"
wheels=(diffusers-0.42.1-py3-none-any.whl importlib_metadata-10.2.0-py3-none-any.whl)
for w in "${wheels[@]}"; do
  [ -f "$cache/whl/$w" ] && continue
  if [ -f ".gpu-b/$w" ]; then cp ".gpu-b/$w" "$cache/whl/"; continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$cache/whl" \
    diffusers==0.42.1 importlib_metadata==10.2.0
done
rm -rf .gpu-train && mkdir .gpu-train
for w in "${wheels[@]}"; do cp "$cache/whl/$w" .gpu-train/; done
cat > .gpu-train/activate.sh <<'EOS'
# source this at the start of a device command: diffusers into /tmp/ditattn-train once per machine, then
# it and the project's src/ on PYTHONPATH
if [ ! -d /tmp/ditattn-train/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ditattn-train \
    .gpu-train/*.whl || return 3
fi
export PYTHONPATH=/tmp/ditattn-train:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
EOS
du -sh .gpu-train
echo "ready: carry [\".gpu-train\", \".shapes-...\"], command 'bash bench/h200_session20.sh vae|dit|dit-resume|vae-dec' (see its header)"
