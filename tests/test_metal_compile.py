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
