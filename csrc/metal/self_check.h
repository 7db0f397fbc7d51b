// The MPSGraph backend's self-check. The facts of docs/semantics.md marked [impl] are our
// reading of behaviour Apple does not document; before the package routes a user's call to
// MPSGraph, it runs a handful of tiny problems through the handler and compares every output
// with a scalar computation of the semantics in double. Everything here is plain C++ (no Apple,
// no XLA headers): the problems, the reference, the tolerances and the verdict per fact are
// unit-tested on Linux with the native kernels as the runner and with runners that are wrong on
// purpose (tests/cpp/test_self_check.cc). mps_handler.mm only supplies the Runner.
#ifndef JAX_SGRNN_METAL_SELF_CHECK_H_
#define JAX_SGRNN_METAL_SELF_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "metal/mps_plan.h"
#include "sgrnn/core.h"

namespace sgrnn::mps {

// The dtype a problem runs in. The inputs are generated as float32 values (rounded to float16
// first for kFloat16, so the reference sees exactly what the handler sees).
enum class Precision { kFloat32, kFloat16 };

// IEEE binary16 conversions, rounding to nearest even (the MPS runner's buffers).
uint16_t HalfFromFloat(float value);
float FloatFromHalf(uint16_t bits);
// Writes `count` values as `precision` elements (4 or 2 bytes each) and reads them back.
void StoreAs(Precision precision, const float* values, int64_t count, void* out);
void LoadFrom(Precision precision, const void* elements, int64_t count, float* out);

// The facts, in the order they are checked. A fact's problems only use flags whose facts come
// earlier (Prerequisites), so a wrong reading of one fact cannot fail an earlier one; a fact
// whose prerequisite failed is not checked, and its verdict names that prerequisite.
enum class Fact {
  kActivation,           // the descriptor's activation is the one run; act and act' of each
  kOptionalInputs,       // each overload; x' = x without an input weight; h0 = 0 without one
  kReverseTimeOrder,     // unidirectional reverse stores step k at y[k]
  kBidirectionalLayout,  // R[1], W's and b's second half; the backward half stored at T-1-k
  kMaskNotFlipped,       // the mask is indexed by processing step in reversed directions too
  kBiasGradient,         // d bias is [D*H], the sum over T and N of dx'
};
inline constexpr int kFactCount = 6;

const char* FactName(Fact fact);       // "reverse_time_order", ...
const char* FactStatement(Fact fact);  // one sentence: what the fact says
std::vector<Fact> Prerequisites(Fact fact);

// One tiny problem. Every output of both ops is compared, d bias against kBiasGradient (which
// therefore covers every problem with a bias whose own fact held), the rest against `fact`.
struct Problem {
  std::string name;
  Fact fact;
  Precision precision;
  Config config;
  Dims dims;
  int64_t mask_tnh[3];  // the mask's own shape (each 1 or full) when config.has_mask
  double source_scale;  // x is uniform in [-source_scale, source_scale]
  uint64_t seed;
};

std::vector<Problem> Problems();

// A problem's operands as float32 values; absent ones are empty. The gradient op's z_state is
// the reference forward's z (rounded to the problem's precision), so the gradient op is judged
// on its own and not on the forward's errors.
struct ProblemData {
  std::vector<float> x, R, W, b, h0, mask, dy, z;
};
ProblemData MakeData(const Problem& problem);

// The reference in double: forward y and z, and the gradient op's outputs.
struct ReferenceResults {
  std::vector<double> y, z, dx, dR, dW, db, dh0;
};
ReferenceResults Reference(const Problem& problem, const ProblemData& data);

// Operands and outputs of one run; absent ones are null. Output sizes are mps_plan's
// ExpectedResults; a runner writes every present output of the op it runs.
struct RunOperands {
  const float *x, *R, *W, *b, *h0, *mask, *dy, *z;
  int64_t mask_tnh[3];
};
struct RunOutputs {
  float *y, *z, *dx, *dR, *dW, *db, *dh0;
};

// Why a run failed: `output` is the result it concerns (an index of ExpectedResults' outputs,
// e.g. a result of the wrong size), or -1 for the run as a whole. An empty `why`: it ran.
struct RunError {
  std::string why;
  int output = -1;
};

// Runs one op of a problem in `precision` (MPSGraph on a Mac; the native kernels, or wrong
// ones, in the unit test). A failure fails the fact of the output it concerns.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual RunError Run(Op op, const Config& c, const Dims& d, Precision precision,
                       const RunOperands& in, const RunOutputs& out) = 0;
};

// The largest error allowed, relative to max(1, max |reference|) of the output compared:
// about 1000 float32 ulps (MPSGraph's transcendentals and summation order are its own), and
// about 20 float16 ulps (the float16 ops' internal precision is not documented).
double Tolerance(Precision precision);

enum class Status { kPassed, kFailed, kNotChecked };
const char* StatusName(Status status);  // "passed", "failed", "not checked"

struct FactVerdict {
  Status status = Status::kNotChecked;
  double worst_error = 0;  // the largest error / scale seen in its comparisons
  double tolerance = 0;    // the tolerance of the comparison that gave it
  std::string where;       // the problem, output and element of worst_error, or why it failed
                           // or was not checked
  int comparisons = 0;
};

struct Report {
  FactVerdict facts[kFactCount];
  int problems = 0;
  double seconds = 0;  // wall time of the whole check
  bool passed() const;
  // The first fact that failed (the one to name to the user); passed() when none did.
  Fact first_failure() const;
  // One line per fact, for logs and the unit test's output.
  std::string Summary() const;
};

Report RunSelfCheck(Runner& runner);

}  // namespace sgrnn::mps

#endif  // JAX_SGRNN_METAL_SELF_CHECK_H_
