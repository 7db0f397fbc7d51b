// Unit test of csrc/metal/self_check.{h,cc}, the MPSGraph backend's self-check, on any machine:
// with the native CPU kernels as the runner every fact passes; with runners that are wrong on
// purpose, each in one [impl] fact of docs/semantics.md, exactly that fact fails (facts that
// depend on it are not checked). Built and run by tests/test_mps_self_check.py.
#include "metal/self_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/kernels.h"

namespace {

using namespace sgrnn;
using namespace sgrnn::mps;
using unit_test::Check;

class SerialExecutor : public cpu::Executor {
 public:
  int64_t width() const override { return 1; }
  void ForEach(int64_t n, const std::function<void(int64_t)>& body) const override {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
};

// The native kernels, computing in float32; float16 results are rounded to float16, as a
// float16 run stores them.
class NativeRunner : public Runner {
 public:
  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    const MaskView<float> mask = in.mask ? MaskView<float>(in.mask, in.mask_tnh[0],
                                                           in.mask_tnh[1], in.mask_tnh[2])
                                         : MaskView<float>();
    if (op == Op::kForward) {
      cpu::Forward<float>(executor_, c, d,
                          {in.x, in.R, in.W, in.b, in.h0, mask, nullptr, out.y, out.z});
    } else {
      cpu::Gradients<float>(executor_, c, d,
                            {in.x, in.R, in.dy, in.z, in.W, in.b, in.h0, mask, nullptr, out.dx,
                             out.dR, out.dW, out.db, out.dh0});
    }
    if (precision == Precision::kFloat16) {
      const float* outputs[2][5] = {{out.y, out.z}, {out.dx, out.dR, out.dW, out.db, out.dh0}};
      for (const ResultSlot& slot : ExpectedResults(op, c, d)) {
        float* data = const_cast<float*>(outputs[op == Op::kGradients][slot.output]);
        for (int64_t i = 0; i < slot.elements; ++i) data[i] = FloatFromHalf(HalfFromFloat(data[i]));
      }
    }
    return {};
  }

 private:
  SerialExecutor executor_;
};

// Flips time (the first axis of [T, N, D*H]) in the columns [col0, col0 + width).
void FlipTime(float* state, const Dims& d, int64_t col0, int64_t width) {
  for (int64_t t = 0; t < d.T / 2; ++t) {
    for (int64_t n = 0; n < d.N; ++n) {
      for (int64_t j = col0; j < col0 + width; ++j) {
        std::swap(state[(t * d.N + n) * d.DH() + j], state[((d.T - 1 - t) * d.N + n) * d.DH() + j]);
      }
    }
  }
}

// A runner whose op stores y and z with some columns flipped in time against the semantics:
// its gradient op reads dy and z the same way.
class FlippedStateRunner : public NativeRunner {
 public:
  using Columns = std::function<bool(const Config&, int64_t* col0, int64_t* width, const Dims&)>;
  explicit FlippedStateRunner(Columns columns) : columns_(std::move(columns)) {}

  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    int64_t col0 = 0, width = 0;
    if (!columns_(c, &col0, &width, d)) return NativeRunner::Run(op, c, d, precision, in, out);
    if (op == Op::kForward) {
      RunError e = NativeRunner::Run(op, c, d, precision, in, out);
      FlipTime(out.y, d, col0, width);
      if (out.z) FlipTime(out.z, d, col0, width);
      return e;
    }
    std::vector<float> dy(in.dy, in.dy + d.rows() * d.DH()), z(in.z, in.z + d.rows() * d.DH());
    FlipTime(dy.data(), d, col0, width);
    FlipTime(z.data(), d, col0, width);
    RunOperands flipped = in;
    flipped.dy = dy.data();
    flipped.z = z.data();
    return NativeRunner::Run(op, c, d, precision, flipped, out);
  }

 private:
  Columns columns_;
};

