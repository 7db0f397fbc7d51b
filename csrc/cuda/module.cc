// The Python module of the CUDA backend: its registrations() and the question the lowering
// asks before choosing it (whether a hidden size fits the on-chip recurrence). It imports
// without a GPU or driver (the CUDA runtime is linked statically and loads the driver on first
// use), so programs can be lowered for cuda anywhere the package was built with nvcc.
#include <cstdint>

#include "cuda/recurrence_plan.h"
#include "pybind11/pybind11.h"
#include "sgrnn/handlers.h"
#include "sgrnn/module.h"
#include "sgrnn/targets.h"

PYBIND11_MODULE(_sgrnn_cuda, m) {
  m.doc() = "jax_sgrnn's XLA FFI handlers for the CUDA platform";
  sgrnn::DefineRegistrations(m, sgrnn::kCudaTargets, sgrnn::CudaForward, sgrnn::CudaGradients);
  m.def(
      "recurrence_fits",
      [](int64_t hidden, int64_t itemsize, bool gradients) {
        return sgrnn::cuda::BlockShape(hidden, itemsize, gradients).has_value();
      },
      pybind11::arg("hidden"), pybind11::arg("itemsize"), pybind11::arg("gradients"),
      "Whether R of this hidden size and element size stays on chip in the forward (or, with "
      "gradients, the gradient) kernel; larger sizes lower to the lax.scan decomposition.");
}
