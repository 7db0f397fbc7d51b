#!/usr/bin/env bash
# On a machine with an sm_90 GPU, nvcc, jax[cuda] and PyTorch, the steps named as arguments,
# in the order given (default: all four), each one's log under $LOGS (default
# /tmp/sgrnn_gpu_check):
#   build  builds and installs the package from this checkout ($PIP_INSTALL: how, default
#          pip install --no-build-isolation --no-deps);
#   test   the GPU tests, with compute-sanitizer over the kernels beside them;
#   bench  the five-shape tables (float32);
#   grid   the grid kernels against the decomposition around the rows where the default
#          starts them.
# Steps are separate so that a machine whose calls are limited in time runs them in several
# calls (the installed package stays between them). The tests run on the GPU only with
# JAX_PLATFORMS naming cuda (the suite defaults to the CPU). They run in $TEST_PROCESSES
# processes (default 4), each given a share of the collected tests: with
# XLA_PYTHON_CLIENT_PREALLOCATE=false each process takes the GPU memory it uses, not 75% of it
# (which would fail the second). On an H100 a quarter of the tests took 69-185 s in its
# process, all of them 317 s in one. Python runs with -P, so that `import jax_sgrnn` finds the
# installed package (with its native modules), not the source folder of the current directory.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${LOGS:-/tmp/sgrnn_gpu_check}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
status=0

build() {
  python3 -m pip install -q ${PIP_INSTALL:---no-build-isolation --no-deps} . \
    > "$LOGS/build.log" 2>&1 || { echo "build failed: $LOGS/build.log"; exit 1; }
  python3 -P -c "import jax_sgrnn, sys; sys.exit(not jax_sgrnn.backends()['cuda'].available)" ||
    { echo "the CUDA handler is not available"; exit 1; }
}

test_on_gpu() {
  scripts/sanitize_cuda.sh > "$LOGS/sanitize.log" 2>&1 &
  local sanitizer=$! part pid testers=()
  JAX_PLATFORMS=cuda,cpu python3 -P -m pytest -q -p no:cacheprovider --collect-only \
    tests/test_cuda.py 2> /dev/null | grep "::" > "$LOGS/test_ids.txt"
  [ -s "$LOGS/test_ids.txt" ] || { echo "test_cuda.py: no tests collected"; exit 1; }
  rm -f "$LOGS"/test_ids.part*
  split -n "r/${TEST_PROCESSES:-4}" "$LOGS/test_ids.txt" "$LOGS/test_ids.part"
  for part in "$LOGS"/test_ids.part*; do  # ids hold spaces (parameters): one argument a line
    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false xargs -d '\n' -a "$part" \
      python3 -P -m pytest -q -p no:cacheprovider > "$part.log" 2>&1 &
    testers+=($!)
  done
  for pid in "${testers[@]}"; do wait "$pid" || status=1; done
  echo "test_cuda.py, $(wc -l < "$LOGS/test_ids.txt") tests in ${#testers[@]} processes:"
  for part in "$LOGS"/test_ids.part*.log; do tail -n 1 "$part"; done
  grep -h -E "^(FAILED|ERROR)" "$LOGS"/test_ids.part*.log
  wait "$sanitizer" || status=1
  grep -E "SUMMARY|failures" "$LOGS/sanitize.log"
}

bench() {
  python3 -P benchmarks/bench_gpu.py --tables float32 --repeats 7 --calls 20 2>&1 |
    tee "$LOGS/bench.log"
}

# With SGRNN_CUDA_GRID=1 the op runs the grid kernels at every row count and "decomp" is the
# decomposition: the two around kGridPaysRows (96).
grid() {
  SGRNN_CUDA_GRID=1 python3 -P benchmarks/bench_gpu.py --shapes 100,64,1024,1024 \
    100,96,1024,1024 100,128,1024,1024 --tables float32 --repeats 7 --calls 20 2>&1 |
    tee "$LOGS/bench_grid.log"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build test bench grid)
for name in "${steps[@]}"; do
  case "$name" in
    build) build ;;
    test) test_on_gpu ;;
    bench) bench ;;
    grid) grid ;;
    *) echo "unknown step '$name' (build, test, bench, grid)"; exit 2 ;;
  esac
done
exit $status
