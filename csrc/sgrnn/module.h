// What every extension module exports to Python: registrations() (target name -> handler
// capsule, as in JAX's FFI examples) for its entry of targets.h.
#ifndef JAX_SGRNN_MODULE_H_
#define JAX_SGRNN_MODULE_H_

#include <type_traits>

#include "pybind11/pybind11.h"
#include "sgrnn/targets.h"
#include "xla/ffi/api/c_api.h"

namespace sgrnn {

// A handler as the capsule jax.ffi.register_ffi_target takes; anything but an FFI handler
// fails to compile instead of crashing XLA.
template <typename F>
pybind11::capsule EncapsulateHandler(F* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, F, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes an XLA_FFI_CallFrame* and returns XLA_FFI_Error*");
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}

// Adds registrations() to `m`: the backend's two targets under their names from targets.h.
inline void DefineRegistrations(pybind11::module_& m, const TargetNames& names,
                                XLA_FFI_Handler* forward, XLA_FFI_Handler* gradients) {
  m.def(
      "registrations",
      [names, forward, gradients]() {
        pybind11::dict targets;
        targets[names.forward] = EncapsulateHandler(forward);
        targets[names.gradients] = EncapsulateHandler(gradients);
        return targets;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
}

}  // namespace sgrnn

#endif  // JAX_SGRNN_MODULE_H_
