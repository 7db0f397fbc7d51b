// CPU math of the single-gate RNN on raw row-major pointers, free of XLA: the handlers in
// ffi_cpu.cc validate buffers and call these. Matrix products go to OpenBLAS (which picks its
// own kernels at run time); the elementwise loops are ours, so kernels.cc is compiled once per
// x86-64 level (baseline, v3 = AVX2/FMA, v4 = AVX-512) and dispatch.cc runs the best one the
// CPU supports.
#ifndef JAX_SGRNN_CPU_KERNELS_H_
#define JAX_SGRNN_CPU_KERNELS_H_

#include <cstdint>
#include <functional>

#include "sgrnn/core.h"

namespace sgrnn::cpu {

// Where the kernels run their parallel parts: ForEach(n, body) runs body(0..n-1), possibly
// concurrently, and returns when all are done. The FFI handlers back it with XLA's own
// intra-op thread pool, so the op shares XLA's threads instead of adding a second pool
// (OpenBLAS itself is kept single-threaded).
class Executor {
 public:
  virtual ~Executor() = default;
  virtual int64_t width() const = 0;  // how many bodies can run at once
  virtual void ForEach(int64_t n, const std::function<void(int64_t)>& body) const = 0;
};

// y (and z) for one problem; both directions, all flags.
template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardOperands<T>& a);

// Backpropagation through time for one problem (spec, "Gradient op").
template <typename T>
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientOperands<T>& a);

// Where the kernels' time goes, for benchmarks/bench_cpu.py: wall time per phase, summed over
// calls and threads' pieces (a phase that runs on two threads at once counts once: it is
// timed on the calling thread). Off by default; when off, a phase costs one relaxed load.
enum class Phase : int {
  kProjection,         // forward: x W^T + b, and the flips into step order
  kRecurrence,         // forward: the T steps
  kBackRecurrence,     // backward: the T steps
  kWeightGradients,    // backward: dR, dW, db
  kInputGradient,      // backward: dx = dz W, and the flips into source time
};
inline constexpr int kPhaseCount = 5;
void SetPhaseTiming(bool on);
bool PhaseTimingOn();
void AddPhaseTime(Phase phase, int64_t nanoseconds);
// Seconds per phase since the last call (which resets them), in Phase order.
void TakePhaseTimes(double (&seconds)[kPhaseCount]);

// The instruction-set build the two functions above run: "baseline", "x86-64-v3" or
// "x86-64-v4" (the best the CPU supports, or SGRNN_CPU_ISA's choice).
const char* SelectedIsa();

// The per-instruction-set builds of kernels.cc that the two functions above dispatch to.
#define SGRNN_DECLARE_ISA_KERNELS(isa)                                          \
  namespace isa {                                                               \
  template <typename T>                                                         \
  void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardOperands<T>& a);        \
  template <typename T>                                                         \
  void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientOperands<T>& a);     \
  }
SGRNN_DECLARE_ISA_KERNELS(baseline)
#if defined(SGRNN_X86_ISAS)
SGRNN_DECLARE_ISA_KERNELS(x86_64_v3)
SGRNN_DECLARE_ISA_KERNELS(x86_64_v4)
#endif
#undef SGRNN_DECLARE_ISA_KERNELS

}  // namespace sgrnn::cpu

#endif  // JAX_SGRNN_CPU_KERNELS_H_
