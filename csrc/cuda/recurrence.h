// The sequential part of the single-gate RNN on an NVIDIA GPU: one persistent kernel launch
// runs all T steps of both directions (recurrence.cu; the split is recurrence_plan.h). The
// large matrix products around it (the input projection, dW, dR, dx) are XLA's, in the lowering.
#ifndef JAX_SGRNN_CUDA_RECURRENCE_H_
#define JAX_SGRNN_CUDA_RECURRENCE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/recurrence_plan.h"
#include "sgrnn/core.h"

namespace sgrnn::cuda {

// Forward recurrence: y (and z when training) from the projected source.
template <typename T>
struct ForwardArgs {
  const T* source;  // projected source x W^T + b [T, N, D*H]
  const T* R;       // [D, H, H]
  const T* h0;      // [N, D*H] or null (zeros)
  MaskView<T> mask;  // over [T, N, D*H]; null data: no mask
  const int32_t* seq_lengths;  // [N] or null
  T* y;  // [T, N, D*H]
  T* z;  // [T, N, D*H] or null
};

// Backpropagation through time: the gradient of the projected source (dz) and dh0. dR is the
// sum over steps of dz_k^T (h_{k-1} m_k), one large product that the lowering leaves to XLA.
template <typename T>
struct GradientArgs {
  const T* R;   // [D, H, H]
  const T* dy;  // [T, N, D*H]
  const T* z;   // [T, N, D*H]
  MaskView<T> mask;
  const int32_t* seq_lengths;
  T* d_source;  // dz in source time [T, N, D*H]
  T* dh0;       // [N, D*H] or null
};

// Enqueue the kernels on `stream`; nothing waits for them. `plan` comes from PlanRecurrence
// for these sizes. Returns the first CUDA error.
template <typename T>
cudaError_t LaunchForward(const Config& c, const Dims& d, const RecurrencePlan& plan,
                          const ForwardArgs<T>& args, cudaStream_t stream);
template <typename T>
cudaError_t LaunchGradients(const Config& c, const Dims& d, const RecurrencePlan& plan,
                            const GradientArgs<T>& args, cudaStream_t stream);

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_RECURRENCE_H_
