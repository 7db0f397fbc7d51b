"""The C++ unit tests of the handlers' plain-C++ decisions, built with the system compiler and
run on any machine: the MPSGraph handler's plan (csrc/metal/mps_plan.cc: overloads, graph keys,
placeholder shapes, mask expansion, buffer wrapping, result mapping), the CUDA handler's
split of a problem over the GPU (csrc/cuda/recurrence_plan.h: every unit and row covered, the
on-chip limits, the lowering's choice between the kernels and the decomposition), the step loop
of its grid kernels in a host emulation against the spec (csrc/cuda/grid_steps.h; again under
ThreadSanitizer) and the CPU handler's x86-64 level from CPUID and XCR0 values
(csrc/cpu/isa_detect.h: real CPUs, the state the OS saves, unsupported leaves, every bit of the
psABI's list). The MPSGraph self-check's unit test is in test_mps_self_check.py."""

import pytest

from conftest import run_cpp_unit_test

UNITS = {
    "mps_plan": ("tests/cpp/test_mps_plan.cc", "csrc/metal/mps_plan.cc"),
    "cuda_plan": ("tests/cpp/test_cuda_plan.cc",),
    "grid_steps": ("tests/cpp/test_grid_steps.cc",),
    "grid_steps_tsan": ("tests/cpp/test_grid_steps.cc",),
    "isa_detect": ("tests/cpp/test_isa_detect.cc",),
}
# The grid kernels' emulation runs a host thread per GPU thread; under ThreadSanitizer it also
# shows that their barriers and counters order every access of the step loop (about 6 minutes).
FLAGS = {"grid_steps": ("-O2", "-pthread"),
         "grid_steps_tsan": ("-O1", "-pthread", "-fsanitize=thread")}


@pytest.mark.parametrize("unit", list(UNITS))
def test_cpp_unit_tests(tmp_path, unit):
    run_cpp_unit_test(tmp_path, *UNITS[unit], flags=FLAGS.get(unit, ()))
