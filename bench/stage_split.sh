#!/usr/bin/env bash
# Since ditattn:shapes ships in the package (13 MB of tracked weights), the tracked tree (~17 MB) plus .gpu-b
# (54 MiB: wheels + the second half of the CUTLASS DSL runtime) is over a device call's 64 MiB.  This moves
# that second half out of .gpu-b into its own stage folder, .gpu-a2, after `bash ../shared/gpu/prepare.sh`:
#
#     bash ../shared/gpu/prepare.sh && bash bench/stage_split.sh
#
# Device calls then: carry [".gpu-a"] `bash .gpu-a/stage.sh`; carry [".gpu-a2"] `bash .gpu-a2/stage.sh`
# (both copy a part to /tmp/ditattn-stage on the warm machine, ~0 s); then carry [".gpu-b"] (21 MiB) as before.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
[ -f .gpu-b/activate.sh ] || { echo "no .gpu-b: run bash ../shared/gpu/prepare.sh first" >&2; exit 3; }
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF /.gpu-a2/ "$exclude" 2>/dev/null || echo /.gpu-a2/ >> "$exclude"
if [ -f .gpu-b/part.01 ]; then
  rm -rf .gpu-a2 && mkdir .gpu-a2 && mv .gpu-b/part.01 .gpu-a2/
fi
[ -f .gpu-a2/part.01 ] || { echo "neither .gpu-b/part.01 nor .gpu-a2/part.01: run prepare.sh again" >&2; exit 3; }
cat > .gpu-a2/stage.sh <<'EOS'
mkdir -p /tmp/ditattn-stage && cp .gpu-a2/part.01 /tmp/ditattn-stage/ && echo "staged part 2 of the CUTLASS DSL runtime"
EOS
# activate.sh: the second part now comes from the stage folder too
sed -i 's#\[ -f /tmp/ditattn-stage/part.00 \] || { echo "activate: run the stage call first (carry .gpu-a, bash .gpu-a/stage.sh)"; return 3; }#[ -f /tmp/ditattn-stage/part.00 ] \&\& [ -f /tmp/ditattn-stage/part.01 ] || { echo "activate: run both stage calls first (carry .gpu-a: bash .gpu-a/stage.sh; carry .gpu-a2: bash .gpu-a2/stage.sh)"; return 3; }#; s#cat /tmp/ditattn-stage/part.00 .gpu-b/part.01#cat /tmp/ditattn-stage/part.00 /tmp/ditattn-stage/part.01#' .gpu-b/activate.sh
grep -q "/tmp/ditattn-stage/part.01" .gpu-b/activate.sh || { echo "activate.sh not in the expected form: check prepare.sh" >&2; exit 3; }
du -sh .gpu-a .gpu-a2 .gpu-b
