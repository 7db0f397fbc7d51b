// Picks, once, the instruction-set build of kernels.cc that this CPU runs best.
#include "cpu/kernels.h"

namespace sgrnn::cpu {
namespace {

enum class Isa { kBaseline, kX86_64_V3, kX86_64_V4 };

Isa BestIsa() {
#if defined(SGRNN_X86_ISAS)
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return Isa::kX86_64_V4;
    if (__builtin_cpu_supports("x86-64-v3")) return Isa::kX86_64_V3;
    return Isa::kBaseline;
  }();
  return best;
#else
  return Isa::kBaseline;
#endif
}

}  // namespace

template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardArgs<T>& a) {
  switch (BestIsa()) {
#if defined(SGRNN_X86_ISAS)
    case Isa::kX86_64_V4: return x86_64_v4::Forward(ex, c, d, a);
    case Isa::kX86_64_V3: return x86_64_v3::Forward(ex, c, d, a);
#endif
    default: return baseline::Forward(ex, c, d, a);
  }
}

template <typename T>
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientArgs<T>& a) {
  switch (BestIsa()) {
#if defined(SGRNN_X86_ISAS)
    case Isa::kX86_64_V4: return x86_64_v4::Gradients(ex, c, d, a);
    case Isa::kX86_64_V3: return x86_64_v3::Gradients(ex, c, d, a);
#endif
    default: return baseline::Gradients(ex, c, d, a);
  }
}

template void Forward<float>(const Executor&, const Config&, const Dims&, const ForwardArgs<float>&);
template void Forward<double>(const Executor&, const Config&, const Dims&, const ForwardArgs<double>&);
template void Gradients<float>(const Executor&, const Config&, const Dims&, const GradientArgs<float>&);
template void Gradients<double>(const Executor&, const Config&, const Dims&, const GradientArgs<double>&);

}  // namespace sgrnn::cpu
