// Picks, once, the instruction-set build of kernels.cc that this CPU runs best.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cpu/isa_detect.h"
#include "cpu/kernels.h"

namespace sgrnn::cpu {
namespace {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kX86_64_V4: return "x86-64-v4";
    case Isa::kX86_64_V3: return "x86-64-v3";
    default: return "baseline";
  }
}

// The best build this CPU runs, or the one named by SGRNN_CPU_ISA ("baseline", "x86-64-v3",
// "x86-64-v4") when the CPU supports it, so that tests can exercise every build.
Isa ChooseIsa() {
  Isa best = Isa::kBaseline;
#if defined(SGRNN_X86_ISAS)
  best = BestIsaFor(ReadCpuidRegisters());
#endif
  if (const char* wanted = std::getenv("SGRNN_CPU_ISA")) {
    for (Isa isa : {Isa::kBaseline, Isa::kX86_64_V3, Isa::kX86_64_V4}) {
      if (isa <= best && std::strcmp(wanted, IsaName(isa)) == 0) return isa;
    }
  }
  return best;
}

Isa BestIsa() {
  static const Isa isa = ChooseIsa();
  return isa;
}

}  // namespace

const char* SelectedIsa() { return IsaName(BestIsa()); }

namespace {
std::atomic<bool> phase_timing{false};
std::atomic<int64_t> phase_nanoseconds[kPhaseCount];
}  // namespace

void SetPhaseTiming(bool on) { phase_timing.store(on, std::memory_order_relaxed); }
bool PhaseTimingOn() { return phase_timing.load(std::memory_order_relaxed); }
void AddPhaseTime(Phase phase, int64_t nanoseconds) {
  phase_nanoseconds[static_cast<int>(phase)].fetch_add(nanoseconds, std::memory_order_relaxed);
}
void TakePhaseTimes(double (&seconds)[kPhaseCount]) {
  for (int i = 0; i < kPhaseCount; ++i) {
    seconds[i] = 1e-9 * static_cast<double>(phase_nanoseconds[i].exchange(0));
  }
}

template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardOperands<T>& a) {
  switch (BestIsa()) {
#if defined(SGRNN_X86_ISAS)
    case Isa::kX86_64_V4: return x86_64_v4::Forward(ex, c, d, a);
    case Isa::kX86_64_V3: return x86_64_v3::Forward(ex, c, d, a);
#endif
    default: return baseline::Forward(ex, c, d, a);
  }
}

template <typename T>
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientOperands<T>& a) {
  switch (BestIsa()) {
#if defined(SGRNN_X86_ISAS)
    case Isa::kX86_64_V4: return x86_64_v4::Gradients(ex, c, d, a);
    case Isa::kX86_64_V3: return x86_64_v3::Gradients(ex, c, d, a);
#endif
    default: return baseline::Gradients(ex, c, d, a);
  }
}

template void Forward<float>(const Executor&, const Config&, const Dims&, const ForwardOperands<float>&);
template void Forward<double>(const Executor&, const Config&, const Dims&, const ForwardOperands<double>&);
template void Gradients<float>(const Executor&, const Config&, const Dims&, const GradientOperands<float>&);
template void Gradients<double>(const Executor&, const Config&, const Dims&, const GradientOperands<double>&);

}  // namespace sgrnn::cpu
