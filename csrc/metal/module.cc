// The Python module _sgrnn_mps: the MPSGraph handlers' registrations and the Metal device name.
#include "metal/mps_device.h"
#include "pybind11/pybind11.h"
#include "sgrnn/handlers.h"
#include "sgrnn/module.h"
#include "sgrnn/targets.h"

PYBIND11_MODULE(_sgrnn_mps, m) {
  m.doc() = "jax_sgrnn's XLA FFI handlers that run MPSGraph's single-gate RNN on the Apple GPU";
  sgrnn::DefineRegistrations(m, sgrnn::kMpsTargets, sgrnn::MpsForward, sgrnn::MpsGradients);
  m.def("device_name", &sgrnn::MpsDeviceName,
        "The default Metal device's name, or '' when there is none.");
}
