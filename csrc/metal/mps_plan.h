// Every decision of the MPSGraph handler (mps_handler.mm) that is not an Apple API call: which
// overload of MPSGraph's op to call, the graph cache key, placeholder shapes, mask expansion,
// whether an XLA buffer can be wrapped without a copy, and how MPSGraph's results map onto the
// schema's outputs. Plain C++ (no Apple, no XLA headers) so that it is unit-tested on Linux
// (tests/cpp/test_mps_plan.cc).
#ifndef JAX_SGRNN_METAL_MPS_PLAN_H_
#define JAX_SGRNN_METAL_MPS_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sgrnn/core.h"

namespace sgrnn::mps {

enum class Op { kForward, kGradients };

// The three overloads each op has (the gradient op's fourth, with stateGradient, is not used:
// see the spec). Both ops pick by the same rule.
enum class Overload {
  kWithMask,       // ...inputWeight:bias:initState:mask:descriptor:name:
  kWithoutMask,    // ...inputWeight:bias:initState:descriptor:name:
  kInitStateOnly,  // ...initState:descriptor:name: (no input weight, bias or mask)
};

// Why MPSGraph cannot run a call of this config, or nothing when it can. MPSGraph's op has no
// per-row sequence lengths; the Python lowering sends such calls to the decomposition, so this
// only answers a raw custom call.
std::optional<std::string> Unsupported(const Config& c);

// The narrowest overload that takes every operand present; absent ones are passed as nil.
Overload ChooseOverload(const Config& c);

// MPSGraph's descriptor.training: the forward returns z only when asked; the gradient op
// consumes z, so its descriptor describes a training run.
bool DescriptorTraining(Op op, const Config& c);

// Every tensor the graphs take, in the order of the ops' arguments.
enum class Operand {
  kSource,
  kRecurrentWeight,
  kInputWeight,
  kBias,
  kInitState,
  kMask,
  kSourceGradient,  // gradient op only
  kZState,          // gradient op only
};
inline constexpr int kOperandCount = 8;

// Whether the op takes the operand: required ones always, optional ones when present.
bool OperandPresent(Op op, Operand operand, const Config& c);

// The operand's placeholder shape as MPSGraph wants it, for one problem (one group): R is [H, H]
// unidirectional and [2, H, H] bidirectional; the mask is always the full [T, N, D*H] (the
// handler expands it rather than relying on MPSGraph's broadcasting).
std::vector<int64_t> PlaceholderShape(Operand operand, const Config& c, const Dims& d);

int64_t ElementCount(const std::vector<int64_t>& shape);

// XLA_FFI_DataType values (xla/ffi/api/c_api.h) and MPSDataType values (MPSCoreTypes.h); the
// handler static_asserts both against the real headers.
inline constexpr int32_t kFfiF16 = 10;
inline constexpr int32_t kFfiF32 = 11;
inline constexpr uint32_t kMpsFloat16 = 0x10000010;  // MPSDataTypeFloatBit | 16
inline constexpr uint32_t kMpsFloat32 = 0x10000020;  // MPSDataTypeFloatBit | 32

struct ElementType {
  uint32_t mps_data_type;
  size_t bytes;
};

// float32 and float16 only: the lowering widens bfloat16 and sends float64 to the CPU handler.
std::optional<ElementType> ElementTypeFor(int32_t ffi_dtype);

// Everything a built graph depends on. The mask's broadcast shape is not part of it: the
// handler always feeds the expanded mask.
struct GraphKey {
  Op op;
  uint32_t mps_data_type;
  Config config;  // training: the descriptor's (DescriptorTraining)
  int64_t T, N, I, H;

  bool operator==(const GraphKey&) const = default;
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const;
};

GraphKey MakeGraphKey(Op op, const Config& c, const Dims& d, uint32_t mps_data_type);

// T = 0, N = 0 or no groups: no graph runs; every output is zero-filled (empty outputs stay
// empty, weight gradients are zero).
bool IsEmptyProblem(const Dims& d, int64_t groups);

// mask_tnh is the mask's [Tm, Nm, Hm], each 1 or the full size (as CheckForward/CheckGradients
// guarantee). A full mask is fed as it is.
bool MaskIsFull(const int64_t mask_tnh[3], const Dims& d);

// Writes the mask broadcast to the full [T, N, D*H] into `out` (T*N*D*H elements). Elements are
// copied as bit patterns of `element_bytes` (2 or 4), with MaskView's stride rule.
void ExpandMask(const void* mask, const int64_t mask_tnh[3], const Dims& d, size_t element_bytes,
                void* out);

// How one XLA buffer reaches the GPU: wrapped in place (newBufferWithBytesNoCopy needs a
// page-aligned address and a non-zero page-multiple length), or through a staging copy.
enum class BufferPlan { kWrap, kStage };

BufferPlan PlanBuffer(uintptr_t address, size_t bytes, size_t page_size);

// One entry of MPSGraph's result list: which schema output it fills and how many elements it
// has per problem. The handler reshapes each result to this flat size, which also turns the
// bias gradient's [1, 1, D*H] into the schema's [D*H] and R's [H, H] into [1, H, H].
struct ResultSlot {
  int output;  // index into the op's FFI results (forward: y, z; gradients: dx, dR, dW, db, dh0)
  int64_t elements;
};

// MPSGraph's results in its order: forward y, then z when training; gradients d source, d R,
// then d W, d b, d h0 for the inputs given [hdr].
std::vector<ResultSlot> ExpectedResults(Op op, const Config& c, const Dims& d);

const char* OutputName(Op op, int output);

// Checks the shapes MPSGraph reports for its results against `expected`. A negative dimension
// (dynamic) or an empty shape (unranked) counts as unknown and is refused: reshaping a tensor
// of the wrong size aborts inside MPSGraph instead of raising. Returns "" or what is wrong;
// `output`, when given, gets the schema output at fault (-1: the number of results).
std::string CheckResultShapes(Op op, const std::vector<ResultSlot>& expected,
                              const std::vector<std::vector<int64_t>>& shapes,
                              int* output = nullptr);

}  // namespace sgrnn::mps

#endif  // JAX_SGRNN_METAL_MPS_PLAN_H_
