#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the CUDA recurrence
# kernels, on a machine with an NVIDIA GPU (sm_90), nvcc and compute-sanitizer. The sanitizer
# cannot follow a Python process running JAX, so this builds tests/cpp/cuda_sanitize.cu, a
# standalone driver of the kernels over every kind of launch the plan makes, and runs it under
# each tool. Exit status: 0 when the driver's own checks pass and no tool reports an error.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${TMPDIR:-/tmp}/sgrnn_cuda_sanitize"
nvcc -std=c++20 -O2 -lineinfo -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
  tests/cpp/cuda_sanitize.cu csrc/cuda/recurrence.cu csrc/cuda/grid_recurrence.cu -o "$BIN"
"$BIN"
status=0
for tool in memcheck racecheck synccheck initcheck; do
  echo "--- compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 9 "$BIN" | tail -n 3 || status=1
done
exit $status
