// Unit test of csrc/metal/mps_plan.{h,cc}, the MPSGraph handler's decisions, on any machine.
// Built and run by tests/test_cpp_units.py; prints each failed check and exits non-zero.
#include "metal/mps_plan.h"

#include "checks.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

using namespace sgrnn;
using namespace sgrnn::mps;

using unit_test::Check;

std::string Str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

Config MakeConfig(bool bidirectional, bool W, bool b, bool h0, bool mask, bool training = false) {
  return Config{Activation::kTanh, false, bidirectional, training, W, b, h0, mask};
}

Dims MakeDims(const Config& c, int64_t T = 3, int64_t N = 2, int64_t I = 5, int64_t H = 4) {
  const int64_t D = c.bidirectional ? 2 : 1;
  return Dims{T, N, c.has_input_weight ? I : D * H, H, D};
}

// The operands each overload's signature has a slot for (besides source and weights).
bool Accepts(Overload o, Operand operand) {
  switch (operand) {
    case Operand::kInitState: return true;
    case Operand::kInputWeight:
    case Operand::kBias: return o != Overload::kInitStateOnly;
    case Operand::kMask: return o == Overload::kWithMask;
    default: return true;
  }
}

void TestOverloads() {
  // Narrowest first: the chosen overload takes every operand present and no narrower one does.
  const Overload by_width[] = {Overload::kInitStateOnly, Overload::kWithoutMask,
                               Overload::kWithMask};
  const Operand optional[] = {Operand::kInputWeight, Operand::kBias, Operand::kInitState,
                              Operand::kMask};
  for (int pattern = 0; pattern < 16; ++pattern) {
    const Config c = MakeConfig(false, pattern & 1, pattern & 2, pattern & 4, pattern & 8);
    auto takes_all = [&](Overload o) {
      for (Operand operand : optional) {
        if (OperandPresent(Op::kForward, operand, c) && !Accepts(o, operand)) return false;
      }
      return true;
    };
    Overload narrowest = Overload::kWithMask;
    for (Overload o : by_width) {
      if (takes_all(o)) {
        narrowest = o;
        break;
      }
    }
    const Overload chosen = ChooseOverload(c);
    Check(chosen == narrowest && takes_all(chosen),
          "overload for presence pattern " + std::to_string(pattern) + ": got " +
              std::to_string(static_cast<int>(chosen)) + ", want " +
              std::to_string(static_cast<int>(narrowest)));
  }
}

void TestOperandsAndTraining() {
  for (int pattern = 0; pattern < 16; ++pattern) {
    const Config c = MakeConfig(false, pattern & 1, pattern & 2, pattern & 4, pattern & 8);
    for (Op op : {Op::kForward, Op::kGradients}) {
      const bool g = op == Op::kGradients;
      const bool want[kOperandCount] = {true, true, c.has_input_weight, c.has_bias,
                                        c.has_init_state, c.has_mask, g, g};
      for (int i = 0; i < kOperandCount; ++i) {
        Check(OperandPresent(op, static_cast<Operand>(i), c) == want[i],
              "OperandPresent op " + std::to_string(g) + " operand " + std::to_string(i) +
                  " pattern " + std::to_string(pattern));
      }
    }
  }
  for (bool training : {false, true}) {
    Config c = MakeConfig(false, true, true, true, true, training);
    Check(DescriptorTraining(Op::kForward, c) == training, "forward descriptor.training");
    Check(DescriptorTraining(Op::kGradients, c), "gradient descriptor.training is YES");
  }
}

