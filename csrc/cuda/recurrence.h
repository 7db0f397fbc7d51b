// The sequential part of the single-gate RNN on an NVIDIA GPU: one persistent kernel launch
// runs all T steps of both directions (recurrence.cu; the split is recurrence_plan.h). The
// large matrix products around it (the input projection, dW, dR, dx) are XLA's, in the lowering.
#ifndef JAX_SGRNN_CUDA_RECURRENCE_H_
#define JAX_SGRNN_CUDA_RECURRENCE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cuda/recurrence_args.h"
#include "cuda/recurrence_plan.h"
#include "sgrnn/core.h"

namespace sgrnn::cuda {

// Enqueue the kernels on `stream`; nothing waits for them. `plan` comes from PlanRecurrence
// for these sizes. Returns the first CUDA error.
template <typename T>
cudaError_t LaunchForward(const Config& c, const Dims& d, const RecurrencePlan& plan,
                          const ForwardArgs<T>& args, cudaStream_t stream);
template <typename T>
cudaError_t LaunchGradients(const Config& c, const Dims& d, const RecurrencePlan& plan,
                            const GradientArgs<T>& args, cudaStream_t stream);

// Where the grid kernels run (recurrence_plan.h, GridUse): SGRNN_CUDA_GRID=0 or 1 in the
// environment when the extension first asks (ffi_cuda.cc), else the default; nullopt, with
// `why` set, where the variable holds any other value.
std::optional<GridUse> RequestedGridUse(std::string* why);

// The limits the lowering plans with (recurrence_plan.h, RunsOnChip): the smallest of the
// visible GPUs', asked once, or kTypicalDevice where none is visible.
DeviceLimits LoweringDeviceLimits();

// The same with each step spread over the whole GPU (grid_recurrence.cu), float32, under a
// plan from PlanGrid: `workspace` is plan.WorkspaceBytes(d.D) bytes of device memory, which
// these zero on the stream before the kernels.
cudaError_t LaunchGridForward(const Config& c, const Dims& d, const GridPlan& plan,
                              const ForwardArgs<float>& args, void* workspace,
                              cudaStream_t stream);
cudaError_t LaunchGridGradients(const Config& c, const Dims& d, const GridPlan& plan,
                                const GradientArgs<float>& args, void* workspace,
                                cudaStream_t stream);

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_RECURRENCE_H_
