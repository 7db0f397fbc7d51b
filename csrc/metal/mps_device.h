// The Metal device the MPSGraph handler runs on (defined in mps_handler.mm).
#ifndef JAX_SGRNN_METAL_MPS_DEVICE_H_
#define JAX_SGRNN_METAL_MPS_DEVICE_H_

#include <string>

namespace sgrnn {

// The default Metal device's name, or "" when this machine has none (Python uses it to decide
// whether the "auto" backend picks MPSGraph).
std::string MpsDeviceName();

}  // namespace sgrnn

#endif  // JAX_SGRNN_METAL_MPS_DEVICE_H_
