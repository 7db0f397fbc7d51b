"""The standalone CUDA programs compile for sm_90 wherever nvcc is found.

They run only on a GPU (the kernels-alone timer, the step and rate probes, the compute-sanitizer
driver), so without this check a change to the kernels' headers could break them unseen until the
next GPU session. Each is compiled to an object file (no GPU needed, no link: the programs that
drive csrc/cuda/recurrence.cu link its object, which the package's build already compiles).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")

PROGRAMS = [
    "benchmarks/time_cuda_kernels.cu",
    "benchmarks/probe_step.cu",
    "benchmarks/probe_grid_step.cu",
    "benchmarks/probe_arith_rate.cu",
    "tests/cpp/cuda_sanitize.cu",
]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("program", PROGRAMS)
def test_compiles(program, tmp_path):
    command = [NVCC, "-std=c++20", "-O3", "-arch=sm_90", "--expt-relaxed-constexpr",
               "-Icsrc", "-Ibenchmarks", "-c", program, "-o", str(tmp_path / "program.o")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "program.o").stat().st_size > 0
