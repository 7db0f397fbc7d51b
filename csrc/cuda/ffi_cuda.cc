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
#include <optional>
#include <string>

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

// The plan for these sizes on the current device, or an error saying why there is none.
ffi::Error PlanFor(Pass pass, const Dims& d, int64_t element_bytes, RecurrencePlan* out) {
  int device = 0, multiprocessors = 0, shared = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err != cudaSuccess) return CudaError(err, "device query");
  if (!IndexesFit(d.T, d.N, d.D, d.H)) {
    return InvalidArgument("the CUDA handler indexes [T, N, D*H] with 32-bit integers, and "
                           "T*N*D*H = " + std::to_string(d.T * d.N * d.D * d.H) +
                           " does not fit (the lowering uses the lax.scan decomposition for it)");
  }
  const std::optional<RecurrencePlan> plan =
      PlanRecurrence(pass, d.H, d.N, d.D, element_bytes, multiprocessors, shared);
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
  CheckedDims checked;
  ffi::Error status = CheckForward(c, x, R, W, b, h0, mask, seq_lengths, *y, *z, &checked);
  if (status.failure()) return status;
  if (status = CheckRecurrenceOnly(c); status.failure()) return status;
  const Dims& d = checked.dims;
  ffi::Error result = ffi::Error::Success();
  status = DispatchFloat<kF32, kF64>(x.element_type(), "CUDA", [&]<typename T>() {
    RecurrencePlan plan;
    if (result = PlanFor(Pass::kForward, d, sizeof(T), &plan); result.failure()) return;
    const int64_t* ms = checked.mask_shape;
    const ForwardArgs<T> args{
        .source = DataOrNull<T>(true, x),
        .R = DataOrNull<T>(true, R),
        .h0 = DataOrNull<T>(c.has_init_state, h0),
        .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask), ms[1], ms[2], ms[3])
                           : MaskView<T>(),
        .seq_lengths = DataOrNull<int32_t>(c.has_seq_lengths, seq_lengths),
        .y = MutableOrNull<T>(true, *y),
        .z = MutableOrNull<T>(c.training, *z)};
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
  CheckedDims checked;
  ffi::Error status = CheckGradients(c, x, R, dy, z, W, b, h0, mask, seq_lengths, *dx, *dR, *dW,
                                     *db, *dh0, &checked, /*with_recurrent_weight_gradient=*/false);
  if (status.failure()) return status;
  if (status = CheckRecurrenceOnly(c); status.failure()) return status;
  const Dims& d = checked.dims;
  ffi::Error result = ffi::Error::Success();
  status = DispatchFloat<kF32, kF64>(x.element_type(), "CUDA", [&]<typename T>() {
    RecurrencePlan plan;
    if (result = PlanFor(Pass::kBackward, d, sizeof(T), &plan); result.failure()) return;
    const int64_t* ms = checked.mask_shape;
    for (int64_t g = 0; g < checked.G; ++g) {
      const GroupOffsets o = checked.Group(g);
      const GradientArgs<T> args{
          .R = DataOrNull<T>(true, R),
          .dy = DataOrNull<T>(true, dy) + o.state,
          .z = DataOrNull<T>(true, z) + o.state,
          .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask) + o.mask, ms[1], ms[2],
                                           ms[3])
                             : MaskView<T>(),
          .seq_lengths = c.has_seq_lengths
                             ? DataOrNull<int32_t>(true, seq_lengths) + o.seq_lengths
                             : nullptr,
          .d_source = MutableOrNull<T>(true, *dx) + o.source,
          .dh0 = c.has_init_state ? MutableOrNull<T>(true, *dh0) + o.init_state : nullptr};
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
