#!/usr/bin/env bash
# Issue 24's GPU checks, as one prepared script for a machine with one CUDA GPU (about 5 minutes
# on an H200): the GPU-only tests (the round on the device against the CPU; two distributed
# processes on the one GPU against the simulator), then `benchmarks.gpu_178m` (crucible against
# the plain loop, per phase, R = 8, S = 4, H = 30, bf16).
#
#     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh [OUT]      # OUT: runs/gpu-check
#
# Writes OUT/tests.txt, OUT/gpu_178m.json and OUT/gpu_178m.log; exits non-zero if any part
# failed (each part still runs). `--dry-run` of the benchmark checks this script on a CPU:
#     GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh
set -u -o pipefail
PY=${PYTHON:-python3}
OUT=${1:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
"$PY" - <<'PY' || exit 2
import sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
sys.exit(0 if torch.cuda.is_available() or __import__("os").environ.get("GPU_CHECK_DRY_RUN")
         else "no CUDA device is visible: this script is for a GPU machine")
PY
if [ -z "${GPU_CHECK_DRY_RUN:-}" ]; then
  timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_round_on_device.py \
      tests/integration/test_distributed.py 2>&1 | tee "$OUT/tests.txt" || status=1
  bench=()
else
  bench=(--dry-run --inner-steps 2 --batch-size 2 --reference-steps 2 --warmup 1
         --eval-tokens 4096)
fi
timeout 300 "$PY" -m benchmarks.gpu_178m --global-steps 2 --inner-steps 30 \
    --reference-steps 20 "${bench[@]}" > "$OUT/gpu_178m.json" 2> "$OUT/gpu_178m.log" || status=1
cat "$OUT/gpu_178m.json"
exit $status