void TestGraphKey() {
  const Config c = MakeConfig(false, true, true, true, true);
  const Dims d = MakeDims(c);
  const GraphKey base = MakeGraphKey(Op::kForward, c, d, kMpsFloat32);
  Check(base == MakeGraphKey(Op::kForward, c, d, kMpsFloat32), "equal inputs, equal keys");
  Check(GraphKeyHash{}(base) == GraphKeyHash{}(MakeGraphKey(Op::kForward, c, d, kMpsFloat32)),
        "equal keys, equal hashes");

  std::vector<std::pair<std::string, GraphKey>> variants;
  auto with_config = [&](const std::string& name, auto change) {
    Config v = c;
    change(v);
    variants.push_back({name, MakeGraphKey(Op::kForward, v, MakeDims(v), kMpsFloat32)});
  };
  with_config("activation", [](Config& v) { v.activation = Activation::kRelu; });
  with_config("reverse", [](Config& v) { v.reverse = true; });
  with_config("bidirectional", [](Config& v) { v.bidirectional = true; });
  with_config("training", [](Config& v) { v.training = true; });
  with_config("has_input_weight", [](Config& v) { v.has_input_weight = false; });
  with_config("has_bias", [](Config& v) { v.has_bias = false; });
  with_config("has_init_state", [](Config& v) { v.has_init_state = false; });
  with_config("has_mask", [](Config& v) { v.has_mask = false; });
  variants.push_back({"op", MakeGraphKey(Op::kGradients, c, d, kMpsFloat32)});
  variants.push_back({"dtype", MakeGraphKey(Op::kForward, c, d, kMpsFloat16)});
  const int64_t Ts[] = {d.T + 1, d.T, d.T, d.T}, Ns[] = {d.N, d.N + 1, d.N, d.N},
                Is[] = {d.I, d.I, d.I + 1, d.I}, Hs[] = {d.H, d.H, d.H, d.H + 1};
  const char* dim_names[] = {"T", "N", "I", "H"};
  for (int i = 0; i < 4; ++i) {
    const Dims changed{Ts[i], Ns[i], Is[i], Hs[i], 1};
    variants.push_back({dim_names[i], MakeGraphKey(Op::kForward, c, changed, kMpsFloat32)});
  }
  std::unordered_set<size_t> hashes{GraphKeyHash{}(base)};
  for (const auto& [name, key] : variants) {
    Check(!(key == base), "keys differing in " + name + " compare unequal");
    Check(hashes.insert(GraphKeyHash{}(key)).second, "hash of the key differing in " + name +
                                                          " collides with another");
  }

  // The gradient descriptor's training is always YES: Config.training does not split its graphs.
  Config trained = c;
  trained.training = true;
  Check(MakeGraphKey(Op::kGradients, c, d, kMpsFloat32) ==
            MakeGraphKey(Op::kGradients, trained, d, kMpsFloat32),
        "gradient keys ignore Config.training");
}

void TestPlaceholderShapes() {
  for (bool bi : {false, true}) {
    for (bool W : {false, true}) {
      const Config c = MakeConfig(bi, W, true, true, true);
      const Dims d = MakeDims(c, 3, 2, 5, 4);
      const int64_t DH = bi ? 8 : 4, I = W ? 5 : DH;
      const std::string tag = std::string(bi ? " bi" : " uni") + (W ? " with W" : " without W");
      const std::vector<int64_t> R =
          bi ? std::vector<int64_t>{2, 4, 4} : std::vector<int64_t>{4, 4};
      const std::vector<std::pair<Operand, std::vector<int64_t>>> want = {
          {Operand::kSource, {3, 2, I}},       {Operand::kRecurrentWeight, R},
          {Operand::kInputWeight, {DH, I}},    {Operand::kBias, {DH}},
          {Operand::kInitState, {2, DH}},      {Operand::kMask, {3, 2, DH}},
          {Operand::kSourceGradient, {3, 2, DH}}, {Operand::kZState, {3, 2, DH}}};
      for (const auto& [operand, shape] : want) {
        const std::vector<int64_t> got = PlaceholderShape(operand, c, d);
        Check(got == shape, "placeholder shape of operand " +
                                std::to_string(static_cast<int>(operand)) + tag + ": got " +
                                Str(got) + ", want " + Str(shape));
      }
    }
  }
  Check(ElementCount({3, 2, 5}) == 30 && ElementCount({7}) == 7, "ElementCount");
}

template <typename Bits>
void CheckMaskPattern(bool bi, int pattern) {
  const Config c = MakeConfig(bi, true, true, true, true);
  const Dims d = MakeDims(c, 3, 4, 5, 3);
  const int64_t tnh[3] = {pattern & 1 ? d.T : 1, pattern & 2 ? d.N : 1, pattern & 4 ? d.DH() : 1};
  std::vector<Bits> mask(tnh[0] * tnh[1] * tnh[2]);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = static_cast<Bits>(0x3c00 + 7 * i + 1);
  std::vector<Bits> got(d.T * d.N * d.DH(), 0), want(got.size());
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t n = 0; n < d.N; ++n) {
      for (int64_t h = 0; h < d.DH(); ++h) {
        const int64_t src = ((tnh[0] == 1 ? 0 : t) * tnh[1] + (tnh[1] == 1 ? 0 : n)) * tnh[2] +
                            (tnh[2] == 1 ? 0 : h);
        want[(t * d.N + n) * d.DH() + h] = mask[src];
      }
    }
  }
  ExpandMask(mask.data(), tnh, d, sizeof(Bits), got.data());
  const std::string tag = std::string(bi ? "bi" : "uni") + " mask shape " +
                          Str({tnh[0], tnh[1], tnh[2]}) + " element bytes " +
                          std::to_string(sizeof(Bits));
  Check(got == want, "ExpandMask " + tag);
  Check(MaskIsFull(tnh, d) == (pattern == 7), "MaskIsFull " + tag);
}

