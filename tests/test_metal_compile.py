"""The MPSGraph handler's Objective-C++ compiles for aarch64-macos on any machine.

scripts/check_metal_compile.sh compiles csrc/metal/*.mm with the `ziglang` wheel's clang
against csrc/metal/apple_sdk_decls.h (it pip-installs ziglang when missing, so the first run may
need the network). A misspelled MPSGraph selector must fail that check and be named in its
output.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path("scripts/check_metal_compile.sh")


def run_check(root):
    env = dict(os.environ, PYTHON=sys.executable)
    # cwd elsewhere: the script must find its own repository root.
    return subprocess.run(["bash", str(root / SCRIPT)], env=env, cwd=root.parent,
                          capture_output=True, text=True, timeout=600)


def test_tree_compiles_for_macos():
    result = run_check(REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "compiled csrc/metal/mps_handler.mm" in output
    assert "compiled csrc/metal/mps_plan.cc" in output


def test_misspelled_selector_fails(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts")
    shutil.copytree(REPO / "csrc", root / "csrc")
    handler = root / "csrc/metal/mps_handler.mm"
    source = handler.read_text()
    assert "singleGateRNNWithSourceTensor:" in source
    handler.write_text(source.replace("singleGateRNNWithSourceTensor:",
                                      "singleGateRNNWithSourceTensr:", 1))
    result = run_check(root)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "singleGateRNNWithSourceTensr:" in output, output
    assert "FAILED   csrc/metal/mps_handler.mm" in output, output


# ------------------------------------------------------------------------------ libc++ 13
# scripts/check_old_libcxx.sh compiles the C++ the Mac build includes against LLVM 13's libc++
# (Xcode 14.1's, the oldest supported). It installs clang-13 itself in CI; here it is skipped
# where clang-13 and libc++ 13 are not installed.
OLD_LIBCXX = Path("scripts/check_old_libcxx.sh")
needs_old_libcxx = pytest.mark.skipif(
    shutil.which("clang++-13") is None or not Path("/usr/lib/llvm-13/include/c++/v1").is_dir(),
    reason="clang-13 and libc++-13-dev are not installed (apt-get install clang-13 libc++-13-dev)")


def run_old_libcxx_check(root):
    env = dict(os.environ, PYTHON=sys.executable, SGRNN_REQUIRE_OLD_LIBCXX="1")
    return subprocess.run(["bash", str(root / OLD_LIBCXX)], env=env, cwd=root.parent,
                          capture_output=True, text=True, timeout=600)


@needs_old_libcxx
def test_shared_cpp_compiles_against_libcxx13():
    result = run_old_libcxx_check(REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for name in ("mm_headers.cc", "csrc/metal/self_check.cc", "csrc/metal/mps_plan.cc"):
        assert f"compiled {name}" in output, output


@needs_old_libcxx
def test_a_library_feature_libcxx13_lacks_fails(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts")
    shutil.copytree(REPO / "csrc", root / "csrc")
    core = root / "csrc/sgrnn/core.h"
    source = core.read_text()
    assert "__builtin_memcpy(&to, &from, sizeof(To));" in source
    core.write_text(source.replace("#include <cstdint>", "#include <bit>\n#include <cstdint>", 1)
                    .replace("__builtin_memcpy(&to, &from, sizeof(To));",
                             "to = std::bit_cast<To>(from);", 1))
    result = run_old_libcxx_check(root)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "bit_cast" in output and "FAILED   mm_headers.cc" in output, output
