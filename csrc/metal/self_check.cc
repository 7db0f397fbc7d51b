#include "metal/self_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

namespace sgrnn::mps {

// ------------------------------------------------------------------------------ float16

uint16_t HalfFromFloat(float value) {
  const uint32_t bits = BitCast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // inf, or NaN (kept quiet)
    return sign | (magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a float16 subnormal (or 0)
    // Scaling by 2^-24 (exact) leaves the subnormal's bits in the float's low mantissa, and
    // adding 0.5 rounds them to nearest even.
    const float scaled = std::fabs(value) * 16777216.0f;  // |value| / 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebiased = magnitude - 0x38000000u;  // exponent bias 127 -> 15
  const uint32_t rounded = rebiased + 0x0fffu + ((rebiased >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

float FloatFromHalf(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitCast<float>(sign | 0x7f800000u | (mantissa << 13));
  return BitCast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

void StoreAs(Precision precision, const float* values, int64_t count, void* out) {
  if (precision == Precision::kFloat32) {
    std::memcpy(out, values, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  auto* halves = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < count; ++i) halves[i] = HalfFromFloat(values[i]);
}

void LoadFrom(Precision precision, const void* elements, int64_t count, float* out) {
  if (precision == Precision::kFloat32) {
    std::memcpy(out, elements, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const auto* halves = static_cast<const uint16_t*>(elements);
  for (int64_t i = 0; i < count; ++i) out[i] = FloatFromHalf(halves[i]);
}

// ------------------------------------------------------------------------------ facts

const char* FactName(Fact fact) {
  switch (fact) {
    case Fact::kActivation: return "activation";
    case Fact::kOptionalInputs: return "optional_inputs";
    case Fact::kReverseTimeOrder: return "reverse_time_order";
    case Fact::kBidirectionalLayout: return "bidirectional_layout";
    case Fact::kMaskNotFlipped: return "mask_not_flipped";
    case Fact::kBiasGradient: return "bias_gradient";
  }
  return "?";
}

const char* FactStatement(Fact fact) {
  switch (fact) {
    case Fact::kActivation:
      return "the descriptor's activation is the one applied (each of the five, forward and "
             "derivative), in the recurrence z = x W^T + b + (h * m) R^T";
    case Fact::kOptionalInputs:
      return "each overload runs with the operands given: without an input weight x' = x (no "
             "product), without a bias no bias, without an initial state h0 = 0, and the mask "
             "scales the recurrent input only";
    case Fact::kReverseTimeOrder:
      return "with reverse (unidirectional), step k consumes x[T-1-k] and is stored at y[k]";
    case Fact::kBidirectionalLayout:
      return "bidirectional: R[1] and the second halves of W, b, h0 belong to the backward "
             "direction, whose step k consumes x[T-1-k] and is stored at y[T-1-k, :, H:]";
    case Fact::kMaskNotFlipped:
      return "the mask is indexed by processing step k, not flipped for reversed directions";
    case Fact::kBiasGradient:
      return "the bias gradient has the bias's D*H elements: the sum over T and N of dz";
  }
  return "?";
}

std::vector<Fact> Prerequisites(Fact fact) {
  switch (fact) {
    case Fact::kActivation: return {};
    case Fact::kOptionalInputs:
    case Fact::kReverseTimeOrder:
    case Fact::kBidirectionalLayout: return {Fact::kActivation};
    case Fact::kMaskNotFlipped:
      return {Fact::kOptionalInputs, Fact::kReverseTimeOrder, Fact::kBidirectionalLayout};
    case Fact::kBiasGradient: return {Fact::kActivation};
  }
  return {};
}

const char* StatusName(Status status) {
  switch (status) {
    case Status::kPassed: return "passed";
    case Status::kFailed: return "failed";
    case Status::kNotChecked: return "not checked";
  }
  return "?";
}

double Tolerance(Precision precision) { return precision == Precision::kFloat32 ? 1e-4 : 2e-2; }

// ------------------------------------------------------------------------------ problems

namespace {

struct Flags {
  Activation activation = Activation::kTanh;
  bool reverse = false, bidirectional = false, training = true;
  bool W = true, b = true, h0 = true;
  bool mask = false;
  int64_t mask_tnh[3] = {0, 0, 0};  // 0: the full size
  double source_scale = 1.5;
};

Problem MakeProblem(std::string name, Fact fact, Precision precision, const Flags& f,
                    uint64_t seed) {
  // Small and all different, so that a transposed or misplaced axis changes the numbers. I is
  // the source width: D*H without an input weight.
  const int64_t T = 4, N = 2, I = 3, H = f.bidirectional ? 3 : 5, D = f.bidirectional ? 2 : 1;
  Problem p;
  p.name = std::move(name);
  p.fact = fact;
  p.precision = precision;
  p.config = Config{f.activation, f.reverse, f.bidirectional, f.training, f.W, f.b, f.h0,
                    f.mask, /*has_seq_lengths=*/false};
  p.dims = Dims{T, N, f.W ? I : D * H, H, D};
  const int64_t full[3] = {T, N, D * H};
  for (int i = 0; i < 3; ++i) p.mask_tnh[i] = f.mask_tnh[i] == 0 ? full[i] : f.mask_tnh[i];
  p.source_scale = f.source_scale;
  p.seed = seed;
  return p;
}

}  // namespace

std::vector<Problem> Problems() {
  constexpr Precision f32 = Precision::kFloat32, f16 = Precision::kFloat16;
  std::vector<Problem> out;
  // The seeds are fixed: the unit test checks that no z of a relu or hard-sigmoid problem lies
  // near a kink, where a tiny difference in z would flip the derivative.
  const struct {
    const char* name;
    Activation activation;
    Precision precision;
    uint64_t seed;
  } activations[] = {
      {"none", Activation::kNone, f32, 11},          {"relu", Activation::kRelu, f32, 12},
      {"tanh", Activation::kTanh, f32, 13},          {"sigmoid", Activation::kSigmoid, f32, 14},
      {"hard_sigmoid", Activation::kHardSigmoid, f32, 15}, {"tanh", Activation::kTanh, f16, 16},
  };
  for (const auto& a : activations) {
    Flags f;
    f.activation = a.activation;
    // Wider inputs for hard sigmoid, so that some z lie beyond its clamp at +-2.5.
    if (a.activation == Activation::kHardSigmoid) f.source_scale = 4.0;
    out.push_back(MakeProblem(std::string(a.name) + (a.precision == f16 ? ", float16" : ""),
                              Fact::kActivation, a.precision, f, a.seed));
  }

  Flags no_weight_no_bias;  // the initState-only overload, with h0
  no_weight_no_bias.W = no_weight_no_bias.b = false;
  out.push_back(MakeProblem("no input weight, no bias, float16", Fact::kOptionalInputs, f16,
                            no_weight_no_bias, 21));
  Flags weight_only;  // the overload without mask; y only (descriptor.training = NO)
  weight_only.b = weight_only.h0 = false;
  weight_only.training = false;
  out.push_back(MakeProblem("input weight only, y only", Fact::kOptionalInputs, f32, weight_only,
                            22));
  Flags bare;  // source and recurrent weight alone
  bare.W = bare.b = bare.h0 = false;
  out.push_back(MakeProblem("no optional input", Fact::kOptionalInputs, f32, bare, 23));
  Flags masked;  // forward order, so the mask's time index is the same either way
  masked.mask = true;
  out.push_back(MakeProblem("mask [T, N, H]", Fact::kOptionalInputs, f32, masked, 24));

  Flags reverse;
  reverse.reverse = true;
  out.push_back(MakeProblem("reverse", Fact::kReverseTimeOrder, f32, reverse, 31));
  out.push_back(MakeProblem("reverse, float16", Fact::kReverseTimeOrder, f16, reverse, 32));

  Flags bidirectional;
  bidirectional.bidirectional = true;
  out.push_back(MakeProblem("bidirectional", Fact::kBidirectionalLayout, f32, bidirectional, 41));
  Flags bidirectional_no_weight = bidirectional;  // the source's halves feed the directions
  bidirectional_no_weight.W = bidirectional_no_weight.b = false;
  out.push_back(MakeProblem("bidirectional, no input weight, float16",
                            Fact::kBidirectionalLayout, f16, bidirectional_no_weight, 42));

  Flags reverse_masked = reverse;
  reverse_masked.mask = true;
  out.push_back(MakeProblem("reverse, mask [T, N, H]", Fact::kMaskNotFlipped, f32,
                            reverse_masked, 51));
  Flags bidirectional_masked = bidirectional;  // also a broadcast mask, expanded by the handler
  bidirectional_masked.mask = true;
  bidirectional_masked.mask_tnh[1] = 1;
  out.push_back(MakeProblem("bidirectional, mask [T, 1, 2H], float16", Fact::kMaskNotFlipped,
                            f16, bidirectional_masked, 52));
  return out;
}

// ------------------------------------------------------------------------------ data

namespace {

// splitmix64: a fixed, portable stream, so every machine checks the same numbers.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  double Uniform(double lo, double hi) {
    state_ += 0x9e3779b97f4a7c15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return lo + (hi - lo) * static_cast<double>(z >> 11) * 0x1.0p-53;
  }

 private:
  uint64_t state_;
};

std::vector<float> Fill(Random& random, int64_t count, double lo, double hi, Precision p) {
  std::vector<float> out(static_cast<size_t>(count));
  for (float& v : out) {
    v = static_cast<float>(random.Uniform(lo, hi));
    if (p == Precision::kFloat16) v = FloatFromHalf(HalfFromFloat(v));
  }
  return out;
}

std::vector<double> Widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// The projected source x' = x W^T + b (x' = x without W), in source time order.
std::vector<double> Projection(const Config& c, const Dims& d, const ProblemData& data) {
  const int64_t DH = d.DH();
  std::vector<double> xp(static_cast<size_t>(d.rows() * DH));
  for (int64_t r = 0; r < d.rows(); ++r) {
    for (int64_t j = 0; j < DH; ++j) {
      double acc = c.has_bias ? data.b[j] : 0.0;
      if (c.has_input_weight) {
        for (int64_t i = 0; i < d.I; ++i) acc += double(data.x[r * d.I + i]) * data.W[j * d.I + i];
      } else {
        acc += data.x[r * DH + j];
      }
      xp[r * DH + j] = acc;
    }
  }
  return xp;
}

template <Activation A>
void ForwardReference(const Config& c, const Dims& d, const ProblemData& data,
                      const int64_t mask_tnh[3], ReferenceResults& out) {
  const int64_t T = d.T, N = d.N, H = d.H, DH = d.DH();
  const std::vector<double> xp = Projection(c, d, data);
  const std::vector<double> mask = Widen(data.mask);
  const MaskView<double> m = c.has_mask ? MaskView<double>(mask.data(), mask_tnh[0], mask_tnh[1],
                                                           mask_tnh[2])
                                        : MaskView<double>();
  out.y.assign(static_cast<size_t>(T * N * DH), 0.0);
  out.z.assign(out.y.size(), 0.0);
  std::vector<double> h(static_cast<size_t>(N * H)), mask_row(static_cast<size_t>(H), 1.0);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    const DirectionLayout layout = LayoutOf(c, dir);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < H; ++j) h[n * H + j] = c.has_init_state ? data.h0[n * DH + dir * H + j] : 0.0;
    }
    for (int64_t k = 0; k < T; ++k) {
      const int64_t source_t = layout.read_reversed ? T - 1 - k : k;
      const int64_t slot = layout.Slot(k, T);
      std::vector<double> next(h.size());
      for (int64_t n = 0; n < N; ++n) {
        if (m.data) m.Expand(k, dir * H, n, n + 1, H, mask_row.data());
        for (int64_t j = 0; j < H; ++j) {
          double acc = xp[(source_t * N + n) * DH + dir * H + j];
          for (int64_t q = 0; q < H; ++q) {
            acc += h[n * H + q] * mask_row[q] * data.R[(dir * H + j) * H + q];
          }
          const int64_t at = (slot * N + n) * DH + dir * H + j;
          out.z[at] = acc;
          out.y[at] = next[n * H + j] = Activate<A>(acc);
        }
      }
      h = next;
    }
  }
}

template <Activation A>
void GradientReference(const Config& c, const Dims& d, const ProblemData& data,
                       const int64_t mask_tnh[3], ReferenceResults& out) {
  const int64_t T = d.T, N = d.N, H = d.H, DH = d.DH(), I = d.I;
  const std::vector<double> mask = Widen(data.mask);
  const MaskView<double> m = c.has_mask ? MaskView<double>(mask.data(), mask_tnh[0], mask_tnh[1],
                                                           mask_tnh[2])
                                        : MaskView<double>();
  std::vector<double> dxp(static_cast<size_t>(d.rows() * DH), 0.0);  // dz in source time
  out.dR.assign(static_cast<size_t>(d.D * H * H), 0.0);
  out.dh0.assign(c.has_init_state ? static_cast<size_t>(N * DH) : 0, 0.0);
  std::vector<double> mask_row(static_cast<size_t>(H), 1.0);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    const DirectionLayout layout = LayoutOf(c, dir);
    std::vector<double> carry(static_cast<size_t>(N * H), 0.0);  // (dz[k+1] R) * m[k+1]
    for (int64_t k = T - 1; k >= 0; --k) {
      const int64_t source_t = layout.read_reversed ? T - 1 - k : k;
      const int64_t slot = layout.Slot(k, T);
      std::vector<double> next_carry(carry.size(), 0.0);
      for (int64_t n = 0; n < N; ++n) {
        if (m.data) m.Expand(k, dir * H, n, n + 1, H, mask_row.data());
        std::vector<double> dz(static_cast<size_t>(H)), h_prev(static_cast<size_t>(H));
        for (int64_t q = 0; q < H; ++q) {
          if (k > 0) {
            h_prev[q] = Activate<A>(double(data.z[(layout.Slot(k - 1, T) * N + n) * DH + dir * H + q]));
          } else {
            h_prev[q] = c.has_init_state ? data.h0[n * DH + dir * H + q] : 0.0;
          }
        }
        for (int64_t j = 0; j < H; ++j) {
          const int64_t at = (slot * N + n) * DH + dir * H + j;
          dz[j] = (data.dy[at] + carry[n * H + j]) * ActivateGrad<A>(double(data.z[at]));
          dxp[(source_t * N + n) * DH + dir * H + j] = dz[j];
          for (int64_t q = 0; q < H; ++q) {
            out.dR[(dir * H + j) * H + q] += dz[j] * h_prev[q] * mask_row[q];
            next_carry[n * H + q] += dz[j] * data.R[(dir * H + j) * H + q] * mask_row[q];
          }
        }
      }
      carry = next_carry;
    }
    if (c.has_init_state) {
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t q = 0; q < H; ++q) out.dh0[n * DH + dir * H + q] = carry[n * H + q];
      }
    }
  }
  out.db.assign(c.has_bias ? static_cast<size_t>(DH) : 0, 0.0);
  out.dW.assign(c.has_input_weight ? static_cast<size_t>(DH * I) : 0, 0.0);
  out.dx.assign(static_cast<size_t>(d.rows() * I), 0.0);
  for (int64_t r = 0; r < d.rows(); ++r) {
    for (int64_t j = 0; j < DH; ++j) {
      const double g = dxp[r * DH + j];
      if (c.has_bias) out.db[j] += g;
      if (c.has_input_weight) {
        for (int64_t i = 0; i < I; ++i) {
          out.dW[j * I + i] += g * data.x[r * I + i];
          out.dx[r * I + i] += g * data.W[j * I + i];
        }
      } else {
        out.dx[r * I + j] = g;
      }
    }
  }
}

// The forward alone (to make z_state), or both ops.
ReferenceResults ReferenceOf(const Problem& problem, const ProblemData& data, bool gradients) {
  ReferenceResults out;
  DispatchActivation(problem.config.activation, [&]<Activation A>() {
    ForwardReference<A>(problem.config, problem.dims, data, problem.mask_tnh, out);
    if (gradients) GradientReference<A>(problem.config, problem.dims, data, problem.mask_tnh, out);
  });
  return out;
}

}  // namespace

ReferenceResults Reference(const Problem& problem, const ProblemData& data) {
  return ReferenceOf(problem, data, /*gradients=*/true);
}

ProblemData MakeData(const Problem& problem) {
  const Config& c = problem.config;
  const Dims& d = problem.dims;
  const Precision p = problem.precision;
  Random random(problem.seed);
  ProblemData data;
  const double r_scale = 1.2 / std::sqrt(static_cast<double>(d.H));
  data.x = Fill(random, d.rows() * d.I, -problem.source_scale, problem.source_scale, p);
  data.R = Fill(random, d.D * d.H * d.H, -r_scale, r_scale, p);
  if (c.has_input_weight) {
    const double w_scale = 1.2 / std::sqrt(static_cast<double>(d.I));
    data.W = Fill(random, d.DH() * d.I, -w_scale, w_scale, p);
  }
  if (c.has_bias) data.b = Fill(random, d.DH(), -0.5, 0.5, p);
  if (c.has_init_state) data.h0 = Fill(random, d.N * d.DH(), -0.8, 0.8, p);
  if (c.has_mask) {
    // Different at every step (and above and below 1), so a mask read at the wrong step shows.
    data.mask = Fill(random, problem.mask_tnh[0] * problem.mask_tnh[1] * problem.mask_tnh[2],
                     0.0, 2.0, p);
  }
  data.dy = Fill(random, d.rows() * d.DH(), -1.0, 1.0, p);
  const ReferenceResults forward = ReferenceOf(problem, data, /*gradients=*/false);
  data.z.resize(forward.z.size());
  for (size_t i = 0; i < data.z.size(); ++i) {
    const auto z = static_cast<float>(forward.z[i]);
    data.z[i] = p == Precision::kFloat16 ? FloatFromHalf(HalfFromFloat(z)) : z;
  }
  return data;
}

// ------------------------------------------------------------------------------ the check

namespace {

const float* OrNull(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// Shape of an output, to say where its worst element is.
std::vector<int64_t> OutputShape(Op op, int output, const Dims& d) {
  if (op == Op::kForward) return {d.T, d.N, d.DH()};
  switch (output) {
    case 0: return {d.T, d.N, d.I};
    case 1: return {d.D, d.H, d.H};
    case 2: return {d.DH(), d.I};
    case 3: return {d.DH()};
    default: return {d.N, d.DH()};
  }
}

std::string Index(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t a = shape.size(); a-- > 0;) {
    index[a] = flat % shape[a];
    flat /= shape[a];
  }
  std::string s = "[";
  for (size_t a = 0; a < index.size(); ++a) s += (a ? ", " : "") + std::to_string(index[a]);
  return s + "]";
}

std::string Number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.6g", v);
  return text;
}

// A verdict's worst error in units of its tolerance; NaN (a NaN in an output) is the worst.
double Severity(double error, double tolerance) {
  return std::isnan(error) ? std::numeric_limits<double>::infinity() : error / tolerance;
}

// Adds one comparison to a fact's verdict, keeping the worst one's error and place.
void Record(FactVerdict& v, double error, double tolerance, const std::string& where) {
  if (v.comparisons == 0 || Severity(error, tolerance) > Severity(v.worst_error, v.tolerance)) {
    v.worst_error = error;
    v.tolerance = tolerance;
    v.where = where;
  }
  ++v.comparisons;
  if (!(error <= tolerance)) {
    v.status = Status::kFailed;
  } else if (v.status == Status::kNotChecked) {
    v.status = Status::kPassed;
  }
}

void Compare(FactVerdict& v, const Problem& problem, Op op, int output, const float* got,
             const std::vector<double>& want) {
  double scale = 1.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  double error = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::fabs(double(got[i]) - want[i]) / scale;
    if (std::isnan(e) || e > error) {
      error = e;
      worst = i;
      if (std::isnan(e)) break;
    }
  }
  const std::string where = problem.name + ": " + OutputName(op, output) +
                            Index(static_cast<int64_t>(worst), OutputShape(op, output, problem.dims)) +
                            " = " + Number(got[worst]) + ", expected " + Number(want[worst]);
  Record(v, error, Tolerance(problem.precision), where);
}

