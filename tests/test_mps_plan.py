"""The MPSGraph handler's decisions (csrc/metal/mps_plan.cc), unit-tested in C++ on any machine.

Builds tests/cpp/test_mps_plan.cc with mps_plan.cc using the system C++ compiler and runs it;
the binary prints each failed check.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_mps_plan_unit_tests(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH")
    binary = tmp_path / "test_mps_plan"
    build = subprocess.run(
        [cxx, "-std=c++20", "-Wall", "-Werror", "-I", str(REPO / "csrc"),
         str(REPO / "tests/cpp/test_mps_plan.cc"), str(REPO / "csrc/metal/mps_plan.cc"),
         "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("0 of "), run.stdout
