// The kernels' phase timing for benchmarks/bench_cpu.py (the counters are kernels.h's).
// Part of kernels.cc, compiled once per instruction set inside its SGRNN_ISA namespace (see
// kernels.h), so each build gets its own copy; include it from kernels.cc only.
#ifndef JAX_SGRNN_CPU_PHASE_TIMER_H_
#define JAX_SGRNN_CPU_PHASE_TIMER_H_

#include <chrono>
#include <cstdint>

#include "cpu/kernels.h"

namespace sgrnn::cpu::SGRNN_ISA {
namespace {

// Adds wall time to the current phase, when timing is on: from construction (or the last
// Switch) to the next Switch or the end of the scope.
class PhaseTimer {
 public:
  explicit PhaseTimer(Phase phase) : phase_(phase), on_(PhaseTimingOn()), start_(Now()) {}
  ~PhaseTimer() { Switch(phase_); }

  void Switch(Phase next) {
    if (on_) {
      const auto now = Now();
      AddPhaseTime(phase_,
                   std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count());
      start_ = now;
    }
    phase_ = next;
  }

 private:
  std::chrono::steady_clock::time_point Now() const {
    return on_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  }

  Phase phase_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace
}  // namespace sgrnn::cpu::SGRNN_ISA

#endif  // JAX_SGRNN_CPU_PHASE_TIMER_H_