void RecordRunFailure(FactVerdict& v, const Problem& problem, Op op, const std::string& why) {
  Record(v, std::numeric_limits<double>::quiet_NaN(), Tolerance(problem.precision),
         problem.name + ": " + (op == Op::kForward ? "singleGateRNN" : "singleGateRNNGradients") +
             " did not run: " + why);
}

// One problem's d bias, judged by kBiasGradient once the problem's own fact is known.
struct BiasResult {
  const Problem* problem;
  std::vector<float> got;
  std::vector<double> want;
  std::string run_error;  // the run's failure concerning d bias, if any
};

constexpr int kBiasOutput = 3;  // the gradient op's d bias

// Runs both ops of one problem and compares every output with the reference: d bias goes to
// `bias_results`, the rest into `own`.
void CheckProblem(Runner& runner, const Problem& problem, FactVerdict& own,
                  std::vector<BiasResult>& bias_results) {
  const Config& c = problem.config;
  const Dims& d = problem.dims;
  const ProblemData data = MakeData(problem);
  const ReferenceResults want = Reference(problem, data);
  const RunOperands in{data.x.data(), data.R.data(), OrNull(data.W), OrNull(data.b),
                       OrNull(data.h0), OrNull(data.mask), data.dy.data(), data.z.data(),
                       {problem.mask_tnh[0], problem.mask_tnh[1], problem.mask_tnh[2]}};
  for (Op op : {Op::kForward, Op::kGradients}) {
    const bool gradients = op == Op::kGradients;
    std::vector<float> results[5];  // by output index; NaN until the runner writes them
    RunOutputs out{};
    float** by_output[2][5] = {{&out.y, &out.z},
                               {&out.dx, &out.dR, &out.dW, &out.db, &out.dh0}};
    const std::vector<ResultSlot> slots = ExpectedResults(op, c, d);
    for (const ResultSlot& slot : slots) {
      results[slot.output].assign(static_cast<size_t>(slot.elements),
                                  std::numeric_limits<float>::quiet_NaN());
      *by_output[gradients][slot.output] = results[slot.output].data();
    }
    const RunError error = runner.Run(op, c, d, problem.precision, in, out);
    if (!error.why.empty()) {
      if (gradients && error.output == kBiasOutput) {
        bias_results.push_back({&problem, {}, want.db, error.why});
      } else {
        RecordRunFailure(own, problem, op, error.why);
      }
      continue;
    }
    const std::vector<double>* wanted[2][5] = {{&want.y, &want.z},
                                               {&want.dx, &want.dR, &want.dW, &want.db, &want.dh0}};
    for (const ResultSlot& slot : slots) {
      if (gradients && slot.output == kBiasOutput) {
        bias_results.push_back({&problem, results[slot.output], want.db, ""});
      } else {
        Compare(own, problem, op, slot.output, results[slot.output].data(),
                *wanted[gradients][slot.output]);
      }
    }
  }
}

}  // namespace

