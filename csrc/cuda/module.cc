// The Python module of the CUDA backend: its registrations() and the question the lowering
// asks before choosing it (whether the on-chip recurrence runs, and pays, at these sizes). It
// imports without a GPU or driver (the CUDA runtime is linked statically and loads the driver on first
// use), so programs can be lowered for cuda anywhere the package was built with nvcc.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/recurrence.h"
#include "cuda/recurrence_plan.h"
#include "pybind11/pybind11.h"
#include "sgrnn/handlers.h"
#include "sgrnn/module.h"
#include "sgrnn/targets.h"

PYBIND11_MODULE(_sgrnn_cuda, m) {
  m.doc() = "jax_sgrnn's XLA FFI handlers for the CUDA platform";
  sgrnn::DefineRegistrations(m, sgrnn::kCudaTargets, sgrnn::CudaForward, sgrnn::CudaGradients);
  m.def(
      "runs_on_chip",
      [](int64_t steps, int64_t hidden, int64_t batch, int64_t directions, int64_t itemsize) {
        std::string why;
        const std::optional<sgrnn::cuda::GridUse> grid = sgrnn::cuda::RequestedGridUse(&why);
        if (!grid) throw std::invalid_argument(why);  // ValueError at trace time
        return sgrnn::cuda::RunsOnChip(steps, hidden, batch, directions, itemsize, *grid,
                                       sgrnn::cuda::LoweringDeviceLimits());
      },
      pybind11::arg("steps"), pybind11::arg("hidden"), pybind11::arg("batch"),
      pybind11::arg("directions"), pybind11::arg("itemsize"),
      "Whether the recurrence kernels (the forward's and the gradient op's share one plan) "
      "run these sizes and are expected to beat the lax.scan decomposition for this batch "
      "on every visible GPU (csrc/cuda/recurrence_plan.h, RunsOnChip; SGRNN_CUDA_GRID=0 or 1 "
      "changes where the grid kernels count, GridUse); otherwise the lowering uses the latter.");
}