void TestMaskExpansion() {
  for (bool bi : {false, true}) {
    for (int pattern = 0; pattern < 8; ++pattern) {
      CheckMaskPattern<uint16_t>(bi, pattern);
      CheckMaskPattern<uint32_t>(bi, pattern);
    }
  }
}

void TestBufferPlan() {
  struct Case {
    uintptr_t address;
    size_t bytes, page;
    BufferPlan want;
    const char* what;
  };
  const Case cases[] = {
      {0x100000000, 16384, 16384, BufferPlan::kWrap, "aligned, one page"},
      {0x100004000, 3 * 16384, 16384, BufferPlan::kWrap, "aligned, three pages"},
      {0x100000040, 16384, 16384, BufferPlan::kStage, "64-byte aligned address"},
      {0x100001000, 16384, 16384, BufferPlan::kStage, "4 KiB aligned on 16 KiB pages"},
      {0x100001000, 4096, 4096, BufferPlan::kWrap, "4 KiB pages"},
      {0x100000000, 16384 + 4, 16384, BufferPlan::kStage, "length not a page multiple"},
      {0x100000000, 100, 16384, BufferPlan::kStage, "length under a page"},
      {0x100000000, 0, 16384, BufferPlan::kStage, "zero length"},
      {0x100000000, 16384, 0, BufferPlan::kStage, "unknown page size"},
  };
  for (const Case& k : cases) Check(PlanBuffer(k.address, k.bytes, k.page) == k.want, k.what);
}

// The shapes MPSGraph is documented [hdr] or observed [impl] to return, in its order.
std::vector<std::vector<int64_t>> MpsGraphGradientShapes(const Config& c, const Dims& d) {
  std::vector<std::vector<int64_t>> shapes{{d.T, d.N, d.I}};
  shapes.push_back(c.bidirectional ? std::vector<int64_t>{2, d.H, d.H}
                                   : std::vector<int64_t>{d.H, d.H});
  if (c.has_input_weight) shapes.push_back({d.DH(), d.I});
  if (c.has_bias) shapes.push_back({1, 1, d.DH()});  // [impl]: [1, 1, D*H], not [D*H]
  if (c.has_init_state) shapes.push_back({d.N, d.DH()});
  return shapes;
}

void TestGradientResults() {
  for (bool bi : {false, true}) {
    for (int pattern = 0; pattern < 8; ++pattern) {
      const Config c = MakeConfig(bi, pattern & 1, pattern & 2, pattern & 4, false);
      const Dims d = MakeDims(c, 3, 2, 5, 4);
      const std::string tag =
          std::string(bi ? "bi" : "uni") + " pattern " + std::to_string(pattern);
      std::vector<ResultSlot> want{{0, d.T * d.N * d.I}, {1, d.D * d.H * d.H}};
      if (c.has_input_weight) want.push_back({2, d.DH() * d.I});
      if (c.has_bias) want.push_back({3, d.DH()});
      if (c.has_init_state) want.push_back({4, d.N * d.DH()});
      const std::vector<ResultSlot> got = ExpectedResults(Op::kGradients, c, d);
      bool same = got.size() == want.size();
      for (size_t i = 0; same && i < got.size(); ++i) {
        same = got[i].output == want[i].output && got[i].elements == want[i].elements;
      }
      Check(same, "gradient result slots " + tag);

      auto shapes = MpsGraphGradientShapes(c, d);
      Check(CheckResultShapes(Op::kGradients, got, shapes).empty(),
            "MPSGraph's gradient shapes accepted " + tag + ": " +
                CheckResultShapes(Op::kGradients, got, shapes));

      auto fewer = shapes;
      fewer.pop_back();
      int at_fault = 0;
      const std::string count_error = CheckResultShapes(Op::kGradients, got, fewer, &at_fault);
      Check(count_error.find("returned " + std::to_string(fewer.size()) + " results") !=
                    std::string::npos && at_fault == -1,
            "a missing result is an error of no one output " + tag + ": " + count_error);
      auto more = shapes;
      more.push_back({1});
      Check(!CheckResultShapes(Op::kGradients, got, more).empty(),
            "an extra result is an error " + tag);

      auto wrong = shapes;
      wrong.back().back() += 1;
      const std::string size_error = CheckResultShapes(Op::kGradients, got, wrong, &at_fault);
      Check(size_error.find(OutputName(Op::kGradients, got.back().output)) != std::string::npos &&
                at_fault == got.back().output,
            "a wrong size names the output " + tag + ": " + size_error);
      CheckResultShapes(Op::kGradients, got, shapes, &at_fault);
      Check(at_fault == -1, "no output at fault when the shapes are right " + tag);

      auto dynamic = shapes;
      dynamic[0][0] = -1;
      Check(CheckResultShapes(Op::kGradients, got, dynamic).find("no static shape") !=
                std::string::npos,
            "a dynamic dimension is refused " + tag);
      auto unranked = shapes;
      unranked[1].clear();
      Check(CheckResultShapes(Op::kGradients, got, unranked).find("d_recurrent_weight") !=
                std::string::npos,
            "an unranked result is refused " + tag);
    }
  }
}