bool Report::passed() const {
  for (const FactVerdict& v : facts) {
    if (v.status != Status::kPassed) return false;
  }
  return true;
}

Fact Report::first_failure() const {
  for (int f = 0; f < kFactCount; ++f) {
    if (facts[f].status == Status::kFailed) return static_cast<Fact>(f);
  }
  return Fact::kActivation;
}

std::string Report::Summary() const {
  std::string s;
  for (int f = 0; f < kFactCount; ++f) {
    const FactVerdict& v = facts[f];
    s += std::string(FactName(static_cast<Fact>(f))) + ": " + StatusName(v.status);
    if (v.status != Status::kNotChecked) {
      s += " (worst error " + Number(v.worst_error) + ", tolerance " + Number(v.tolerance) +
           "; " + v.where + ")";
    } else {
      s += " (" + v.where + ")";
    }
    s += "\n";
  }
  return s;
}

Report RunSelfCheck(Runner& runner) {
  const auto start = std::chrono::steady_clock::now();
  Report report;
  const std::vector<Problem> problems = Problems();
  report.problems = static_cast<int>(problems.size());
  std::vector<BiasResult> bias_results;
  auto unmet = [&](Fact fact) -> std::string {
    for (Fact need : Prerequisites(fact)) {
      if (report.facts[static_cast<int>(need)].status != Status::kPassed) {
        return std::string("needs ") + FactName(need) + ", which " +
               (report.facts[static_cast<int>(need)].status == Status::kFailed ? "failed"
                                                                              : "was not checked");
      }
    }
    return "";
  };
  for (int f = 0; f < kFactCount; ++f) {
    const auto fact = static_cast<Fact>(f);
    if (fact == Fact::kBiasGradient) continue;  // judged below, from the other facts' runs
    FactVerdict& verdict = report.facts[f];
    if (std::string why = unmet(fact); !why.empty()) {
      verdict.where = why;
      continue;
    }
    for (const Problem& problem : problems) {
      if (problem.fact == fact) CheckProblem(runner, problem, verdict, bias_results);
    }
  }
  // d bias of every problem whose own fact held: its dz is then right, so d bias is judged on
  // its own shape and sum.
  FactVerdict& bias = report.facts[static_cast<int>(Fact::kBiasGradient)];
  bias.where = unmet(Fact::kBiasGradient);
  if (bias.where.empty()) {
    for (const BiasResult& r : bias_results) {
      if (report.facts[static_cast<int>(r.problem->fact)].status != Status::kPassed) continue;
      if (!r.run_error.empty()) {
        RecordRunFailure(bias, *r.problem, Op::kGradients, r.run_error);
      } else {
        Compare(bias, *r.problem, Op::kGradients, kBiasOutput, r.got.data(), r.want);
      }
    }
    if (bias.comparisons == 0) bias.where = "no problem with a bias passed its own fact";
  }
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace sgrnn::mps
