#!/usr/bin/env bash
# Stage torchao for the H200 machine (it has no torchao and no registry) as a third carry folder,
# .gpu-c (about 0.7 MB), next to ../shared/gpu/prepare.sh's .gpu-a / .gpu-b.
#
# Only torchao's Python code travels: its C++ extensions (_C*.so) are built for torch 2.10 and
# torchao itself skips loading them under another torch (the machine has 2.11; see torchao issue 2919).
# ditattn does not need them: --dit-quantization fp8 runs torch._scaled_mm and int8 runs torch._int_mm
# (PyTorch ops) with torchao's Python quantization code (Float8Tensor / LinearActivationQuantizedTensor).
#
# Run once from the project root on this machine (it needs pip and the registry):
#     bash bench/stage_extra.sh
# then, on a warm machine after the .gpu-a stage call, every device call that needs torchao:
#     carry [".gpu-b", ".gpu-c"], command "source .gpu-b/activate.sh && source .gpu-c/activate.sh && ..."
# (.gpu-b is ~54 MiB, .gpu-c 0.7 MB, the tracked files ~2-3 MB: under the 64 MiB a call may carry).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
version=${TORCHAO_VERSION:-0.16.0}
cache=${DITATTN_GPU_CACHE:-$HOME/.cache/ditattn-gpu}
mkdir -p "$cache/whl"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.gpu-c/ "$exclude" 2>/dev/null || echo /.gpu-c/ >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  -d "$cache/whl" "torchao==$version"
wheel=$(ls "$cache"/whl/torchao-"$version"-*.whl | head -1)
tmp=$(mktemp -d)
python3 -m zipfile -e "$wheel" "$tmp"
find "$tmp" -name '*.so' -delete
rm -rf .gpu-c && mkdir .gpu-c
tar -C "$tmp" -cf - . | xz -T0 -6 > .gpu-c/torchao.tar.xz
rm -rf "$tmp"
cat > .gpu-c/activate.sh <<'EOS'
# source this (after .gpu-b/activate.sh) in a device command: torchao's Python code into
# /tmp/ditattn-torchao once per machine, then on PYTHONPATH
if [ ! -d /tmp/ditattn-torchao/torchao ]; then
  mkdir -p /tmp/ditattn-torchao && tar xJf .gpu-c/torchao.tar.xz -C /tmp/ditattn-torchao || return 3
fi
export PYTHONPATH=/tmp/ditattn-torchao${PYTHONPATH:+:$PYTHONPATH}
EOS
du -sh .gpu-c
[ -d .gpu-b ] && du -shc .gpu-b .gpu-c | tail -1
echo "ready: carry [\".gpu-b\", \".gpu-c\"], command 'source .gpu-b/activate.sh && source .gpu-c/activate.sh && ...'"
