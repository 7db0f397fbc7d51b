// The XLA FFI handlers for the CUDA platform (module.cc exports them to Python). Each handler
// validates its buffers (ffi_schema.cc), plans the split over the device (recurrence_plan.h)
// and enqueues the recurrence kernels (recurrence.cu) on XLA's stream; it never waits for them.
//
// They run the recurrence only: the lowering (jax_sgrnn/_lowering.py) applies the input weight
// and the bias, and computes dW, dR, db and dx from the returned dz, with XLA's matrix
// products. So the forward takes the projected source as x, and the gradient op returns dz as
// dx and no dR.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
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

cudaError_t QueryLimits(int device, DeviceLimits* out) {
  int multiprocessors = 0, shared_bytes = 0;
  cudaError_t err =
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  *out = {multiprocessors, shared_bytes};
  return err;
}

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
  if (cudaError_t err = QueryLimits(device, &limits); err != cudaSuccess) {
    return CudaError(err, "device query");
  }
  known.emplace(device, limits);
  *out = limits;
  return ffi::Error::Success();
}

// The kernels a call runs and their plan.
struct CallPlan {
  CudaPath path;  // kBlocks or kGrid
  RecurrencePlan blocks;
  GridPlan grid;
};

// The plan for these sizes on the current device, or an error saying why there is none. The
// block kernels run wherever their plan fits and ChoosePath does not pick the grid kernels.
ffi::Error PlanFor(const Dims& d, int64_t element_bytes, CallPlan* out) {
  DeviceLimits limits;
  if (ffi::Error status = CurrentDeviceLimits(&limits); status.failure()) return status;
  if (!IndexesFit(d.T, d.N, d.D, d.H)) {
    return InvalidArgument("the CUDA handler indexes [T, N, D*H] with 32-bit integers, and "
                           "T*N*D*H = " + std::to_string(d.T * d.N * d.D * d.H) +
                           " does not fit (the lowering uses the lax.scan decomposition for it)");
  }
  std::string why;
  const std::optional<GridUse> grid = RequestedGridUse(&why);
  if (!grid) return InvalidArgument(why);
  if (ChoosePath(d.T, d.H, d.N, d.D, element_bytes, limits, *grid) == CudaPath::kGrid) {
    out->path = CudaPath::kGrid;
    out->grid =
        *PlanGrid(d.H, d.N, element_bytes, limits.multiprocessors, limits.shared_bytes);
    return ffi::Error::Success();
  }
  const std::optional<RecurrencePlan> plan =
      PlanRecurrence(d.H, d.N, d.D, element_bytes, limits.multiprocessors, limits.shared_bytes);
  if (!plan) {
    return InvalidArgument("hidden size " + std::to_string(d.H) +
                           " does not fit the CUDA handler's on-chip recurrence (the lowering "
                           "uses the lax.scan decomposition for it)");
  }
  out->path = CudaPath::kBlocks;
  out->blocks = *plan;
  return ffi::Error::Success();
}

