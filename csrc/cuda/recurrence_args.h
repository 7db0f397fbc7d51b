// What the CUDA recurrence kernels take, and the per-step rules they share (the kernels of
// one block a row group, recurrence.cu, and those of a step over the whole GPU,
// grid_steps.h): plain C++ with no CUDA types, so that the rules compile for the host too and
// the grid kernels' step loop runs in a host emulation (tests/cpp/test_grid_steps.cc).
#ifndef JAX_SGRNN_CUDA_RECURRENCE_ARGS_H_
#define JAX_SGRNN_CUDA_RECURRENCE_ARGS_H_

#include <cstdint>

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

template <typename T>
SGRNN_HOST_DEVICE inline const T* MaskPointer(const MaskView<T>& m, int k, int n, int col) {
  return m.data + k * static_cast<int>(m.t_stride) + n * static_cast<int>(m.n_stride) +
         col * static_cast<int>(m.h_stride);
}
template <typename T>
SGRNN_HOST_DEVICE inline T MaskAt(const MaskView<T>& m, int k, int n, int col) {
  return m.data ? *MaskPointer(m, k, n, col) : T(1);
}

// Where processing step k >= 0 of a row with `length` valid steps reads its source (in_time)
// and stores its outputs (slot); padded steps (k >= length) stay at k.
struct StepTimes {
  int in_time, slot;
  bool valid;
};
SGRNN_HOST_DEVICE inline StepTimes TimesOf(const DirectionLayout& layout, int k, int length) {
  const bool valid = k < length;
  const int flipped = length - 1 - k;
  return {layout.read_reversed && valid ? flipped : k, layout.store_flipped && valid ? flipped : k,
          valid};
}

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_RECURRENCE_ARGS_H_
