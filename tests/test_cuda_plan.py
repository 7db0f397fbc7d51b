"""The CUDA handler's split of a problem over the GPU (csrc/cuda/recurrence_plan.h), unit-tested
in C++ on any machine: every unit and row covered, the on-chip limits, and the lowering's
choice between the kernel and the decomposition."""

from conftest import run_cpp_unit_test


def test_cuda_plan_unit_tests(tmp_path):
    run_cpp_unit_test(tmp_path, "tests/cpp/test_cuda_plan.cc")
