#!/usr/bin/env bash
# Compiles the MPSGraph backend's Objective-C++ (csrc/metal/*.mm), its plain C++
# (csrc/metal/mps_plan.cc, csrc/metal/self_check.cc) and, where pybind11 is installed,
# csrc/metal/module.cc for aarch64-macos on any machine, with the
# clang that the `ziglang` wheel ships, against csrc/metal/apple_sdk_decls.h (a transcription of
# the Apple SDK declarations the handler uses) instead of Apple's frameworks. A misspelled
# selector, a wrong argument type or a C++ error fails here; what only Apple's real headers and
# frameworks can show (a declaration that differs from the SDK, linking, behaviour) does not.
# Exits non-zero on any compile error.
#
#   scripts/check_metal_compile.sh            # no arguments
#
# Environment: PYTHON, the interpreter with jax installed (default python3); ziglang is
# pip-installed into it when missing.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -m ziglang version >/dev/null 2>&1; then
  echo "check_metal_compile: installing ziglang (for its clang) into $PYTHON"
  "$PYTHON" -m pip install --quiet ziglang
fi
XLA_INCLUDE="$("$PYTHON" -c "import jax; print(jax.ffi.include_dir())")"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

# -Wall -Werror hold for XLA's FFI headers too; objects are compiled, not linked.
COMMON=(-target aarch64-macos.13.0 -std=c++20 -Icsrc "-I$XLA_INCLUDE" -Wall -Werror)
status=0
compile() {  # compile FILE EXTRA_FLAGS...
  local file="$1"
  shift
  if "$PYTHON" -m ziglang c++ "${COMMON[@]}" "$@" -c "$file" -o "$OUT/$(basename "$file").o"; then
    echo "compiled $file"
  else
    echo "FAILED   $file" >&2
    status=1
  fi
}

shopt -s nullglob
sources=(csrc/metal/*.mm)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_metal_compile: no csrc/metal/*.mm found" >&2
  exit 1
fi
for file in "${sources[@]}"; do
  compile "$file" -x objective-c++ -fobjc-arc -DSGRNN_APPLE_SDK_DECLS
done
compile csrc/metal/mps_plan.cc
compile csrc/metal/self_check.cc
# module.cc is plain C++ but needs pybind11 and Python.h (this machine's, so only a syntax-level
# check for the Mac target); it is skipped where pybind11 is not installed.
if PYBIND11_INCLUDE="$("$PYTHON" -c "import pybind11; print(pybind11.get_include())" \
    2>/dev/null)"; then
  PYTHON_INCLUDE="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
  compile csrc/metal/module.cc "-I$PYBIND11_INCLUDE" "-I$PYTHON_INCLUDE"
else
  echo "skipped  csrc/metal/module.cc (pybind11 is not installed for $PYTHON)"
fi

ZIG_VERSION="$("$PYTHON" -m ziglang version)"
if [ "$status" -ne 0 ]; then
  echo "check_metal_compile: compile errors (target aarch64-macos.13.0, zig $ZIG_VERSION)" >&2
else
  echo "check_metal_compile: ok (target aarch64-macos.13.0, zig $ZIG_VERSION)"
fi
exit "$status"
