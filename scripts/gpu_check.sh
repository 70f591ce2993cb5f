#!/usr/bin/env bash
# Install dynabatch on a GPU machine's own image without touching its torch, then run `dynabatch bench gpu`.
#
#   scripts/gpu_check.sh [--quick] [OUT_DIR]        (from anywhere; OUT_DIR defaults to $OUT, else out/gpu)
#
# The project goes in with --no-deps (the image's torch, transformers, numpy, numba, pyarrow stay as they are);
# what the image lacks comes from the wheels in .whl/ (see docs/benchmarks.md, "dynabatch bench gpu", for the
# pip download command), installed into a folder of their own on PYTHONPATH. No network is needed.
# Writes OUT_DIR/result.json, OUT_DIR/cost_model.json and OUT_DIR/table.txt; exits non-zero when a section failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out_dir=${OUT:-out/gpu}
quick=()
for arg in "$@"; do
  case $arg in
    --quick) quick=(--quick) ;;
    -*) echo "gpu_check.sh: unknown option $arg (usage: scripts/gpu_check.sh [--quick] [OUT_DIR])" >&2; exit 2 ;;
    *) out_dir=$arg ;;
  esac
done
py=${PYTHON:-python3}
site=${DYNABATCH_WHEELS_SITE:-/tmp/dynabatch-wheels}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
  echo "gpu_check.sh: pip install -e . failed (above); running from the checkout through PYTHONPATH instead" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$out_dir"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
# the table on stdout and in table.txt; a liveness cap well above the 8-minute (quick: 3-minute) budget
PYTHONUNBUFFERED=1 timeout 590 "$py" -m dynabatch.cli bench gpu "${quick[@]}" --out "$out_dir" | tee "$out_dir/table.txt"
exit "${PIPESTATUS[0]}"