// Unidirectional reverse stored in source order (y[T-1-k]) instead of processing order.
FlippedStateRunner ReverseStoredInSourceOrder() {
  return FlippedStateRunner([](const Config& c, int64_t* col0, int64_t* width, const Dims& d) {
    *col0 = 0;
    *width = d.DH();
    return c.reverse && !c.bidirectional;
  });
}

// The bidirectional backward half stored in processing order (y[k]) instead of at T-1-k.
FlippedStateRunner BackwardHalfInProcessingOrder() {
  return FlippedStateRunner([](const Config& c, int64_t* col0, int64_t* width, const Dims& d) {
    *col0 = d.H;
    *width = d.H;
    return c.bidirectional;
  });
}

// The mask flipped in time for the directions that read the source reversed.
class MaskFlippedWithReverse : public NativeRunner {
 public:
  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    if (!in.mask || !(c.reverse || c.bidirectional)) {
      return NativeRunner::Run(op, c, d, precision, in, out);
    }
    std::vector<float> full(static_cast<size_t>(d.rows() * d.DH()));
    const MaskView<float> view(in.mask, in.mask_tnh[0], in.mask_tnh[1], in.mask_tnh[2]);
    for (int64_t t = 0; t < d.T; ++t) view.Expand(t, 0, 0, d.N, d.DH(), full.data() + t * d.N * d.DH());
    if (c.bidirectional) {
      FlipTime(full.data(), d, d.H, d.H);
    } else {
      FlipTime(full.data(), d, 0, d.DH());
    }
    RunOperands flipped = in;
    flipped.mask = full.data();
    flipped.mask_tnh[0] = d.T;
    flipped.mask_tnh[1] = d.N;
    flipped.mask_tnh[2] = d.DH();
    return NativeRunner::Run(op, c, d, precision, flipped, out);
  }
};

// The descriptor's activation ignored where tanh was asked: relu, +descriptor's default.
class ReluWhereTanhAsked : public NativeRunner {
 public:
  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    Config relu = c;
    if (c.activation == Activation::kTanh) relu.activation = Activation::kRelu;
    return NativeRunner::Run(op, relu, d, precision, in, out);
  }
};

// d bias reduced over N and kept per step, [T, 1, D*H]: as the handler's shape check reports
// such a result from MPSGraph.
class BiasGradientPerStep : public NativeRunner {
 public:
  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    if (op == Op::kGradients && c.has_bias) {
      const std::vector<ResultSlot> slots = ExpectedResults(op, c, d);
      std::vector<std::vector<int64_t>> shapes;
      for (const ResultSlot& slot : slots) {
        shapes.push_back(slot.output == 3 ? std::vector<int64_t>{d.T, 1, d.DH()}
                                          : std::vector<int64_t>{slot.elements});
      }
      RunError e;
      e.why = CheckResultShapes(op, slots, shapes, &e.output);
      return e;
    }
    return NativeRunner::Run(op, c, d, precision, in, out);
  }
};

// d bias summed from dy instead of dz (act' and the recurrence left out): the right size,
// the wrong values.
class BiasGradientOfSourceGradient : public NativeRunner {
 public:
  RunError Run(Op op, const Config& c, const Dims& d, Precision precision, const RunOperands& in,
               const RunOutputs& out) override {
    RunError e = NativeRunner::Run(op, c, d, precision, in, out);
    if (op == Op::kGradients && out.db) {
      std::fill(out.db, out.db + d.DH(), 0.0f);
      for (int64_t r = 0; r < d.rows(); ++r) {
        for (int64_t j = 0; j < d.DH(); ++j) out.db[j] += in.dy[r * d.DH() + j];
      }
    }
    return e;
  }
};

// Writes nothing: every output stays NaN.
class SilentRunner : public Runner {
 public:
  RunError Run(Op, const Config&, const Dims&, Precision, const RunOperands&,
               const RunOutputs&) override {
    return {};
  }
};

std::string Name(Fact f) { return FactName(f); }

