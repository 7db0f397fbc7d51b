#!/usr/bin/env bash
# Compiles the C++ that the macOS build of the MPSGraph extension compiles (csrc/metal/*.cc,
# csrc/sgrnn/ffi_schema.cc, and every project header csrc/metal/*.mm includes) against LLVM 13's
# libc++, the C++ library of Xcode 14.1's macOS 13 SDK: the oldest toolchain the README supports
# on a Mac. A C++20 library feature that libc++ 13 lacks (std::bit_cast, say) fails here, where
# a current libc++ (zig's, the Linux build's libstdc++) would accept it.
#
#   scripts/check_old_libcxx.sh          # installs clang-13 and libc++-13-dev with apt-get if
#                                        # missing (as root); else skips, exit status 0
#
# Environment: PYTHON, the interpreter with jax (for XLA's FFI headers) and optionally pybind11
# installed (default python3). SGRNN_REQUIRE_OLD_LIBCXX=1 turns a skip into a failure (CI).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CXX13=clang++-13
LIBCXX13=/usr/lib/llvm-13/include/c++/v1

skip() {
  if [ "${SGRNN_REQUIRE_OLD_LIBCXX:-0}" = "1" ]; then
    echo "check_old_libcxx: FAILED: $1" >&2
    exit 1
  fi
  echo "check_old_libcxx: skipped: $1"
  exit 0
}

if ! command -v "$CXX13" >/dev/null 2>&1 || [ ! -d "$LIBCXX13" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "check_old_libcxx: installing Debian's clang-13 and libc++-13-dev"
    apt-get install -y -qq --no-install-recommends clang-13 libc++-13-dev libc++abi-13-dev \
      >/dev/null || { apt-get update -qq >/dev/null &&
                      apt-get install -y -qq --no-install-recommends clang-13 libc++-13-dev \
                        libc++abi-13-dev >/dev/null; } || skip "apt-get could not install clang-13"
  else
    skip "clang++-13 with libc++ 13 is not installed (apt-get install clang-13 libc++-13-dev)"
  fi
fi

XLA_INCLUDE="$("$PYTHON" -c "import jax; print(jax.ffi.include_dir())")"
FLAGS=(-stdlib=libc++ -std=c++20 -fsyntax-only -Wall -Werror -Icsrc "-I$XLA_INCLUDE")
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

# Every project header the Objective-C++ includes, in one translation unit (the Apple headers
# and the declarations stand-in are Objective-C; check_metal_compile.sh covers those).
headers="$OUT/mm_headers.cc"
grep -h '^#include "' csrc/metal/*.mm | grep -v apple_sdk_decls | sort -u > "$headers"

status=0
check() {  # check FILE EXTRA_FLAGS...
  local file="$1"
  shift
  if "$CXX13" "${FLAGS[@]}" "$@" "$file"; then
    echo "compiled ${file#"$OUT/"}"
  else
    echo "FAILED   ${file#"$OUT/"}" >&2
    status=1
  fi
}

check "$headers"
check csrc/metal/mps_plan.cc
check csrc/metal/self_check.cc
check csrc/sgrnn/ffi_schema.cc
if PYBIND11_INCLUDE="$("$PYTHON" -c "import pybind11; print(pybind11.get_include())" \
    2>/dev/null)"; then
  PYTHON_INCLUDE="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
  check csrc/metal/module.cc "-I$PYBIND11_INCLUDE" "-I$PYTHON_INCLUDE"
else
  echo "skipped  csrc/metal/module.cc (pybind11 is not installed for $PYTHON)"
fi

VERSION="$("$CXX13" --version | head -n 1)"
if [ "$status" -ne 0 ]; then
  echo "check_old_libcxx: compile errors against libc++ 13 ($VERSION)" >&2
else
  echo "check_old_libcxx: ok (libc++ 13, $VERSION)"
fi
exit "$status"
