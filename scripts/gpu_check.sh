#!/usr/bin/env bash
# The CUDA evidence in one run: every GPU test and the GPU benchmark with its
# tokens-per-step sweep, on a fresh single-GPU machine with no network.
#
#   scripts/gpu_check.sh OUT_DIR        (default: $OUT, else ./gpu_check_out)
#
# Budget: under 8 minutes, enforced per part by `timeout` and overall by a deadline; a hung
# test dumps every thread's stack (tests/gpu/conftest.py) and only its file stops. Writes
# into OUT_DIR, each as it goes: versions.txt (versions, native build,
# `python -m adambridge info`), gpu_tests.log, junit_NAME.xml for each tests/gpu/test_cuda_NAME.py,
# bench_step_gpu.{md,json}, plan.txt (the plan for the benchmark's model on this card and
# host, its predicted step times and GPU memory beside the measured ones, and --check's
# host update), plan_memory.{txt,json} (the plan's gradients and activations of one async
# and one sync step of a small decoder against torch.cuda.max_memory_allocated).
# Exit status: 0 all passed, 1 a part failed, 2 no CUDA device.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-$PWD/gpu_check_out}}"
mkdir -p "$OUT_DIR"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1                      # every line reaches the log as it happens
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
export ADAMBRIDGE_CACHE_DIR="${ADAMBRIDGE_CACHE_DIR:-$(mktemp -d)}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # bitwise cuBLAS
export ADAMBRIDGE_GPU_TEST_TIMEOUT="${ADAMBRIDGE_GPU_TEST_TIMEOUT:-90}"
DEADLINE=$((SECONDS + 470))
status=0

left() { echo $((DEADLINE - SECONDS)); }
# run_part SECONDS LOG CMD...: at most SECONDS (less if the deadline is nearer), output
# appended to LOG; a part that would start with under 15 s left is skipped and fails.
run_part() {
  local limit=$1 log=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 15 ]; then
    echo "gpu_check: SKIPPED (deadline): $*" | tee -a "$log"; status=1; return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "== $(date -u +%H:%M:%S) ($limit s): $*" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== exit status $rc" | tee -a "$log"
  [ "$rc" -ne 0 ] && status=1
  return 0
}

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname) python=$PYTHON"
  "$PYTHON" --version
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(),
"device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  "$PYTHON" -c 'import pytest; print("pytest", pytest.__version__)' || echo "pytest: NOT installed"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "no nvidia-smi"
  echo "cpus $(nproc); ulimit -l $(ulimit -l)"
} 2>&1 | tee "$OUT_DIR/versions.txt"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device; nothing to check" >&2
  exit 2
fi

run_part 60 "$OUT_DIR/versions.txt" "$PYTHON" -c \
  'from adambridge._native import loader; loader.load(); print("native kernel: built")'
run_part 30 "$OUT_DIR/versions.txt" "$PYTHON" -m adambridge info

# One process per file, every tests/gpu/test_cuda_*.py (found, not listed, so a new file is
# never left out): a hang (or an aborted graph capture) stops only its own file.
for file in tests/gpu/test_cuda_*.py; do
  name=$(basename "$file" .py); name=${name#test_cuda_}
  case $name in pipeline) limit=90;; ordering) limit=150;; *) limit=60;; esac
  run_part "$limit" "$OUT_DIR/gpu_tests.log" "$PYTHON" -m pytest -m gpu \
    "$file" -v -rs -p no:cacheprovider --junitxml="$OUT_DIR/junit_$name.xml"
done

run_part 110 "$OUT_DIR/bench_step_gpu.md" "$PYTHON" benchmarks/bench_step.py --preset gpu \
  --precisions bf16,fp8 --max-seconds 30 --sweep --sweep-seconds 40 \
  --json "$OUT_DIR/bench_step_gpu.json"

# The plan beside the benchmark: the card found, this host measured, bench_step's model.
if [ -f "$OUT_DIR/bench_step_gpu.json" ]; then
  run_part 45 "$OUT_DIR/plan.txt" "$PYTHON" -m adambridge plan \
    --bench-json "$OUT_DIR/bench_step_gpu.json" --check
else
  echo "gpu_check: no bench_step_gpu.json, so no plan beside it" | tee -a "$OUT_DIR/plan.txt"
  status=1
fi

# The plan's GPU memory against a measured step: async mode (each gradient released once its
# copy is queued) and sync mode, gradients plus estimated activations against the peak
# allocated beyond the step's start (adambridge/plan/measure.py; its CPU dry path is tested
# in tests/plan/test_plan_memory.py).
run_part 60 "$OUT_DIR/plan_memory.txt" "$PYTHON" -m adambridge.plan.measure --json "$OUT_DIR/plan_memory.json"

echo "gpu_check: $([ "$status" -eq 0 ] && echo "all passed" || echo "FAILURES (see logs)");" \
  "$((SECONDS))s; outputs in $OUT_DIR"
exit "$status"
