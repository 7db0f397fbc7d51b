// The FFI handler symbols of every backend, so that the files that bind them into a Python
// module (module.h) only need this header. Each takes BindForward() / BindGradients()
// (ffi_schema.h) plus its backend's context.
#ifndef JAX_SGRNN_HANDLERS_H_
#define JAX_SGRNN_HANDLERS_H_

#include "xla/ffi/api/api.h"

namespace sgrnn {

// csrc/cpu/ffi_cpu.cc: C++ and OpenBLAS (Accelerate on macOS) on XLA's intra-op thread pool.
XLA_FFI_DECLARE_HANDLER_SYMBOL(NativeForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NativeGradients);

// csrc/cuda/ffi_cuda.cc: the recurrence on an NVIDIA GPU, on XLA's stream (built with nvcc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaGradients);

// csrc/metal/mps_handler.mm: MPSGraph's singleGateRNN ops on the Apple GPU (macOS only).
XLA_FFI_DECLARE_HANDLER_SYMBOL(MpsForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MpsGradients);

}  // namespace sgrnn

#endif  // JAX_SGRNN_HANDLERS_H_
