#!/usr/bin/env bash
# Every CUDA test (pytest -m gpu) and the GPU benchmark, on one machine with a GPU.
# Budget: under 8 minutes on one H200, enforced by timeouts (native build <= 90 s,
# tests <= 200 s, benchmark <= 180 s).
# Writes versions.txt, gpu_tests.{log,xml}, bench_step_gpu.{md,json} under $OUT (if set,
# e.g. by a job runner) or ./gpu_check_out. Exit status: non-zero if any part failed.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR"
# Run from the checkout even where the package is not installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ADAMBRIDGE_CACHE_DIR="${ADAMBRIDGE_CACHE_DIR:-$(mktemp -d)}"
# Bitwise-reproducible cuBLAS across streams (the tests compare async and sync bit for bit).
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
PYTHON="${PYTHON:-python}"

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname)"
  "$PYTHON" --version
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(),
"device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  "$PYTHON" -c 'import pytest; print("pytest", pytest.__version__)' || echo "pytest: NOT installed"
  nvidia-smi || echo "nvidia-smi not found"
  nproc
} 2>&1 | tee "$OUT_DIR/versions.txt"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device; nothing to check" >&2
  exit 2
fi

# The native kernel is built on first use; say which backend the checks will run.
precisions="fp32,bf16,fp8"
if timeout 90 "$PYTHON" -c 'from adambridge._native import loader; loader.load()' \
    >"$OUT_DIR/native_build.log" 2>&1; then
  echo "native kernel: built" | tee -a "$OUT_DIR/versions.txt"
else
  # The torch backend is far slower than the native kernel: time one precision only.
  precisions="bf16"
  echo "native kernel: NOT available (see native_build.log); benchmark limited to bf16" \
    | tee -a "$OUT_DIR/versions.txt"
fi

status=0
timeout 200 "$PYTHON" -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log" || status=$?
echo "gpu tests: exit status $status"

bench_status=0
timeout 180 "$PYTHON" benchmarks/bench_step.py --preset gpu --precisions "$precisions" \
  --max-seconds 60 --json "$OUT_DIR/bench_step_gpu.json" 2>&1 \
  | tee "$OUT_DIR/bench_step_gpu.md" || bench_status=$?
echo "bench_step (gpu preset): exit status $bench_status"

if [ "$status" -ne 0 ] || [ "$bench_status" -ne 0 ]; then
  exit 1
fi
echo "gpu_check: all passed; outputs in $OUT_DIR"
