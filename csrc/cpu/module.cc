// The Python module of the native CPU backend: its registrations(), the target names of every
// backend (so Python can lower for a backend whose module is not built here), stand-in
// handlers for such backends, and the instruction-set build in use.
#include <cstddef>
#include <string>
#include <utility>

#include "cpu/blas.h"
#include "cpu/kernels.h"
#include "pybind11/pybind11.h"
#include "sgrnn/ffi_dispatch.h"
#include "sgrnn/ffi_schema.h"
#include "sgrnn/handlers.h"
#include "sgrnn/module.h"
#include "sgrnn/targets.h"

namespace py = pybind11;

namespace sgrnn {
namespace {

// Registered under the targets of a backend whose module did not load, so that running a
// program lowered for it (jax_sgrnn.set_cpu_backend) fails with an FFI error naming the
// backend, instead of XLA's "no registered implementation".
template <size_t kBackend>
struct MissingBackend {
  static ffi::Error Fail() {
    const std::string name = kAllTargets[kBackend].backend;
    return Failure(ffi::ErrorCode::kFailedPrecondition,
                   "this program was lowered for the '" + name +
                       "' backend, whose handler is not available in this process; "
                       "jax_sgrnn.backends()['" + name + "'].reason says why. Choose "
                       "another with jax_sgrnn.set_cpu_backend() or jax_sgrnn.cpu_backend().");
  }
  using Buf = ffi::AnyBuffer;
  using Out = ffi::Result<ffi::AnyBuffer>;
  static ffi::Error Forward(Buf, Buf, Buf, Buf, Buf, Buf, Buf, Config, Out, Out) {
    return Fail();
  }
  static ffi::Error Gradients(Buf, Buf, Buf, Buf, Buf, Buf, Buf, Buf, Buf, Config, Out, Out,
                              Out, Out, Out) {
    return Fail();
  }
  static XLA_FFI_Error* ForwardHandler(XLA_FFI_CallFrame* frame) {
    static auto* handler = BindForward().To(Forward).release();
    return handler->Call(frame);
  }
  static XLA_FFI_Error* GradientsHandler(XLA_FFI_CallFrame* frame) {
    static auto* handler = BindGradients().To(Gradients).release();
    return handler->Call(frame);
  }
};

template <size_t... kBackends>
py::dict MissingBackendRegistrations(std::index_sequence<kBackends...>) {
  py::dict out;
  ((out[kAllTargets[kBackends].backend] = py::make_tuple(
        EncapsulateHandler(MissingBackend<kBackends>::ForwardHandler),
        EncapsulateHandler(MissingBackend<kBackends>::GradientsHandler))),
   ...);
  return out;
}

}  // namespace
}  // namespace sgrnn

PYBIND11_MODULE(_sgrnn_cpu, m) {
  m.doc() = "jax_sgrnn's native XLA FFI handlers for the CPU platform";
  // Parallel work goes through XLA's thread pool (the handlers' Executor); a second pool
  // inside the BLAS would oversubscribe the cores.
  sgrnn::cpu::MakeBlasSingleThreaded();
  sgrnn::DefineRegistrations(m, sgrnn::kNativeTargets, sgrnn::NativeForward,
                             sgrnn::NativeGradients);
  m.def(
      "target_names",
      []() {
        py::dict table;
        for (const sgrnn::TargetNames& t : sgrnn::kAllTargets) {
          py::dict roles;
          roles["forward"] = t.forward;
          roles["gradients"] = t.gradients;
          table[t.backend] = roles;
        }
        return table;
      },
      "backend name -> {'forward': target, 'gradients': target}, for every backend.");
  m.def(
      "missing_backend_handlers",
      []() {
        return sgrnn::MissingBackendRegistrations(
            std::make_index_sequence<std::size(sgrnn::kAllTargets)>());
      },
      "backend name -> (forward, gradients) capsules of handlers that return an error saying "
      "that backend is not available; registered for backends whose module did not load.");
  m.def("selected_isa", &sgrnn::cpu::SelectedIsa,
        "The instruction-set build of the CPU kernels in use (SGRNN_CPU_ISA overrides).");
  m.def("set_phase_timing", &sgrnn::cpu::SetPhaseTiming, py::arg("on"),
        "Turns the kernels' per-phase wall-time counters on or off (off by default).");
  m.def(
      "take_phase_times",
      []() {
        double seconds[sgrnn::cpu::kPhaseCount];
        sgrnn::cpu::TakePhaseTimes(seconds);
        py::dict out;
        const char* names[] = {"projection", "recurrence", "backward_recurrence",
                               "weight_gradients", "input_gradient"};
        for (int i = 0; i < sgrnn::cpu::kPhaseCount; ++i) out[names[i]] = seconds[i];
        return out;
      },
      "Seconds per kernel phase since the last call, which resets them.");
}
