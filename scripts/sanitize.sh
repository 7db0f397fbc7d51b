#!/usr/bin/env bash
# Builds the C++ handlers with AddressSanitizer + UndefinedBehaviorSanitizer and runs a
# subset of the test suite against that build. Exits non-zero on any sanitizer report or any
# test failure. See docs/reliability.md.
#
#   PYTHON=.venv/bin/python scripts/sanitize.sh            # default subset (below)
#   PYTHON=... scripts/sanitize.sh tests/test_fuzz.py -x   # arguments go to pytest instead
#
# Default subset: every path through the handlers. tests/test_op.py (the flag grid, every
# dtype, the gradient op), test_transforms.py (vmap: gradient groups G > 1), test_fuzz.py
# (random sizes and flags), test_handler_direct.py (bad buffers straight to the handlers),
# test_concurrency.py (the parallel pieces, from several threads), test_extreme.py (empty,
# size-1 and long problems, non-finite values) and test_seq_lengths.py (per-row lengths: its
# float32 grid, every activation with every time order, masks and inputs cycling), each case on
# the native handler only. Left out, as they run none of this build's code or none it does not
# run elsewhere here: the cases on the "scan" decomposition, second derivatives and losses of z
# (autodiff of the decomposition), the Flax modules, float16 (the float32 handler) and the
# float64 grid with lengths (the float32 one takes the same handler paths). With
# pytest-xdist installed, one worker per CPU. tests/test_isa_builds.py is left out (one
# subprocess per instruction-set build, far slower under ASan); pass it as an argument to run
# every build under the sanitizers.
#
# Environment:
#   PYTHON     the interpreter whose jax / scipy-openblas32 / pytest to use (default python3);
#              jax_sgrnn must be installed in it (regular or editable install)
#   CXX        the C++ compiler (default g++); its own libasan is preloaded into Python
#   SANITIZE_BUILD_DIR   scratch build directory (default build/sanitize in the repository)
#   SANITIZE_JOBS        parallel compile jobs (default: number of CPUs)
#
# How: cmake builds the extension (csrc/) with -fsanitize=address,undefined into the scratch
# directory; the package's Python files and the sanitized _sgrnn_cpu*.so are staged in
# <build>/python, which goes first on PYTHONPATH (a sitecustomize there also disables
# scikit-build-core's editable-install redirect, so an editable install cannot win); pytest
# runs from that directory, so the repository's own jax_sgrnn/ (no .so) is never imported,
# with libasan preloaded (jaxlib and Python are not instrumented) and leak detection off
# (their allocations are not ours). ASan reports go to <build>/logs/asan.<pid> (subprocesses'
# too), which must stay empty; pytest's output, which must hold no sanitizer report (UBSan's
# go there), is kept in <build>/pytest.log.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PYTHON="$(command -v "$PYTHON")"
CXX="$(command -v "${CXX:-g++}")"
BUILD="${SANITIZE_BUILD_DIR:-$REPO/build/sanitize}"
JOBS="${SANITIZE_JOBS:-$(nproc 2>/dev/null || echo 2)}"
STAGE="$BUILD/python"
LOGS="$BUILD/logs"

say() { printf '\n== sanitize: %s\n' "$*"; }

