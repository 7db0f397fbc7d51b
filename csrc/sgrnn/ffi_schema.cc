#include "sgrnn/ffi_schema.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "sgrnn/ffi_dispatch.h"

namespace sgrnn {
namespace {

using Shape = std::vector<int64_t>;

std::string ShapeString(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Shape ShapeOf(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return Shape(d.begin(), d.end());
}

// Collects the first failure; every check after a failure is a no-op.
class Checker {
 public:
  explicit Checker(ffi::DataType dtype) : dtype_(dtype) {}

  bool ok() const { return error_.empty(); }

  ffi::Error Result() const {
    if (ok()) return ffi::Error::Success();
    return InvalidArgument(error_);
  }

  void Fail(const std::string& message) {
    if (ok()) error_ = message;
  }

  // The buffer has exactly `shape` and the shared float dtype.
  void Exact(const char* name, const ffi::AnyBuffer& b, const Shape& shape) {
    if (!ok()) return;
    if (b.element_type() != dtype_) {
      Fail(std::string(name) + ": dtype does not match the source's");
    } else if (ShapeOf(b) != shape) {
      Fail(std::string(name) + ": expected shape " + ShapeString(shape) + ", got " +
           ShapeString(ShapeOf(b)));
    }
  }

  // `shape` when the operand is present, else the empty [0] placeholder.
  void Optional(const char* name, bool present, const ffi::AnyBuffer& b, const Shape& shape) {
    if (present) {
      Exact(name, b, shape);
    } else if (ok() && ShapeOf(b) != Shape{0}) {
      Fail(std::string(name) + ": absent, so expected the empty placeholder [0], got " +
           ShapeString(ShapeOf(b)));
    }
  }

  // Per-row lengths: int32 of exactly `shape` when present, else the [0] placeholder (any
  // dtype). Their values need no check: the kernels clamp them to [0, T].
  void Lengths(const char* name, bool present, const ffi::AnyBuffer& b, const Shape& shape) {
    if (!ok()) return;
    if (present && b.element_type() != ffi::DataType::S32) {
      Fail(std::string(name) + ": expected int32");
    } else if (present && ShapeOf(b) != shape) {
      Fail(std::string(name) + ": expected shape " + ShapeString(shape) + ", got " +
           ShapeString(ShapeOf(b)));
    } else if (!present && ShapeOf(b) != Shape{0}) {
      Fail(std::string(name) + ": absent, so expected the empty placeholder [0], got " +
           ShapeString(ShapeOf(b)));
    }
  }

  // Each dimension of the buffer is 1 or the matching one of `full`.
  void Broadcastable(const char* name, const ffi::AnyBuffer& b, const Shape& full,
                     int64_t* dims_out) {
    if (!ok()) return;
    Shape s = ShapeOf(b);
    bool fits = b.element_type() == dtype_ && s.size() == full.size();
    for (size_t i = 0; fits && i < s.size(); ++i) fits = s[i] == 1 || s[i] == full[i];
    if (!fits) {
      Fail(std::string(name) + ": expected a " + std::to_string(full.size()) +
           "-d shape broadcastable to " + ShapeString(full) + " in the source's dtype, got " +
           ShapeString(s));
      return;
    }
    for (size_t i = 0; i < s.size(); ++i) dims_out[i] = s[i];
  }

  // Reads the rank-`rank` buffer's dimensions, or fails.
  bool Rank(const char* name, const ffi::AnyBuffer& b, size_t rank, const char* layout) {
    if (!ok()) return false;
    if (ShapeOf(b).size() != rank) {
      Fail(std::string(name) + ": expected rank " + std::to_string(rank) + " " + layout +
           ", got " + ShapeString(ShapeOf(b)));
      return false;
    }
    return true;
  }

 private:
  ffi::DataType dtype_;
  std::string error_;
};

// The checks both ops share: the activation, R against D, W/I, b and BLAS's 32-bit sizes.
void CheckWeights(const Config& c, Checker& check, const ffi::AnyBuffer& R,
                  const ffi::AnyBuffer& W, const ffi::AnyBuffer& b, Dims& d) {
  if (!IsValidActivation(c.activation)) {
    check.Fail("activation: expected 0..4, got " +
               std::to_string(static_cast<int32_t>(c.activation)));
  }
  d.D = c.directions();
  if (check.Rank("recurrent_weight", R, 3, "[D, H, H]")) d.H = ShapeOf(R)[2];
  if (d.H < 1) check.Fail("recurrent_weight: hidden size H must be >= 1");
  check.Exact("recurrent_weight", R, {d.D, d.H, d.H});
  check.Optional("input_weight", c.has_input_weight, W, {d.DH(), d.I});
  if (!c.has_input_weight && d.I != d.DH()) {
    check.Fail("source: without input_weight the feature size must be D*H = " +
               std::to_string(d.DH()) + ", got " + std::to_string(d.I));
  }
  if (d.I < 1) check.Fail("source: feature size I must be >= 1");
  check.Optional("bias", c.has_bias, b, {d.DH()});
  constexpr int64_t kMaxBlas = std::numeric_limits<int32_t>::max();
  if (d.rows() > kMaxBlas || d.I * d.DH() > kMaxBlas || d.H * d.H > kMaxBlas) {
    check.Fail("sizes exceed the 32-bit BLAS interface");
  }
}

}  // namespace

ffi::Error CheckForward(const Config& c, const ForwardBuffers& f, CheckedDims* out) {
  Checker check(f.x.element_type());
  Dims& d = out->dims;
  d = Dims{0, 0, 0, 0, 1};
  if (check.Rank("source", f.x, 3, "[T, N, I]")) {
    Shape s = ShapeOf(f.x);
    d.T = s[0], d.N = s[1], d.I = s[2];
  }
  CheckWeights(c, check, f.R, f.W, f.b, d);
  check.Optional("init_state", c.has_init_state, f.h0, {d.N, d.DH()});
  if (c.has_mask) {
    check.Broadcastable("mask", f.mask, {d.T, d.N, d.DH()}, out->mask_shape + 1);
  } else {
    check.Optional("mask", false, f.mask, {});
  }
  check.Lengths("seq_lengths", c.has_seq_lengths, f.seq_lengths, {d.N});
  check.Exact("y", f.y, {d.T, d.N, d.DH()});
  check.Optional("z", c.training, f.z, {d.T, d.N, d.DH()});
  return check.Result();
}

ffi::Error CheckGradients(const Config& c, const GradientBuffers& g, CheckedDims* out,
                          bool with_recurrent_weight_gradient) {
  Checker check(g.x.element_type());
  Dims& d = out->dims;
  d = Dims{0, 0, 0, 0, 1};
  int64_t& G = out->G;
  out->recurrent_weight_gradient = with_recurrent_weight_gradient;
  if (check.Rank("source", g.x, 4, "[G, T, N, I]")) {
    Shape s = ShapeOf(g.x);
    G = s[0], d.T = s[1], d.N = s[2], d.I = s[3];
  }
  CheckWeights(c, check, g.R, g.W, g.b, d);
  const int64_t DH = d.DH();
  check.Exact("source_gradient", g.dy, {G, d.T, d.N, DH});
  check.Exact("z_state", g.z, {G, d.T, d.N, DH});
  check.Optional("init_state", c.has_init_state, g.h0, {G, d.N, DH});
  if (c.has_mask) {
    check.Broadcastable("mask", g.mask, {G, d.T, d.N, DH}, out->mask_shape);
  } else {
    check.Optional("mask", false, g.mask, {});
  }
  check.Lengths("seq_lengths", c.has_seq_lengths, g.seq_lengths, {G, d.N});
  check.Exact("d_source", g.dx, {G, d.T, d.N, d.I});
  check.Optional("d_recurrent_weight", with_recurrent_weight_gradient, g.dR, {G, d.D, d.H, d.H});
  check.Optional("d_input_weight", c.has_input_weight, g.dW, {G, DH, d.I});
  check.Optional("d_bias", c.has_bias, g.db, {G, DH});
  check.Optional("d_init_state", c.has_init_state, g.dh0, {G, d.N, DH});
  return check.Result();
}

}  // namespace sgrnn