void TestCorrectRunnerPasses() {
  NativeRunner runner;
  const auto start = std::chrono::steady_clock::now();
  const Report report = RunSelfCheck(runner);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "native runner (%d problems, %.3f s):\n%s", report.problems, seconds,
              report.Summary().c_str());
  Check(report.passed(), "every fact passes with the native kernels");
  for (int f = 0; f < kFactCount; ++f) {
    const FactVerdict& v = report.facts[f];
    Check(v.status == Status::kPassed && v.comparisons > 0,
          Name(static_cast<Fact>(f)) + " compared and passed");
    // Far inside the tolerance, so the threshold is not what makes it pass.
    Check(v.worst_error < 0.1 * v.tolerance,
          Name(static_cast<Fact>(f)) + " worst error " + std::to_string(v.worst_error));
  }
  Check(seconds < 1.0, "the check takes under a second with the native kernels");
}

// `runner` gets exactly `wrong` failed: every fact before it passes, and a later one passes
// unless it depends (directly or not) on a fact that failed, in which case it is not checked.
void ExpectOnlyFact(Runner& runner, Fact wrong, const std::string& what) {
  const Report report = RunSelfCheck(runner);
  std::fprintf(stderr, "%s:\n%s", what.c_str(), report.Summary().c_str());
  Check(!report.passed() && report.first_failure() == wrong,
        what + ": first failure is " + Name(wrong));
  for (int f = 0; f < kFactCount; ++f) {
    const auto fact = static_cast<Fact>(f);
    const FactVerdict& v = report.facts[f];
    if (fact == wrong) {
      Check(v.status == Status::kFailed, what + ": " + Name(fact) + " failed");
      // Far outside the tolerance, so the check is not on a knife edge.
      Check(!(v.worst_error < 10 * v.tolerance),
            what + ": " + Name(fact) + " fails by a wide margin (" + std::to_string(v.worst_error) + ")");
      continue;
    }
    bool depends = false;
    for (Fact need : Prerequisites(fact)) {
      depends = depends || report.facts[static_cast<int>(need)].status != Status::kPassed;
    }
    const Status want = depends ? Status::kNotChecked : Status::kPassed;
    Check(v.status == want, what + ": " + Name(fact) + " is " + StatusName(v.status) + ", want " +
                                StatusName(want));
  }
}

void TestWrongRunners() {
  FlippedStateRunner reverse = ReverseStoredInSourceOrder();
  ExpectOnlyFact(reverse, Fact::kReverseTimeOrder, "reverse stored in source order");
  FlippedStateRunner backward = BackwardHalfInProcessingOrder();
  ExpectOnlyFact(backward, Fact::kBidirectionalLayout, "backward half in processing order");
  MaskFlippedWithReverse mask;
  ExpectOnlyFact(mask, Fact::kMaskNotFlipped, "mask flipped with reverse");
  ReluWhereTanhAsked relu;
  ExpectOnlyFact(relu, Fact::kActivation, "relu where tanh was asked");
  BiasGradientPerStep per_step;
  ExpectOnlyFact(per_step, Fact::kBiasGradient, "bias gradient per step ([T, 1, D*H])");
  BiasGradientOfSourceGradient of_dy;
  ExpectOnlyFact(of_dy, Fact::kBiasGradient, "bias gradient summed from dy");

  SilentRunner silent;
  const Report report = RunSelfCheck(silent);
  Check(report.first_failure() == Fact::kActivation &&
            report.facts[0].where.find("nan") != std::string::npos,
        "a runner that writes nothing fails on NaN: " + report.facts[0].where);
}

