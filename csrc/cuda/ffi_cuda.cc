// The XLA FFI handlers for the CUDA platform (module.cc exports them to Python). Each handler
// validates its buffers (ffi_schema.cc), plans the split over the device (recurrence_plan.h)
// and enqueues the recurrence kernels (recurrence.cu) on XLA's stream; it never waits for them.
//
// They run the recurrence only: the lowering (jax_sgrnn/_lowering.py) applies the input weight
// and the bias, and computes dW, dR, db and dx from the returned dz, with XLA's matrix
// products. So the forward takes the projected source as x, and the gradient op returns dz as
// dx and no dR.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "cuda/recurrence.h"
#include "cuda/recurrence_plan.h"
#include "sgrnn/ffi_dispatch.h"
#include "sgrnn/ffi_schema.h"
#include "sgrnn/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace sgrnn::cuda {
namespace {

namespace ffi = ::xla::ffi;
constexpr ffi::DataType kF32 = ffi::DataType::F32, kF64 = ffi::DataType::F64;

ffi::Error CudaError(cudaError_t err, const char* what) {
  return Failure(ffi::ErrorCode::kInternal,
                 std::string("CUDA ") + what + ": " + cudaGetErrorString(err));
}

// What the handlers take beyond the shared schema.
ffi::Error CheckRecurrenceOnly(const Config& c) {
  if (c.has_input_weight || c.has_bias) {
    return InvalidArgument(
        "the CUDA handler runs the recurrence only and takes the projected source; "
        "input_weight and bias are applied by the lowering (call the op through jax_sgrnn)");
  }
  return ffi::Error::Success();
}

// What the plan needs to know of a device.
struct DeviceLimits {
  int multiprocessors = 0;
  int shared_bytes = 0;  // opt-in shared memory per block
};

// The current device's limits, queried once per device: they do not change while the process
// runs, and a query on every call would add driver calls to each launch.
ffi::Error CurrentDeviceLimits(DeviceLimits* out) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return CudaError(err, "device query");
  }
  static std::mutex mutex;
  static std::unordered_map<int, DeviceLimits> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(device); it != known.end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  DeviceLimits limits;
  cudaError_t err = cudaDeviceGetAttribute(&limits.multiprocessors,
                                           cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&limits.shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                 device);
  }
  if (err != cudaSuccess) return CudaError(err, "device query");
  known.emplace(device, limits);
  *out = limits;
  return ffi::Error::Success();
}

// The plan for these sizes on the current device, or an error saying why there is none.
ffi::Error PlanFor(const Dims& d, int64_t element_bytes, RecurrencePlan* out) {
  DeviceLimits limits;
  if (ffi::Error status = CurrentDeviceLimits(&limits); status.failure()) return status;
  if (!IndexesFit(d.T, d.N, d.D, d.H)) {
    return InvalidArgument("the CUDA handler indexes [T, N, D*H] with 32-bit integers, and "
                           "T*N*D*H = " + std::to_string(d.T * d.N * d.D * d.H) +
                           " does not fit (the lowering uses the lax.scan decomposition for it)");
  }
  const std::optional<RecurrencePlan> plan =
      PlanRecurrence(d.H, d.N, d.D, element_bytes, limits.multiprocessors, limits.shared_bytes);
  if (!plan) {
    return InvalidArgument("hidden size " + std::to_string(d.H) +
                           " does not fit the CUDA handler's on-chip recurrence (the lowering "
                           "uses the lax.scan decomposition for it)");
  }
  *out = *plan;
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer W, ffi::AnyBuffer b,
                       ffi::AnyBuffer h0, ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths,
                       Config c, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z,
                       cudaStream_t stream) {
  const ForwardBuffers buffers{x, R, W, b, h0, mask, seq_lengths, *y, *z};
  CheckedDims checked;
  ffi::Error status = CheckForward(c, buffers, &checked);
  if (status.failure()) return status;
  if (status = CheckRecurrenceOnly(c); status.failure()) return status;
  const Dims& d = checked.dims;
  ffi::Error result = ffi::Error::Success();
  status = DispatchFloat<kF32, kF64>(x.element_type(), "CUDA", [&]<typename T>() {
    RecurrencePlan plan;
    if (result = PlanFor(d, sizeof(T), &plan); result.failure()) return;
    const ForwardOperands<T> o = TypedOperands<T>(c, buffers, checked);
    const ForwardArgs<T> args{.source = o.x, .R = o.R, .h0 = o.h0, .mask = o.mask,
                              .seq_lengths = o.seq_lengths, .y = o.y, .z = o.z};
    if (cudaError_t err = LaunchForward<T>(c, d, plan, args, stream); err != cudaSuccess) {
      result = CudaError(err, "forward launch");
    }
  });
  return status.failure() ? status : result;
}

// x and h0 are not read (their only uses, dW and dR, are the lowering's products): they are
// checked for their shapes, and the lowering passes dy as x, which has the same shape. dR is
// the [0] placeholder.
ffi::Error GradientsImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy, ffi::AnyBuffer z,
                         ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                         ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths, Config c,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dR,
                         ffi::Result<ffi::AnyBuffer> dW, ffi::Result<ffi::AnyBuffer> db,
                         ffi::Result<ffi::AnyBuffer> dh0, cudaStream_t stream) {
  const GradientBuffers buffers{x, R, dy, z, W, b, h0, mask, seq_lengths, *dx, *dR, *dW, *db, *dh0};
  CheckedDims checked;
  ffi::Error status =
      CheckGradients(c, buffers, &checked, /*with_recurrent_weight_gradient=*/false);
  if (status.failure()) return status;
  if (status = CheckRecurrenceOnly(c); status.failure()) return status;
  const Dims& d = checked.dims;
  ffi::Error result = ffi::Error::Success();
  status = DispatchFloat<kF32, kF64>(x.element_type(), "CUDA", [&]<typename T>() {
    RecurrencePlan plan;
    if (result = PlanFor(d, sizeof(T), &plan); result.failure()) return;
    for (int64_t g = 0; g < checked.G; ++g) {
      const GradientOperands<T> o = TypedOperands<T>(c, buffers, checked, g);
      const GradientArgs<T> args{.R = o.R, .dy = o.dy, .z = o.z, .mask = o.mask,
                                 .seq_lengths = o.seq_lengths, .d_source = o.dx, .dh0 = o.dh0};
      if (cudaError_t err = LaunchGradients<T>(c, d, plan, args, stream); err != cudaSuccess) {
        result = CudaError(err, "gradients launch");
        return;
      }
    }
  });
  return status.failure() ? status : result;
}

}  // namespace
}  // namespace sgrnn::cuda

namespace sgrnn {

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaForward, cuda::ForwardImpl,
                              BindForward().Ctx<ffi::PlatformStream<cudaStream_t>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaGradients, cuda::GradientsImpl,
                              BindGradients().Ctx<ffi::PlatformStream<cudaStream_t>>());

}  // namespace sgrnn