// Runs launch(workspace) with `bytes` of device memory, stream-ordered, from a pool of the
// handler's own per device that keeps its memory between calls (the default pool gives it back
// to the driver at each synchronisation), so that XLA's allocator and other libraries' pools
// are left alone. The memory is freed after the launches on the stream.
template <typename Launch>
ffi::Error WithWorkspace(int64_t bytes, cudaStream_t stream, Launch&& launch) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return CudaError(err, "device query");
  }
  cudaMemPool_t pool = nullptr;
  {
    static std::mutex mutex;
    static std::unordered_map<int, cudaMemPool_t> pools;
    const std::lock_guard<std::mutex> lock(mutex);
    if (auto it = pools.find(device); it != pools.end()) {
      pool = it->second;
    } else {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaError_t err = cudaMemPoolCreate(&pool, &props);
      uint64_t keep = UINT64_MAX;
      if (err == cudaSuccess) {
        err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
      if (err != cudaSuccess) return CudaError(err, "workspace pool");
      pools.emplace(device, pool);
    }
  }
  void* workspace = nullptr;
  if (cudaError_t err = cudaMallocFromPoolAsync(&workspace, bytes, pool, stream);
      err != cudaSuccess) {
    return CudaError(err, "workspace allocation");
  }
  const cudaError_t launched = launch(workspace);
  const cudaError_t freed = cudaFreeAsync(workspace, stream);
  if (launched != cudaSuccess) return CudaError(launched, "grid launch");
  return freed == cudaSuccess ? ffi::Error::Success() : CudaError(freed, "workspace free");
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
    CallPlan plan;
    if (result = PlanFor(d, sizeof(T), &plan); result.failure()) return;
    const ForwardOperands<T> o = TypedOperands<T>(c, buffers, checked);
    const ForwardArgs<T> args{.source = o.x, .R = o.R, .h0 = o.h0, .mask = o.mask,
                              .seq_lengths = o.seq_lengths, .y = o.y, .z = o.z};
    if constexpr (std::is_same_v<T, float>) {  // PlanGrid plans float32 only
      if (plan.path == CudaPath::kGrid) {
        result = WithWorkspace(plan.grid.WorkspaceBytes(d.D), stream, [&](void* workspace) {
          return LaunchGridForward(c, d, plan.grid, args, workspace, stream);
        });
        return;
      }
    }
    if (cudaError_t err = LaunchForward<T>(c, d, plan.blocks, args, stream); err != cudaSuccess) {
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
    CallPlan plan;
    if (result = PlanFor(d, sizeof(T), &plan); result.failure()) return;
    const auto args_of = [&](int64_t g) {
      const GradientOperands<T> o = TypedOperands<T>(c, buffers, checked, g);
      return GradientArgs<T>{.R = o.R, .dy = o.dy, .z = o.z, .mask = o.mask,
                             .seq_lengths = o.seq_lengths, .d_source = o.dx, .dh0 = o.dh0};
    };
    if constexpr (std::is_same_v<T, float>) {  // PlanGrid plans float32 only
      if (plan.path == CudaPath::kGrid) {  // the groups one after another, in one workspace
        result = WithWorkspace(plan.grid.WorkspaceBytes(d.D), stream, [&](void* workspace) {
          cudaError_t err = cudaSuccess;
          for (int64_t g = 0; err == cudaSuccess && g < checked.G; ++g) {
            err = LaunchGridGradients(c, d, plan.grid, args_of(g), workspace, stream);
          }
          return err;
        });
        return;
      }
    }
    for (int64_t g = 0; g < checked.G; ++g) {
      if (cudaError_t err = LaunchGradients<T>(c, d, plan.blocks, args_of(g), stream);
          err != cudaSuccess) {
        result = CudaError(err, "gradients launch");
        return;
      }
    }
  });
  return status.failure() ? status : result;
}

}  // namespace

DeviceLimits LoweringDeviceLimits() {
  static const DeviceLimits smallest = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();  // no GPU here (lowering to export): not an error of a later call
      return kTypicalDevice;
    }
    DeviceLimits out{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()};
    for (int device = 0; device < count; ++device) {
      DeviceLimits limits;
      if (QueryLimits(device, &limits) != cudaSuccess) {
        cudaGetLastError();
        return kTypicalDevice;
      }
      out = {std::min(out.multiprocessors, limits.multiprocessors),
             std::min(out.shared_bytes, limits.shared_bytes)};
    }
    return out;
  }();
  return smallest;
}

std::optional<GridUse> RequestedGridUse(std::string* why) {
  static const char* const value = std::getenv("SGRNN_CUDA_GRID");
  static const std::optional<GridUse> use = ParseGridUse(value != nullptr ? value : "");
  if (!use && why != nullptr) {
    *why = "SGRNN_CUDA_GRID is '" + std::string(value) +
           "'; it must be unset, 0 (never the grid kernels) or 1 (wherever they fit)";
  }
  return use;
}

}  // namespace sgrnn::cuda

namespace sgrnn {

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaForward, cuda::ForwardImpl,
                              BindForward().Ctx<ffi::PlatformStream<cudaStream_t>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaGradients, cuda::GradientsImpl,
                              BindGradients().Ctx<ffi::PlatformStream<cudaStream_t>>());

}  // namespace sgrnn