void TestForwardResults() {
  for (bool training : {false, true}) {
    const Config c = MakeConfig(true, true, true, true, true, training);
    const Dims d = MakeDims(c);
    const std::vector<ResultSlot> got = ExpectedResults(Op::kForward, c, d);
    const int64_t state = d.T * d.N * d.DH();
    Check(got.size() == (training ? 2u : 1u) && got[0].output == 0 && got[0].elements == state &&
              (!training || (got[1].output == 1 && got[1].elements == state)),
          "forward result slots, training " + std::to_string(training));
    std::vector<std::vector<int64_t>> shapes(got.size(), {d.T, d.N, d.DH()});
    Check(CheckResultShapes(Op::kForward, got, shapes).empty(), "forward shapes accepted");
  }
  Check(std::string(OutputName(Op::kForward, 1)) == "z" &&
            std::string(OutputName(Op::kGradients, 3)) == "d_bias",
        "output names");
}

void TestElementTypes() {
  const auto f32 = ElementTypeFor(kFfiF32), f16 = ElementTypeFor(kFfiF16);
  Check(f32 && f32->mps_data_type == 0x10000020u && f32->bytes == 4,
        "float32 -> MPSDataTypeFloat32");
  Check(f16 && f16->mps_data_type == 0x10000010u && f16->bytes == 2,
        "float16 -> MPSDataTypeFloat16");
  // XLA_FFI_DataType: PRED 1, S32 4, F64 12, C64 15, BF16 16; none is taken.
  for (int32_t other : {0, 1, 4, 12, 15, 16}) {
    Check(!ElementTypeFor(other), "dtype " + std::to_string(other) + " refused");
  }
}

void TestUnsupported() {
  Config c = MakeConfig(true, true, true, true, true, true);
  Check(!Unsupported(c), "every MPSGraph operand pattern is supported");
  c.has_seq_lengths = true;
  const std::optional<std::string> why = Unsupported(c);
  Check(why && why->find("seq_lengths") != std::string::npos,
        "seq_lengths is refused, naming the operand");
}

void TestEmptyProblem() {
  Check(IsEmptyProblem(Dims{0, 2, 3, 4, 1}, 1), "T = 0 is empty");
  Check(IsEmptyProblem(Dims{2, 0, 3, 4, 1}, 1), "N = 0 is empty");
  Check(IsEmptyProblem(Dims{2, 2, 3, 4, 1}, 0), "no groups is empty");
  Check(!IsEmptyProblem(Dims{1, 1, 1, 1, 2}, 1), "T = N = 1 is not empty");
}

}  // namespace

int main() {
  TestOverloads();
  TestOperandsAndTraining();
  TestGraphKey();
  TestPlaceholderShapes();
  TestMaskExpansion();
  TestBufferPlan();
  TestGradientResults();
  TestForwardResults();
  TestElementTypes();
  TestEmptyProblem();
  TestUnsupported();
  return unit_test::Report();
}