# --- build tools: cmake, ninja (optional) and pybind11's CMake package, in $PYTHON's env ---
export PATH="$(dirname "$PYTHON"):$PATH"  # a venv's own cmake/ninja first
need=()
"$PYTHON" -m pybind11 --cmakedir >/dev/null 2>&1 || need+=("pybind11>=2.12")
cmake --version >/dev/null 2>&1 || need+=("cmake>=3.18")
ninja --version >/dev/null 2>&1 || need+=("ninja")
if [ ${#need[@]} -gt 0 ]; then
  say "installing build tools into $PYTHON's environment: ${need[*]}"
  "$PYTHON" -m pip install --quiet "${need[@]}"
  hash -r
fi
GENERATOR=()
ninja --version >/dev/null 2>&1 && GENERATOR=(-G Ninja)

ASAN_LIB="$("$CXX" -print-file-name=libasan.so)"
if [ ! -e "$ASAN_LIB" ]; then
  echo "sanitize: $CXX has no libasan.so (install the compiler's sanitizer runtime)" >&2
  exit 2
fi
# libstdc++ is preloaded too: Python itself does not link it, and ASan's __cxa_throw
# interceptor must find the real one at start-up, or the first C++ exception inside jaxlib
# fails an ASan CHECK ("real___cxa_throw != 0").
STDCXX_LIB="$(readlink -f "$("$CXX" -print-file-name=libstdc++.so)")"
PRELOAD="$ASAN_LIB${STDCXX_LIB:+ $STDCXX_LIB}"

# --- configure and build ---------------------------------------------------------------
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g"
mkdir -p "$BUILD"
say "building the handlers with $SAN_FLAGS into $BUILD"
cmake -S "$REPO" -B "$BUILD/cmake" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS" \
  -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF \
  -DSGRNN_ENABLE_CUDA=OFF \
  -DPython_EXECUTABLE="$PYTHON" \
  -Dpybind11_DIR="$("$PYTHON" -m pybind11 --cmakedir)" >"$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 2; }
echo "configured (log: $BUILD/configure.log); building (log: $BUILD/build.log)"
cmake --build "$BUILD/cmake" --parallel "$JOBS" >"$BUILD/build.log" 2>&1 \
  || { cat "$BUILD/build.log"; exit 2; }

SO="$(find "$BUILD/cmake" -maxdepth 1 -name '_sgrnn_cpu*.so' | head -n 1)"
[ -n "$SO" ] || { echo "sanitize: no _sgrnn_cpu*.so was built" >&2; exit 2; }

# --- stage the package: its Python files plus the sanitized extension --------------------
rm -rf "$STAGE" "$LOGS"
mkdir -p "$STAGE/jax_sgrnn" "$LOGS"
cp "$REPO"/jax_sgrnn/*.py "$STAGE/jax_sgrnn/"
cp "$SO" "$STAGE/jax_sgrnn/"
cat >"$STAGE/sitecustomize.py" <<'EOF'
# Written by scripts/sanitize.sh: makes the staged (sanitized) jax_sgrnn win over an editable
# install, whose import hook (scikit-build-core's) sits in front of sys.path.
import importlib.machinery
import importlib.util
import os
import sys


def _redirects_jax_sgrnn(finder):
    for attr in ("known_source_files", "known_wheel_files", "known_packages"):
        for name in getattr(finder, attr, ()):
            if name == "jax_sgrnn" or str(name).startswith("jax_sgrnn."):
                return True
    return False


sys.meta_path[:] = [f for f in sys.meta_path if not _redirects_jax_sgrnn(f)]

# Chain to a sitecustomize further down sys.path, if the environment has one.
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
EOF

OPENBLAS_LIB="$("$PYTHON" -c 'import scipy_openblas32 as s; print(s.get_lib_dir())')"
export LD_LIBRARY_PATH="$OPENBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$LOGS/asan"
# UBSan (next to ASan) reports on stderr whatever log_path says; the pytest log is searched.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export JAX_PLATFORMS=cpu

run_python() { (cd "$STAGE" && LD_PRELOAD="$PRELOAD" "$PYTHON" "$@"); }

# --- the staged, sanitized extension is the one imported ----------------------------------
say "checking that the sanitized extension is the one loaded"
run_python -W error::RuntimeWarning - "$STAGE" <<'EOF'
import sys
import jax_sgrnn
from jax_sgrnn import _sgrnn_cpu
stage = sys.argv[1]
loaded = _sgrnn_cpu.__file__
print("jax_sgrnn:", jax_sgrnn.__file__)
print("extension:", loaded)
assert jax_sgrnn.__file__.startswith(stage), "jax_sgrnn is not the staged copy"
assert loaded.startswith(stage), "the sanitized _sgrnn_cpu is not the one loaded"
assert "cpu" in jax_sgrnn.NATIVE_PLATFORMS, jax_sgrnn.NATIVE_PLATFORMS
with open("/proc/self/maps") as maps:
    assert "libasan" in maps.read(), "libasan is not loaded"
EOF
if [ -n "$(ls -A "$LOGS")" ]; then cat "$LOGS"/*; exit 1; fi

# --- the tests -----------------------------------------------------------------------------
if [ $# -gt 0 ]; then
  TESTS=()
  for a in "$@"; do  # paths relative to the caller's directory become absolute
    p="${a%%::*}"
    if [[ "$a" != -* && -e "$p" ]]; then
      TESTS+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")${a#"$p"}")
    else
      TESTS+=("$a")
    fi
  done
else
  SKIP="not scan and not second_derivative and not z_loss and not flax_modules"
  TESTS=(-k "$SKIP and not per_row_oracle_float64 and not half_precision")
  for f in test_op test_transforms test_fuzz test_handler_direct test_concurrency \
           test_extreme test_seq_lengths; do
    TESTS+=("$REPO/tests/$f.py")
  done
  if run_python -c "import xdist" 2>/dev/null; then TESTS+=(-n auto); fi
fi
say "running pytest under ASan+UBSan: ${TESTS[*]#"$REPO"/}"
# --capture=sys: pytest captures Python's sys.stdout/sys.stderr only, so a sanitizer report
# (written to file descriptor 2 by the runtime) reaches this log even when it kills the process.
set +e
run_python -m pytest -q -p no:cacheprovider --capture=sys --durations=10 --rootdir="$REPO" \
  "${TESTS[@]}" \
  2>&1 | tee "$BUILD/pytest.log"
status=${PIPESTATUS[0]}
set -e

say "summary"
SIGNATURES='runtime error:|ERROR: AddressSanitizer|AddressSanitizer: CHECK|UndefinedBehaviorSanitizer|ERROR: LeakSanitizer'
if [ -n "$(ls -A "$LOGS")" ] || grep -Eq "$SIGNATURES" "$BUILD/pytest.log"; then
  echo "sanitizer reports:"
  grep -E -A12 "$SIGNATURES" "$BUILD/pytest.log" || true
  for f in "$LOGS"/*; do [ -e "$f" ] && { echo "---- $f"; cat "$f"; }; done
  echo "FAILED: sanitizer reports above (full output: $BUILD/pytest.log)"
  exit 1
fi
echo "sanitizer reports: none"
if [ "$status" -ne 0 ]; then
  echo "FAILED: pytest exited with status $status"
  exit "$status"
fi
echo "OK: tests passed, no sanitizer report"
