"""The build's check that no instruction-set build lends its code to another
(cmake/check_isa_symbols.py), on objects compiled here: it must reject a weak function outside
the build's namespace whose code differs from the baseline's, and accept one whose code is the
same (a standard library's inline helper) or one inside the namespace."""

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "cmake" / "check_isa_symbols.py"

# Each function is weak (inline, kept out of line); the sums vectorise differently per build.
SOURCE = """
#define KEEP __attribute__((noinline))
KEEP inline float sum_of_squares(const float* x, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}
KEEP inline int answer() { return 42; }
namespace sgrnn::cpu::x86_64_v4 {
KEEP inline float twice_sum_of_squares(const float* x, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += 2 * x[i] * x[i];
  return s;
}
}
float use(const float* x, int n) { return BODY; }
"""
SUM = "sum_of_squares(x, n)"
OWN = "sgrnn::cpu::x86_64_v4::twice_sum_of_squares(x, n)"


def compile_object(tmp_path, name: str, body: str, *flags: str) -> Path:
    source = tmp_path / f"{name}.cc"
    source.write_text(SOURCE.replace("BODY", body))
    obj = tmp_path / f"{name}.o"
    subprocess.run([shutil.which("g++"), "-std=c++20", "-O3", "-ffast-math", "-c", *flags,
                    str(source), "-o", str(obj)], check=True)
    return obj


def run_check(baseline: Path, obj: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "x86_64_v4", str(baseline), str(obj)],
                          capture_output=True, text=True)


@pytest.fixture
def objects(tmp_path):
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs g++ targeting x86-64 (the check runs for the x86 builds only)")
    return tmp_path


def test_rejects_a_weak_function_whose_code_differs(objects):
    baseline = compile_object(objects, "baseline", f"{SUM} + answer()")
    v4 = compile_object(objects, "v4", f"{SUM} + answer()", "-march=x86-64-v4")
    result = run_check(baseline, v4)
    assert result.returncode != 0
    assert "_Z14sum_of_squaresPKfi" in result.stderr, result.stderr


def test_accepts_identical_copies_and_the_builds_own_namespace(objects):
    baseline = compile_object(objects, "baseline", "answer()")
    v4 = compile_object(objects, "v4", f"answer() + {OWN}", "-march=x86-64-v4")
    result = run_check(baseline, v4)
    assert result.returncode == 0, result.stderr


def test_rejects_a_weak_function_the_baseline_lacks(objects):
    baseline = compile_object(objects, "baseline", "answer()")
    v4 = compile_object(objects, "v4", f"{SUM} + answer()", "-march=x86-64-v4")
    result = run_check(baseline, v4)
    assert result.returncode != 0 and "_Z14sum_of_squaresPKfi" in result.stderr, result.stderr
