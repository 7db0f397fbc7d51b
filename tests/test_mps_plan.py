"""The MPSGraph handler's decisions (csrc/metal/mps_plan.cc), unit-tested in C++ on any machine."""

from conftest import run_cpp_unit_test


def test_mps_plan_unit_tests(tmp_path):
    run_cpp_unit_test(tmp_path, "tests/cpp/test_mps_plan.cc", "csrc/metal/mps_plan.cc")
