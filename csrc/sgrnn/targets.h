// The FFI target names of every backend, spelled once. Each extension module registers its
// handlers under its own entry (module.h); the native module also exports the whole table, so
// Python can lower for a backend whose module is not built here (jax_sgrnn/_backends.py).
#ifndef JAX_SGRNN_TARGETS_H_
#define JAX_SGRNN_TARGETS_H_

namespace sgrnn {

struct TargetNames {
  const char* backend;    // the name jax_sgrnn.backends() uses
  const char* forward;    // singleGateRNN
  const char* gradients;  // singleGateRNNGradients
};

inline constexpr TargetNames kNativeTargets{"native", "jax_sgrnn_forward", "jax_sgrnn_gradients"};
inline constexpr TargetNames kMpsTargets{"mps", "jax_sgrnn_mps_forward",
                                         "jax_sgrnn_mps_gradients"};
inline constexpr TargetNames kCudaTargets{"cuda", "jax_sgrnn_cuda_forward",
                                          "jax_sgrnn_cuda_gradients"};
inline constexpr TargetNames kAllTargets[] = {kNativeTargets, kMpsTargets, kCudaTargets};

}  // namespace sgrnn

#endif  // JAX_SGRNN_TARGETS_H_
