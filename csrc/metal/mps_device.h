// What mps_handler.mm offers the Python module besides its handlers: the Metal device it runs
// on, and the self-check of MPSGraph against the semantics (self_check.h) through it.
#ifndef JAX_SGRNN_METAL_MPS_DEVICE_H_
#define JAX_SGRNN_METAL_MPS_DEVICE_H_

#include <string>

#include "metal/self_check.h"

namespace sgrnn {

// The default Metal device's name, or "" when this machine has none (Python uses it to decide
// whether the "auto" backend picks MPSGraph).
std::string MpsDeviceName();

// Runs the self-check's problems through the MPSGraph handler.
mps::Report MpsSelfCheck();

}  // namespace sgrnn

#endif  // JAX_SGRNN_METAL_MPS_DEVICE_H_