// No z of a relu or hard-sigmoid problem lies within 1e-3 of a kink (1000 times the float32
// tolerance), where a tiny difference in z would flip the derivative.
void TestProblemsAvoidKinks() {
  for (const Problem& p : Problems()) {
    const Activation a = p.config.activation;
    if (a != Activation::kRelu && a != Activation::kHardSigmoid) continue;
    const ReferenceResults r = Reference(p, MakeData(p));
    double margin = 1e9;
    for (double z : r.z) {
      margin = std::min(margin, a == Activation::kRelu
                                    ? std::fabs(z)
                                    : std::min(std::fabs(z - 2.5), std::fabs(z + 2.5)));
    }
    Check(margin > 1e-3, p.name + ": z is " + std::to_string(margin) + " from a kink");
    if (a == Activation::kHardSigmoid) {
      double widest = 0;
      for (double z : r.z) widest = std::max(widest, std::fabs(z));
      Check(widest > 2.5, p.name + ": some z reaches hard sigmoid's clamp");
    }
  }
}

// Every fact but the bias gradient has problems of its own; together they cover each
// activation, both precisions, every optional input and each overload.
void TestCoverage() {
  bool activation[5] = {}, precision[2] = {}, W = false, no_W = false, no_b = false,
       no_h0 = false, mask = false, broadcast_mask = false, y_only = false;
  int per_fact[kFactCount] = {};
  for (const Problem& p : Problems()) {
    ++per_fact[static_cast<int>(p.fact)];
    activation[static_cast<int>(p.config.activation)] = true;
    precision[static_cast<int>(p.precision)] = true;
    W |= p.config.has_input_weight;
    no_W |= !p.config.has_input_weight;
    no_b |= !p.config.has_bias;
    no_h0 |= !p.config.has_init_state;
    mask |= p.config.has_mask;
    broadcast_mask |= p.config.has_mask && p.mask_tnh[1] == 1;
    y_only |= !p.config.training;
  }
  for (bool seen : activation) Check(seen, "every activation has a problem");
  Check(precision[0] && precision[1], "float32 and float16 problems");
  Check(W && no_W && no_b && no_h0 && mask && broadcast_mask && y_only,
        "every optional input present and absent");
  for (int f = 0; f < kFactCount; ++f) {
    if (static_cast<Fact>(f) == Fact::kBiasGradient) continue;
    Check(per_fact[f] > 0, Name(static_cast<Fact>(f)) + " has problems");
  }
}

void TestHalfConversions() {
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {  // every float16 survives a round trip
    const float value = FloatFromHalf(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    if (HalfFromFloat(value) != bits) ++mismatches;
  }
  Check(mismatches == 0, "float16 -> float32 -> float16 is exact");
#if defined(__FLT16_MAX__)
  // Against the compiler's own conversion, over floats spread across every exponent.
  int differ = 0;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    const float value = BitCast<float>(static_cast<uint32_t>(bits));
    if (std::isnan(value)) continue;
    const auto h = static_cast<_Float16>(value);
    if (HalfFromFloat(value) != BitCast<uint16_t>(h)) ++differ;
  }
  Check(differ == 0, "HalfFromFloat rounds as _Float16 does (" + std::to_string(differ) + ")");
#endif
  Check(HalfFromFloat(1.0f) == 0x3c00 && HalfFromFloat(-2.0f) == 0xc000 &&
            HalfFromFloat(65520.0f) == 0x7c00 && HalfFromFloat(1e-8f) == 0 &&
            FloatFromHalf(0x0001) == std::ldexp(1.0f, -24),
        "float16 landmarks");
  const float values[3] = {0.1f, -3.5f, 1e-3f};
  uint16_t halves[3];
  float back[3];
  StoreAs(Precision::kFloat16, values, 3, halves);
  LoadFrom(Precision::kFloat16, halves, 3, back);
  Check(std::fabs(back[0] - 0.1f) < 1e-4f && back[1] == -3.5f, "StoreAs/LoadFrom float16");
  float same[3];
  StoreAs(Precision::kFloat32, values, 3, same);
  Check(same[2] == values[2], "StoreAs float32 copies");
}

}  // namespace

int main() {
  TestHalfConversions();
  TestCoverage();
  TestProblemsAvoidKinks();
  TestCorrectRunnerPasses();
  TestWrongRunners();
  return unit_test::Report();
}
