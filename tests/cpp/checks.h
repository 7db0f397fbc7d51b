// The check counter of the C++ unit tests (run by tests/conftest.py's run_cpp_unit_test):
// Check() prints each failed check; Report() prints "F of N checks failed" and gives the exit
// status.
#ifndef JAX_SGRNN_TESTS_CHECKS_H_
#define JAX_SGRNN_TESTS_CHECKS_H_

#include <cstdio>
#include <string>

namespace unit_test {

inline int failures = 0;
inline int checks = 0;

inline void Check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

inline int Report() {
  std::printf("%d of %d checks failed\n", failures, checks);
  return failures == 0 ? 0 : 1;
}

}  // namespace unit_test

#endif  // JAX_SGRNN_TESTS_CHECKS_H_
