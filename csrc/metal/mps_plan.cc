#include "metal/mps_plan.h"

#include <cstring>
#include <functional>

namespace sgrnn::mps {

std::optional<std::string> Unsupported(const Config& c) {
  if (c.has_seq_lengths) {
    return "seq_lengths: MPSGraph's single-gate RNN has no per-row lengths (the lowering runs "
           "such calls on the lax.scan decomposition)";
  }
  return std::nullopt;
}

Overload ChooseOverload(const Config& c) {
  if (c.has_mask) return Overload::kWithMask;
  if (c.has_input_weight || c.has_bias) return Overload::kWithoutMask;
  return Overload::kInitStateOnly;
}

bool DescriptorTraining(Op op, const Config& c) { return op == Op::kGradients || c.training; }

bool OperandPresent(Op op, Operand operand, const Config& c) {
  switch (operand) {
    case Operand::kSource:
    case Operand::kRecurrentWeight: return true;
    case Operand::kInputWeight: return c.has_input_weight;
    case Operand::kBias: return c.has_bias;
    case Operand::kInitState: return c.has_init_state;
    case Operand::kMask: return c.has_mask;
    case Operand::kSourceGradient:
    case Operand::kZState: return op == Op::kGradients;
  }
  return false;
}

std::vector<int64_t> PlaceholderShape(Operand operand, const Config& c, const Dims& d) {
  switch (operand) {
    case Operand::kSource: return {d.T, d.N, d.I};
    case Operand::kRecurrentWeight:
      return c.bidirectional ? std::vector<int64_t>{2, d.H, d.H} : std::vector<int64_t>{d.H, d.H};
    case Operand::kInputWeight: return {d.DH(), d.I};
    case Operand::kBias: return {d.DH()};
    case Operand::kInitState: return {d.N, d.DH()};
    case Operand::kMask:
    case Operand::kSourceGradient:
    case Operand::kZState: return {d.T, d.N, d.DH()};
  }
  return {};
}

int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::optional<ElementType> ElementTypeFor(int32_t ffi_dtype) {
  switch (ffi_dtype) {
    case kFfiF32: return ElementType{kMpsFloat32, 4};
    case kFfiF16: return ElementType{kMpsFloat16, 2};
    default: return std::nullopt;
  }
}

size_t GraphKeyHash::operator()(const GraphKey& k) const {
  size_t h = 0;
  auto mix = [&h](uint64_t v) {
    h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  };
  mix(static_cast<uint64_t>(k.op));
  mix(k.mps_data_type);
  const Config& c = k.config;
  mix(static_cast<uint64_t>(c.activation));
  uint64_t flags = 0;
  for (bool flag : {c.reverse, c.bidirectional, c.training, c.has_input_weight, c.has_bias,
                    c.has_init_state, c.has_mask, c.has_seq_lengths}) {
    flags = flags << 1 | flag;
  }
  mix(flags);
  for (int64_t v : {k.T, k.N, k.I, k.H}) mix(static_cast<uint64_t>(v));
  return h;
}

GraphKey MakeGraphKey(Op op, const Config& c, const Dims& d, uint32_t mps_data_type) {
  Config config = c;
  config.training = DescriptorTraining(op, c);
  return GraphKey{op, mps_data_type, config, d.T, d.N, d.I, d.H};
}

bool IsEmptyProblem(const Dims& d, int64_t groups) { return d.T == 0 || d.N == 0 || groups == 0; }

bool MaskIsFull(const int64_t mask_tnh[3], const Dims& d) {
  return mask_tnh[0] == d.T && mask_tnh[1] == d.N && mask_tnh[2] == d.DH();
}

namespace {

template <typename Bits>
void ExpandMaskAs(const Bits* mask, const int64_t mask_tnh[3], const Dims& d, Bits* out) {
  const MaskView<Bits> view(mask, mask_tnh[0], mask_tnh[1], mask_tnh[2]);
  for (int64_t t = 0; t < d.T; ++t) view.Expand(t, 0, 0, d.N, d.DH(), out + t * d.N * d.DH());
}

}  // namespace

void ExpandMask(const void* mask, const int64_t mask_tnh[3], const Dims& d, size_t element_bytes,
                void* out) {
  if (element_bytes == 2) {
    ExpandMaskAs(static_cast<const uint16_t*>(mask), mask_tnh, d, static_cast<uint16_t*>(out));
  } else {
    ExpandMaskAs(static_cast<const uint32_t*>(mask), mask_tnh, d, static_cast<uint32_t*>(out));
  }
}

BufferPlan PlanBuffer(uintptr_t address, size_t bytes, size_t page_size) {
  const bool wrappable = page_size > 0 && bytes > 0 && address % page_size == 0 &&
                         bytes % page_size == 0;
  return wrappable ? BufferPlan::kWrap : BufferPlan::kStage;
}

std::vector<ResultSlot> ExpectedResults(Op op, const Config& c, const Dims& d) {
  const int64_t state = d.T * d.N * d.DH();
  if (op == Op::kForward) {
    std::vector<ResultSlot> slots{{0, state}};
    if (c.training) slots.push_back({1, state});
    return slots;
  }
  std::vector<ResultSlot> slots{{0, d.T * d.N * d.I}, {1, d.D * d.H * d.H}};
  if (c.has_input_weight) slots.push_back({2, d.DH() * d.I});
  if (c.has_bias) slots.push_back({3, d.DH()});
  if (c.has_init_state) slots.push_back({4, d.N * d.DH()});
  return slots;
}

const char* OutputName(Op op, int output) {
  static const char* const kForward[] = {"y", "z"};
  static const char* const kGradients[] = {"d_source", "d_recurrent_weight", "d_input_weight",
                                           "d_bias", "d_init_state"};
  if (op == Op::kForward) return output >= 0 && output < 2 ? kForward[output] : "?";
  return output >= 0 && output < 5 ? kGradients[output] : "?";
}

std::string CheckResultShapes(Op op, const std::vector<ResultSlot>& expected,
                              const std::vector<std::vector<int64_t>>& shapes, int* output) {
  const char* what = op == Op::kForward ? "singleGateRNN" : "singleGateRNNGradients";
  int at_fault = -1;
  if (output == nullptr) output = &at_fault;
  *output = -1;
  if (shapes.size() != expected.size()) {
    return std::string("MPSGraph's ") + what + " returned " + std::to_string(shapes.size()) +
           " results, expected " + std::to_string(expected.size());
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    const std::string name = OutputName(op, expected[i].output);
    *output = expected[i].output;
    bool known = !shapes[i].empty();
    for (int64_t s : shapes[i]) known = known && s >= 0;
    if (!known) {
      return std::string("MPSGraph's ") + what + " result " + std::to_string(i) + " (" + name +
             ") has no static shape";
    }
    if (ElementCount(shapes[i]) != expected[i].elements) {
      return std::string("MPSGraph's ") + what + " result " + std::to_string(i) + " (" + name +
             ") has " + std::to_string(ElementCount(shapes[i])) + " elements, expected " +
             std::to_string(expected[i].elements);
    }
  }
  *output = -1;
  return "";
}

}  // namespace sgrnn::mps
